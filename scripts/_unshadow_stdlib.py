"""Imported first by every script in this folder: takes the folder off ``sys.path``.

Python puts a script's folder first on ``sys.path``, so ``scripts/select.py`` would shadow the standard library's
``select`` module (which ``subprocess`` imports) for every script here. Importing this module (found through that very
entry) removes the entry before anything else is imported.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

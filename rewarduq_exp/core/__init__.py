"""The lowest layer: what every other layer uses and nothing of this package's own.

``errors`` (the one-line user error), ``checks`` (argument checks that raise it), ``hashing`` (stable hashes for run
identities and cache keys), ``atomic_write`` (temp file + rename, honouring the umask), ``distributed`` (which
process am I under torchrun / accelerate), ``hub_access`` (is the Hugging Face hub reachable) and ``config_dir``
(where the config tree is: the checkout's ``conf/`` or the installed package's copy).
"""

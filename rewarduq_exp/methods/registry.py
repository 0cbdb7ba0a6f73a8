"""The methods by name, and the settings a file may give one of them.

A method is its class and its config, nothing else: ``conf/method/<name>.yaml`` names the class (``_target_``), and
this table is read from those files of the package's own config tree (:data:`~rewarduq_exp.core.config_dir.CONF_DIR`),
so adding a method edits no code outside its own module. A class defined elsewhere (a plugin, a test) joins with
:func:`register_method`.

A run folder is a file someone may hand you. Whatever reads one (``load_method``, ``evaluate.py``, the Python API,
``downstream.py``) takes the method's class from :data:`METHOD_CLASSES` by the method's *name*, never by importing a
class path written in the file (importing a module runs its code, and calling an arbitrary class with the file's
arguments can run anything, ``subprocess.Popen`` included), and takes from the file only settings this class
declares, with plain JSON values (:func:`check_settings`). Only classes of this package (``rewarduq_exp.methods.``)
are read from the config tree; anything else must be registered in the process by code the user runs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping

import yaml

from rewarduq_exp.core.config_dir import CONF_DIR
from rewarduq_exp.core.errors import UserError

PACKAGE_METHODS = "rewarduq_exp.methods."
# The configs are read as YAML (a ``_target_`` quoted, or written in flow style, is the same class to Hydra), without
# composing them: Hydra is not needed to list the methods. libyaml's parser where PyYAML has it: this runs at every
# start-up (1.5 ms for the twelve files here).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _target_of(text: str) -> str | None:
    """The ``_target_`` of a config's text, or None (no such key, or a file Hydra will refuse when it is composed)."""
    try:
        data = yaml.load(text, Loader=_LOADER)  # noqa: S506 (a safe loader: CSafeLoader or SafeLoader)
    except yaml.YAMLError:
        return None
    target = data.get("_target_") if isinstance(data, dict) else None
    return target if isinstance(target, str) else None


def _config_tree_methods() -> dict[str, str]:
    """name -> class path of every ``conf/method/<name>.yaml`` whose ``_target_`` is a class of this package."""
    table = {}
    for path in sorted((CONF_DIR / "method").glob("*.yaml")):
        target = _target_of(path.read_text())
        if target is not None and target.startswith(PACKAGE_METHODS):
            table[path.stem] = target
    return table


# name (``method.json``'s "method", ``conf/method/<name>.yaml``) -> the class that implements it
METHOD_CLASSES: dict[str, str] = _config_tree_methods()
_REGISTERED: dict[str, type] = {}   # classes registered in this process (not importable by their path, perhaps)
_NAME_OF_CLASS = {path: name for name, path in METHOD_CLASSES.items()}


def register_method(cls: type) -> type:
    """Make ``cls`` (a :class:`~rewarduq_exp.methods.base.Method` subclass) the method ``cls.name`` in this process:
    configs may name it (``_target_``: its module and qualified name), run folders of it load. Usable as a class
    decorator. A name of the package's own methods cannot be taken over."""
    from rewarduq_exp.methods.base import Method

    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"register_method takes a Method subclass, not {cls!r}")
    path = f"{cls.__module__}.{cls.__qualname__}"
    if METHOD_CLASSES.get(cls.name, path) != path:
        raise ValueError(f"method name {cls.name!r} is taken by {METHOD_CLASSES[cls.name]}")
    METHOD_CLASSES[cls.name] = path
    _NAME_OF_CLASS[path] = cls.name
    _REGISTERED[cls.name] = cls
    saved_only_keys.cache_clear()
    return cls


# What a saved or configured setting may be: what every method's ``hyperparameters()`` writes (numbers, flags, names,
# None, lists of those such as adam_betas or target_modules). A mapping is refused: no method saves one, and a
# mapping is how a config asks Hydra to build an object (``{"_target_": ...}``).
PLAIN_SCALARS = (type(None), bool, int, float, str)
# The longest list a setting may hold. The methods' lists are short (adam_betas: 2, score_range: 2, a label-ranking
# net's hidden layer widths: a handful); a file with more was not written by this project, and its values would each
# be checked and copied on (10^8 betas cost a minute and gigabytes).
MAX_LIST_SETTING = 64


def method_names() -> list[str]:
    return sorted(METHOD_CLASSES)


def method_class(name: str) -> type:
    """The class of method ``name`` (a key of :data:`METHOD_CLASSES`; imported from this table, never from input)."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    module, _, qualname = METHOD_CLASSES[name].rpartition(".")
    return getattr(importlib.import_module(module), qualname)


def method_name_of_target(target) -> str | None:
    """The method name whose class is ``target`` (a ``_target_`` string of a method config), or None."""
    return _NAME_OF_CLASS.get(target) if isinstance(target, str) else None


def settings_class_of(method_cfg) -> type | None:
    """The settings dataclass of the method a composed ``method`` config builds (its ``_target_``), or None when it
    names no method of the table. Imports that method's module (and torch): only the checks of ``method.<key>``
    values call it."""
    target = method_cfg.get("_target_") if isinstance(method_cfg, Mapping) else None
    name = method_name_of_target(target)
    return method_class(name).settings_class if name is not None else None


def method_bounds(method_cfg) -> dict:
    """``method.<key>`` -> :class:`~rewarduq_exp.core.setting_bounds.Bound` of the integer settings of the method a
    composed ``method`` config builds (empty when it names none): what its settings dataclass declares."""
    settings = settings_class_of(method_cfg)
    return settings.bounds() if settings is not None else {}


def allowed_classes() -> str:
    """For messages: the classes by their method names (the full paths are in :data:`METHOD_CLASSES`)."""
    return "the classes of " + ", ".join(sorted(METHOD_CLASSES))


@functools.lru_cache(maxsize=None)
def saved_only_keys(name: str) -> frozenset[str]:
    """Keys ``hyperparameters()`` of method ``name`` writes that are records, not constructor settings (the
    schedule's ``lr_schedule``, ENS-LoRA's ``head_init_used``): allowed in ``method.json``, never passed to the
    constructor."""
    cls = method_class(name)
    return frozenset(set(cls().hyperparameters()) - set(cls.settings_class.names()))


def settings_of(name: str, *, runtime: bool) -> frozenset[str]:
    """The settings of method ``name`` a file may give: the fields of its settings dataclass (``runtime``: the
    runtime-only ones too, as a run's config holds them; ``method.json`` never does). The backbone (``encoder``)
    always comes from the caller."""
    settings = method_class(name).settings_class
    return frozenset(settings.names() if runtime else settings.saved_names())


def field_name(key) -> str:
    """A key read from a file as it can be shown in a one-line message (odd ones quoted, newlines escaped)."""
    return key if isinstance(key, str) and key.isidentifier() else repr(key)


def is_plain(value) -> bool:
    if isinstance(value, PLAIN_SCALARS):
        return True
    return isinstance(value, list) and all(isinstance(v, PLAIN_SCALARS) for v in value)


def check_settings(name: str, values, where: str, prefix: str, *, runtime: bool = False,
                   records: bool = False) -> dict:
    """``values`` (settings of method ``name`` read from a file), each one checked: a setting of that method
    (``runtime``: runtime settings allowed; ``records``: the keys ``hyperparameters()`` saves beside the settings
    allowed too) with a plain value. A refusal is one line naming ``where`` (the file) and the field
    (``prefix`` + key). Returns the settings the constructor takes (records left out)."""
    if not isinstance(values, Mapping):
        raise UserError(f"{where}: {prefix.rstrip('.')} is a JSON {type(values).__name__}, not an object of settings")
    accepted = settings_of(name, runtime=runtime)
    recorded = saved_only_keys(name) if records else frozenset()
    out = {}
    for key, value in values.items():
        if key not in accepted and key not in recorded:
            raise UserError(f"{where}: {prefix}{field_name(key)} is not a setting of {name}; allowed: "
                            f"{', '.join(sorted(accepted | recorded))}")
        if isinstance(value, list) and len(value) > MAX_LIST_SETTING:
            raise UserError(f"{where}: {prefix}{field_name(key)} is a list of {len(value)} values; a setting holds "
                            f"at most {MAX_LIST_SETTING}")
        if not is_plain(value):
            raise UserError(f"{where}: {prefix}{field_name(key)} is a {type(value).__name__}, not a plain value "
                            "(a number, true/false, a string, null or a list of those)")
        if key in accepted:
            out[key] = value
    return out

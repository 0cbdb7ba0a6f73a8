"""Reading a YAML config someone else wrote (a run folder's ``.hydra/``): data, never a program.

A run folder may come from another cluster or a colleague. OmegaConf evaluates ``${name:...}`` in any value it
resolves, with every resolver registered in the process: ``oc.env`` reads the environment, and this project's own
``unique_run_dir`` creates folders at the path it is given. So a ``.hydra/config.yaml`` whose ``model.name`` held
``${unique_run_dir:/somewhere}`` made ``evaluate.py`` and ``load_run`` create folders there, and ``${oc.env:SECRET}``
put the reader's environment into a field. Here a foreign config is read as data:

* **Resolver calls are refused**, one line naming the file and the key. Keeping them as literal strings would be the
  other choice, but a literal ``${...}`` string turns back into an interpolation as soon as any later step builds a
  config from it (``OmegaConf.create`` of a resolved container, a merge), so none may survive reading. One form is
  read as its default instead: ``${oc.env:NAME,null}`` in ``paths.datasets_dir`` and ``paths.label_ranking_dir``,
  which ``conf/train.yaml`` writes into every run folder. It reads as null (the environment is never read) unless the
  caller passes its own folder (``paths=``): where data lies is a fact of the reading machine, not of the run.
* **References to the file's own settings are followed** (``${seed}``, ``${paths.output_root}/cache``), as every
  run folder holds them (``train.py`` writes the config as Hydra composed it, so that the dataset's
  ``${paths.datasets_dir}`` takes the reading machine's folder, see above). They are resolved here, once and
  eagerly, with no resolver involved: the config returned holds plain values and no ``${`` at all. A reference must
  name a single value in the file (not a group, not a missing key, no cycle); the text it produces is bounded.
* **Size and shape are bounded** before anything is built: the file's bytes, the nesting depth and the number of
  YAML nodes; YAML aliases (``*name``) are refused, since a few hundred bytes of nested aliases expand to millions of
  nodes and OmegaConf's own configs never write one (``OmegaConf.to_yaml`` dumps plain containers, whose values are
  never shared objects). Scalars mean what they mean to ``OmegaConf.load`` (its loader, a ``yaml.SafeLoader``, is
  the base: ``1e-3`` is a float, duplicate keys are refused).

:func:`read_yaml_data` gives the plain data of any such file (``hydra.yaml``, ``overrides.yaml``): nothing resolved,
a ``${...}`` stays text; :func:`read_foreign_config` gives a run's config as a resolved ``DictConfig``.
"""

from __future__ import annotations

import os
import re

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_yaml_loader  # the loader OmegaConf.load uses (same scalars, duplicate keys refused)

from rewarduq_exp.core.errors import UserError, first_line, one_line
from rewarduq_exp.core.saved_files import read_bounded

# A run's config.yaml and hydra.yaml are about 4 KB each, nested at most 6 deep with a few hundred values; the caps
# leave a margin of 20x and more, and a file at the caps still reads in about a second (OmegaConf builds a node per
# value: 10,000 values cost 2 s on one core).
MAX_CONFIG_BYTES = 128 << 10
MAX_DEPTH = 32
MAX_NODES = 5_000
# Characters that resolving references may produce over the whole file (a chain of references that doubles a string
# at each step would otherwise grow it exponentially).
MAX_RESOLVED_CHARS = 128 << 10

# A reference to another setting of the same file, by its absolute dotted path: ``${seed}``, ``${paths.cache_dir}``.
_REFERENCE = re.compile(r"\$\{([\w-]+(?:\.[\w-]+)*)\}")
# What conf/train.yaml writes into every run's paths: the environment's folder, null when unset.
_LEGACY_PATH_ENV = re.compile(r"\$\{oc\.env:[A-Za-z_][A-Za-z0-9_]*,\s*null\s*\}")
# Folders of data on the machine that reads a run (local copies of the hub's datasets, the label-ranking CSVs).
MACHINE_PATHS = ("datasets_dir", "label_ranking_dir")

_OmegaConfLoader = get_yaml_loader()


class _Refused(Exception):
    """A bound of this module was hit; the message says which (the file is named by the caller)."""


class _BoundedLoader(_OmegaConfLoader):
    """OmegaConf's safe loader, counting nodes and depth while it composes and refusing aliases before they are
    expanded (PyYAML composes recursively: the depth cap also keeps a deeply nested file from a RecursionError)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise _Refused("uses a YAML alias (*name); run folders never hold one (aliases can expand a small file "
                           "into millions of values)")
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Refused(f"holds more than {MAX_NODES} values")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"is nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _label(path, what: str) -> str:
    return f"{path}{f' ({what})' if what else ''}"


def read_yaml_data(path: str | os.PathLike, what: str = ""):
    """The plain data (dicts, lists, scalars) of the YAML file ``path``, read within the bounds above; nothing is
    resolved (a ``${...}`` is text). A one-line :class:`UserError` naming the file otherwise."""
    label = _label(path, what)
    raw = read_bounded(path, MAX_CONFIG_BYTES, label)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{label} is corrupt: not UTF-8 text (byte {err.start})") from None
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except _Refused as err:
        raise UserError(one_line(f"{label} is refused: it {err}")) from None
    except (yaml.YAMLError, RecursionError, ValueError, TypeError) as err:
        raise UserError(one_line(f"{label} is corrupt: not valid YAML ({type(err).__name__}: "
                                 f"{first_line(err)})")) from None
    finally:
        loader.dispose()


def read_foreign_config(path: str | os.PathLike, what: str = "", paths: dict | None = None) -> DictConfig:
    """A run's config (``.hydra/config.yaml``) as a ``DictConfig`` with every reference to its own settings
    resolved and no interpolation left; resolver calls refused (see the module docstring). ``paths``: the caller's
    own ``paths.<key>`` values (non-null ones win over the file's, before references are followed, so the run's
    dataset reads this machine's ``datasets_dir``). One line naming the file and the key on any refusal."""
    label = _label(path, what)
    data = read_yaml_data(path, what)
    if not isinstance(data, dict):
        raise UserError(f"{label} is corrupt: not a mapping of settings")
    data = _with_paths(data, paths or {})
    try:
        resolved = _Resolver(data).resolve()
    except _Refused as err:
        raise UserError(one_line(f"{label}: {err}")) from None
    try:
        config = OmegaConf.create(resolved)
    except Exception as err:  # noqa: BLE001 (OmegaConf's errors for unsupported keys or values vary)
        raise UserError(one_line(f"{label} is corrupt ({type(err).__name__}: {first_line(err)})")) from None
    if not isinstance(config, DictConfig):
        raise UserError(f"{label} is corrupt: not a mapping of settings")
    return config


def _with_paths(data: dict, own: dict) -> dict:
    """``data`` with ``paths.<key>`` set from the caller's non-null values, and the environment lookups our own
    configs write into ``paths`` (:data:`MACHINE_PATHS`) read as their default, null."""
    node = data.get("paths")
    if not isinstance(node, dict):
        return data
    node = dict(node)
    for key in MACHINE_PATHS:
        if isinstance(node.get(key), str) and _LEGACY_PATH_ENV.fullmatch(node[key].strip()):
            node[key] = None
    for key, value in own.items():
        if value is not None:
            node[key] = value
    return {**data, "paths": node}


def _field(keys: tuple) -> str:
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


class _Resolver:
    """Resolves ``${a.b}`` references of a plain config tree into plain values, memoised (each setting is resolved
    once, so chains of references cost their length, not their fan-out), cycles and runaway text refused."""

    def __init__(self, root: dict):
        self.root = root
        self.done: dict[tuple, object] = {}
        self.active: set[tuple] = set()
        self.budget = MAX_RESOLVED_CHARS

    def resolve(self):
        return self._walk(self.root, ())

    def _walk(self, value, keys: tuple):
        if isinstance(value, dict):
            return {k: self._walk(v, (*keys, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, (*keys, i)) for i, v in enumerate(value)]
        return self._scalar(value, keys)

    def _scalar(self, value, keys: tuple):
        if not isinstance(value, str) or "${" not in value:
            return value
        if keys in self.done:
            return self.done[keys]
        field = _field(keys)
        if keys in self.active:
            raise _Refused(f"{field} refers to itself through other settings ({value!r})")
        if "${" in _REFERENCE.sub("", value):
            raise _Refused(f"{field} holds {value!r}: a run folder's config is read as data, so only references to "
                           "its own settings (${seed}, ${paths.output_root}) are followed, never a resolver call "
                           "(${name:...}, ${oc.env:...}) or a nested interpolation; edit the file or retrain")
        self.active.add(keys)
        whole = _REFERENCE.fullmatch(value)
        if whole:  # ${seed} keeps the type of what it names (an int), as OmegaConf does
            result = self._target(whole.group(1), field)
        else:
            result = _REFERENCE.sub(lambda m: str(self._target(m.group(1), field)), value)
        self.active.discard(keys)
        if isinstance(result, str):
            self.budget -= len(result)
            if self.budget < 0:
                raise _Refused(f"resolving its references produces more than {MAX_RESOLVED_CHARS} characters "
                               f"(at {field})")
            if "${" in result:  # put together from pieces: it must not become an interpolation later
                raise _Refused(f"{field} resolves to {result[:200]!r}, which holds an interpolation")
        self.done[keys] = result
        return result

    def _target(self, reference: str, field: str):
        node, keys = self.root, ()
        for key in reference.split("."):
            if not isinstance(node, dict) or key not in node:
                raise _Refused(f"{field} refers to ${{{reference}}}, which is not a setting of the file")
            node, keys = node[key], (*keys, key)
        if isinstance(node, (dict, list)):
            raise _Refused(f"{field} refers to ${{{reference}}}, a group of settings; only references to single "
                           "values are followed")
        return self._scalar(node, keys)

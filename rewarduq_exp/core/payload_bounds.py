"""Bounded reads of the arrays in a run folder's binary files (``.npz``, safetensors).

A run folder may come from anyone, and a small file can declare a huge array: a 2 MB ``.npz`` whose deflated member
unpacks to 2 GiB of zeros, a ``.npy`` header that declares 10^12 elements (numpy allocates the whole array before it
reads a byte), a safetensors file whose header names a tensor far larger than anything the run trained. Every
loader here checks what a file *declares* before any data is read, and refuses in one line that names the file, the
array, its declared shape and the bound, and where the bound comes from:

* **Structure** (any file): the ``.npz``'s zip directory (at most :data:`MAX_NPZ_MEMBERS` members, each a ``.npy``)
  and each member's ``.npy`` header, parsed from the member's stream (numpy reads the header only, at most 10 kB):
  no Python objects, a plain numeric, boolean or text dtype, and a shape whose bytes plus the header are exactly the
  member's uncompressed size in the zip directory (``zipfile`` never unpacks more than that size, and checks the
  CRC). For safetensors, :func:`rewarduq_exp.core.saved_files.safetensors_problem` checks the header (at most
  :data:`~rewarduq_exp.core.saved_files.MAX_SAFETENSORS_HEADER` bytes), each tensor's dtype and shape against its
  byte range, and that the byte ranges tile the rest of the file: the data a file declares is the data it holds.
* **Settings** (each loader): the arrays a saved method has, by name, and their shapes, from the run's own settings:
  the method's hyperparameters and fit summary in ``method.json`` (feature dimension, ensemble members, hidden
  width, layers, LoRA rank, labels, training rows), or the base model the weights belong to (LoRA adapters, a
  fine-tuned policy). A dimension the settings do not give is bounded by a constant of this module (a feature
  dimension by :data:`MAX_FEATURE_DIM`, ...); a file with an array the method never saves, or without one it does,
  is refused too.

:class:`NpzArrays` reads an ``.npz`` this way; :func:`check_tensors` checks a safetensors file's header against the
shapes a loader expects (``load_safetensors(path, expected=...)`` in :mod:`rewarduq_exp.core.saved_files`).
"""

from __future__ import annotations

import math
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rewarduq_exp.core.errors import UserError, one_line

DAMAGED = "the run folder is damaged: copy it again or retrain"
# Bounds for a dimension the run's settings do not give. Hidden sizes of today's language models are at most about
# 25 600 (a BoRP probe with rubrics concatenates one difference vector per rubric); training sets of the methods
# here are at most a few million rows; label-ranking datasets have at most a few dozen labels.
MAX_FEATURE_DIM = 1 << 17
MAX_ROWS = 10_000_000
MAX_LABELS = 1024
# A saved .npz of this project has at most a dozen members (a probe: meta, a centroid, train rows, two per layer).
MAX_NPZ_MEMBERS = 256
# numpy's own bound of a .npy header (numpy.lib.format.read_array: max_header_size).
MAX_NPY_HEADER = 10_000
_KIND_WORDS = {"f": "float", "i": "int", "u": "int", "b": "bool", "U": "text"}
_SIZES = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def human_bytes(n: int) -> str:
    for unit, name in _SIZES:
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} bytes"


@dataclass(frozen=True)
class AtMost:
    """A dimension of at most ``n`` (where the settings bound it but do not fix it)."""

    n: int

    def __str__(self) -> str:
        return f"<={self.n}"


@dataclass(frozen=True)
class Expected:
    """What a loader expects of one array: its ``shape`` (each dimension an int, exactly, or :class:`AtMost`), the
    numpy dtype kinds it may have (``f`` float, ``i``/``u`` integer, ``b`` bool, ``U`` text) and at most
    ``max_itemsize`` bytes per element; ``why`` says where the bound comes from (shown when it is refused)."""

    shape: tuple
    kinds: str = "f"
    why: str = ""
    max_itemsize: int = 8

    def text(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        kinds = "/".join(dict.fromkeys(_KIND_WORDS.get(k, k) for k in self.kinds))
        return f"({dims}{',' if len(self.shape) == 1 else ''}) of {kinds}"


@dataclass(frozen=True)
class Declared:
    """What a file declares of one array, read from its header: shape, dtype name, kind and item size."""

    shape: tuple
    dtype: str
    kind: str
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def text(self) -> str:
        return f"shape {tuple(self.shape)} of {self.dtype} ({human_bytes(self.nbytes)})"


def within(declared: Declared, expected: Expected) -> bool:
    """Whether a declared array is of an allowed dtype and within the expected shape."""
    if declared.kind not in expected.kinds or declared.itemsize > expected.max_itemsize:
        return False
    return len(declared.shape) == len(expected.shape) and all(
        got <= want.n if isinstance(want, AtMost) else got == int(want)
        for got, want in zip(declared.shape, expected.shape))


def check_declared(path, member: str, name: str, declared: Declared, expected: Expected, fix: str = DAMAGED) -> None:
    """Refuse (one line) an array whose declared dtype or shape is not what ``expected`` allows."""
    if not within(declared, expected):
        why = f" ({expected.why})" if expected.why else ""
        raise UserError(one_line(f"{path}: {member} {name!r} declares {declared.text()}; this run's settings allow "
                                 f"shape {expected.text()}{why}; refused before reading it; {fix}"))


def check_all(path, member: str, declared: Mapping[str, Declared], expected: Mapping[str, Expected],
              fix: str = DAMAGED, optional=()) -> None:
    """Every expected array is declared (those in ``optional`` may be absent), nothing else is, and each is within
    its bound: the arrays' total is then within the bounds' total."""
    unexpected = [name for name in declared if name not in expected]
    if unexpected:
        name = unexpected[0]
        article = "an" if member[0] in "aeiou" else "a"
        raise UserError(one_line(f"{path}: holds {article} {member} {name!r} ({declared[name].text()}) that a saved "
                                 f"model of these settings never has; refused before reading it; {fix}"))
    missing = [name for name in expected if name not in declared and name not in optional]
    if missing:
        raise UserError(one_line(f"{path}: holds no {member} {missing[0]!r}; {fix}"))
    for name, spec in expected.items():
        if name in declared:
            check_declared(path, member, name, declared[name], spec, fix)


# ---------------------------------------------------------------------------------------------------- .npz
def _zip_directory(fh, size: int) -> tuple[int, int] | None:
    """(entries, bytes) of the zip's central directory, as its end-of-central-directory record declares them (the
    zip64 record where there is one, as ``zipfile`` reads it), read before ``zipfile`` builds an object per entry;
    None where no record is found (``zipfile`` then says what is wrong)."""
    tail = min(size, 22 + 0xFFFF)
    fh.seek(size - tail)
    data = fh.read(tail)
    fh.seek(0)
    at = data.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(data):
        return None
    entries, cd_size = struct.unpack("<HL", data[at + 10:at + 16])
    base = size - tail + at
    if base >= 20 + 56:   # a zip64 locator right before the record: zipfile takes the zip64 record's values
        fh.seek(base - 20 - 56)
        record = fh.read(56 + 20)
        fh.seek(0)
        if record[56:60] == b"PK\x06\x07" and record[:4] == b"PK\x06\x06":
            entries, cd_size = struct.unpack("<QQ", record[32:48])
    return entries, cd_size


def _check_directory(fh, size: int, path, most: int, what: str, fix: str) -> None:
    """Refuse a zip whose directory declares more than ``most`` members, or more than 1 KiB of directory per member
    (a member's entry: 46 bytes, its name and a few extra fields)."""
    found = _zip_directory(fh, size)
    if found is not None and (found[0] > most or found[1] > most * 1024):
        raise UserError(one_line(f"{path}: its zip directory declares {found[0]} members in {human_bytes(found[1])}, "
                                 f"more than the {most} a {what} may have; refused before reading it; {fix}"))


# What zipfile raises on a damaged archive: cut short or not a zip (BadZipFile, EOFError, struct.error), a bad CRC
# (BadZipFile), data that does not inflate (zlib.error), an unknown compression (NotImplementedError), an encrypted
# member (RuntimeError).
_ZIP_ERRORS = (ValueError, OSError, EOFError, zipfile.BadZipFile, NotImplementedError, struct.error, zlib.error,
               RuntimeError)


class NpzArrays:
    """An ``.npz`` opened for bounded reading (a context manager): :attr:`declared` holds every member's declared
    shape and dtype (the zip directory and the ``.npy`` headers only); :meth:`check` compares them with what the
    loader expects; :meth:`read` reads one checked array (``allow_pickle=False``: never code).

    ``what`` names the file's kind in the messages (``BoRP probe``); a file that is not a complete ``.npz`` is one
    line ``<path>: not a saved <what> (<why>)``."""

    def __init__(self, path, what: str, fix: str = DAMAGED):
        self.path, self.what, self.fix = Path(path), what, fix
        self.checked: set[str] = set()
        self._zip = None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise UserError(f"{self.path}: no saved {what} there") from None
        except OSError as err:
            raise UserError(f"{self.path} cannot be read ({err.strerror or type(err).__name__})") from None
        self._fh = os.fdopen(fd, "rb")
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UserError(f"{self.path}: not a saved {what} (not a regular file)")
            _check_directory(self._fh, info.st_size, self.path, MAX_NPZ_MEMBERS, f"saved {what}", fix)
            self._zip = zipfile.ZipFile(self._fh)
            self.declared = self._headers()
        except UserError:
            self.close()
            raise
        except _ZIP_ERRORS as err:
            self.close()
            raise self._not_saved(err) from None

    def _not_saved(self, err: Exception) -> UserError:
        first = (str(err).splitlines() or [type(err).__name__])[0][:200]
        return UserError(one_line(f"{self.path}: not a saved {self.what} ({first}); the file is damaged or of "
                                  "another kind"))

    def _headers(self) -> dict[str, Declared]:
        from numpy.lib import format as npy

        infos = self._zip.infolist()
        if len(infos) > MAX_NPZ_MEMBERS:
            raise UserError(one_line(f"{self.path}: {len(infos)} members, more than the {MAX_NPZ_MEMBERS} a saved "
                                     f"{self.what} may have; refused before reading it; {self.fix}"))
        declared: dict[str, Declared] = {}
        for info in infos:
            name = info.filename
            if not name.endswith(".npy") or info.is_dir():
                raise UserError(one_line(f"{self.path}: member {name!r} is not an array (.npy); {self.fix}"))
            key = name[:-4]
            if key in declared:
                raise UserError(one_line(f"{self.path}: array {key!r} is in the file twice; {self.fix}"))
            with self._zip.open(info) as fh:
                try:
                    version = npy.read_magic(fh)
                    if version == (1, 0):
                        shape, _, dtype = npy.read_array_header_1_0(fh, max_header_size=MAX_NPY_HEADER)
                    elif version == (2, 0):
                        shape, _, dtype = npy.read_array_header_2_0(fh, max_header_size=MAX_NPY_HEADER)
                    else:
                        raise ValueError(f".npy format version {version[0]}.{version[1]}")
                    offset = fh.tell()
                except (ValueError, EOFError, SyntaxError, TypeError, OSError, zlib.error) as err:
                    first = (str(err).splitlines() or [type(err).__name__])[0][:200]
                    raise UserError(one_line(f"{self.path}: array {key!r} has no valid .npy header ({first}); "
                                             f"{self.fix}")) from None
            if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "fiubU":
                raise UserError(one_line(f"{self.path}: array {key!r} has dtype {dtype.name!r}, not plain numbers or "
                                         "text (Python objects would need a pickle, which is never loaded); "
                                         f"{self.fix}"))
            if any(d < 0 for d in shape):
                raise UserError(one_line(f"{self.path}: array {key!r} declares shape {tuple(shape)}, with a "
                                         f"negative dimension; {self.fix}"))
            item = Declared(tuple(int(d) for d in shape), dtype.name, dtype.kind, int(dtype.itemsize))
            if offset + item.nbytes != info.file_size:
                raise UserError(one_line(f"{self.path}: array {key!r} declares {item.text()}, but its member holds "
                                         f"{human_bytes(max(0, info.file_size - offset))} of data; refused before "
                                         f"reading it; {self.fix}"))
            declared[key] = item
        return declared

    def check(self, expected: Mapping[str, Expected], optional=()) -> None:
        """The file holds exactly the ``expected`` arrays (``optional`` ones may be absent), each within its bound."""
        check_all(self.path, "array", self.declared, expected, self.fix, optional)
        self.checked |= {name for name in expected if name in self.declared}

    def check_one(self, name: str, expected: Expected) -> None:
        if name not in self.declared:
            raise UserError(one_line(f"{self.path}: holds no array {name!r}; {self.fix}"))
        check_declared(self.path, "array", name, self.declared[name], expected, self.fix)
        self.checked.add(name)

    def read(self, name: str):
        """The array ``name``, once checked (:meth:`check` / :meth:`check_one`)."""
        from numpy.lib import format as npy

        if name not in self.checked:
            raise RuntimeError(f"{self.path}: array {name!r} read before its declared shape was checked")
        try:
            with self._zip.open(name + ".npy") as fh:
                return npy.read_array(fh, allow_pickle=False, max_header_size=MAX_NPY_HEADER)
        except _ZIP_ERRORS as err:  # cut short, a bad CRC, deflated data that does not inflate
            raise self._not_saved(err) from None

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
        self._fh.close()

    def __enter__(self) -> NpzArrays:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_zip_total(data: bytes, path, limit: int, why: str, fix: str = DAMAGED) -> None:
    """Refuse a zip archive (held in ``data``) whose members unpack to more than ``limit`` bytes in all, or that
    declares more than :data:`MAX_NPZ_MEMBERS` x 64 members (a skops file: one per object); a file that is not a zip
    is left to its reader."""
    import io

    _check_directory(io.BytesIO(data), len(data), path, 64 * MAX_NPZ_MEMBERS, "file of this kind", fix)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            total = sum(info.file_size for info in zf.infolist())
    except _ZIP_ERRORS:
        return
    if total > limit:
        raise UserError(one_line(f"{path}: its members unpack to {human_bytes(total)}, more than the "
                                 f"{human_bytes(limit)} this run's settings allow ({why}); refused before reading "
                                 f"it; {fix}"))


# ---------------------------------------------------------------------------------------------------- safetensors
# safetensors' dtypes: (numpy kind, bytes per element). Sub-byte types (F4, F6) are never written by this project.
SAFETENSORS_DTYPES = {
    "BOOL": ("b", 1), "U8": ("u", 1), "I8": ("i", 1), "F8_E5M2": ("f", 1), "F8_E4M3": ("f", 1),
    "F8_E8M0": ("f", 1), "U16": ("u", 2), "I16": ("i", 2), "F16": ("f", 2), "BF16": ("f", 2),
    "U32": ("u", 4), "I32": ("i", 4), "F32": ("f", 4), "U64": ("u", 8), "I64": ("i", 8), "F64": ("f", 8),
    "C64": ("c", 8),
}


def declared_tensors(path) -> dict[str, Declared]:
    """The tensors a safetensors file declares (its header only), after
    :func:`~rewarduq_exp.core.saved_files.check_safetensors` (complete file, consistent header)."""
    import json

    from rewarduq_exp.core.saved_files import check_safetensors

    check_safetensors(path)
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n).decode("utf-8"))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        kind, size = SAFETENSORS_DTYPES[entry["dtype"]]
        out[name] = Declared(tuple(int(d) for d in entry["shape"]), entry["dtype"], kind, size)
    return out


def check_tensors(path, expected: Mapping[str, Expected], fix: str = DAMAGED, optional=()) -> None:
    """Refuse (one line) a safetensors file unless it holds exactly the ``expected`` tensors (those in ``optional``
    may be absent), each of an allowed dtype and within its shape bound; reads the header only."""
    check_all(path, "tensor", declared_tensors(path), expected, fix, optional)

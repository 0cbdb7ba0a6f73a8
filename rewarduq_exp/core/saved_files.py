"""Reading files that someone else may have written: a run folder copied from another cluster, a colleague's
download, a file cut short by a full disk or a killed copy.

Every reader here turns a missing, truncated or corrupt file into one :class:`UserError` line that names the file and
what is wrong with it, instead of a library's traceback (a ``SafetensorError`` that does not say which file, a
``JSONDecodeError`` with a line number into a file nobody named). Nothing here executes code from a file: JSON and
safetensors only. JSON files are bounded in size, depth and number of values (:func:`read_json_object`): a file
beyond what this project writes is refused in one line before it costs minutes or gigabytes, and a deeply nested
one never surfaces as a RecursionError.

:func:`safetensors_problem` checks a safetensors file without reading its tensors (its header and the file size the
header implies), cheap enough to run over every run of a sweep before it is counted.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

from rewarduq_exp.core.errors import UserError

# A safetensors file starts with the header's length (8 bytes, little-endian), then the JSON header. The format caps
# headers at 100 MB; the largest this project writes (a training checkpoint of a 32B policy: ~2 000 tensors) is under
# 1 MB, and parsing 100 MB of JSON would cost a gigabyte, so headers beyond 16 MiB are refused unread.
MAX_SAFETENSORS_HEADER = 16 * 2**20
_MAX_HEADER = MAX_SAFETENSORS_HEADER
# Bounds of the JSON files of a run folder (method.json, metrics.json, status.json, adapter configs). The largest the
# project writes are a few KB (a metrics.json with RewardBench's categories: 6 KB, nested 3 deep; a status.json with
# a traceback: 3 KB); a run evaluated on a hundred datasets stays under 1 MB. Beyond these bounds a file was not
# written by this project, and reading it on would cost minutes and gigabytes (10^8 numbers in adam_betas); at them,
# reading costs a fraction of a second.
MAX_JSON_BYTES = 4 * 2**20
MAX_JSON_DEPTH = 64
MAX_JSON_VALUES = 500_000


def read_bounded(path: str | os.PathLike, limit: int, label: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; a one-line :class:`UserError` naming
    ``label`` when it is missing, unreadable, not a regular file (a fifo would block, a device never end) or larger.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UserError(f"{label} is missing") from None
    except OSError as err:
        raise UserError(f"{label} cannot be read ({err.strerror or type(err).__name__})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{label} is not a regular file")
        if info.st_size > limit:
            raise UserError(f"{label} is refused: {info.st_size} bytes, more than the {limit} such a file may have")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)  # the size may have grown since fstat
    except OSError as err:
        raise UserError(f"{label} cannot be read ({err.strerror or type(err).__name__})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UserError(f"{label} is refused: more than the {limit} bytes such a file may have")
    return data


def json_shape_problem(data, max_depth: int = MAX_JSON_DEPTH, max_values: int = MAX_JSON_VALUES) -> str | None:
    """Why parsed JSON ``data`` is too deep or too large for the readers downstream (recursive walks, per-value
    checks), or None. Walks without recursion."""
    if not isinstance(data, (dict, list)):
        return None
    stack, count = [(data, 1)], 1
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            return f"is nested more than {max_depth} levels deep"
        count += len(value)  # counted before they are visited: a huge list is refused without a walk over it
        if count > max_values:
            return f"holds more than {max_values} values"
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return None


def read_json_object(path: str | os.PathLike, what: str = "") -> dict:
    """The JSON object in ``path``; a one-line :class:`UserError` naming the file when it is missing, unreadable,
    not valid UTF-8 / JSON, not an object, or beyond the bounds of a run folder's JSON files (:data:`MAX_JSON_BYTES`,
    :data:`MAX_JSON_DEPTH`, :data:`MAX_JSON_VALUES`). ``what`` says what the file is for (shown in the message)."""
    path = Path(path)
    label = f"{path}{f' ({what})' if what else ''}"
    raw = read_bounded(path, MAX_JSON_BYTES, label)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{label} is corrupt: not UTF-8 text (byte {err.start})") from None
    try:
        data = json.loads(text)
    except RecursionError:  # json's C parser stops at the interpreter's recursion limit
        raise UserError(f"{label} is refused: nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as err:
        raise UserError(f"{label} is corrupt: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"{label} is corrupt: a JSON {type(data).__name__}, not an object")
    problem = json_shape_problem(data)
    if problem:
        raise UserError(f"{label} is refused: it {problem}")
    return data


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete safetensors file (missing, truncated, bad header), or None when it is.

    Reads the header only: the tensors' byte ranges must lie inside the file and the file must end where the last
    one ends, so a copy cut short (or padded) is caught without loading any weights."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{path} is truncated ({size} bytes, not a safetensors file)"
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                return (f"{path} is refused: its header declares {n} bytes, more than the {_MAX_HEADER} a "
                        "safetensors file of a run may have (not read)")
            if 8 + n > size:
                return f"{path} is truncated or not a safetensors file (header of {n} bytes in a {size}-byte file)"
            header = json.loads(fh.read(n).decode("utf-8"))
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or type(err).__name__})"
    except (ValueError, RecursionError):  # bad UTF-8 or JSON in the header, or JSON nested beyond the parser
        return f"{path} is corrupt (its header is not valid JSON)"
    if not isinstance(header, dict):
        return f"{path} is corrupt (its header is not a JSON object)"
    from rewarduq_exp.core.payload_bounds import SAFETENSORS_DTYPES, human_bytes

    ranges = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"{path} is corrupt (tensor {name!r} has no valid data_offsets)"
        shape, dtype = entry.get("shape"), entry.get("dtype")
        if dtype not in SAFETENSORS_DTYPES or not (isinstance(shape, list) and len(shape) <= 64
                                                   and all(type(d) is int and d >= 0 for d in shape)):
            return f"{path} is corrupt (tensor {name!r} has no valid dtype and shape)"
        # What the header declares is what the file holds: shape x dtype must be the tensor's byte range (checked
        # before anything is allocated; safetensors checks it too, without naming the file).
        declared = SAFETENSORS_DTYPES[dtype][1] * math.prod(shape)
        if declared != offsets[1] - offsets[0]:
            return (f"{path} is corrupt: tensor {name!r} declares shape {tuple(shape)} of {dtype} "
                    f"({human_bytes(declared)}) but its data_offsets span {offsets[1] - offsets[0]} bytes")
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(ranges):
        if start != end:  # the ranges tile the data: no gap, no overlap (safetensors refuses either)
            return f"{path} is corrupt (tensor {name!r} overlaps another tensor or leaves a gap before it)"
        end = stop
    expected = 8 + n + end
    if size != expected:
        state = "truncated" if size < expected else "corrupt (longer than its header says)"
        return f"{path} is {state}: {size} bytes, the header needs {expected}"
    return None


def check_safetensors(path: str | os.PathLike) -> None:
    """Raise a one-line :class:`UserError` naming ``path`` unless it is a complete safetensors file."""
    problem = safetensors_problem(path)
    if problem:
        raise UserError(f"{problem}; the run folder is damaged: copy it again or retrain")


def check_finite(tensors, path: str | os.PathLike) -> None:
    """Raise a one-line :class:`UserError` naming ``path`` and the tensor when a floating-point tensor of
    ``tensors`` ({name: torch tensor or numpy array}, as read from that file) holds NaN or inf: no saved state of a
    run does, and a poisoned one would score NaN with exit 0. Every loader of a run's weights calls it (through
    :func:`load_safetensors`, or on what PEFT or safetensors loaded into a model)."""
    import numpy as np
    import torch

    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            bad = value.is_floating_point() and not bool(torch.isfinite(value).all())
        else:
            value = np.asarray(value)
            bad = value.dtype.kind in "fc" and not bool(np.isfinite(value).all())
        if bad:
            raise UserError(f"{path}: tensor {name!r} holds NaN or inf values; the run folder is damaged: copy it "
                            "again or retrain")


def load_safetensors(path: str | os.PathLike, framework: str = "pt", expected=None, optional=()) -> dict:
    """The tensors of a safetensors file (``framework``: ``pt`` for torch tensors, ``np`` for numpy arrays), after
    :func:`check_safetensors`; a read error still left is reported in one line naming the file.

    ``expected`` ({name: :class:`~rewarduq_exp.core.payload_bounds.Expected`}): the tensors the loader expects, with
    the shapes the run's settings allow; the header is checked against them before any tensor is read
    (:func:`~rewarduq_exp.core.payload_bounds.check_tensors`; ``optional`` ones may be absent)."""
    check_safetensors(path)
    if expected is not None:
        from rewarduq_exp.core.payload_bounds import check_tensors

        check_tensors(path, expected, optional=optional)
    if framework == "np":
        from safetensors.numpy import load_file
    else:
        from safetensors.torch import load_file
    try:
        tensors = load_file(str(path))
    except Exception as err:  # noqa: BLE001 (SafetensorError and friends do not name the file)
        raise UserError(f"{path} could not be read as safetensors ({type(err).__name__}: {err}); the run folder is "
                        "damaged: copy it again or retrain") from None
    check_finite(tensors, path)
    return tensors

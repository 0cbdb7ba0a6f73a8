"""The one way this package writes a result: to a temporary name beside the target, then a rename.

A reader (a colleague's ``select_runs.py``, a dashboard polling the run folder, a sweep job waiting on the feature
cache) never sees a half-written file, and a killed writer leaves at most a hidden ``.<name>.<random>.tmp``.

Files and folders are created with the permissions the user's umask gives, as any ``open()`` or ``mkdir`` would:
``tempfile.mkstemp`` / ``mkdtemp`` create 0600 / 0700 whatever the umask, which on a shared cluster makes results
unreadable to the colleagues the run folder is shared with. Here the temporary file is created by ``os.open`` with
mode 0666 (and a folder by ``os.mkdir`` with 0777), which the kernel masks with the umask.

Kept free of torch and pandas so that light readers (selection, tables) import it cheaply.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def _temporary_name(path: Path) -> Path:
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary file path beside ``path``; on success it is renamed onto ``path``.

    The temporary file already exists (empty, mode 0666 & ~umask). Writers that reopen it by name (``torch.save``,
    ``DataFrame.to_parquet``) keep those permissions; some replace it by a file of their own (``safetensors``
    writes 0600), so the mode is set again before the rename. On an exception the temporary file is removed and
    ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    umask_mode = os.stat(tmp).st_mode & 0o777  # what the kernel gave a 0666 file under the caller's umask
    try:
        yield tmp
        os.chmod(tmp, umask_mode)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write text (UTF-8) or bytes to ``path`` atomically, honouring the umask."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; on success it becomes ``path``.

    ``replace=True`` removes an existing ``path`` first (a re-saved model); otherwise an existing ``path`` (another
    process finished the same folder first, e.g. the shared tiny model) is kept and the temporary one discarded.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)
    os.mkdir(tmp, 0o777)
    dir_mode = os.stat(tmp).st_mode & 0o777  # 0777 & ~umask
    try:
        yield tmp
        # Writers of whole folders (safetensors, save_pretrained) create some files 0600: give everything the
        # umask's permissions, as if created by open() and mkdir.
        for root, dirs, files in os.walk(tmp):
            for name in dirs:
                os.chmod(os.path.join(root, name), dir_mode)
            for name in files:
                os.chmod(os.path.join(root, name), dir_mode & 0o666)
        if replace and path.exists():
            shutil.rmtree(path)
        try:
            os.replace(tmp, path)
        except OSError:
            if replace or not path.is_dir():  # lost a race only when someone else wrote the same folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

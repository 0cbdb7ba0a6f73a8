"""The one way this package writes a result: to a temporary name beside the target, then a rename.

A reader (a colleague's ``select_runs.py``, a dashboard polling the run folder, a sweep job waiting on the feature
cache) never sees a half-written file, and a killed writer leaves at most a hidden ``.<name>.<random>.tmp``.

Files and folders are created with the permissions the user's umask gives, as any ``open()`` or ``mkdir`` would:
``tempfile.mkstemp`` / ``mkdtemp`` create 0600 / 0700 whatever the umask, which on a shared cluster makes results
unreadable to the colleagues the run folder is shared with. Here the temporary file is created by ``os.open`` with
mode 0666 (and a folder by ``os.mkdir`` with 0777), which the kernel masks with the umask.

Inside a run, evaluation or downstream folder (one :func:`rewarduq_exp.core.inside_folder.check_writes_inside` has
checked) every write is checked again when it happens (:mod:`rewarduq_exp.core.inside_folder`, "at the write"): the
folder it goes into is reached one component at a time, never through a link, before the temporary file is created
there, and again right before the rename, which goes through that open folder; a link made meanwhile is refused in
one line and its target gets nothing. Elsewhere (caches) links are followed, as any ``open()`` does.

Kept free of torch and pandas so that light readers (selection, tables) import it cheaply.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.inside_folder import open_parent

# A full disk or quota: one line saying where (every writer of results, caches and checkpoints comes through here)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


# How writers that wrap the OS error in a type of their own say it (safetensors' SafetensorError: "I/O error: No
# space left on device (os error 28)"; pyarrow's OSError subclasses without an errno): read from the message.
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


@contextlib.contextmanager
def _disk_full_is_one_line(path: Path) -> Iterator[None]:
    try:
        yield
    except Exception as err:
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            why = err.strerror
        elif not isinstance(err, UserError) and any(text in str(err) for text in DISK_FULL_TEXT):
            why = next(text for text in DISK_FULL_TEXT if text in str(err))
        else:
            raise
        raise UserError(f"no space left to write {path} ({why}): free space on that disk or point the output there "
                        "elsewhere (paths.output_root, paths.cache_dir); nothing half-written was kept") from None


def _temporary_name(name: str) -> str:
    return f".{name}.{uuid.uuid4().hex[:12]}.tmp"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary file path beside ``path``; on success it is renamed onto ``path``.

    The temporary file already exists (empty, mode 0666 & ~umask). Writers that reopen it by name (``torch.save``,
    ``DataFrame.to_parquet``) keep those permissions; some replace it by a file of their own (``safetensors``
    writes 0600), so the mode is set again before the rename. On an exception the temporary file is removed and
    ``path`` is left as it was. Inside a guarded folder the path yielded names the temporary file through the open
    folder (``/proc/self/fd/<n>/.<name>.<random>.tmp`` on Linux): open it by that path, as given.
    """
    path = Path(path)
    with _disk_full_is_one_line(path), open_parent(path) as parent:
        parent.check_entry(path.name, "file")    # before anything is created there
        tmp = _temporary_name(path.name)
        fd = parent.create_file(tmp, 0o666)
        try:
            umask_mode = os.fstat(fd).st_mode & 0o777  # what the kernel gave a 0666 file under the caller's umask
        finally:
            os.close(fd)
        try:
            yield parent.entry(tmp)
            parent.chmod(tmp, umask_mode)
            parent.recheck()                        # a link made on the way while the file was written
            parent.check_entry(path.name, "file")
            parent.replace(tmp, path.name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                parent.unlink(tmp)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write text (UTF-8) or bytes to ``path`` atomically, honouring the umask."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; on success it becomes ``path``.

    ``replace=True`` replaces an existing ``path`` (a re-saved model: the old folder is renamed aside, the new one
    renamed in, the old one removed); otherwise an existing ``path`` (another process finished the same folder first,
    e.g. the shared tiny model) is kept and the temporary one discarded.
    """
    path = Path(path)
    with _disk_full_is_one_line(path), open_parent(path) as parent:
        parent.check_entry(path.name, "folder")
        tmp = _temporary_name(path.name)
        parent.make_folder(tmp, 0o777)
        dir_mode = parent.lstat(tmp).st_mode & 0o777  # 0777 & ~umask
        try:
            yield parent.entry(tmp)
            _give_umask_modes(parent.entry(tmp), dir_mode)
            parent.recheck()
            parent.check_entry(path.name, "folder")
            if replace and parent.lstat(path.name) is not None:
                old = _temporary_name(path.name) + ".old"
                parent.replace(path.name, old)
                try:
                    parent.replace(tmp, path.name)
                except OSError:
                    parent.replace(old, path.name)
                    raise
                parent.remove_tree(old)
            else:
                try:
                    parent.replace(tmp, path.name)
                except OSError:
                    st = parent.lstat(path.name)  # lost a race only when someone else wrote the same folder
                    if replace or st is None or not stat.S_ISDIR(st.st_mode):
                        raise
        finally:
            parent.remove_tree(tmp)


def _give_umask_modes(top: Path, dir_mode: int) -> None:
    """Writers of whole folders (safetensors, save_pretrained) create some files 0600: give everything the umask's
    permissions, as if created by open() and mkdir. Links are left alone (chmod would follow them)."""
    for root, dirs, files in os.walk(top):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), dir_mode & 0o666)

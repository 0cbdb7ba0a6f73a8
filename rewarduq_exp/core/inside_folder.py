"""Every write of a run (or of an evaluation's, a downstream task's) stays inside its folder.

A run folder is a directory others can edit: a colleague may have replaced ``predictions/`` by a link to a folder of
their own, ``figures/`` by a link to another run's figures, or left ``.metrics.json.lock`` as a link or a folder.
Writing through such a link changes files outside the run (the other run's PNGs, a shared folder), and a non-folder
where a folder should be fails late, after part of the results were written. :func:`check_writes_inside` looks at
every path a writer is about to use, before it writes anything, and refuses (one line: the path, why, what to do)

* a symbolic link anywhere between the folder and a path it writes (the link itself included),
* a non-folder where a folder of results should be, and a non-regular file (a folder, a fifo) where a result file
  or lock file should be,
* a path that resolves outside the folder (``..`` in a dataset name, say).

Only what is inside the folder is checked: the folder itself may be reached through a link (an ``outputs/`` on
another disk of a cluster is common), so its own path is resolved once and everything is compared with that.

A link is refused, never replaced by a real folder: it may be how the user keeps results on another disk, and
replacing it would silently take out of the run the results reached through it (and whatever reads them there);
the user decides where they belong.

The check runs twice. Before the work (:func:`check_writes_inside`: one line, nothing written). And at the moment of
every write: a folder checked there is *guarded* from then on in this process, and every write below it through
:mod:`rewarduq_exp.core.atomic_write` (every result file and folder: status.json, metrics.json, predictions, figures,
model, checkpoint, .hydra) walks from the folder to the written file's parent one component at a time, each opened
relative to the one before with ``O_NOFOLLOW`` (:func:`open_parent`), creating what is missing there. A link made
while a run is under way (``predictions/`` replaced by a link four seconds into training) is refused in the same one
line at the write, before the temporary file is created (it is created beside the final name, so in the checked
folder, through the open folder, never by name), and again right before the rename, which goes through the same open
folder: the link's target gets no file, not even a temporary one. The writers that reopen the temporary file by name
(``torch.save``, ``to_parquet``, ``safetensors``) get it as ``/proc/self/fd/<folder>/<name>`` on Linux, so they too
write into the checked folder whatever happens to the names on the way meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rewarduq_exp.core.errors import UserError, one_line


def check_writes_inside(root: str | os.PathLike, *, folders: Iterable[str] = (), files: Iterable[str] = (),
                        trees: Iterable[str] = ()) -> None:
    """Refuse (:class:`UserError`, nothing written) unless every write below ``root`` stays inside it.

    ``folders``: relative paths of folders the writer creates or writes into (each must be a real folder or not
    exist yet); ``files``: result files and lock files (a regular file or nothing); ``trees``: folders whose whole
    content the writer may rewrite (``model/``, ``.hydra/``): as ``folders``, and no link anywhere below them.
    The parents of each path must be real folders too. A path that does not exist yet is fine: the writer creates
    it, as a real folder or file, inside ``root``.

    From then on ``root`` is guarded (:func:`guard_writes`): every atomic write below it is checked again when it
    happens."""
    root = Path(root)
    guard_writes(root)
    base = root.resolve()
    for rel, kind in [*((f, "folder") for f in folders), *((f, "file") for f in files),
                      *((t, "tree") for t in trees)]:
        path = root / rel
        _check_chain(root, Path(rel), kind)  # first: a link is named as such
        resolved = path.resolve()
        if resolved != base and base not in resolved.parents:  # what is left: '..' in a name
            raise UserError(one_line(f"{path} resolves to {resolved}, outside {root}: results are written only inside "
                                     "their folder; use a name without '..'"))
        if kind == "tree" and path.is_dir():
            _check_no_links_below(path)


def _check_chain(root: Path, rel: Path, kind: str) -> None:
    """Each component of ``rel`` below ``root``: not a link; a folder, except the last when ``kind`` is a file."""
    current = root
    for i, part in enumerate(rel.parts):
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return  # created by the writer, with everything below it, inside the folder
        last = i == len(rel.parts) - 1
        wanted = "file" if last and kind == "file" else "folder"
        if stat.S_ISLNK(mode):
            _refuse_link(current, wanted)
        _check_kind(current, mode, wanted)


def _check_kind(path: Path, mode: int, wanted: str) -> None:
    if wanted == "folder" and not stat.S_ISDIR(mode):
        raise UserError(one_line(f"{path} is not a folder, but results are written into a folder of that "
                                 "name: move it away (or remove it) and run again"))
    if wanted == "file" and not stat.S_ISREG(mode):
        raise UserError(one_line(f"{path} is not a regular file ({_kind(mode)}), but a result is written "
                                 "under that name: move it away (or remove it) and run again"))


def _check_no_links_below(folder: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(folder):  # never follows links: a linked folder is in dirnames
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            if path.is_symlink():
                _refuse_link(path, "folder" if path.is_dir() else "file")


def _refuse_link(path: Path, wanted: str, dir_fd: int | None = None, name: str | None = None) -> None:
    try:
        target = f" (to {os.readlink(name, dir_fd=dir_fd) if dir_fd is not None else os.readlink(path)})"
    except OSError:
        target = ""
    raise UserError(one_line(f"{path} is a symbolic link{target}; results are written only inside their folder, "
                             f"never through a link: replace it by a real {wanted} (copy what it points to, if "
                             "you need it) and run again"))


def _kind(mode: int) -> str:
    return "a folder" if stat.S_ISDIR(mode) else "a special file"


# ---------------------------------------------------------------------------------------------------- at the write
# The folders checked in this process (each as given, made absolute, and resolved, as tuples of path parts). A write
# is checked from the innermost one that holds it lexically: that folder may itself be reached through a link, what
# is below it may not. Never forgotten: a folder this process put results in is never written through a link later.
_GUARDED: set[tuple[str, ...]] = set()
_GUARDED_LOCK = threading.Lock()
# Opening, creating and renaming relative to a folder's descriptor (openat, mkdirat, renameat): every POSIX system.
# Elsewhere the same checks run by name right before each step (a window of microseconds between check and write).
_AT = {os.open, os.mkdir, os.rename, os.stat, os.unlink, os.rmdir, os.chmod} <= os.supports_dir_fd
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# A descriptor's folder by name, whatever happens to the names on the way to it (Linux).
_PROC_FD = Path("/proc/self/fd")


def guard_writes(root: str | os.PathLike) -> None:
    """Check every later atomic write below ``root`` (:mod:`rewarduq_exp.core.atomic_write`) when it happens:
    :func:`check_writes_inside` calls it, so every folder checked before the work is also guarded during it."""
    root = Path(root)
    forms = {_absolute(root).parts}   # lexical, as the writers build their paths from it
    with contextlib.suppress(OSError, RuntimeError):
        forms.add(root.resolve().parts)
    with _GUARDED_LOCK:
        _GUARDED.update(forms)


def guarded_root(path: str | os.PathLike) -> tuple[Path, tuple[str, ...]] | None:
    """(the innermost guarded folder that holds ``path``, the parts of ``path`` below it), or None."""
    parts = _absolute(Path(path)).parts
    with _GUARDED_LOCK:
        holders = [root for root in _GUARDED if len(parts) > len(root) and parts[:len(root)] == root]
    if not holders:
        return None
    root = max(holders, key=len)
    return Path(*root), parts[len(root):]


def _absolute(path: Path) -> Path:
    """``path`` made absolute without resolving anything (``..`` stays: the kernel, not this, decides where it
    goes); a relative path is taken from the working directory, so a relative folder guarded before a ``chdir`` is
    not recognised after it (Hydra's ``chdir`` is off in every config here)."""
    return path if path.is_absolute() else Path.cwd() / path


@dataclass
class Parent:
    """The open folder a result is written into (:func:`open_parent`): its entries are created, renamed and removed
    through ``fd`` (None: by name, where descriptors cannot be used). ``root`` is the guarded folder it lies in
    (None: not guarded, e.g. a cache) and ``chain`` its path below ``root``."""
    path: Path
    fd: int | None
    root: Path | None = None
    chain: tuple[str, ...] = ()

    def entry(self, name: str) -> Path:
        """The path a writer opens ``name`` by: in a guarded folder, through the open folder itself (Linux), so a
        link made on the way meanwhile is never followed."""
        if self.root is not None and self.fd is not None and _PROC_FD.is_dir():
            return _PROC_FD / str(self.fd) / name
        return self.path / name

    def _at(self, name: str) -> tuple[str, dict]:
        return (name, {"dir_fd": self.fd}) if self.fd is not None else (str(self.path / name), {})

    def create_file(self, name: str, mode: int = 0o666) -> int:
        """A new empty file (never an existing name, never through a link), open for writing."""
        where, kw = self._at(name)
        return os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode,
                       **kw)

    def make_folder(self, name: str, mode: int = 0o777) -> None:
        where, kw = self._at(name)
        os.mkdir(where, mode, **kw)

    def lstat(self, name: str) -> os.stat_result | None:
        where, kw = self._at(name)
        try:
            return os.stat(where, follow_symlinks=False, **kw)
        except FileNotFoundError:
            return None

    def chmod(self, name: str, mode: int) -> None:
        where, kw = self._at(name)
        os.chmod(where, mode, **kw)

    def replace(self, src: str, dst: str) -> None:
        """Rename entry ``src`` onto entry ``dst`` of this folder (one rename: atomic)."""
        if self.fd is not None:
            os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        else:
            os.replace(self.path / src, self.path / dst)

    def unlink(self, name: str) -> None:
        where, kw = self._at(name)
        os.unlink(where, **kw)

    def remove_tree(self, name: str) -> None:
        """Remove entry ``name`` (a folder with everything below it, or a file), never following a link; what cannot
        be removed is left."""
        if self.fd is None:
            import shutil

            shutil.rmtree(self.path / name, ignore_errors=True)
            return
        _remove_at(self.fd, name)

    def check_entry(self, name: str, kind: str) -> None:
        """In a guarded folder: ``name`` is nothing yet, or a real ``kind`` ("file" or "folder"), not a link."""
        if self.root is None:
            return
        st = self.lstat(name)
        if st is None:
            return
        if stat.S_ISLNK(st.st_mode):
            _refuse_link(self.path / name, kind, self.fd, name)
        _check_kind(self.path / name, st.st_mode, kind)

    def recheck(self) -> None:
        """In a guarded folder: the folder is still the one at ``root/chain``, reached with no link on the way (a
        link made since it was opened is refused by name, as before the work); call it right before the rename."""
        if self.root is None:
            return
        if self.fd is None:
            _check_chain(self.root, Path(*self.chain), "folder")
            return
        try:
            fd = _walk(self.root, self.chain, create=False)
        except FileNotFoundError:
            raise UserError(one_line(f"{self.path} was moved or removed while results were written into it; leave "
                                     "the run folder as it is while the run writes, and run again")) from None
        try:
            now, held = os.fstat(fd), os.fstat(self.fd)
        finally:
            os.close(fd)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            raise UserError(one_line(f"{self.path} was replaced while results were written into it; leave the run "
                                     "folder as it is while the run writes, and run again"))


@contextlib.contextmanager
def open_parent(path: str | os.PathLike, create: bool = True) -> Iterator[Parent]:
    """The folder ``path`` is written into, open (:class:`Parent`), created with what is missing above it when
    ``create``. Inside a guarded folder it is reached from there one component at a time, each opened relative to
    the one before and never through a link: a link or a non-folder on the way is refused (:class:`UserError`, one
    line naming it), and so is a ``..``. Elsewhere (a cache) it is created and opened by name, links followed."""
    path = Path(path)
    found = guarded_root(path)
    if found is None:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        parent = Parent(path.parent, os.open(path.parent, _DIR) if _AT else None)
    else:
        root, rel = found
        if os.pardir in rel:
            raise UserError(one_line(f"{path} leaves {root} ('..'): results are written only inside their folder; "
                                     "use a name without '..'"))
        chain = rel[:-1]
        if _AT:
            parent = Parent(root.joinpath(*chain), _walk(root, chain, create), root, chain)
        else:
            _check_chain(root, Path(*chain), "folder")
            if create:
                root.joinpath(*chain).mkdir(parents=True, exist_ok=True)
            parent = Parent(root.joinpath(*chain), None, root, chain)
    try:
        yield parent
    finally:
        if parent.fd is not None:
            os.close(parent.fd)


def make_folders(path: str | os.PathLike) -> Path:
    """Create the folder ``path`` with what is missing above it (as ``mkdir -p``); inside a guarded folder never
    through a link (:func:`open_parent`), and an existing non-folder or link there is refused."""
    path = Path(path)
    with open_parent(path) as parent:
        parent.check_entry(path.name, "folder")
        if parent.lstat(path.name) is None:
            with contextlib.suppress(FileExistsError):
                parent.make_folder(path.name)
        parent.check_entry(path.name, "folder")
    return path


def replace_inside(src: str | os.PathLike, dst: str | os.PathLike, kind: str = "file") -> None:
    """Rename ``src`` onto ``dst`` (``kind``: "file" or "folder"; an existing folder must be moved aside first),
    both folders reached as :func:`open_parent` does and checked right before the rename: for a writer that
    finishes results elsewhere in its folder and swaps them in (``evaluate.py``'s staging folder)."""
    src, dst = Path(src), Path(dst)
    with open_parent(src, create=False) as source, open_parent(dst) as target:
        target.recheck()
        target.check_entry(dst.name, kind)
        if source.fd is not None and target.fd is not None:
            os.replace(src.name, dst.name, src_dir_fd=source.fd, dst_dir_fd=target.fd)
        else:
            os.replace(source.path / src.name, target.path / dst.name)


def _walk(root: Path, chain: tuple[str, ...], create: bool) -> int:
    """A descriptor of ``root/chain``: ``root`` opened by name (it may be reached through a link), then each part of
    ``chain`` opened relative to the one before with ``O_NOFOLLOW`` (created first when missing and ``create``)."""
    try:
        fd = os.open(root, _DIR)
    except FileNotFoundError:
        if not create:
            raise
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, _DIR)
    current = root
    try:
        for part in chain:
            current = current / part
            below = _open_folder_at(fd, part, current, create)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_folder_at(fd: int, name: str, display: Path, create: bool) -> int:
    for first in (True, False):
        try:
            return os.open(name, _DIR | _NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            if not (create and first):
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=fd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):  # a link (EMLINK: BSD), or not a folder
                try:
                    mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                except OSError:
                    raise err from None
                if stat.S_ISLNK(mode):
                    _refuse_link(display, "folder", fd, name)
                _check_kind(display, mode, "folder")
            raise
    raise AssertionError("unreachable")


def _remove_at(fd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=fd)
            return
        below = os.open(name, _DIR | _NOFOLLOW, dir_fd=fd)
        try:
            with os.scandir(below) as entries:
                names = [e.name for e in entries]
            for entry in names:
                _remove_at(below, entry)
        finally:
            os.close(below)
        os.rmdir(name, dir_fd=fd)

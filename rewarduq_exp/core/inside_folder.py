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
the user decides where they belong. The check runs before the work (one line, nothing written); the writers check
again right before they swap their results in, so a link made in the meantime is refused too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from rewarduq_exp.core.errors import UserError, one_line


def check_writes_inside(root: str | os.PathLike, *, folders: Iterable[str] = (), files: Iterable[str] = (),
                        trees: Iterable[str] = ()) -> None:
    """Refuse (:class:`UserError`, nothing written) unless every write below ``root`` stays inside it.

    ``folders``: relative paths of folders the writer creates or writes into (each must be a real folder or not
    exist yet); ``files``: result files and lock files (a regular file or nothing); ``trees``: folders whose whole
    content the writer may rewrite (``model/``, ``.hydra/``): as ``folders``, and no link anywhere below them.
    The parents of each path must be real folders too. A path that does not exist yet is fine: the writer creates
    it, as a real folder or file, inside ``root``."""
    root = Path(root)
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
        if wanted == "folder" and not stat.S_ISDIR(mode):
            raise UserError(one_line(f"{current} is not a folder, but results are written into a folder of that "
                                     "name: move it away (or remove it) and run again"))
        if wanted == "file" and not stat.S_ISREG(mode):
            raise UserError(one_line(f"{current} is not a regular file ({_kind(mode)}), but a result is written "
                                     "under that name: move it away (or remove it) and run again"))


def _check_no_links_below(folder: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(folder):  # never follows links: a linked folder is in dirnames
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            if path.is_symlink():
                _refuse_link(path, "folder" if path.is_dir() else "file")


def _refuse_link(path: Path, wanted: str) -> None:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    raise UserError(one_line(f"{path} is a symbolic link{target}; results are written only inside their folder, "
                             f"never through a link: replace it by a real {wanted} (copy what it points to, if "
                             "you need it) and run again"))


def _kind(mode: int) -> str:
    return "a folder" if stat.S_ISDIR(mode) else "a special file"

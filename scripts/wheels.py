"""Wheels for a machine without a package index: every package the project's install needs that the machine lacks.

    make wheels                                           # for this Python and platform, into wheels/
    make wheels PYTHON_VERSION=3.12 NODE_FREEZE=freeze.txt  # for a node, minus what its `pip freeze` lists
    python scripts/wheels.py --python-version 3.12 --platform manylinux_2_28_aarch64 --out wheels

Run where pip reaches the package index; carry the folder to the node (it is small: the heavy packages stay out) and
install it there beside the node's own packages (docs/gpu-and-slurm.md, "An offline GPU node"). The steps:

1. The requirements: pyproject.toml's dependencies and the extras asked for (default ``dev``: the check of a node
   runs the tests), without ruff (lint is a developer's job).
2. What the node already has: the packages of ``--node-freeze`` (``pip freeze`` run on the node), pinned to their
   versions; or, without one, the documented default of a GPU image: torch and its CUDA stack, numpy, scipy, pandas,
   pyarrow, scikit-learn and matplotlib, with what only they require (a package that the project also needs
   through another path, such as filelock or cloudpickle, is brought: the image's versions may be older).
3. One resolution for the target (``pip install --dry-run --report`` with ``--python-version`` / ``--platform`` /
   ``--only-binary=:all:``): with a freeze file, each of the node's packages is a local stand-in wheel of its exact
   version without requirements, so the resolver keeps the node's versions (custom builds such as ``2.11.0+cu130``
   included) and never looks at their CUDA stacks. A package published as source only (antlr4-python3-runtime 4.9.3,
   Hydra's parser) is built into a wheel here first; it must be pure Python.
4. The download (``pip download --no-deps``) of the resolved packages the node lacks. Wheels in the folder from an
   earlier call that are no longer wanted are removed; ``manifest.txt`` lists the target, the node's packages and the
   wheels. The count and total size are printed: a GPU node that is lent through a transfer of limited size
   (64 MiB here) must get the heavy stack from its image.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import urllib.parse
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from preflight import ROOT, canonical, project_requirements  # noqa: E402

sys.path.insert(0, str(ROOT))
from rewarduq_exp.core.atomic_write import write_atomic  # noqa: E402 (standard library only: any python3 runs this)

try:
    from packaging.requirements import Requirement
except ModuleNotFoundError:   # pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

# The default node: a GPU image with these (and everything they require) already installed.
HEAVY = ("torch", "numpy", "scipy", "pandas", "pyarrow", "scikit-learn", "matplotlib")
# Published as source only: built here into (pure-Python) wheels before the resolution, since pip's resolver, asked
# for binaries, reports such a requirement as a conflict of whatever requires it (hydra-core) rather than by name.
SOURCE_ONLY = ("antlr4-python3-runtime==4.9.3",)
NOT_FOUND = re.compile(r"No matching distribution found for (\S+)")


def default_platforms() -> list[str]:
    """The running machine's platform tags pip should accept for the target (Linux: manylinux 2.17 to 2.28)."""
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    if plat.startswith("linux_"):
        machine = plat[len("linux_"):]
        return [f"manylinux_2_{v}_{machine}" for v in (28, 27, 24, 17)] + [f"manylinux2014_{machine}"]
    return [plat]


def read_freeze(path: Path) -> dict[str, str | None]:
    """``pip freeze`` output: name -> version (``None`` for a line that names no version, e.g. ``x @ file://...``)."""
    node: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):   # comments, -e editable installs, options
            continue
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(==|@)\s*(\S+)", line)
        if not match:
            raise SystemExit(f"wheels: {path}: cannot read the line {raw!r}; expected 'name==version' or "
                             f"'name @ url' as pip freeze writes them")
        name, op, value = match.groups()
        node[canonical(name)] = value if op == "==" else None
    return node


def stand_in_wheel(folder: Path, name: str, version: str) -> str:
    """A wheel of ``name`` with no files and no requirements: for the resolver, the node's package. Its version is the
    node's with ``node`` added to the local label (``2.4.6+node``, ``2.11.0+cu130.node``): it satisfies every specifier
    that the node's version does (local labels are ignored there), and pinned to it the resolver cannot take the
    index's wheel of the same version instead (which it would prefer for its more specific platform tag, and whose
    requirements, torch's CUDA stack, it would then bring). Returns that version."""
    version = f"{version}.node" if "+" in version else f"{version}+node"
    metadata_wheel(folder, name, version)
    return version


def metadata_wheel(folder: Path, name: str, version: str, requires=(), tag: str = "py3-none-any") -> Path:
    """A wheel that holds only its metadata (name, version, ``requires``)."""
    dist = f"{re.sub(r'[-.]+', '_', name)}-{version}"
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                           + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: rewarduq_exp\nRoot-Is-Purelib: true\n"
                                        f"Tag: {tag}\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}.dist-info/RECORD,,\n"
    path = folder / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for arc, text in files.items():
            zf.writestr(arc, text)
    return path


def file_path(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path)


def wheel_key(wheel: Path) -> tuple[str, str]:
    """(canonical name, version) of a wheel file's name."""
    name, version = wheel.name.split("-")[:2]
    return canonical(name), version


def pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


class Target:
    def __init__(self, python_version: str, platforms: list[str]):
        self.python_version, self.platforms = python_version, platforms
        self.args = ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
        for plat in platforms:
            self.args += ["--platform", plat]
        machine = re.sub(r"^(manylinux\d*(_\d+_\d+)?|musllinux_\d+_\d+|linux)_", "", platforms[0])
        linux = platforms[0].startswith(("manylinux", "musllinux", "linux"))
        major, minor = python_version.split(".")[:2]
        self.markers = {"python_version": f"{major}.{minor}", "python_full_version": f"{major}.{minor}.0",
                        "implementation_name": "cpython", "platform_python_implementation": "CPython",
                        "os_name": "posix" if linux else "nt", "sys_platform": "linux" if linux else sys.platform,
                        "platform_system": "Linux" if linux else platform.system(), "platform_machine": machine,
                        "platform_release": "", "platform_version": "", "implementation_version": "",
                        "extra": ""}

    def applies(self, requirement: str) -> Requirement | None:
        req = Requirement(requirement)
        if req.marker is not None and not req.marker.evaluate(self.markers):
            return None
        return req


def resolve(requirements: list[str], target: Target, links: Path, constraints: Path, work: Path) -> list[dict]:
    """The packages one install of ``requirements`` resolves to for ``target`` (pip's installation report), building
    a wheel here for each requirement that is published as source only."""
    built: set[str] = set()
    for spec in SOURCE_ONLY:
        build_wheel(spec, links)
    while True:
        report = work / "report.json"
        done = pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                    "--target", str(work / "target"), *target.args, "--find-links", str(links), "-c", str(constraints),
                    *requirements])
        if done.returncode == 0:
            return json.loads(report.read_text())["install"]
        missing = NOT_FOUND.search(done.stderr)
        if not missing or missing.group(1) in built:
            raise SystemExit("wheels: pip could not resolve the project's requirements for python "
                             f"{target.python_version} on {target.platforms[0]}:\n{done.stderr.strip()}")
        built.add(missing.group(1))
        print(f"wheels: {missing.group(1)} has no wheel for the target; building one from its source", flush=True)
        build_wheel(missing.group(1), links)


def build_wheel(spec: str, links: Path) -> None:
    """A wheel of ``spec`` built here from its source distribution into ``links``; it must be pure Python."""
    before = set(links.glob("*.whl"))
    made = pip(["wheel", "--quiet", "--no-deps", "--no-binary", ":all:", "-w", str(links), spec])
    new = sorted(set(links.glob("*.whl")) - before)
    if made.returncode != 0 or not new:
        raise SystemExit(f"wheels: building {spec} from its source failed:\n{made.stderr.strip()}")
    if not all(w.name.endswith("-none-any.whl") for w in new):
        raise SystemExit(f"wheels: {spec} builds a platform wheel ({new[0].name}); build it on the node's platform")


def closure(installs: list[dict], roots, target: Target, stop=()) -> set[str]:
    """``roots`` and every package of the resolution that they require, transitively (markers of the target), not
    going into the packages of ``stop``."""
    by_name = {canonical(i["metadata"]["name"]): i for i in installs}
    found, todo = set(), [canonical(r) for r in roots if canonical(r) in by_name]
    while todo:
        name = todo.pop()
        if name in found or name in stop:
            continue
        found.add(name)
        for text in by_name[name]["metadata"].get("requires_dist") or []:
            req = target.applies(text)
            if req is not None and canonical(req.name) in by_name:
                todo.append(canonical(req.name))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="wheels", help="the folder for the wheels (default: wheels)")
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="the node's python, e.g. 3.12 (default: this one's)")
    parser.add_argument("--platform", action="append", default=None,
                        help="a platform tag the node accepts (repeatable; default: this machine's, e.g. "
                             "manylinux_2_28_x86_64 down to manylinux2014_x86_64)")
    parser.add_argument("--node-freeze", default=None,
                        help="`pip freeze` of the node's python: these packages are not brought (default: the node "
                             f"has {', '.join(HEAVY)} and what only they require)")
    parser.add_argument("--extras", default="dev", help="extras of pyproject.toml to bring too (default: dev)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: expected major.minor, e.g. 3.12")
    target = Target(args.python_version, args.platform or default_platforms())
    requirements = project_requirements([e for e in args.extras.split(",") if e.strip()])
    node = read_freeze(Path(args.node_freeze)) if args.node_freeze else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.txt").unlink(missing_ok=True)   # a folder whose download fails has no manifest, not a stale one
    with tempfile.TemporaryDirectory(prefix="rewarduq-wheels-") as tmp:
        work, links = Path(tmp), Path(tmp) / "links"
        links.mkdir()
        constraints = work / "constraints.txt"
        pins = []
        for name, version in (node or {}).items():
            if version is not None:
                pins.append(f"{name}=={stand_in_wheel(links, name, version)}")
        constraints.write_text("".join(f"{p}\n" for p in pins))
        print(f"wheels: resolving {len(requirements)} requirements for python {target.python_version} on "
              f"{target.platforms[0]}" + (f", the node's {len(pins)} packages kept" if node else ""), flush=True)
        installs = resolve(requirements, target, links, constraints, work)
        if node is not None:
            has = {canonical(i["metadata"]["name"]) for i in installs} & set(node)
        else:   # what only the heavy packages need (torch's CUDA stack, ...); a small package that the project
            # needs through another path too (filelock, cloudpickle) is brought: the node's torch may be older
            direct = [Requirement(r).name for r in requirements]
            brought = closure(installs, direct, target, stop={canonical(h) for h in HEAVY})
            has = {canonical(i["metadata"]["name"]) for i in installs} - brought
        wanted = {(canonical(i["metadata"]["name"]), i["metadata"]["version"]): i for i in installs
                  if canonical(i["metadata"]["name"]) not in has}
        built = [i for i in wanted.values() if i["download_info"]["url"].startswith("file:")
                 and Path(file_path(i["download_info"]["url"])).parent == links]
        for item in built:   # built here from a source distribution
            shutil.copy2(file_path(item["download_info"]["url"]), out)
        remote = [f"{name}=={version}" for (name, version), i in wanted.items() if i not in built]
        print(f"wheels: downloading {len(remote)} wheels into {out}", flush=True)
        done = pip(["download", "--quiet", "--no-deps", *target.args, "-d", str(out), *remote])
        if done.returncode != 0:
            raise SystemExit(f"wheels: pip download failed:\n{done.stderr.strip()}")
    wheels = []
    for wheel in sorted(out.glob("*.whl")):
        if wheel_key(wheel) in wanted:
            wheels.append(wheel)
        else:   # from an earlier call, for another target or node
            wheel.unlink()
    missing = set(wanted) - {wheel_key(w) for w in wheels}
    if missing:
        raise SystemExit(f"wheels: pip did not write {', '.join(f'{n}=={v}' for n, v in sorted(missing))}")
    size = sum(w.stat().st_size for w in wheels)
    node_line = (f"the packages of {args.node_freeze}" if node is not None else
                 f"{', '.join(HEAVY)} and what only they require (the default)")
    write_atomic(out / "manifest.txt",
        f"# python {target.python_version}, {' '.join(target.platforms)}; extras: {args.extras or '(none)'}\n"
        f"# the node has: {node_line}: {' '.join(sorted(has))}\n" + "".join(f"{w.name}\n" for w in wheels))
    print(f"wheels: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {out} (not brought, the node has them: "
          f"{len(has)} packages: {node_line})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# An offline GPU node, simulated on this machine (make offline-node-check): what a cluster user without network on the
# node does, step by step, as docs/gpu-and-slurm.md ("An offline GPU node") says.
#
# 1. The node's image: a fresh venv holding only torch (this machine's local CPU build stands in for the image's CUDA
#    build) and the heavy stack that wheels.py assumes by default (numpy, scipy, pandas, pyarrow, scikit-learn,
#    matplotlib). Making the image is the only step that reaches the package index besides 2.
# 2. On the "login node" (index reachable): make wheels for the image's python version, the default exclusion (or,
#    with --freeze, the image's pip freeze as NODE_FREEZE).
# 3. The "transfer": the project's files as git lists them (tracked, and untracked but not ignored: a fresh clone plus
#    what is not committed yet) and the wheels, copied into a new folder: no .venv, no outputs.
# 4. On the "node", with every index unreachable (no pip configuration, PIP_NO_INDEX, a refused PIP_INDEX_URL, no
#    find-links): make offline-install, then
#    a. the preflight with one wheel left out (DROP, default xxhash): make gpu-check must stop with exit status 2 and
#       exactly one "missing:" line, naming that package;
#    b. make gpu-check: every step on the CPU.
# Prints each phase's time and the check's summary; exit status 0 only when both a. and b. hold.
#   scripts/offline_node.sh [--freeze] [--keep]    (OFFLINE_NODE_DIR=<folder> to choose where; DROP=<package>)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
drop=${DROP:-xxhash}
freeze=0
keep=0
for arg in "$@"; do
  case $arg in
    --freeze) freeze=1 ;;
    --keep) keep=1 ;;
    *) echo "offline_node.sh: unknown option $arg; allowed: --freeze, --keep" >&2; exit 2 ;;
  esac
done
work=${OFFLINE_NODE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/offline-node-XXXXXX")}
mkdir -p "$work"
[ "$keep" = 1 ] || [ -n "${OFFLINE_NODE_DIR:-}" ] || trap 'rm -rf "$work"' EXIT
t0=$SECONDS
phase() { echo "== [$((SECONDS - t0)) s] $*"; }

phase "1. the node's image in $work/image: torch and the heavy stack"
"$python" -m venv "$work/image"
image="$work/image/bin/python"
"$image" -m pip install --quiet --no-compile torch==2.13.0
"$image" -m pip install --quiet --no-compile numpy scipy pandas pyarrow scikit-learn matplotlib
# byte-compiled, as an image's packages are (where PYTHONDONTWRITEBYTECODE is set nothing else would compile them)
"$image" -m compileall -q -j 0 "$work/image/lib" > /dev/null 2>&1 || true
"$image" -m pip freeze > "$work/image-freeze.txt"
version=$("$image" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')

phase "2. make wheels for python $version"
freeze_arg=()
[ "$freeze" = 1 ] && freeze_arg=(NODE_FREEZE="$work/image-freeze.txt")
make --no-print-directory -C "$root" wheels WHEELS_DIR="$work/wheels" PYTHON_VERSION="$version" "${freeze_arg[@]}"

phase "3. the transfer: the project's files and the wheels into $work/node"
mkdir -p "$work/node"
(cd "$root" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -f "$f" ] && mkdir -p "$work/node/$(dirname "$f")" && cp -p "$f" "$work/node/$f"; done)
cp -r "$work/wheels" "$work/node/wheels"

phase "4. on the node, offline"
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS="" PIP_EXTRA_INDEX_URL="" \
  PIP_INDEX_URL=http://127.0.0.1:9/simple HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
cd "$work/node"
mkdir -p wheels-but-one
find wheels -name '*.whl' ! -iname "$(echo "$drop" | tr - _)-*" -exec cp {} wheels-but-one/ \;
make --no-print-directory offline-install PYTHON="$image" WHEELS_DIR=wheels-but-one NODE_SITE=.node-site-but-one
set +e
make --no-print-directory gpu-check PYTHON="$image" NODE_SITE=.node-site-but-one GPU_CHECK_OUT="$work/check-but-one" \
  > "$work/preflight-but-one.log" 2>&1
code=$?
set -e
missing=$(grep -c '^missing:' "$work/preflight-but-one.log" || true)
phase "4a. without the $drop wheel: exit $code, $missing missing line(s):"
grep '^missing:' "$work/preflight-but-one.log" || true
drop_ok=0
if [ "$code" != 0 ] && [ "$missing" = 1 ] && grep -qi "^missing: $drop:" "$work/preflight-but-one.log"; then drop_ok=1; fi
if ! grep -q "Error 2" "$work/preflight-but-one.log"; then drop_ok=0; fi

make --no-print-directory offline-install PYTHON="$image"
set +e
make --no-print-directory gpu-check PYTHON="$image" GPU_CHECK_OUT="$work/check"
check=$?
set -e
phase "4b. make gpu-check on the node: exit $check"
[ -f "$work/check/summary.md" ] && cat "$work/check/summary.md"
echo "wheels: $(ls "$work/wheels"/*.whl | wc -l) files, $(du -sh "$work/wheels" | cut -f1); preflight without $drop: \
$([ $drop_ok = 1 ] && echo 'named it, alone' || echo FAILED); gpu-check: $([ $check = 0 ] && echo passed || echo FAILED)"
[ "$drop_ok" = 1 ] && [ "$check" = 0 ]

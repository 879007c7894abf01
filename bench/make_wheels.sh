#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what bench/gpu.sh installs on a GPU machine that has torch, transformers, accelerate
# and peft but not TRL, datasets or this package, and no package index: pure-Python wheels of trl and datasets and
# of the dependencies that image lacks (dill, multiprocess), a wheel of this package, and (unless --no-pyarrow) a
# cp312 manylinux pyarrow, installed there only if the image's pyarrow is older than datasets needs.
# Usage: bench/make_wheels.sh [--no-pyarrow]     (run from anywhere; needs PyPI; checks the 64 MiB limit)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${WHEEL_DIR:-.whl}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}   # the GPU image's CPython (3.12); another only to test gpu.sh elsewhere
PYTAG=cp${PYTHON_VERSION/./}
TRL_VERSION=1.16.0
DATASETS_VERSION=5.2.0      # needs pyarrow>=24, dill<0.4.2, multiprocess<0.70.20, huggingface-hub>=1.31
PYARROW_VERSION=26.0.1
WITH_PYARROW=1
[ "${1:-}" = "--no-pyarrow" ] && WITH_PYARROW=0

rm -rf "$DEST"
mkdir -p "$DEST"
# the target image's interpreter: CPython 3.12 on x86-64 Linux
TARGET=(--python-version "$PYTHON_VERSION" --implementation cp --abi "$PYTAG" --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
"$PY" -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d "$DEST" \
    "trl==$TRL_VERSION" "datasets==$DATASETS_VERSION" "dill==0.4.1" "multiprocess==0.70.19"
if [ "$WITH_PYARROW" = 1 ]; then
    mkdir -p "$DEST/optional"
    "$PY" -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d "$DEST/optional" \
        "pyarrow==$PYARROW_VERSION"
fi
# this package, from the working tree (no build isolation: the venv's setuptools builds it offline)
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" . 
rm -rf build

ls -l "$DEST" "$DEST/optional" 2>/dev/null || true
total=$(du -sb "$DEST" | cut -f1)
echo "total: $((total / 1024)) KiB in $DEST"
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
    echo "error: $DEST is over 60 MiB (the device machine takes 64 MiB with the repository): rerun with --no-pyarrow" >&2
    exit 1
fi

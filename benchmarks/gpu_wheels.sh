#!/usr/bin/env bash
# Build what a GPU machine without network needs to run this repository's code into .whl/
# (git-ignored): a wheel of every package (core, plugins, the installable test plugins) and
# jax-triton 0.3.1, the release that works with triton 3.6. Extra arguments are more
# requirements to download as wheels for that machine's Python (3.12 by default; PYVER=3.13 ...).
# TOKAMAX=1 also downloads tokamax (a peer the mosaic benchmark compares against, never a
# dependency) and what of its requirements the GPU machine lacks into .whl/peers/ (qwix and
# xprof are left out: benchmarks/mosaic_bench.py stubs them). See CONTRIBUTING.md, "Working on
# a GPU".
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
pyver=${PYVER:-3.12}
rm -rf .whl && mkdir -p .whl
for p in ./core ./plugins/*/ ./tests/*/; do
  if [ -f "$p/pyproject.toml" ]; then python3 -m pip wheel -q --no-deps -w .whl "$p"; fi
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp --platform any -d .whl "jax-triton==0.3.1" "$@"
if [ "${TOKAMAX:-0}" = 1 ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d .whl/peers "tokamax==0.0.17" absl-py einshape jaxtyping wadler_lindig pydantic \
    pydantic-core annotated-types typing-inspection typing-extensions immutabledict tensorboardx protobuf
fi
ls -1 .whl

#!/usr/bin/env bash
# Builds the wheel folder that bench/gpu_check.sh installs on a GPU machine that reaches no package
# registry. Such a machine's image has python3 3.12 with a CUDA build of torch, numpy, pyarrow,
# safetensors, tokenizers, huggingface-hub, typer, psutil, msgpack, ninja, einops, py-cpuinfo...; it
# lacks DeepSpeed, DuckDB, pydantic and hjson, and holds other versions of transformers, regex, fsspec
# and typing-extensions than the ones our tests ran with. This folder brings exactly those, at the
# versions installed in .venv (torch is never included: the image's CUDA build is the point).
#
#     bash bench/gpu_prepare.sh [DEST] [PYTHON_VERSION]      # defaults: bench/gpu_wheels 3.12
#
# Run it where the package registry is reachable (it needs .venv from `make install`). DEST stays out
# of git (.gitignore lists bench/gpu_wheels/) and is copied with the repository to the GPU machine,
# where `bash bench/gpu_check.sh` installs it. Only pure-Python wheels and manylinux x86_64 wheels for
# PYTHON_VERSION; DeepSpeed is built from its sdist with its ops off (a pure-Python wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-bench/gpu_wheels}
PYVER=${2:-3.12}
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run 'make install' first" >&2; exit 1; }

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
PACKAGES="pydantic pydantic-core annotated-types typing-inspection typing-extensions duckdb hjson regex transformers fsspec"
SPECS=()
for name in $PACKAGES; do SPECS+=("$name==$(version "$name")"); done

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" \
  --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  "${SPECS[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$(version deepspeed)"

ls -1 "$DEST"
echo "$(du -sh "$DEST" | cut -f1) in $DEST (python $PYVER, manylinux x86_64)"

#!/usr/bin/env bash
# The GPU check (bench/gpu): one command, from anywhere, on a GPU machine or on a CPU.
#
#     bash bench/gpu_check.sh [--quick] [--sections engine,train,...]
#
# A rerun of some sections only (the others' entries of bench/results/gpu.json are kept when that file
# travels with the run), in less time:
#     GPU_CHECK_BUDGET=200 GPU_CHECK_TIMEOUT=240 bash bench/gpu_check.sh --sections deepspeed,migration
#
# On a GPU machine without a package registry: its python3 holds a CUDA build of torch. What our
# code needs beyond that image travels as wheels in bench/gpu_wheels/ (built by bench/gpu_prepare.sh
# where a registry is reachable, kept out of git, copied with the repository); they are installed into
# /tmp/gyre-site, which goes on PYTHONPATH before the image's packages, with the repo root. Then
# `python -m bench.gpu` runs every section within a 420 s budget under `timeout 470` and writes
# bench/results/gpu.json; when OUT names a folder, it also gets gpu.json after every step
# (--copy-to "$OUT") and the run's log (gpu_check.log). The repository's .venv is not used there:
# its torch is a CPU build.
#
# Without CUDA it falls back to .venv (tiny preset, tiny sizes) and writes bench/results/gpu_cpu.json,
# so a CPU run never overwrites the GPU figures.
#
# Sections: engine, train, deepspeed, role_switch, migration, vllm (bench/gpu/__init__.py says what each
# measures). vllm starts one vLLM engine through the product's path with the first of $GYRE_VLLM_PYTHON,
# ./.venv-vllm/bin/python and the python running the check whose environment holds vLLM; vLLM cannot
# travel with the repository (at most 64 MiB) and the GPU machine reaches no registry, so without one
# the section records "skipped" and why, and the check goes on. On CPU it uses .venv-vllm (make vllm).
#
# Environment: GPU_CHECK_BUDGET (seconds, default 420), GPU_CHECK_TIMEOUT (default 470), OUT (a folder
# for gpu.json and the log, optional), GYRE_VLLM_PYTHON (vLLM's python, optional).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUDGET=${GPU_CHECK_BUDGET:-420}
LIMIT=${GPU_CHECK_TIMEOUT:-470}
SITE=/tmp/gyre-site

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

PY=""
for candidate in python3 /opt/torch/.venv/bin/python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then
    PY=$(command -v "$candidate")
    break
  fi
done

if [ -n "$PY" ]; then
  RESULT=bench/results/gpu.json
  if compgen -G "bench/gpu_wheels/*.whl" >/dev/null; then
    echo "[gpu_check] installing $(ls bench/gpu_wheels/*.whl | wc -l) carried wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      bench/gpu_wheels/*.whl || { echo "[gpu_check] wheel install failed" >&2; exit 3; }
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "[gpu_check] no bench/gpu_wheels/: using the packages of $PY as they are"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
  RESULT=bench/results/gpu_cpu.json
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  PY=$(command -v python3)
  RESULT=bench/results/gpu_cpu.json
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1

LOG=/dev/null
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  LOG=$OUT/gpu_check.log
fi

{
  # one interpreter start: what runs, and the imports every section needs (deepspeed only its own),
  # before any of the budget is spent
  "$PY" - <<'PYCHECK' || { echo "[gpu_check] missing packages: build bench/gpu_wheels with bench/gpu_prepare.sh and copy it along" >&2; exit 2; }
import importlib.metadata as m, sys
import torch
print(f"[gpu_check] {sys.executable} {sys.version.split()[0]}, cuda available: {torch.cuda.is_available()}")
for name in ("torch", "transformers", "deepspeed", "pydantic", "duckdb", "pyarrow", "fsspec", "huggingface-hub", "tokenizers", "safetensors"):
    try:
        print(f"[gpu_check]   {name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"[gpu_check]   {name} missing")
import pydantic, duckdb, pyarrow, transformers, bench.gpu  # noqa: E401,F401
PYCHECK
  COPY=()
  [ -n "${OUT:-}" ] && COPY=(--copy-to "$OUT")
  timeout --kill-after=15 "$LIMIT" "$PY" -m bench.gpu --budget "$BUDGET" --out "$RESULT" "${COPY[@]}" "$@"
  rc=$?
  [ "$rc" -eq 124 ] && echo "[gpu_check] stopped by the $LIMIT s time limit; $RESULT holds every section finished before it"
  if [ -n "${OUT:-}" ] && [ -f "$RESULT" ]; then cp "$RESULT" "$OUT/gpu.json"; fi
  echo "[gpu_check] exit $rc, results in $RESULT"
  exit "$rc"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# The part of the GPU check that runs on a GPU machine WITHOUT a package index: its own
# python3 with a CUDA torch, plus two small wheels carried in .whl/ (torch_memory_saver,
# megatron-core; tools/gpu_check_wheels.sh downloads them on a machine with one).
#
#   tools/gpu_check_wheels.sh             # where PyPI is reachable: fills .whl/ (~5 MB)
#   OUT=gpu-check tools/gpu_check_offline.sh   # on the GPU machine, from the repo root
#
# What it runs, each step killed at its limit and the next run anyway (158 s on one H200,
# 2026-12-04): the `gpu` tests of ppo-lifecycle and ppo-trainer (offload backends on CUDA,
# the cross-process memory test, torch_memory_saver, Megatron on CUDA, NCCL suspend) and
# the offload benchmark. What needs Ray, sglang or Transformer Engine (the driver's
# 3-step train, the sglang tests) is left to `uv run nox -s gpu`, which installs them.
# Logs: $OUT/summary.txt, $OUT/env.txt, one $OUT/<step>.log per step.
set -u
cd "$(dirname "$0")/.."
. tools/uv_lock_version.sh  # locked NAME: the version uv.lock pins
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
read -r -a PIP <<<"${PIP:-$PY -m pip}"  # the pip that installs for $PY
mkdir -p "$OUT"
: >"$OUT/summary.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    "${PIP[@]}" install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-check-site .whl/*.whl || { echo "wheel install failed" >>"$OUT/summary.txt"; exit 1; }
    SITE=/tmp/gpu-check-site:
else
    SITE=
fi
SRC=$(printf '%s:' "$PWD"/packages/{lifecycle,trainer,sampler}/src)
export PYTHONPATH="${SITE}${SRC}${PYTHONPATH:-}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

step() {  # step NAME LIMIT_S CMD...: run, log, time, record; never stops the script
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: $([ $rc = 0 ] && echo ok || echo "FAILED (rc $rc)") in $((SECONDS - t0)) s (limit $limit s)" \
        | tee -a "$OUT/summary.txt"
}

{
    nvidia-smi
    "$PY" - <<'EOF'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
for d in ("megatron-core", "torch-memory-saver", "transformers", "safetensors", "numpy"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "missing")
EOF
    # this check runs the machine's own torch; the project locks another one
    echo "uv.lock: torch $(locked torch)"
} >"$OUT/env.txt" 2>&1

if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA device seen by $PY's torch: nothing run (see $OUT/env.txt)" | tee -a "$OUT/summary.txt"
    exit 1
fi
PYTEST=("$PY" -m pytest -p no:cacheprovider -m gpu -rA --durations=20)
step pytest-lifecycle 240 "${PYTEST[@]}" --junitxml="$OUT/pytest-lifecycle.xml" packages/lifecycle/tests
step pytest-trainer 300 "${PYTEST[@]}" --junitxml="$OUT/pytest-trainer.xml" packages/trainer/tests
step bench-lifecycle 90 "$PY" bench/bench_lifecycle.py --device cuda --param-gib 1.0 --repeats 2
! grep -q FAILED "$OUT/summary.txt"

#!/usr/bin/env bash
# Download, into .whl/, the wheels tools/gpu_check_offline.sh installs on a GPU machine
# that has no package index: the locked torch_memory_saver and megatron-core, for
# CPython $PYVER (default 3.12) on x86-64 Linux. Everything else they need (torch,
# numpy, packaging, transformers, safetensors, pytest) must already be on that machine.
set -eu
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
. tools/uv_lock_version.sh  # locked NAME: the version uv.lock pins
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${platforms[@]}" -d .whl \
    "torch-memory-saver==$(locked torch-memory-saver)" "megatron-core==$(locked megatron-core)"
ls -l .whl

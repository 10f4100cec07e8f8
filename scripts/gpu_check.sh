#!/usr/bin/env bash
# One call on the lent GPU machine: GPU tests, then the weight-sync and rollout benchmarks.
# Logs land in $OUT (the device tool brings them back). Each stage has its own time limit so
# a hang in one still returns the others' figures.
set -u
export PYTHONUNBUFFERED=1
if ! python3 -c "import zmq" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
fi
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout "${TEST_S:-150}" python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests/model/test_cuda_graph.py tests/attention/test_backends_gpu.py tests/kernels tests/weightsync/test_cuda_ipc_gpu.py} 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
timeout "${WS_S:-120}" python3 -m scripts.bench_weightsync --repeats 3 2>&1 | grep -v Loading | tee "$OUT/weightsync.log" | tail -8
timeout "${RB_S:-200}" python3 -m scripts.bench_rollout --shape llama8b --workloads ${WORKLOADS:-b a} --json "$OUT/rollout.json" 2>&1 | grep -v Loading | tee "$OUT/rollout.log" | tail -12

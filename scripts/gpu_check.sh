#!/usr/bin/env bash
# One call on the lent GPU machine: GPU tests, a decode-step profile, then the rollout and
# weight-sync benchmarks. Logs land in $OUT (the device tool brings them back). Each stage
# has its own time limit so a hang in one still returns the others' figures.
#   STAGES="tests profile rollout weightsync lora tp det"   (default: the first four; tp needs 2 GPUs)
#   STAGES=det: deterministic mode (issue #14) in one call under DET_S seconds (default 460):
#     GPU invariance tests, check_deterministic (deterministic mode only), the rollout bench
#     b a c with deterministic off on on off (ABBA), then the batch-invariant matmul bench;
#     CGBS=512 sets the bench's cuda_graph_max_bs (GRPO's c decodes 512 rows)
#   PROFILE="256:flashinfer:off 1:flashinfer:on"   (batch:attention:overlap per profile run)
#   ATTENTION="flashinfer triton"  OVERLAP="on off"  WORKLOADS="b a"  for the rollout bench
set -u
source scripts/gpu_env.sh
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
STAGES=${STAGES:-tests profile rollout weightsync}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import flashinfer, time; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1

if [[ " $STAGES " == *" tests "* ]]; then
  timeout "${TEST_S:-300}" python3 -m pytest -q -x -p no:cacheprovider ${TESTS:-tests/attention/test_backends_gpu.py tests/model/test_cuda_graph.py tests/kernels tests/weightsync/test_cuda_ipc_gpu.py} 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  fi_save_jit "$OUT"
fi
if [[ " $STAGES " == *" profile "* ]]; then
  for bs_att in ${PROFILE:-256:flashinfer:off 1:flashinfer:off}; do
    IFS=: read -r bs att ov <<<"$bs_att"
    flag=""; [ "$ov" = on ] && flag="--overlap"
    timeout "${PROFILE_S:-120}" python3 -m benchmarks.diagnostics.profile_step --shape llama8b --batch "$bs" --attention "$att" $flag --steps 20 --top 18 2>&1 \
      | grep -v -E "Loading|USDT|profiler_st" | tee -a "$OUT/profile.log" | grep -E "ms per decode|^  [a-z]" 
  done
fi
if [[ " $STAGES " == *" rollout "* ]]; then
  timeout "${RB_S:-400}" python3 -m benchmarks.rollout --shape llama8b --workloads ${WORKLOADS:-b a} \
    --attention ${ATTENTION:-flashinfer triton} --overlap ${OVERLAP:-on off} ${HF:-} --json "$OUT/rollout.json" 2>&1 \
    | grep -v Loading | tee "$OUT/rollout.log" | tail -14
fi
if [[ " $STAGES " == *" weightsync "* ]]; then
  timeout "${WS_S:-120}" python3 -m benchmarks.weightsync --repeats 3 2>&1 | grep -v Loading | tee "$OUT/weightsync.log" | tail -8
fi
if [[ " $STAGES " == *" tp "* ]]; then  # needs nvidia-h200-x2; the three limits fit one 600 s call
  timeout "${TP_TEST_S:-120}" python3 -m pytest -q -x -p no:cacheprovider tests/distributed/test_tp_gpu.py 2>&1 | tail -8 | tee "$OUT/tp_tests.log"
  timeout "${TP_S:-330}" python3 -m benchmarks.tp --model llama8b --tp 2 --device cuda --dtype bfloat16 --output "$OUT/tp.json" 2>&1 \
    | grep -v Loading | tee "$OUT/tp.log" | tail -12
  timeout "${BB_S:-140}" torchrun --nproc-per-node 2 -m benchmarks.broadcast --model llama8b --device cuda \
    --dtype bfloat16 2>&1 | grep -v Loading | tee "$OUT/broadcast.log" | tail -10
fi
if [[ " $STAGES " == *" lora "* ]]; then
  timeout "${LORA_S:-200}" python3 -m benchmarks.kernels.sgmv 2>&1 | tee "$OUT/sgmv.log" | tail -30
  timeout "${LORA_BENCH_S:-400}" python3 -m benchmarks.lora --workloads ${LORA_WORKLOADS:-a b s} 2>&1 | grep -v Loading \
    | tee "$OUT/lora.log" | tail -16
fi
if [[ " $STAGES " == *" det "* ]]; then
  # one shared deadline: each step gets min(its cap, the time left), the goal figures before the matmul table
  det_end=$((SECONDS + ${DET_S:-460}))
  left() { local l=$((det_end - SECONDS)); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # timeout 0 = none
  took() { echo "[det] $1: $((SECONDS - $2)) s (deadline in $((det_end - SECONDS)) s)" | tee -a "$OUT/det_times.log"; }
  t0=$SECONDS
  timeout "$(left 80)" python3 -m pytest -q -rf -p no:cacheprovider tests/kernels/test_batch_invariant.py \
    tests/attention/test_deterministic_attention.py tests/test_deterministic.py::test_decode_graphs_replay_the_same_bits \
    2>&1 | tee "$OUT/det_tests.log" | tail -12
  took "GPU invariance tests" $t0; t0=$SECONDS
  timeout "$(left 80)" python3 -m scripts.check_deterministic --mem-fraction 0.2 --modes deterministic --no-distance 2>&1 \
    | grep -v Loading | tee "$OUT/det_check.log" | tail -7
  took "check_deterministic" $t0; t0=$SECONDS
  # ABBA: each mode early and late in the call (the same mode's runs moved by up to 14% within one call)
  timeout "$(left 300)" python3 -m benchmarks.rollout --shape llama8b --workloads b a c --deterministic off on on off \
    ${CGBS:+--cuda-graph-max-bs $CGBS} --json "$OUT/det_rollout.json" 2>&1 | grep -v Loading | tee "$OUT/det_rollout.log" | tail -17
  took "benchmarks.rollout b a c, deterministic off on on off" $t0; t0=$SECONDS
  if [ "$(left 30)" -ge 30 ]; then
    timeout "$(left 60)" python3 -m benchmarks.kernels.batch_invariant --rows 1 256 8192 2>&1 | tee "$OUT/det_matmul.log" | tail -6
    took "benchmarks.kernels.batch_invariant" $t0
  fi
fi

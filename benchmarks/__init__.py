"""Benchmarks, profiles and diagnostics of the engine: every figure in BENCHMARKS.md comes from
a program here. Not installed with the packages, and never imported by them. Run each as a
module from the repository root (by path, benchmarks/rollout.py would shadow the rollout
package):

    python -m benchmarks.rollout --shape llama8b --workloads b a c   # the headline benchmark
    python -m benchmarks.cpu                                         # against transformers on CPU

End to end (the engine, one program each): rollout (throughput against the roofline and
transformers, workloads a-d), batch1 (batch-1 decode, kernel variants side by side),
first_step (a batch-1 run step by step), host (the host's cost of a step, no GPU), spec
(speculative decoding), lora (multi-LoRA), structured (constrained decoding), client (the
engine process against in-process), sleep (sleep / wake), weightsync (weight updates),
broadcast (the weight broadcast under torchrun), tp (tensor parallelism), precision (bf16 /
fp16 log-probs against fp32), cpu (against transformers on CPU).

kernels/: one kernel against its peer. diagnostics/: where the time goes. experiments/:
kernels tried and not adopted. common/: parts the programs share. Their CPU smoke runs are
tests/benchmarks/."""

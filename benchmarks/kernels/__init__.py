"""Kernel micro-benchmarks: one kernel (or one layer's kernels) against its peer (cuBLAS,
torch, FlashInfer), on a model's shapes on the GPU, or on tiny shapes under the Triton
interpreter as a CPU smoke run. `python -m benchmarks.kernels.NAME --help` says what each
sweeps."""

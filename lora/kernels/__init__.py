"""Triton kernels for multi-LoRA: ``sgmv`` (segmented shrink/expand), the block sizes and
split-K they launch with (``tiling``, pure Python), and the one-row shrink (``row``); their
micro-benchmarks are benchmarks/kernels/sgmv.py and lora_row.py.
Importing this package does not import triton; ``lora.ops`` loads ``lora.kernels.sgmv`` on
first use."""

# The expand kernel finds an N-block's slice among at most this many (q/k/v is three).
MAX_SLICES = 4

"""Triton kernels for multi-LoRA: ``sgmv`` (segmented shrink/expand), the block sizes and
split-K they launch with (``tiling``, pure Python) and a GPU micro-benchmark (``bench``).
Importing this package does not import triton; ``lora.ops`` loads ``lora.kernels.sgmv`` on
first use."""

# The expand kernel finds an N-block's slice among at most this many (q/k/v is three).
MAX_SLICES = 4

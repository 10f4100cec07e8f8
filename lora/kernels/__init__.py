"""Triton kernels for multi-LoRA (``sgmv``: segmented shrink/expand). Importing this
package does not import triton; ``lora.ops`` loads ``lora.kernels.sgmv`` on first use."""

# The expand kernel finds an N-block's slice among at most this many (q/k/v is three).
MAX_SLICES = 4

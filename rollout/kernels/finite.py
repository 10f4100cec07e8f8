"""Which of many tensors hold a NaN or an Inf: one Triton launch over all of them.

A weight update must be checked for finiteness before anything is written (the old weights
keep serving if it is refused), so the check is on the critical path of every sync: 16 GB
for an 8B model. torch's multi-tensor inf-norm (`_foreach_norm`) computes a norm it does not
need and reads well below the read bandwidth, and a per-tensor `isfinite().all()` is slower
still (BENCHMARKS.md, weight sync, "Run 3 (2026-12-01, issue #16): zero-copy CUDA IPC, the
NaN/Inf check in one launch"); this kernel only reads, so it runs at the read bandwidth.

How: a float is NaN or +-Inf exactly when its exponent bits are all ones, so each tensor is
read as integers of its width and masked, with no float conversion. The tensors are not
copied together: the kernel gets a table of their addresses, and the work is cut into
fixed chunks of CHUNK elements (a tensor of n elements owns cdiv(n, CHUNK) consecutive
programs), so a 1 GB embedding and a 4 KB norm weight are spread over the GPU alike.
Each program raises its tensor's flag if its chunk holds a non-finite value.

The torch path (kernels.first_non_finite on CPU) is the reference; tests run this kernel
under TRITON_INTERPRET=1 on CPU tensors.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

# element bits -> (integer dtype to read the bits as, exponent mask) per float dtype
_EXPONENT: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}
CHUNK = 1 << 20  # elements per program: ~2 MB of bf16, thousands of programs for a model
BLOCK = 4096  # elements per load
NUM_WARPS = 8


@triton.jit
def _non_finite_kernel(base, offsets, numels, owner, first_program, flags,
                       MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(owner + pid)  # which tensor this program reads
    chunk = pid - tl.load(first_program + t)
    n = tl.load(numels + t)
    # tensor t starts `offsets[t]` elements from `base` (the first tensor; a real pointer
    # argument, so the compiler knows its alignment). An offset read from memory tells the
    # compiler nothing: ALIGN says how many elements it is a multiple of, or no vector loads.
    start = tl.multiple_of(tl.load(offsets + t), ALIGN) + chunk.to(tl.int64) * CHUNK
    length = tl.minimum(CHUNK, n - chunk.to(tl.int64) * CHUNK)
    full = length // BLOCK * BLOCK
    seen = tl.zeros([BLOCK], dtype=tl.int32)
    # whole blocks unmasked (a mask against a length read from memory would also stop the
    # loads from being vectorized), then one masked block for the rest
    for offset in range(0, full, BLOCK):
        bits = tl.load(base + start + offset + tl.arange(0, BLOCK))
        seen |= ((bits & MASK) == MASK).to(tl.int32)
    idx = full + tl.arange(0, BLOCK)
    bits = tl.load(base + start + idx, mask=idx < length, other=0)
    seen |= ((bits & MASK) == MASK).to(tl.int32)
    bad = tl.max(seen, axis=0)
    if bad != 0:
        tl.store(flags + t, 1)


def non_finite_flags(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A device int32 flag per tensor (1: holds a NaN or an Inf), without a host sync.

    All tensors must be on one device and of one float dtype; any strides (a non-contiguous
    tensor is read through a contiguous copy)."""
    if not tensors:
        raise ValueError("non_finite_flags: no tensors")
    device, dtype = tensors[0].device, tensors[0].dtype
    if dtype not in _EXPONENT:
        raise ValueError(f"non_finite_flags: unsupported dtype {dtype}")
    int_dtype, mask = _EXPONENT[dtype]
    views = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    if any(v.device != device or v.dtype != dtype for v in views):
        raise ValueError("non_finite_flags: tensors must share one device and dtype")
    numels = [v.numel() for v in views]
    chunks = [max(1, -(-n // CHUNK)) for n in numels]
    first = [0, *itertools.accumulate(chunks)][:-1]  # each tensor's first program
    # every tensor as element offsets from the first non-empty one (one device, one address space)
    itemsize = dtype.itemsize
    anchor = next((v for v in views if v.numel()), views[0])
    addresses = [v.data_ptr() for v in views]
    offsets = [(address - anchor.data_ptr()) // itemsize for address in addresses]
    align = 16 // itemsize if all(address % 16 == 0 for address in addresses) else 1
    # [4, T] int64 on the host, one copy to the device
    table = torch.tensor([offsets, numels, first, chunks], dtype=torch.int64)
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
    owner = torch.repeat_interleave(torch.arange(len(views), device=device), table[3], output_size=sum(chunks))
    flags = torch.zeros(len(views), dtype=torch.int32, device=device)
    # (contiguous copies freed on return are safe: the allocator reuses their memory only for
    # work queued after this kernel on the same stream)
    _non_finite_kernel[(sum(chunks),)](anchor.view(int_dtype), table[0], table[1], owner, table[2], flags,
                                       MASK=mask, CHUNK=CHUNK, BLOCK=BLOCK, ALIGN=align, num_warps=NUM_WARPS)
    return flags

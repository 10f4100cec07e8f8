"""Shared checks of the fused kernels' tests (test_fused.py, test_rotary.py): outputs a
kernel forgets to write show up, and differences from the torch twin are counted in units
in the last place of the 16-bit reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


@contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Floating tensors from torch.empty come NaN-filled, so an output element the kernel
    forgets to write shows up (the random inputs hold no NaN)."""
    real_empty = torch.empty

    def empty(*args, **kwargs) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = real_empty  # type: ignore[assignment]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of x (in x's 16-bit dtype), as fp32."""
    info = torch.finfo(x.dtype)
    mant = {torch.float16: 10, torch.bfloat16: 7}[x.dtype]
    _, exp = torch.frexp(x.float().abs())  # |x| = m * 2^exp, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp - 1 - mant)
    return ulp.clamp_min(info.smallest_normal * 2.0**-mant)  # subnormals and zero


def assert_matches(out: torch.Tensor, ref: torch.Tensor, max_ulps: int, rtol32: float = 1e-6) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert not out.isnan().any(), "output not fully written (NaN poison left)"
    if max_ulps == 0:
        assert torch.equal(out, ref), f"not bit-identical: max diff {(out.float() - ref.float()).abs().max()}"
        return
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=rtol32, atol=rtol32 * 1e-2)
        return
    diff = (out.float() - ref.float()).abs()
    ulps = diff / _ulp(ref)
    assert ulps.max() <= max_ulps, f"{ulps.max().item():.1f} ulp > {max_ulps} (max abs diff {diff.max().item():.3g})"
    assert (out != ref).float().mean() < 0.01, f"{(out != ref).float().mean().item():.2%} of elements differ"

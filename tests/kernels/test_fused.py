"""Fused Triton kernels (rollout.kernels.fused) against their torch twins in
rollout.model.llama: RMSNorm (+ residual add), SiLU-and-mul, rotary embedding, and a tiny
model forward with the fused path forced on.

On CPU the kernels run under TRITON_INTERPRET=1 in float32 and float16. The interpreter
truncates fp32 -> bf16 instead of rounding to nearest, so bf16 gets only a loose smoke test
there; the exact bf16 checks run on a GPU (same file, `DEVICE == "cuda"`).

Tolerances (16-bit dtypes, in units in the last place (ulp) of the reference element):
* rotary: bit-identical in every dtype (each rounding of the torch twin is reproduced and
  fp32 FMA contraction is disabled).
* rms_norm: <= 2 ulp. The fp32 mean of squares may differ from torch's in the last bits
  (another summation order), which can flip the rounding of the normalized value to the
  dtype by 1 ulp; times a weight of magnitude < 2 and the final rounding, <= 2 ulp.
* silu_and_mul: <= 3 ulp. exp() may differ from torch's in the last fp32 bits, which can
  flip silu's rounding to the dtype by 1 ulp; times `up` (up to 2 ulp of the product) and
  the final rounding, <= 3 ulp.
Both flips are rare: fewer than 1% of elements may differ at all (a systematic rounding
error, e.g. truncation instead of round-to-nearest, differs in about half of them).
float32: 1e-6 relative (rotary: exact).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout import kernels  # noqa: E402
from rollout.kernels import fused  # noqa: E402
from rollout.model.config import ModelConfig  # noqa: E402
from rollout.model.llama import LlamaModel, _rotate, with_delta  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
# bf16 is exact only on a GPU (see the module docstring); fp16/fp32 everywhere.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
EPS = 1e-6


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


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # transformers' LlamaRMSNorm (what llama.RMSNorm's 16-bit path computes)
    r = x if residual is None else residual + x
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(r.dtype), r


def _weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(n, device=DEVICE)).clamp(-1.9, 1.9).to(dtype)  # |w| < 2: see tolerances


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    res = torch.randn(tokens, hidden, device=DEVICE).to(dtype) if with_residual else None
    w = _weight(hidden, dtype)
    x0, res0 = x.clone(), None if res is None else res.clone()
    with poisoned_outputs():
        got = fused.rms_norm(x, w, EPS, residual=res)
    ref_out, ref_res = _torch_rms_norm(x, w, res)
    if res is None:
        assert isinstance(got, torch.Tensor)
        out = got
    else:
        out, new_res = got
        assert_matches(new_res, ref_res, max_ulps=0)  # one add, rounded once: exact
        assert torch.equal(res, res0), "residual must not be modified"
    assert torch.equal(x, x0), "x must not be modified"
    if dtype == torch.float32:  # llama.RMSNorm's fp32 path is F.rms_norm
        assert_matches(out, F.rms_norm(ref_res, (hidden,), w, EPS), max_ulps=1)
    assert_matches(out, ref_out, max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_wide_rows_in_chunks(dtype: torch.dtype) -> None:
    # wider than one register tile (8192): the two-pass chunked path, non-multiple width
    tokens, hidden = 3, 9000
    x, res = (torch.randn(tokens, hidden, device=DEVICE).to(dtype) for _ in range(2))
    w = _weight(hidden, dtype)
    with poisoned_outputs():
        out, new_res = fused.rms_norm(x, w, EPS, residual=res)
    ref_out, ref_res = _torch_rms_norm(x, w, res)
    assert_matches(new_res, ref_res, max_ulps=0)
    assert_matches(out, ref_out, max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_strided_heads(dtype: torch.dtype) -> None:
    # Qwen3's q/k norm: [T, H, D] views of the fused qkv output, normalized per head.
    tokens, heads, kv_heads, dim = 7, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    q = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    w = _weight(dim, dtype)
    for x in (q, k):
        with poisoned_outputs():
            out = fused.rms_norm(x, w, EPS)
        assert_matches(out, _torch_rms_norm(x, w, None)[0], max_ulps=2)


# ------------------------------------------------------------------------- SiLU * up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 576, 1000])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_silu_and_mul(tokens: int, inter: int, dtype: torch.dtype) -> None:
    gate_up = (2.0 * torch.randn(tokens, 2 * inter, device=DEVICE)).to(dtype)
    x0 = gate_up.clone()
    with poisoned_outputs():
        out = fused.silu_and_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    assert torch.equal(gate_up, x0)
    assert_matches(out, F.silu(gate) * up, max_ulps=3)


# ---------------------------------------------------------------------------- rotary


def _tables(dim: int, max_pos: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [max_pos, D/2]
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def _torch_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # exactly llama.Rotary.forward's torch path
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, c, s), _rotate(k, c, s)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_rotary_strided_qkv(tokens: int, heads: tuple[int, int], dim: int, dtype: torch.dtype) -> None:
    # q/k as Attention.forward makes them: strided views of one fused qkv output
    n_q, n_kv = heads
    qkv = torch.randn(tokens, (n_q + 2 * n_kv) * dim, device=DEVICE).to(dtype)
    q = qkv[:, : n_q * dim].reshape(tokens, n_q, dim)
    k = qkv[:, n_q * dim : (n_q + n_kv) * dim].reshape(tokens, n_kv, dim)
    cos, sin = _tables(dim)
    positions = torch.randint(0, cos.shape[0], (tokens,), device=DEVICE)
    qkv0 = qkv.clone()
    with poisoned_outputs():
        q_rot, k_rot = fused.rotary_embedding(q, k, cos, sin, positions)
    ref_q, ref_k = _torch_rotary(q, k, cos, sin, positions)
    assert torch.equal(qkv, qkv0), "out-of-place rotary must not touch its inputs"
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    assert_matches(q_rot, ref_q, max_ulps=0)
    assert_matches(k_rot, ref_k, max_ulps=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_inplace(dtype: torch.dtype) -> None:
    tokens, n_q, n_kv, dim = 5, 8, 2, 64
    qkv = torch.randn(tokens, (n_q + 2 * n_kv) * dim, device=DEVICE).to(dtype)
    q = qkv[:, : n_q * dim].reshape(tokens, n_q, dim)
    k = qkv[:, n_q * dim : (n_q + n_kv) * dim].reshape(tokens, n_kv, dim)
    cos, sin = _tables(dim)
    positions = torch.randint(0, cos.shape[0], (tokens,), device=DEVICE)
    ref_q, ref_k = _torch_rotary(q, k, cos, sin, positions)
    v0 = qkv[:, (n_q + n_kv) * dim :].clone()
    q_rot, k_rot = fused.rotary_embedding(q, k, cos, sin, positions, inplace=True)
    assert q_rot.data_ptr() == q.data_ptr() and k_rot.data_ptr() == k.data_ptr()
    assert_matches(q, ref_q, max_ulps=0)
    assert_matches(k, ref_k, max_ulps=0)
    assert torch.equal(qkv[:, (n_q + n_kv) * dim :], v0), "v must be untouched"


# ------------------------------------------------------- deferred adapter deltas (lora/hook.py)
# A kernel given an fp32 delta must compute exactly what it computes on with_delta(input,
# delta): the input the in-place expand would have left (one rounding of input + delta).


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 9000])  # 9000: the wide-row path (two passes over chunks)
def test_rms_norm_adds_a_delta_on_load(hidden: int, dtype: torch.dtype) -> None:
    x, res = (torch.randn(6, hidden, device=DEVICE).to(dtype) for _ in range(2))
    delta = torch.randn(6, hidden, device=DEVICE)
    w = _weight(hidden, dtype)
    with poisoned_outputs():
        out, new_res = fused.rms_norm(x, w, EPS, residual=res, delta=delta)
    want_out, want_res = fused.rms_norm(with_delta(x, delta), w, EPS, residual=res)
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)
    assert not torch.equal(out, fused.rms_norm(x, w, EPS, residual=res)[0]), "the delta was not added"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_adds_a_delta_on_load(dtype: torch.dtype) -> None:
    gate_up = torch.randn(5, 2 * 1100, device=DEVICE).to(dtype)  # 1100: two column blocks, the last ragged
    delta = torch.randn(5, 2 * 1100, device=DEVICE)
    with poisoned_outputs():
        out = fused.silu_and_mul(gate_up, delta=delta)
    assert torch.equal(out, fused.silu_and_mul(with_delta(gate_up, delta)))
    assert not torch.equal(out, fused.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 2), (6, 1), (4, 4)], ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
def test_rotary_adds_a_qkv_delta_and_updates_v_in_place(heads: tuple[int, int], dtype: torch.dtype) -> None:
    tokens, (n_q, n_kv), dim = 7, heads, 64
    qkv = torch.randn(tokens, (n_q + 2 * n_kv) * dim, device=DEVICE).to(dtype)
    delta = torch.randn(tokens, qkv.shape[1], device=DEVICE)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([n_q * dim, n_kv * dim, n_kv * dim], dim=-1)
        return q.reshape(tokens, n_q, dim), k.reshape(tokens, n_kv, dim), v.reshape(tokens, n_kv, dim)

    cos, sin = _tables(dim)
    positions = torch.randint(0, cos.shape[0], (tokens,), device=DEVICE)
    wq, wk, wv = views(with_delta(qkv, delta))  # before the call: it writes v in place
    q, k, v = views(qkv)
    with poisoned_outputs():
        q_rot, k_rot = fused.rotary_embedding(q, k, cos, sin, positions, v=v, delta=delta)
    want_q, want_k = fused.rotary_embedding(wq, wk, cos, sin, positions)
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    assert torch.equal(v, wv), "v must hold v + its delta"
    # the torch twin of the rotation (llama.Rotary's CPU path) agrees too
    ref_q, ref_k = _torch_rotary(wq, wk, cos, sin, positions)
    assert_matches(q_rot, ref_q, max_ulps=0)
    assert_matches(k_rot, ref_k, max_ulps=0)


def test_deltas_are_checked() -> None:
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    for bad in (torch.zeros(3, 64, dtype=torch.float16, device=DEVICE), torch.zeros(3, 65, device=DEVICE),
                torch.zeros(64, 3, device=DEVICE).T):
        with pytest.raises(ValueError, match="delta must be a contiguous float32"):
            fused.rms_norm(x, w, EPS, residual=x, delta=bad)
        with pytest.raises(ValueError, match="delta must be a contiguous float32"):
            fused.silu_and_mul(torch.randn(3, 64, device=DEVICE), delta=bad)
    qkv = torch.randn(2, 6 * 16, device=DEVICE)
    q, k, v = qkv[:, :64].reshape(2, 4, 16), qkv[:, 64:80].reshape(2, 1, 16), qkv[:, 80:].reshape(2, 1, 16)
    cos, sin = _tables(16)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="a delta needs v"):
        fused.rotary_embedding(q, k, cos, sin, pos, delta=torch.zeros(2, 96, device=DEVICE))
    with pytest.raises(ValueError, match=r"delta must be a contiguous float32 \(2, 96\)"):
        fused.rotary_embedding(q, k, cos, sin, pos, v=v, delta=torch.zeros(2, 80, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES + ([] if ON_GPU else [torch.bfloat16]), ids=str)
@pytest.mark.parametrize("kv_heads,dim", [(2, 64), (1, 128), (8, 128)])
@pytest.mark.parametrize("tokens", [1, 9])
def test_store_kv_writes_both_caches_by_slot(tokens: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    # k contiguous (the rotary output), v a strided view of the fused qkv output; a copy is
    # exact in any dtype, so bf16 is checked in the interpreter too
    n_q = 4
    qkv = torch.randn(tokens, (n_q + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    v = qkv[:, (n_q + kv_heads) * dim :].reshape(tokens, kv_heads, dim)
    k = torch.randn(tokens, kv_heads, dim, device=DEVICE).to(dtype)
    k_cache = torch.randn(64, kv_heads, dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(64, kv_heads, dim, device=DEVICE).to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(64, device=DEVICE)[:tokens]
    ref_k.index_copy_(0, slots, k)
    ref_v.index_copy_(0, slots, v)
    fused.store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_store_kv_rejects_mismatches() -> None:
    cache = torch.zeros(8, 2, 16, device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="mismatched"):
        fused.store_kv(cache, cache.clone(), torch.arange(3, device=DEVICE), k, torch.zeros(3, 1, 16, device=DEVICE))
    with pytest.raises(ValueError, match="slots"):
        fused.store_kv(cache, cache.clone(), torch.arange(2, device=DEVICE), k, k.clone())
    with pytest.raises(ValueError, match="contiguous"):
        fused.store_kv(cache, cache.clone(), torch.arange(3, device=DEVICE), k.transpose(0, 1).contiguous().transpose(0, 1), k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta_", [False, True], ids=["plain", "delta"])
@pytest.mark.parametrize("heads", [(8, 2), (6, 1), (4, 4)], ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("tokens", [1, 9])
def test_rotary_stores_k_and_v_by_slot_in_its_launch(tokens: int, heads: tuple[int, int], with_delta_: bool,
                                                     dtype: torch.dtype) -> None:
    # the fused store (Attention.forward on GPU) writes exactly what the rotary then store_kv
    # would: k_rot and v (after its delta) at the slots, nothing else of the caches
    (n_q, n_kv), dim = heads, 64
    qkv = torch.randn(tokens, (n_q + 2 * n_kv) * dim, device=DEVICE).to(dtype)
    delta = torch.randn(tokens, qkv.shape[1], device=DEVICE) if with_delta_ else None

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([n_q * dim, n_kv * dim, n_kv * dim], dim=-1)
        return q.reshape(tokens, n_q, dim), k.reshape(tokens, n_kv, dim), v.reshape(tokens, n_kv, dim)

    cos, sin = _tables(dim)
    positions = torch.randint(0, cos.shape[0], (tokens,), device=DEVICE)
    k_cache, v_cache = (torch.randn(40, n_kv, dim, device=DEVICE).to(dtype) for _ in range(2))
    slots = torch.randperm(40, device=DEVICE)[:tokens]
    ref_qkv = qkv.clone()
    rq, rk, rv = views(ref_qkv)
    want_q, want_k = fused.rotary_embedding(rq, rk, cos, sin, positions, v=rv if with_delta_ else None, delta=delta)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    fused.store_kv(want_kc, want_vc, slots, want_k, rv)
    q, k, v = views(qkv)
    with poisoned_outputs():
        q_rot, k_rot = fused.rotary_embedding(q, k, cos, sin, positions, v=v, delta=delta, k_cache=k_cache,
                                              v_cache=v_cache, slots=slots)
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)
    assert torch.equal(qkv, ref_qkv), "v in place only with a delta, and as the unfused rotary leaves it"


def test_rotary_store_is_checked() -> None:
    qkv = torch.randn(2, 6 * 16, device=DEVICE)
    q, k, v = qkv[:, :64].reshape(2, 4, 16), qkv[:, 64:80].reshape(2, 1, 16), qkv[:, 80:].reshape(2, 1, 16)
    cos, sin = _tables(16)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(8, 1, 16, device=DEVICE)
    slots = torch.tensor([3, 5], device=DEVICE)
    with pytest.raises(ValueError, match="needs k_cache, v_cache, slots and v"):
        fused.rotary_embedding(q, k, cos, sin, pos, k_cache=cache, v_cache=cache.clone(), slots=slots)
    with pytest.raises(ValueError, match="needs k_cache, v_cache, slots and v"):
        fused.rotary_embedding(q, k, cos, sin, pos, v=v, k_cache=cache, v_cache=cache.clone())
    with pytest.raises(ValueError, match="slots must be int"):
        fused.rotary_embedding(q, k, cos, sin, pos, v=v, k_cache=cache, v_cache=cache.clone(), slots=slots[:1])
    with pytest.raises(ValueError, match="mismatched"):
        fused.rotary_embedding(q, k, cos, sin, pos, v=v, k_cache=torch.zeros(8, 2, 16, device=DEVICE),
                               v_cache=torch.zeros(8, 2, 16, device=DEVICE), slots=slots)
    assert torch.equal(cache, torch.zeros_like(cache)), "a refused call writes nothing"


# ------------------------------------------------------------ bf16 smoke (interpreter)


@pytest.mark.skipif(ON_GPU, reason="on a GPU bf16 is in the exact tests")
def test_bf16_smoke_in_interpreter() -> None:
    # The interpreter truncates fp32 -> bf16 (no round-to-nearest), so this checks only the
    # bf16 plumbing (loads, stores, dtype dispatch) with a tolerance of a few bf16 ulps.
    bf16, tol = torch.bfloat16, dict(rtol=0.05, atol=0.05)
    x, res = torch.randn(7, 576).to(bf16), torch.randn(7, 576).to(bf16)
    w = _weight(576, bf16)
    out, new_res = fused.rms_norm(x, w, EPS, residual=res)
    ref_out, ref_res = _torch_rms_norm(x, w, res)
    torch.testing.assert_close(new_res, ref_res, **tol)
    torch.testing.assert_close(out, ref_out, **tol)
    gate_up = torch.randn(7, 2000).to(bf16)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), F.silu(gate_up[:, :1000]) * gate_up[:, 1000:], **tol)
    q, k = torch.randn(7, 8, 64).to(bf16), torch.randn(7, 2, 64).to(bf16)
    cos, sin = _tables(64)
    positions = torch.randint(0, 4096, (7,))
    for got, ref in zip(fused.rotary_embedding(q, k, cos, sin, positions), _torch_rotary(q, k, cos, sin, positions)):
        torch.testing.assert_close(got, ref, **tol)


# ------------------------------------------------------------------- argument checks


def test_rejects_bad_arguments() -> None:
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, torch.ones(32, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused.rms_norm(x, torch.ones(64, device=DEVICE), EPS, residual=x.half())
    with pytest.raises(ValueError, match="contiguous"):
        fused.rms_norm(torch.randn(64, 4, device=DEVICE).t(), torch.ones(64, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="even"):
        fused.silu_and_mul(torch.randn(4, 63, device=DEVICE))
    cos, sin = _tables(64)
    with pytest.raises(ValueError, match="cos/sin"):
        fused.rotary_embedding(torch.randn(2, 4, 128, device=DEVICE), torch.randn(2, 2, 128, device=DEVICE), cos, sin,
                               torch.zeros(2, dtype=torch.long, device=DEVICE))


# ----------------------------------------------------------------- tiny model forward


class _CausalAttention:
    """A stand-in attention backend: one sequence, causal, GQA by repeating kv heads."""

    def kv_target(self, layer_id: int) -> None:
        return None  # no pool: forward gets k and v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                stored: bool = False) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        return out.transpose(0, 1)


def _tiny_model(arch: str, dtype: torch.dtype) -> LlamaModel:
    cfg = ModelConfig.from_dict({
        "architectures": [arch], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": EPS, "rope_theta": 10000.0, "tie_word_embeddings": False,
    })
    model = LlamaModel(cfg, max_positions=256)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    model.to(DEVICE)
    for p in model.parameters():  # weights in the model dtype; rope tables stay fp32 (as the engine does)
        p.data = p.data.to(dtype)
    return model


def _forward(model: LlamaModel, fused_on: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setattr(kernels, "enabled", fused_on)
    ids = torch.arange(11, device=DEVICE) * 7 % model.config.vocab_size
    positions = torch.arange(11, device=DEVICE) + 3
    with torch.inference_mode():
        return model(ids, positions, _CausalAttention())  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_model_forward_fused_matches_torch(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Llama: plain; Qwen2: qkv bias; Qwen3: q/k norm on strided [T, H, D] views.
    model = _tiny_model(arch, torch.float32)
    calls: dict[str, int] = {}
    for name in ("rms_norm", "silu_and_mul", "rotary_embedding"):
        real: Callable[..., object] = getattr(fused, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused, name, counted)
    ref = _forward(model, False, monkeypatch)
    assert not calls, "the torch path must not call the kernels"
    got = _forward(model, True, monkeypatch)
    layers = model.config.num_layers
    norms = 2 * layers + 1 + (2 * layers if model.config.qk_norm else 0)
    assert calls == {"rms_norm": norms, "silu_and_mul": layers, "rotary_embedding": layers}
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_cpu_path_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "enabled", None)
    assert not kernels.use_fused(torch.zeros(2))  # CPU tensors: the torch path
    assert kernels.use_fused(torch.zeros(2, device=DEVICE)) == ON_GPU
    assert not kernels.use_fused(torch.zeros(2, dtype=torch.float64, device=DEVICE))  # unsupported dtype


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (bf16 is not exact in the interpreter)")
def test_model_forward_fused_bf16_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16: the kernels round where torch rounds, so only rare 1-ulp flips separate the two
    # paths; over two layers these stay at the bf16 noise level.
    model = _tiny_model("Qwen3ForCausalLM", torch.bfloat16)
    ref = _forward(model, False, monkeypatch).float()
    got = _forward(model, True, monkeypatch).float()
    torch.testing.assert_close(got, ref, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("hidden", [4096, 8192, 16384])
def test_real_shapes_bf16_gpu(hidden: int) -> None:
    # H200-sized rows: decode batch of 256, Llama-3-8B-like MLP/heads, chunked norm at 16384.
    bf16, tokens = torch.bfloat16, 256
    x, res = (torch.randn(tokens, hidden, device=DEVICE).to(bf16) for _ in range(2))
    w = _weight(hidden, bf16)
    out, new_res = fused.rms_norm(x, w, EPS, residual=res)
    ref_out, ref_res = _torch_rms_norm(x, w, res)
    assert_matches(new_res, ref_res, max_ulps=0)
    assert_matches(out, ref_out, max_ulps=2)
    gate_up = (2.0 * torch.randn(tokens, 2 * 14336, device=DEVICE)).to(bf16)
    assert_matches(fused.silu_and_mul(gate_up), F.silu(gate_up[:, :14336]) * gate_up[:, 14336:], max_ulps=3)
    qkv = torch.randn(tokens, (32 + 16) * 128, device=DEVICE).to(bf16)
    q, k = qkv[:, : 32 * 128].reshape(tokens, 32, 128), qkv[:, 32 * 128 : 40 * 128].reshape(tokens, 8, 128)
    cos, sin = _tables(128, max_pos=8192)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    for got, ref in zip(fused.rotary_embedding(q, k, cos, sin, positions), _torch_rotary(q, k, cos, sin, positions)):
        assert_matches(got, ref, max_ulps=0)

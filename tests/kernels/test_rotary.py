"""The rotary embedding and the KV store (rollout.kernels.rotary) against their torch twins
in rollout.model.llama and against each other: the rotary bit-identical in every dtype
(each rounding of the twin is reproduced, fp32 FMA contraction is off), with a LoRA delta
added to q, k and v on load, and storing K/V by slot in its own launch exactly as store_kv
would. On CPU the kernels run under TRITON_INTERPRET=1 in float32 and float16 (bf16, which
the interpreter truncates, gets a smoke test; exact bf16 runs on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout.kernels import rotary  # noqa: E402
from rollout.model.llama import _rotate, with_delta  # noqa: E402
from ulp_checks import DEVICE, ON_GPU, assert_matches, poisoned_outputs  # noqa: E402

# bf16 is exact only on a GPU (see the module docstring); fp16/fp32 everywhere.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


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
        q_rot, k_rot = rotary.rotary_embedding(q, k, cos, sin, positions)
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
    q_rot, k_rot = rotary.rotary_embedding(q, k, cos, sin, positions, inplace=True)
    assert q_rot.data_ptr() == q.data_ptr() and k_rot.data_ptr() == k.data_ptr()
    assert_matches(q, ref_q, max_ulps=0)
    assert_matches(k, ref_k, max_ulps=0)
    assert torch.equal(qkv[:, (n_q + n_kv) * dim :], v0), "v must be untouched"


# ------------------------------------------------------- a deferred adapter delta (lora/hook.py)


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
        q_rot, k_rot = rotary.rotary_embedding(q, k, cos, sin, positions, v=v, delta=delta)
    want_q, want_k = rotary.rotary_embedding(wq, wk, cos, sin, positions)
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    assert torch.equal(v, wv), "v must hold v + its delta"
    # the torch twin of the rotation (llama.Rotary's CPU path) agrees too
    ref_q, ref_k = _torch_rotary(wq, wk, cos, sin, positions)
    assert_matches(q_rot, ref_q, max_ulps=0)
    assert_matches(k_rot, ref_k, max_ulps=0)


def test_deltas_are_checked() -> None:
    qkv = torch.randn(2, 6 * 16, device=DEVICE)
    q, k, v = qkv[:, :64].reshape(2, 4, 16), qkv[:, 64:80].reshape(2, 1, 16), qkv[:, 80:].reshape(2, 1, 16)
    cos, sin = _tables(16)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="a delta needs v"):
        rotary.rotary_embedding(q, k, cos, sin, pos, delta=torch.zeros(2, 96, device=DEVICE))
    with pytest.raises(ValueError, match=r"delta must be a contiguous float32 \(2, 96\)"):
        rotary.rotary_embedding(q, k, cos, sin, pos, v=v, delta=torch.zeros(2, 80, device=DEVICE))


# ---------------------------------------------------------------------------- KV store


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
    rotary.store_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_store_kv_rejects_mismatches() -> None:
    cache = torch.zeros(8, 2, 16, device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="mismatched"):
        rotary.store_kv(cache, cache.clone(), torch.arange(3, device=DEVICE), k, torch.zeros(3, 1, 16, device=DEVICE))
    with pytest.raises(ValueError, match="slots"):
        rotary.store_kv(cache, cache.clone(), torch.arange(2, device=DEVICE), k, k.clone())
    with pytest.raises(ValueError, match="contiguous"):
        rotary.store_kv(cache, cache.clone(), torch.arange(3, device=DEVICE), k.transpose(0, 1).contiguous().transpose(0, 1), k)


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
    want_q, want_k = rotary.rotary_embedding(rq, rk, cos, sin, positions, v=rv if with_delta_ else None, delta=delta)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    rotary.store_kv(want_kc, want_vc, slots, want_k, rv)
    q, k, v = views(qkv)
    with poisoned_outputs():
        q_rot, k_rot = rotary.rotary_embedding(q, k, cos, sin, positions, v=v, delta=delta, k_cache=k_cache,
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
        rotary.rotary_embedding(q, k, cos, sin, pos, k_cache=cache, v_cache=cache.clone(), slots=slots)
    with pytest.raises(ValueError, match="needs k_cache, v_cache, slots and v"):
        rotary.rotary_embedding(q, k, cos, sin, pos, v=v, k_cache=cache, v_cache=cache.clone())
    with pytest.raises(ValueError, match="slots must be int"):
        rotary.rotary_embedding(q, k, cos, sin, pos, v=v, k_cache=cache, v_cache=cache.clone(), slots=slots[:1])
    with pytest.raises(ValueError, match="mismatched"):
        rotary.rotary_embedding(q, k, cos, sin, pos, v=v, k_cache=torch.zeros(8, 2, 16, device=DEVICE),
                               v_cache=torch.zeros(8, 2, 16, device=DEVICE), slots=slots)
    assert torch.equal(cache, torch.zeros_like(cache)), "a refused call writes nothing"


@pytest.mark.skipif(ON_GPU, reason="on a GPU bf16 is in the exact tests")
def test_bf16_smoke_in_interpreter() -> None:
    # the interpreter truncates fp32 -> bf16: only the bf16 plumbing, at a few bf16 ulps
    bf16, tol = torch.bfloat16, dict(rtol=0.05, atol=0.05)
    q, k = torch.randn(7, 8, 64).to(bf16), torch.randn(7, 2, 64).to(bf16)
    cos, sin = _tables(64)
    positions = torch.randint(0, 4096, (7,))
    for got, ref in zip(rotary.rotary_embedding(q, k, cos, sin, positions), _torch_rotary(q, k, cos, sin, positions)):
        torch.testing.assert_close(got, ref, **tol)


def test_rejects_bad_arguments() -> None:
    cos, sin = _tables(64)
    with pytest.raises(ValueError, match="cos/sin"):
        rotary.rotary_embedding(torch.randn(2, 4, 128, device=DEVICE), torch.randn(2, 2, 128, device=DEVICE), cos, sin,
                               torch.zeros(2, dtype=torch.long, device=DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_real_shapes_bf16_gpu() -> None:
    # a decode batch of 256 with Llama-3-8B's heads (32 q, 8 kv, head_dim 128)
    bf16, tokens = torch.bfloat16, 256
    qkv = torch.randn(tokens, (32 + 16) * 128, device=DEVICE).to(bf16)
    q, k = qkv[:, : 32 * 128].reshape(tokens, 32, 128), qkv[:, 32 * 128 : 40 * 128].reshape(tokens, 8, 128)
    cos, sin = _tables(128, max_pos=8192)
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    for got, ref in zip(rotary.rotary_embedding(q, k, cos, sin, positions), _torch_rotary(q, k, cos, sin, positions)):
        assert_matches(got, ref, max_ulps=0)

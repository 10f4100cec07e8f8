"""Triton paged-attention kernels vs a float64 torch reference.

Without CUDA the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, which
must be set before triton is imported); with CUDA the same tests run compiled on GPU.
Shapes are tiny because the interpreter executes every program in Python/numpy.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed; Triton attention kernels cannot be tested")

from rollout.attention.triton_kernels import decode_attention, extend_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's tl.dot multiplies bf16 bit patterns as uint16 integers (numpy has no
# bf16), so bf16 is only checked on GPU; fp16 works in both.
HALF_DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


def reference_attention(
    q: torch.Tensor,  # [total_new_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,  # [batch + 1]
    kv_indptr: torch.Tensor,  # [batch + 1]
    kv_indices: torch.Tensor,  # [nnz]
    sm_scale: float,
) -> torch.Tensor:
    """Per-request gather + explicit causal masked softmax in float64 (decode = 1 new token)."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        n, kv_len = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        if n == 0:
            continue
        idx = kv_indices[kvp[b]:kvp[b + 1]].long().cpu()
        k = k_cache.cpu()[idx].double().repeat_interleave(group, dim=1)  # [kv_len, H, D]
        v = v_cache.cpu()[idx].double().repeat_interleave(group, dim=1)
        qb = q[qo[b]:qo[b + 1]].cpu().double()  # [n, H, D]
        scores = torch.einsum("thd,lhd->htl", qb, k) * sm_scale  # [H, n, kv_len]
        pos = kv_len - n + torch.arange(n)  # absolute positions of the new tokens
        visible = torch.arange(kv_len)[None, :] <= pos[:, None]  # [n, kv_len]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qo[b]:qo[b + 1]] = torch.einsum("htl,lhd->thd", torch.softmax(scores, dim=-1), v)
    return out


def make_case(
    kv_lens: list[int],
    new_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    index_dtype: torch.dtype = torch.int32,
    strided_q: bool = False,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    nnz = sum(kv_lens)
    num_slots = nnz + 11  # spare slots, never referenced
    # Shuffled, non-contiguous slots: catches kernels that index by position instead of slot.
    slots = torch.randperm(num_slots, generator=g)[:nnz]
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[slots] = False
    # NaN in slots no request owns: any stray read poisons the output.
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    total_new = sum(new_lens)
    if strided_q:
        # q as a head-slice of a fused qkv buffer: rows are not densely packed.
        qkv = torch.randn(total_new, num_heads + 2 * num_kv_heads, head_dim, generator=g)
        q = qkv.to(dtype).to(DEVICE)[:, :num_heads]
        assert not q.is_contiguous()
    else:
        q = torch.randn(total_new, num_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    to_i32 = lambda xs: torch.tensor([0] + xs, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)  # noqa: E731
    return {
        "q": q,
        "k_cache": k_cache.to(dtype).to(DEVICE),
        "v_cache": v_cache.to(dtype).to(DEVICE),
        "qo_indptr": to_i32(new_lens),
        "kv_indptr": to_i32(kv_lens),
        "kv_indices": slots.to(index_dtype).to(DEVICE),
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.cpu().double() - ref).norm() / ref.norm()).item()


def run_decode(c: dict[str, torch.Tensor], num_kv_splits: int | None, **kw: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = c["q"]
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    res = decode_attention(q, c["k_cache"], c["v_cache"], c["kv_indptr"], c["kv_indices"], scale,
                           out=out, num_kv_splits=num_kv_splits, **kw)
    assert res is out and res.shape == q.shape and res.dtype == q.dtype
    assert torch.isfinite(res).all(), "decode left unwritten or non-finite elements"
    ref = reference_attention(q, c["k_cache"], c["v_cache"], c["qo_indptr"], c["kv_indptr"], c["kv_indices"], scale)
    return res, ref


def run_extend(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    q = c["q"]
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    res = extend_attention(q, c["k_cache"], c["v_cache"], c["qo_indptr"], c["kv_indptr"], c["kv_indices"], scale,
                           out=out)
    assert res is out
    assert torch.isfinite(res).all(), "extend left unwritten or non-finite elements"
    ref = reference_attention(q, c["k_cache"], c["v_cache"], c["qo_indptr"], c["kv_indptr"], c["kv_indices"], scale)
    return res, ref


# (num_heads, num_kv_heads, head_dim): MHA and GQA ratio 3
HEAD_CONFIGS = [(4, 4, 32), (6, 2, 64)]
DECODE_KV_LENS = [37, 1, 20, 50]  # length-1 request, lengths crossing several 16-token blocks


@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("num_kv_splits", [1, 3, None])
def test_decode_fp32(heads: tuple[int, int, int], num_kv_splits: int | None) -> None:
    h, kvh, d = heads
    c = make_case(DECODE_KV_LENS, [1] * 4, h, kvh, d, torch.float32, seed=1 + h + (num_kv_splits or 0))
    res, ref = run_decode(c, num_kv_splits)
    assert rel_err(res, ref) < 1e-4


def test_decode_many_splits_int64_indices_strided_q() -> None:
    # 5 splits: 16-token splits on the interpreter, so the 1-, 20- and 32-token requests
    # have empty splits that stage 2 must skip (32 ends exactly on a split boundary);
    # int64 indices and a non-contiguous q.
    c = make_case([*DECODE_KV_LENS, 32], [1] * 5, 6, 2, 32, torch.float32, seed=7, index_dtype=torch.int64,
                  strided_q=True)
    res, ref = run_decode(c, 5)
    assert rel_err(res, ref) < 1e-4


def test_decode_non_pow2_head_dim_and_big_group() -> None:
    # head_dim 24 is masked up to 32; 80 query heads per kv head exceed one 64-row head
    # block, so the group is spread over two programs.
    c = make_case([9, 17], [1, 1], 80, 1, 24, torch.float32, seed=11)
    res, ref = run_decode(c, 2)
    assert rel_err(res, ref) < 1e-4


def test_decode_default_splits_with_hint() -> None:
    c = make_case([3, 40], [1, 1], 4, 4, 16, torch.float32, seed=13)
    res, ref = run_decode(c, None, max_kv_len=40)
    assert rel_err(res, ref) < 1e-4


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_decode_half(dtype: torch.dtype) -> None:
    c = make_case(DECODE_KV_LENS, [1] * 4, 6, 2, 64, dtype, seed=17)
    res, ref = run_decode(c, 3)
    assert rel_err(res, ref) < 1e-2  # p is rounded to the KV dtype before p @ v


# (prefix, new) per request: empty prefix spanning two 16-row query tiles, a single new
# token, a prefix not aligned to tiles, and a one-token request with no prefix.
EXTEND_REQS = [(0, 21), (10, 1), (19, 18), (0, 1)]


@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
def test_extend_fp32(heads: tuple[int, int, int]) -> None:
    h, kvh, d = heads
    kv_lens = [p + n for p, n in EXTEND_REQS]
    new_lens = [n for _, n in EXTEND_REQS]
    c = make_case(kv_lens, new_lens, h, kvh, d, torch.float32, seed=23 + h)
    res, ref = run_extend(c)
    assert rel_err(res, ref) < 1e-4


def test_extend_int64_indices_strided_q_non_pow2() -> None:
    c = make_case([5 + 3, 0 + 17], [3, 17], 6, 2, 40, torch.float32, seed=29, index_dtype=torch.int64,
                  strided_q=True)
    res, ref = run_extend(c)
    assert rel_err(res, ref) < 1e-4


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_extend_half(dtype: torch.dtype) -> None:
    c = make_case([p + n for p, n in EXTEND_REQS], [n for _, n in EXTEND_REQS], 6, 2, 64, dtype, seed=31)
    res, ref = run_extend(c)
    assert rel_err(res, ref) < 1e-2


@pytest.mark.whole_gpu  # the largest tiles (float32, head_dim 256): failed beside 5 other GPU workers on one H200
@pytest.mark.parametrize("head_dim", [128, 256])
def test_large_head_dims(head_dim: int) -> None:
    c = make_case([20, 3], [1, 1], 4, 2, head_dim, torch.float32, seed=43 + head_dim)
    res, ref = run_decode(c, 2)
    assert rel_err(res, ref) < 1e-4
    c = make_case([5 + 18, 0 + 2], [18, 2], 4, 2, head_dim, torch.float32, seed=47 + head_dim)
    res, ref = run_extend(c)
    assert rel_err(res, ref) < 1e-4


def test_decode_equals_extend_with_one_new_token() -> None:
    c = make_case([12, 30], [1, 1], 6, 2, 32, torch.float32, seed=37)
    scale = 32 ** -0.5
    d = decode_attention(c["q"], c["k_cache"], c["v_cache"], c["kv_indptr"], c["kv_indices"], scale, num_kv_splits=2)
    e = extend_attention(c["q"], c["k_cache"], c["v_cache"], c["qo_indptr"], c["kv_indptr"], c["kv_indices"], scale)
    assert rel_err(d, e.cpu().double()) < 1e-5


def test_rejects_bad_inputs() -> None:
    c = make_case([4], [1], 4, 4, 16, torch.float32, seed=41)
    with pytest.raises(ValueError, match="head_dim"):
        big = torch.zeros(1, 4, 512, device=DEVICE)
        cache = torch.zeros(8, 4, 512, device=DEVICE)
        decode_attention(big, cache, cache, c["kv_indptr"], c["kv_indices"], 1.0)
    with pytest.raises(ValueError, match="incompatible"):
        decode_attention(torch.zeros(1, 5, 16, device=DEVICE), c["k_cache"], c["v_cache"], c["kv_indptr"],
                         c["kv_indices"], 1.0)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(c["q"].half(), c["k_cache"], c["v_cache"], c["kv_indptr"], c["kv_indices"], 1.0)

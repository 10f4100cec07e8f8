"""The deterministic attention kernel (deterministic_triton.py) and its block plan
(row_blocks.py): a token's output must be bit for bit the same whether it is computed as a
decode (a block of one), inside a prompt chunk's block of up to 64 MMA rows, in a chunk that starts
after a cached prefix, or next to other requests, and close to a float64 softmax reference.

On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) on tiny shapes, its
tl.dot reducing each element in K order as an MMA does (tests/mma_dot.py); with
CUDA the same tests run compiled on the Llama-3.1-8B head shape in bf16, where the block
sizes pick different MMA instructions (16 and 32 rows: mma.sync; 64: wgmma), which is what
the invariance rests on (the kernel's docstring)."""

from __future__ import annotations

import pytest
import torch

from mma_dot import use_mma_dot
from rollout.attention import deterministic_backend
from rollout.attention.row_blocks import decode_table, heads_per_kv, plan_row_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cuda":  # (heads, kv heads, head dim, tile, dtype, request length): Llama-3.1-8B, SmolLM2
    SHAPES = [(32, 8, 128, 64, torch.bfloat16, 700), (9, 3, 64, 64, torch.bfloat16, 300)]
else:
    SHAPES = [(4, 2, 16, 16, torch.float32, 45), (9, 3, 16, 16, torch.float32, 37)]
SHAPE = SHAPES[0]


def _cap(shape) -> int:
    """The most tokens the engine puts in one program (64 MMA rows): 16 tokens of 4 heads
    (a group of 3 padded to 4), 32 of 2."""
    return deterministic_backend.BLOCK_ROWS // heads_per_kv(shape[0], shape[1])


def test_the_plan_covers_every_row_once() -> None:
    extend = [1, 7, 1, 1, 33, 2, 16]
    for max_tokens in (1, 4, 16, 64):
        seen = []
        launches = plan_row_blocks(extend, max_tokens)
        assert [t for _, t in launches][0] == 1  # the decodes' launch: the one the graphs replay
        first = [sum(extend[:b]) for b in range(len(extend))]
        for table, tokens in launches:
            assert table.dtype == torch.int32 and table.shape[0] == 4
            assert tokens <= max(1, max_tokens)
            for req, row, count, back in table.T.tolist():
                assert 1 <= count <= tokens
                j0 = row - first[req]  # the block's first token within its request
                assert back == extend[req] - 1 - j0 and back - (count - 1) >= 0
                seen += range(row, row + count)
        assert sorted(seen) == list(range(sum(extend)))
    assert plan_row_blocks([3, 5], 64)[0][1] == 8  # a few new tokens: blocks of the next power of two
    assert plan_row_blocks([], 64) == []
    assert decode_table(3, torch.device("cpu")).tolist() == [[0, 1, 2], [0, 1, 2], [1, 1, 1], [0, 0, 0]]


def _attend(q, k_buf, v_buf, entries, max_tokens, tile):
    """Attention for a batch of `entries` (kv slots, q rows): each entry is one request whose
    new tokens are the last len(q rows) of its KV. Returns the output rows in entry order."""
    from rollout.attention.deterministic_triton import tiled_attention
    from rollout.attention.row_blocks import RowBlocks

    kv_indices = torch.cat([s for s, _ in entries])
    lens = torch.tensor([0] + [len(s) for s, _ in entries])
    kv_indptr = torch.cumsum(lens, 0).to(torch.int32).to(q.device)
    rows = torch.cat([r for _, r in entries])
    out = torch.full_like(rows, float("nan"))
    heads, dim = q.shape[1], q.shape[2]
    scale = dim**-0.5
    for table, tokens in plan_row_blocks([len(r) for _, r in entries], max_tokens):
        tiled_attention(rows, k_buf, v_buf, kv_indptr, kv_indices, RowBlocks(table.to(q.device), tokens), scale, out,
                        tile)
    assert not out.isnan().any() and out.shape[1] == heads
    return out


def _reference(q_rows, slots, k_buf, v_buf):
    """float64 softmax attention of the last len(q_rows) tokens of one request."""
    group = q_rows.shape[1] // k_buf.shape[1]
    n, total = q_rows.shape[0], len(slots)
    keys = k_buf[slots].double().repeat_interleave(group, 1)  # [L, H, D]
    values = v_buf[slots].double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,lhd->thl", q_rows.double(), keys) * q_rows.shape[-1] ** -0.5
    pos = torch.arange(total - n, total)[:, None, None]
    scores = scores.masked_fill(torch.arange(total)[None, None, :] > pos, float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(scores, -1), values)


@pytest.fixture(autouse=True)
def mma_dot(monkeypatch):
    use_mma_dot(monkeypatch)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}/{s[1]}heads-d{s[2]}")
def request_kv(request):
    heads, kv_heads, dim, tile, dtype, length = request.param
    g = torch.Generator().manual_seed(0)
    slots = 2 * length + 50
    k_buf = torch.randn(slots, kv_heads, dim, generator=g).to(DEVICE, dtype)
    v_buf = torch.randn(slots, kv_heads, dim, generator=g).to(DEVICE, dtype)
    kv = (torch.randperm(slots - 1, generator=g)[:length] + 1).to(DEVICE)  # scattered, never slot 0
    q = torch.randn(length, heads, dim, generator=g).to(DEVICE, dtype)  # the query of each position
    others = [((torch.randperm(slots - 1, generator=g)[:n] + 1).to(DEVICE),
               torch.randn(e, heads, dim, generator=g).to(DEVICE, dtype)) for n, e in ((length // 3, 1), (50, 9), (17, 17))]
    return k_buf, v_buf, kv, q, others, tile, _cap(request.param)


def test_rows_match_the_reference(request_kv) -> None:
    k_buf, v_buf, kv, q, others, tile, cap = request_kv
    prefix = len(kv) - 20  # a chunk of 20 new tokens after a cached prefix, among decodes and prompts
    entries = others[:2] + [(kv, q[prefix:])] + others[2:]
    out = _attend(q, k_buf, v_buf, entries, cap, tile)
    at = 0
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    for slots, rows in entries:
        want = _reference(rows.cpu(), slots.cpu(), k_buf.cpu(), v_buf.cpu())
        got = out[at : at + len(rows)].cpu().double()
        assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()
        at += len(rows)


def test_a_token_is_the_same_in_every_block_and_split(request_kv) -> None:
    """Every position of one request computed: as one chunk in blocks of 2, 4, 8, ... up to
    the engine's 64 MMA rows, chunked after cached prefixes at different splits, each token as
    a decode over its own prefix, and among other requests: all bitwise equal."""
    k_buf, v_buf, kv, q, others, tile, cap = request_kv
    n = len(kv)
    whole = [(kv, q)]
    reference = _attend(q, k_buf, v_buf, whole, 1, tile)  # blocks of one: the decode launch
    sizes = [t for t in (2, 4, 8, 16, 32) if t <= cap]
    variants = {f"one chunk, blocks of {t}": _attend(q, k_buf, v_buf, whole, t, tile) for t in sizes}

    def chunked(splits, max_tokens):
        bounds = [0, *splits, n]
        entries = [(kv[:b], q[a:b]) for a, b in zip(bounds, bounds[1:])]  # each chunk: the prefix is cached
        return _attend(q, k_buf, v_buf, entries, max_tokens, tile)

    variants["chunks at 1, n/3, n-5"] = chunked([1, n // 3, n - 5], cap)
    variants["chunks of tile +/- 1"] = chunked(list(range(tile - 1, n, tile + 1)), 16)
    variants["every token a decode"] = torch.cat([_attend(q, k_buf, v_buf, [(kv[: j + 1], q[j : j + 1])], cap, tile)
                                                  for j in range(0, n, max(1, n // 40))])
    batched = _attend(q, k_buf, v_buf, others[:2] + whole + others[2:], cap, tile)
    start = sum(len(r) for _, r in others[:2])
    variants["among other requests"] = batched[start : start + n]
    for name, got in variants.items():
        want = reference if name != "every token a decode" else reference[0 : n : max(1, n // 40)]
        assert torch.equal(got, want), name


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_backend_rows_alone_equal_rows_in_a_batch(path: str) -> None:
    """Through DeterministicAttention (plan + forward): a decode row and a prompt chunk, each
    alone in its step, equal the same rows in a step with other decodes and a prefill. The
    torch path (CPU) once failed this for a decode alone (MKL's batched GEMM, a permuted B)."""
    from rollout.attention.deterministic_backend import DeterministicAttention
    from rollout.cache.kv_pool import KVPool
    from rollout.kernels.options import KernelOptions
    from rollout.batch import ForwardBatch

    if path == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    if path == "torch" and DEVICE == "cuda":
        # the torch path is the CPU engine's; on CUDA the engine always takes the Triton kernel
        # (cuBLAS picks its fp32 algorithm by shape: not batch-invariant, as seen on the H200)
        pytest.skip("the deterministic torch path serves CPU engines only")
    heads, kv_heads, dim, _, dtype, _ = SHAPE
    if path == "torch":
        dtype = torch.float32
    g = torch.Generator().manual_seed(4)
    pool = KVPool(1, kv_heads, dim, 1024, 1, dtype, torch.device(DEVICE))
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=g))
    pool.v_buffers[0].copy_(torch.randn(pool.v_buffers[0].shape, generator=g))
    backend = DeterministicAttention(pool, heads, kv_heads, dim, KernelOptions(deterministic_triton=path == "triton"))
    # requests as (KV slots, new tokens): decodes over 130 and 7 slots, a chunk of 21 after 40 cached
    reqs = {"decode": (torch.arange(1, 131), 1), "short": (torch.arange(200, 207), 1), "chunk": (torch.arange(300, 361), 21)}
    q_of = {name: torch.randn(n, heads, dim, generator=g).to(DEVICE, dtype) for name, (_, n) in reqs.items()}

    def step(names):
        slots = [reqs[n][0].to(DEVICE) for n in names]
        ext = [reqs[n][1] for n in names]
        lens = [len(s) for s in slots]
        fb = ForwardBatch(
            input_ids=torch.zeros(sum(ext), dtype=torch.long, device=DEVICE),
            positions=torch.zeros(sum(ext), dtype=torch.long, device=DEVICE),
            out_cache_loc=torch.cat([s[len(s) - e:] for s, e in zip(slots, ext)]),
            qo_indptr=torch.tensor([0, *torch.tensor(ext).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE),
            kv_indptr=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE),
            kv_indices=torch.cat(slots), logits_indices=torch.zeros(0, dtype=torch.long, device=DEVICE),
            extend_lens=ext, seq_lens=lens, num_decode=sum(e == 1 for e in ext),
        )
        backend.plan(fb)
        q = torch.cat([q_of[n] for n in names])
        out = torch.empty_like(q)  # attend only: the pool's K/V stand for the tokens' own (no store)
        backend.attend(q, None, None, pool.k_buffers[0], pool.v_buffers[0], fb, out)
        return dict(zip(names, out.split(ext)))

    mixed = step(["short", "decode", "chunk"])
    for name in ("decode", "chunk"):
        assert torch.equal(step([name])[name], mixed[name]), name


def test_warm_up_launches_every_block_shape_a_step_can_plan(monkeypatch) -> None:
    """The engine compiles the kernel's launch shapes at start (deterministic_triton.warm_up):
    a shape first launched inside a rollout compiles there, 1-3 s on a fresh GPU machine. A
    shape is what Triton compiles apart: the MMA rows of a block and whether it is a decode's
    (its warps and stages); the table's offset and stride are not specialized on."""
    from rollout.attention import deterministic_triton

    heads, kv_heads, dim, tile, dtype, _ = SHAPE
    cap, group = _cap(SHAPE), heads_per_kv(heads, kv_heads)

    def shape(tokens: int, index_dtype: torch.dtype) -> tuple[int, bool, torch.dtype]:
        return max(16, tokens * group), tokens > 1, index_dtype

    launched = []
    real = deterministic_triton.tiled_attention

    def spy(q, k_buf, v_buf, kv_indptr, kv_indices, blocks, *args):
        launched.append(shape(blocks.tokens, kv_indices.dtype))
        return real(q, k_buf, v_buf, kv_indptr, kv_indices, blocks, *args)

    monkeypatch.setattr(deterministic_triton, "tiled_attention", spy)
    k_buf = torch.zeros(4, kv_heads, dim, dtype=dtype, device=DEVICE)
    calls = deterministic_triton.warm_up(k_buf, torch.zeros_like(k_buf), heads, dtype, cap, tile)
    assert calls == len(launched) > 0
    # eager steps: int64 KV indices (ForwardBatch); decode graphs: int32 (DecodeGraphs' buffer)
    planned = {shape(tokens, torch.int64) for extend in range(1, 3 * cap) for mix in ([extend], [1, extend], [3, extend])
               for _, tokens in plan_row_blocks(mix, cap)}
    planned.add(shape(1, torch.int32))
    assert planned - set(launched) == set(), "shapes a step can launch that the warm-up did not compile"


def test_backend_warm_up_does_nothing_off_the_gpu() -> None:
    from rollout.attention.deterministic_backend import DeterministicAttention
    from rollout.cache.kv_pool import KVPool

    pool = KVPool(1, 2, 16, 64, 1, torch.float32, torch.device("cpu"))
    assert DeterministicAttention(pool, 4, 2, 16).warm_up() == 0

"""The batch-invariant Triton kernels (deterministic mode) on tiny shapes: the matmul, the
per-row attention and the fused RMSNorm at one row per program. Each row's result must be
bit for bit the same whatever the other rows are and however many there are, and close to
the torch reference. On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py);
with CUDA the same tests run compiled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the batch-invariant kernels cannot be tested")

from rollout.attention.deterministic_triton import rows_attention  # noqa: E402
from rollout.kernels import batch_invariant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_matmul(monkeypatch):
    monkeypatch.setattr(batch_invariant, "use_triton", True)


@pytest.mark.parametrize("k,n", [(64, 96), (72, 40)])
def test_triton_matmul_rows_do_not_depend_on_the_batch(triton_matmul, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    x = torch.randn(70, k, generator=g).to(DEVICE)
    full = batch_invariant.linear(x, weight, bias)
    assert torch.allclose(full, x @ weight.T + bias, atol=1e-4)
    for m in (1, 5, 33):
        assert torch.equal(batch_invariant.linear(x[:m], weight, bias), full[:m]), m
    other = torch.randn(70, k, generator=g).to(DEVICE)
    other[17] = x[3]
    assert torch.equal(batch_invariant.linear(other, weight, bias)[17], full[3])


def _reference(q, k_buf, v_buf, kv_indptr, kv_indices, row_req, row_back, scale):
    out = torch.empty_like(q, dtype=torch.float64)
    group = q.shape[1] // k_buf.shape[1]
    for r in range(q.shape[0]):
        b = int(row_req[r])
        slots = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1]) - int(row_back[r])]
        keys = k_buf[slots].double().repeat_interleave(group, 1)  # [L, H, D]
        values = v_buf[slots].double().repeat_interleave(group, 1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[r].double(), keys) * scale, -1)
        out[r] = torch.einsum("hl,lhd->hd", probs, values)
    return out


def test_rows_attention_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, tile = 4, 2, 16, 16
    k_buf = torch.randn(200, kv_heads, dim, generator=g).to(DEVICE)
    v_buf = torch.randn(200, kv_heads, dim, generator=g).to(DEVICE)
    # three requests: a prefill of 3 new tokens over 37 slots, a decode over 20, one over 5
    lengths = [37, 20, 5]
    kv_indices = torch.randperm(199, generator=g)[: sum(lengths)].add(1).to(DEVICE)
    kv_indptr = torch.tensor([0, 37, 57, 62], dtype=torch.int32, device=DEVICE)
    row_req = torch.tensor([0, 0, 0, 1, 2], dtype=torch.int32, device=DEVICE)
    row_back = torch.tensor([2, 1, 0, 0, 0], dtype=torch.int64, device=DEVICE)
    q = torch.randn(5, heads, dim, generator=g).to(DEVICE)
    scale = dim**-0.5
    out = torch.empty_like(q)
    rows_attention(q, k_buf, v_buf, kv_indptr, kv_indices, row_req, row_back, scale, out, tile)
    want = _reference(q.cpu(), k_buf.cpu(), v_buf.cpu(), kv_indptr.cpu(), kv_indices.cpu(), row_req.cpu(),
                      row_back.cpu(), scale)
    assert torch.allclose(out.cpu().double(), want, atol=1e-5)
    # row 1 (request 0, 36 slots) alone, as a decode of a request whose KV is those 36 slots
    alone = torch.empty_like(q[:1])
    rows_attention(q[1:2], k_buf, v_buf, torch.tensor([0, 36], dtype=torch.int32, device=DEVICE), kv_indices[:36],
                   torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE),
                   scale, alone, tile)
    assert torch.equal(alone[0], out[1])


def test_rms_norm_one_row_per_program_is_batch_invariant() -> None:
    from rollout.kernels import fused

    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 64, generator=g).to(DEVICE)
    weight = torch.randn(64, generator=g).to(DEVICE)
    full = fused.rms_norm(x, weight, 1e-5, rows_per_program=1)
    for m in (1, 3, 17):
        assert torch.equal(fused.rms_norm(x[:m], weight, 1e-5, rows_per_program=1), full[:m])
    assert torch.allclose(full, torch.nn.functional.rms_norm(x, (64,), weight, 1e-5), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="a property of the GPU's MMA instructions (the interpreter's numpy dot is not them)")
def test_every_tile_config_gives_the_same_bits(monkeypatch) -> None:
    """The row count picks the tiles (batch_invariant.config_for): safe only because every
    config with the same BLOCK_K reduces each output in the same order, bit for bit."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    configs = [(64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (32, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 256, 64, 8, 3)]
    for k, n in ((4096, 6144), (14336, 4096), (4096, 20000)):
        weight = (torch.randn(n, k, generator=g, device=DEVICE) * 0.02).bfloat16()
        x = torch.randn(300, k, generator=g, device=DEVICE).bfloat16()
        outs = []
        for c in configs:
            monkeypatch.setattr(batch_invariant, "config", batch_invariant.TileConfig(*c))
            outs.append(batch_invariant.linear(x, weight))
        assert all(torch.equal(o, outs[0]) for o in outs), (k, n)
    monkeypatch.setattr(batch_invariant, "config", None)
    full = batch_invariant.linear(x, weight)  # 300 rows: the large tiles; 1 and 64 rows: the small ones
    for m in (1, 64, 65):
        assert torch.equal(batch_invariant.linear(x[:m], weight), full[:m])

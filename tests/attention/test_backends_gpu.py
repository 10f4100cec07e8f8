"""On CUDA: every attention backend agrees with the torch reference on a ragged batch
(decodes and extends over cached prefixes, pages scattered over the pool) in bf16, page
sizes 1 and 16."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU backends need CUDA (CPU twin: test_triton_kernels under TRITON_INTERPRET)")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_backend_matches_torch_reference(backend: str, page_size: int) -> None:
    from rollout.attention import make_backend
    from rollout.cache.kv_pool import KVPool
    from rollout.batch import ForwardBatch

    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed on this machine")

    torch.manual_seed(0)
    heads, kv_heads, dim, dev = 32, 8, 128, "cuda"
    pool = KVPool(1, kv_heads, dim, 8192, page_size, torch.bfloat16, dev)
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    # (cached prefix, new tokens): 3 decodes then extends with and without a prefix
    shapes = [(700, 1), (1, 1), (2047, 1), (0, 300), (129, 77), (16, 1000)]
    # each request's positions fill its own pages in order (the pool's layout), pages scattered, never page 0
    pages = torch.randperm(pool.num_slots // page_size - 1, device=dev) + 1
    kv, out_loc, off = [], [], 0
    for prefix, new in shapes:
        n_pages = -(-(prefix + new) // page_size)
        s = (pages[off: off + n_pages, None] * page_size + torch.arange(page_size, device=dev)).reshape(-1)[: prefix + new]
        off += n_pages
        kv.append(s)
        out_loc.append(s[prefix:])
    seq_lens = [p + n for p, n in shapes]
    ext = [n for _, n in shapes]
    fb = ForwardBatch(
        input_ids=torch.zeros(sum(ext), dtype=torch.long, device=dev), positions=torch.zeros(sum(ext), dtype=torch.long, device=dev),
        out_cache_loc=torch.cat(out_loc), qo_indptr=torch.tensor([0, *torch.tensor(ext).cumsum(0).tolist()], dtype=torch.int32, device=dev),
        kv_indptr=torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev),
        kv_indices=torch.cat(kv), logits_indices=torch.zeros(0, dtype=torch.long, device=dev),
        extend_lens=ext, seq_lens=seq_lens, num_decode=3,
    )
    q = torch.randn(sum(ext), heads, dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(sum(ext), kv_heads, dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    outs = {}
    for name in ("torch", backend):
        b = make_backend(name, pool, heads, kv_heads, dim, dev)
        assert b.name == name
        b.plan(fb)
        outs[name] = b.forward(q, k, v, 0).float()
    ref = outs["torch"]
    err = ((outs[backend] - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"{backend} vs torch reference: relative error {err:.2e}"

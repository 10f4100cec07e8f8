"""A stand-in for the `flashinfer` package on CPU: its two paged wrappers with the
documented semantics (CSR page tables, NHD pages, last-page lengths, causal aligned to the
bottom right, graph mode reading the caller's fixed buffers at run time), computed in
plain torch. It lets CI check our FlashInfer backend's glue (page tables, decode/extend
split, graph padding and re-planning) against transformers; the real kernels are checked
on the GPU (tests/attention/test_backends_gpu.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _attend(q, k_pages, v_pages, qo_indptr, indptr, indices, last, scale, causal) -> torch.Tensor:
    """q [T, H, D] over the pages of each request -> [T, H, D]."""
    page_size, hkv, d = k_pages.shape[1:]
    out = torch.empty_like(q)
    group = q.shape[1] // hkv
    for b in range(last.numel()):
        pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
        kv_len = (pages.numel() - 1) * page_size + int(last[b])
        keys = k_pages[pages].reshape(-1, hkv, d)[:kv_len]
        values = v_pages[pages].reshape(-1, hkv, d)[:kv_len]
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        n = q1 - q0
        mask = None
        if causal:  # new token i sits at position kv_len - n + i
            mask = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - n, kv_len)[:, None]
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1).float(), keys.repeat_interleave(group, 1).transpose(0, 1).float(),
            values.repeat_interleave(group, 1).transpose(0, 1).float(), attn_mask=mask, scale=scale,
        )
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
    return out


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None) -> None:
        assert kv_layout == "NHD"
        self.use_cuda_graph = use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.num_plans = 0

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             q_data_type="float16", kv_data_type=None, sm_scale=None, **kwargs) -> None:
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"  # host planning: no sync
        assert int(indptr[-1]) == indices.numel() and indptr.numel() == last_page_len.numel() + 1
        assert bool((last_page_len >= 1).all()) and bool((last_page_len <= page_size).all())
        self.scale = sm_scale if sm_scale is not None else head_dim**-0.5
        self.num_plans += 1
        if self.use_cuda_graph:  # the graph reads these buffers; the batch size is fixed
            ip, ix, lp = self.bufs
            if indptr.numel() != ip.numel():
                raise ValueError("The batch size should be fixed in cudagraph mode")
            ip.copy_(indptr)
            ix[: indices.numel()].copy_(indices)
            lp.copy_(last_page_len)
        else:
            self.bufs = (indptr.clone(), indices.clone(), last_page_len.clone())

    def run(self, q, paged_kv_cache, *, out=None, **kwargs):
        indptr, indices, last = self.bufs
        qo = torch.arange(last.numel() + 1)
        assert q.shape[0] == last.numel(), "decode: one query row per planned request"
        o = _attend(q, *paged_kv_cache, qo, indptr, indices, last, self.scale, causal=False)
        if out is None:
            return o
        out.copy_(o)
        return out


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", **kwargs) -> None:
        assert kv_layout == "NHD"
        self.num_plans = 0

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, causal=False, sm_scale=None, q_data_type="float16", kv_data_type=None,
             **kwargs) -> None:
        for t in (qo_indptr, paged_kv_indptr, paged_kv_last_page_len):
            assert t.device.type == "cpu" and t.dtype == torch.int32
        assert int(paged_kv_indptr[-1]) == paged_kv_indices.numel()
        self.args = (qo_indptr.clone(), paged_kv_indptr.clone(), paged_kv_indices.clone(), paged_kv_last_page_len.clone())
        self.scale = sm_scale if sm_scale is not None else head_dim_qk**-0.5
        self.causal = causal
        self.num_plans += 1

    def run(self, q, paged_kv_cache, *, out=None, **kwargs):
        qo, indptr, indices, last = self.args
        assert q.shape[0] == int(qo[-1])
        o = _attend(q, *paged_kv_cache, qo, indptr, indices, last, self.scale, causal=self.causal)
        if out is None:
            return o
        out.copy_(o)
        return out

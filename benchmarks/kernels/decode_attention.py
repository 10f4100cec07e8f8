"""Decode attention at large batches, kernel against kernel, beside the read floor.

    python -m benchmarks.kernels.decode_attention [--batch 256 --context 640 --page-size 16]
    python -m benchmarks.kernels.decode_attention --device cpu     # a smoke run (interpreter, tiny)

One layer's decode attention over a paged pool laid out as the engine lays it out (each
prompt's pages contiguous, the decode pages after them interleaved across requests), for
each backend and launch choice the engine could make: FlashInfer's tensor-core decode (what
graphs of more than `SMALL_DECODE_ROWS` rows run), the same on HND pages (a copy of the KV,
each page's head contiguous) and without a KV split (no merge kernel), its CUDA-core decode,
its fa3 (sm90) tensor-core path, and our Triton kernel at several KV split counts and tiles. Prints the
median time, the KV read bandwidth (K and V bytes the step must read / time) and each
output's largest difference from an fp32 torch reference; the floor beside them is a
flat amax over a buffer of the same bytes (what a plain read reaches in this run).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from benchmarks.common.kernel_device import kernel_bench_device, kernel_ms


def _ms(fn: Callable[[], object], device: torch.device) -> float:
    return kernel_ms(fn, device, warmup=10, rep=80)


def engine_layout(batch: int, prompt: int, context: int, page_size: int, device: torch.device,
                  share: int = 1) -> tuple:
    """(kv_indptr int32 [B+1], kv_indices int32 slot ids, num_slots): prompts' pages contiguous
    per request, pages past the prompt handed out round-robin across requests, as the engine's
    allocator does when a batch decodes in step. `share`: consecutive groups of that many
    requests hold one prompt's pages (n samples of a prompt through the radix cache)."""
    p = page_size
    prompt_pages, total_pages = -(-prompt // p), -(-context // p)
    pages = [[] for _ in range(batch)]
    nxt = 1  # page 0 is the padding page
    for b in range(batch):
        if b % share:
            pages[b] = list(pages[b - 1][:prompt_pages])
            continue
        pages[b] = list(range(nxt, nxt + prompt_pages))
        nxt += prompt_pages
    for _ in range(total_pages - prompt_pages):
        for b in range(batch):
            pages[b].append(nxt)
            nxt += 1
    slots = [torch.arange(context, dtype=torch.int64) % p + torch.tensor(pg, dtype=torch.int64).repeat_interleave(p)[:context] * p
             for pg in pages]
    indices = torch.cat(slots).to(torch.int32).to(device)
    indptr = torch.arange(0, (batch + 1) * context, context, dtype=torch.int32).to(device)
    return indptr, indices, nxt * p


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[640])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--share", type=int, default=1,
                    help="requests per prompt sharing its KV pages (GRPO's n samples through the radix cache)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    args = ap.parse_args(argv)
    device, _, dtype = kernel_bench_device(args.device, None)
    gpu = device.type == "cuda"
    if not gpu:
        args.batch, args.context, args.prompt, args.heads, args.kv_heads, args.head_dim = [3], [40], 24, 4, 2, 16
        args.page_size, args.splits = 4, [1, 2]
    from rollout.attention import triton_kernels as tk

    nq, nkv, d, ps = args.heads, args.kv_heads, args.head_dim, args.page_size
    scale = d ** -0.5
    print(f"{torch.cuda.get_device_name(device) if gpu else 'cpu'}, {dtype}, heads {nq}/{nkv} x {d}, page {ps}")
    rows = []
    for batch in args.batch:
        for context in args.context:
            indptr, indices, num_slots = engine_layout(batch, min(args.prompt, context), context, ps, device,
                                                         args.share)
            k_buf = torch.randn(num_slots, nkv, d, device=device, dtype=dtype)
            v_buf = torch.randn(num_slots, nkv, d, device=device, dtype=dtype)
            q = torch.randn(batch, nq, d, device=device, dtype=dtype)
            # bytes each request reads (a prompt shared by `share` requests counts once each)
            kv_bytes = 2 * batch * context * nkv * d * k_buf.element_size()
            unique = 2 * num_slots * nkv * d * k_buf.element_size()
            variants: dict[str, Callable[[], torch.Tensor]] = {}
            if gpu:
                variants.update(_flashinfer_variants(q, k_buf, v_buf, indptr, indices, batch, context, ps, scale))

            def triton_run(splits: int, block_n: int | None, stages: int | None, warps: int | None):
                def run() -> torch.Tensor:
                    base = tk._decode_config
                    if block_n is not None:
                        tk._decode_config = lambda *a: (block_n, {"num_warps": warps, "num_stages": stages})
                    try:
                        return tk.decode_attention(q, k_buf, v_buf, indptr, indices, scale, num_kv_splits=splits,
                                                   max_kv_len=context)
                    finally:
                        tk._decode_config = base
                return run

            for s in args.splits:
                variants[f"triton s={s}"] = triton_run(s, None, None, None)
            if args.share > 1:
                variants.update(_shared_variants(tk, q, k_buf, v_buf, indptr, indices, batch, context,
                                                 min(-(-args.prompt // ps) * ps, context - 1), args.share, scale, gpu))
            if gpu:
                for s in (1, 2):
                    for bn, st, w in ((32, 3, 4), (64, 3, 4), (128, 2, 4), (64, 2, 8), (32, 4, 2)):
                        variants[f"triton s={s} n{bn} st{st} w{w}"] = triton_run(s, bn, st, w)
            ref = _reference(q, k_buf, v_buf, indices, batch, context, scale)
            if gpu:
                flat = torch.empty(kv_bytes // 2, device=device, dtype=dtype).normal_()
                floor_ms = _ms(lambda: flat.amax(), device)
                del flat
            else:
                floor_ms = float("nan")
            for name, fn in variants.items():
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    ms = _ms(fn, device)
                except Exception as exc:  # a backend this build lacks: say so, keep going
                    rows.append((batch, context, name, None, None, None, f"{type(exc).__name__}: {exc}"[:80]))
                    continue
                rows.append((batch, context, name, ms, kv_bytes / ms / 1e9, err, f"{unique / ms / 1e9:.2f}"))
            rows.append((batch, context, "floor: flat amax, same bytes", floor_ms, kv_bytes / floor_ms / 1e9, None, "-"))
            del k_buf, v_buf
    print(f"\nshare {args.share}: TB/s counts what each request reads, 'pool TB/s' the distinct pages once")
    print("\n| batch | context | variant | us | TB/s | pool TB/s | max diff vs fp32 |\n|---:|---:|---|---:|---:|---:|---:|")
    for b, c, name, ms, tbs, err, note in rows:
        if ms is None:
            print(f"| {b} | {c} | {name} | - | - | - | {note} |")
        else:
            print(f"| {b} | {c} | {name} | {ms * 1e3:.1f} | {tbs:.2f} | {note} | {'' if err is None else f'{err:.2e}'} |")


def _shared_variants(tk, q, k_buf, v_buf, indptr, indices, batch, context, prefix, share, scale, gpu) -> dict:
    """Our Triton decode with each prompt's pages attended once for its `share` requests
    (prefix_kernel.py), at the engine's tile and the sweep's."""
    from rollout.attention import prefix_kernel as pk
    from rollout.attention import shared_prefix

    groups = [(prefix, list(range(b, min(b + share, batch)))) for b in range(0, batch, share)]
    groups = [g for g in groups if len(g[1]) > 1]
    shared = shared_prefix.pack(groups, batch, q.device)
    out: dict[str, Callable[[], torch.Tensor]] = {}

    def run_with(splits: int, pre: tuple[int, int, int, int, int] | None):
        def run() -> torch.Tensor:
            saved = pk.PRE_SPLITS, pk.BLOCK_M, pk.BLOCK_N, pk.NUM_WARPS, pk.NUM_STAGES
            if pre is not None:
                pk.PRE_SPLITS, pk.BLOCK_M, pk.BLOCK_N, pk.NUM_WARPS, pk.NUM_STAGES = pre
            try:
                return tk.decode_attention(q, k_buf, v_buf, indptr, indices, scale, num_kv_splits=splits,
                                           max_kv_len=context, shared=shared)
            finally:
                pk.PRE_SPLITS, pk.BLOCK_M, pk.BLOCK_N, pk.NUM_WARPS, pk.NUM_STAGES = saved
        return run

    out["shared prefix (engine's tile) s=1"] = run_with(1, None)
    if gpu:
        out["shared prefix s=2"] = run_with(2, None)
        q_rows = share * q.shape[1] // k_buf.shape[1]
        for pre in ((4, 64, 64, 4, 2), (2, 64, 64, 4, 2), (4, 64, 32, 4, 3), (2, 32, 64, 4, 3), (8, 32, 64, 4, 3),
                    (4, 32, 32, 4, 3), (4, 32, 64, 4, 4), (4, 32, 64, 2, 3)):
            if pre[1] >= q_rows:
                out["shared prefix s=1 splits/M/N/warps/stages " + "/".join(map(str, pre))] = run_with(1, pre)
    return out


def _reference(q, k_buf, v_buf, indices, batch, context, scale) -> torch.Tensor:
    """fp32 attention of each request's one query over its gathered KV (GQA heads repeated)."""
    idx = indices.long().view(batch, context)
    group = q.shape[1] // k_buf.shape[1]
    k = k_buf[idx].float().repeat_interleave(group, dim=2)  # [B, T, H, D]
    v = v_buf[idx].float().repeat_interleave(group, dim=2)
    s = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
    return torch.einsum("bht,bthd->bhd", s.softmax(-1), v)


def _flashinfer_variants(q, k_buf, v_buf, indptr, indices, batch, context, ps, scale) -> dict:
    import flashinfer

    from rollout.attention.page_table import page_table

    out: dict[str, Callable[[], torch.Tensor]] = {}
    nq, nkv, d = q.shape[1], k_buf.shape[1], k_buf.shape[2]
    pt = page_table([context] * batch, indices, ps)
    nhd = (k_buf.view(-1, ps, nkv, d), v_buf.view(-1, ps, nkv, d))  # the engine's pool, no copy
    # HND pages [num_pages, Hkv, P, D], a copy of the same KV: each (page, head) one contiguous
    # block of P x D, against NHD's P rows of D strided by Hkv x D (what a pool re-layout would buy)
    hnd = tuple(t.transpose(1, 2).contiguous() for t in nhd)
    kw = dict(q_data_type=q.dtype, kv_data_type=q.dtype, sm_scale=scale)
    for name, tc, backend, split, layout in (("flashinfer tc (engine)", True, "auto", None, "NHD"),
                                             ("flashinfer tc, HND pages", True, "auto", None, "HND"),
                                             ("flashinfer tc, no KV split", True, "auto", 0, "NHD"),
                                             ("flashinfer tc split 8 pages", True, "auto", 8, "NHD"),
                                             ("flashinfer tc split 16 pages", True, "auto", 16, "NHD"),
                                             ("flashinfer cuda-core", False, "auto", None, "NHD"),
                                             ("flashinfer cuda-core, HND pages", False, "auto", None, "HND"),
                                             ("flashinfer tc fa3", True, "fa3", None, "NHD")):
        try:
            ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=tc, backend=backend)
            # split 0: no KV split at all (no partial states, no merge kernel after it)
            extra = {} if split is None else {"disable_split_kv": True} if split == 0 else {"fixed_split_size": split}
            w.plan(pt.indptr.to(q.device), pt.indices, pt.last_page_len.to(q.device), nq, nkv, d, ps, **kw, **extra)
            o = torch.empty_like(q)
            kv = hnd if layout == "HND" else nhd
            out[name] = (lambda w=w, o=o, kv=kv: w.run(q, kv, out=o))
        except Exception as exc:
            print(f"{name}: not available ({type(exc).__name__}: {str(exc)[:120]})")
    return out


if __name__ == "__main__":
    main()

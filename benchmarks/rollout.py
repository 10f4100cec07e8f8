"""GPU rollout benchmark: random bf16 weights shaped like Llama-3.1-8B or Qwen3-0.6B, made on
the GPU (no download), against the memory-bandwidth roofline and transformers `generate`.

Workloads (issue #3):
  a  256 prompts, input 512, output 256, ignore EOS
  b  batch 1, input 128, output 256
  c  GRPO-shaped: 64 prompts x n=8, prompt 1024, output 256, radix cache on and off
  d  256 sequences, input and output lengths uniform in [100, 1024]

For each: output tokens/s, mean step time, and the roofline for the same work: every
decode step reads the weights once plus the KV of every running sequence (bytes over the
device copy bandwidth measured in this run), and prefill does 2 x params FLOPs per prompt
token (over the bf16 matmul rate measured in this run).

    python -m benchmarks.rollout [--shape llama8b|qwen06b] [--workloads a b c d] [--hf] [--peer] [--output-len 256]

--peer also times issue #16's bar, a decode step in plain torch compiled and captured in one
CUDA graph (benchmarks/common/compiled_peer.py), on (a)'s and (b)'s decode: its step time goes
beside the engine's decode step in the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common.compiled_peer import PeerTiming, time_decode
from benchmarks.common.compiles import CompileRecord, triton_compiles
from rollout.kernels.options import KernelOptions
from rollout.model.shapes import SHAPES, write_shape_dir


@dataclass
class Result:
    name: str
    output_tokens: int
    seconds: float
    steps: int
    roofline_seconds: float  # the bandwidth roofline of the decode steps (issue #3's definition)
    prefill_floor_seconds: float  # prefill FLOPs over the matmul rate: the rest of the floor
    prefill_seconds: float | None = None
    decode_step_ms: float = 0.0  # median wall time of the decode-only steps (graph-replayed or eager)
    compiles: int = 0  # Triton kernels compiled inside this workload's timing (benchmarks/common/compiles.py)
    compile_seconds: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def roofline_tok_s(self) -> float:
        return self.output_tokens / self.roofline_seconds


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _release() -> None:
    """Give back what dropped engines or peers held, before the next one sizes its memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), measured now."""
    if device.type == "cpu":  # smoke runs only: rough host figures, small buffers
        src = torch.randn(16 * 1024**2)
        start = time.perf_counter()
        src.clone()
        bw = 2 * src.numel() * 4 / (time.perf_counter() - start)
        a = torch.randn(512, 512)
        start = time.perf_counter()
        a @ a
        return bw, 2 * 512**3 / (time.perf_counter() - start)
    src = torch.randn(2 * 1024**3 // 2, dtype=torch.bfloat16, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * src.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3)
    return bw, flops


class Roofline:
    def __init__(self, cfg: dict, bw: float, flops: float) -> None:
        h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
        d, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * i
        self.matmul_params = layers * per_layer + cfg["vocab_size"] * h  # lm_head read every step
        self.weight_bytes = 2 * self.matmul_params
        self.kv_bytes_per_token = 2 * layers * kv * d * 2
        self.bw, self.flops = bw, flops

    def time(self, prompt_lens: list[int], output_lens: list[int], computed_prompt_tokens: int) -> tuple[float, float]:
        """(decode seconds: one weight read per step + each live sequence's KV over the copy
        bandwidth; prefill seconds: 2 x params FLOPs per computed prompt token)."""
        total = 0.0
        steps = max(output_lens)
        for s in range(1, steps):
            live = [(p + s) for p, o in zip(prompt_lens, output_lens) if s < o]
            if live:
                total += (self.weight_bytes + self.kv_bytes_per_token * sum(live)) / self.bw
        return total, 2 * self.matmul_params * computed_prompt_tokens / self.flops


def run_engine(engine, prompts: list[list[int]], params) -> tuple[list, float, float, float, float, CompileRecord]:
    """Returns (outputs, total seconds, seconds until every sample had its first token,
    median wall ms of the decode-only steps, the share of those that replayed a decode graph,
    the Triton compiles made inside the timing).
    A step is decode-only when, before it, nothing waits and every running request has its
    first token; past `cuda_graph_max_bs` rows such steps run eager (a GRPO batch of 512 with
    the default 256), which the share shows. `params`: one for all or one per prompt."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for p, sp in zip(prompts, per_prompt):
        engine.add_request(p, sp)
    _sync()
    with triton_compiles() as compiled:
        return _timed_run(engine, compiled)


def _timed_run(engine, compiled: CompileRecord) -> tuple[list, float, float, float, float, CompileRecord]:
    graphs = engine.runner.graphs
    start = time.perf_counter()
    first_token_at = None
    outs, decode_steps, replayed = [], [], 0
    sched = engine.scheduler
    decode_only = False  # the prompts were just added
    while engine.has_unfinished():
        replays = graphs.num_replays if graphs is not None else 0
        t = time.perf_counter()
        outs += engine.step()
        if decode_only:
            decode_steps.append(time.perf_counter() - t)
            replayed += graphs is not None and graphs.num_replays > replays
        decode_only = not sched.waiting and all(r.output_ids for r in sched.running)  # the next step's
        if first_token_at is None and decode_only:
            first_token_at = time.perf_counter() - start
    _sync()
    decode_ms = 1e3 * sorted(decode_steps)[len(decode_steps) // 2] if decode_steps else 0.0
    share = replayed / len(decode_steps) if decode_steps else 0.0
    return outs, time.perf_counter() - start, first_token_at or 0.0, decode_ms, share, compiled


def kernel_options(*, skinny: str = "on", rotary_store: str = "on", silu: str = "on", rope: str = "on",
                   rows: str = "on", small: int | None = None) -> KernelOptions:
    """The engine's KernelOptions for one run's on/off switches (all on, small None: the engine's
    defaults). `rotary_store` off: the K/V stored in a launch of their own and no PDL for the
    rotary and the Triton decode kernels (the engine before either); PDL itself stays ROLLOUT_PDL's."""
    return KernelOptions(skinny_matmul=skinny == "on", rotary_kv_store=rotary_store == "on",
                         pdl_rotary_attention=rotary_store == "on", silu_epilogue=silu == "on",
                         rope_epilogue=rope == "on", extend_rows_kv=None if rows == "on" else 0,
                         small_decode_rows=small)


def hf_generate(model_dir: str, cfg: dict, batch: int, input_len: int, output_len: int, device) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # same init as the engine's dummy weights (from_config may leave memory unset)
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    prompts = torch.randint(100, cfg["vocab_size"] - 100, (batch, input_len), device=device)
    with torch.no_grad():
        model.generate(prompts[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=output_len,
                       min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    tps = batch * output_len / (time.perf_counter() - start)
    del model
    torch.cuda.empty_cache()
    return tps


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    parser.add_argument("--workloads", nargs="+", default=["a", "b", "c", "d"])
    parser.add_argument("--attention", nargs="+", default=["auto"], help="one run of the workloads per backend")
    parser.add_argument("--overlap", nargs="+", default=["on"], choices=["on", "off"],
                        help="overlap scheduling: one run of the workloads per value")
    parser.add_argument("--hf", action="store_true", help="also time transformers generate for (a) and (b)")
    parser.add_argument("--hf-only", action="store_true", help="time only the transformers peers")
    parser.add_argument("--hf-output-len", type=int, default=64, help="output length of the HF peer runs")
    parser.add_argument("--peer", action="store_true",
                        help="also time issue #16's compiled peer (benchmarks/common/compiled_peer.py) on (a)'s and (b)'s "
                             "decode: the same rows, contexts and new tokens, no prefill (its KV is random)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--output-len", type=int, default=256,
                        help="(a), (b) and (c)'s new tokens, and the peer's (fewer: a quicker smoke run)")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run with --shape tiny")
    parser.add_argument("--mem-fraction", type=float, default=0.6, help="of free GPU memory for the KV pool")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None,
                        help="EngineConfig.cuda_graph_max_bs (default: the engine's); GRPO (c) decodes 512 rows")
    parser.add_argument("--deterministic", nargs="+", default=["off"], choices=["off", "on"],
                        help="one run of the workloads per mode, in this order, repeats allowed "
                             "(EngineConfig.deterministic; attention 'auto')")
    # engine switches for A/B runs: one run of the workloads per value given, in that order, repeats allowed
    for flag, what in (
        ("--skinny", "the skinny matmul at batch 1 (KernelOptions.skinny_matmul) or cuBLAS"),
        ("--rotary-store", "K/V stored in the rotary's launch, and PDL for the rotary and the Triton decode kernels "
                           "(on), or neither (off: the engine of H200, 2026-12-01, before the rotary stored K/V)"),
        ("--silu-epilogue", "batch 1: SiLU-mul as the gate_up GEMV's epilogue (KernelOptions.silu_epilogue) or "
                            "its own kernel"),
        ("--rope-epilogue", "batch 1: the rotary and the K/V store as the qkv GEMV's epilogue "
                            "(KernelOptions.rope_epilogue) or the rotary's own launch"),
        ("--prefill-rows", "small prefills as decode rows replaying a decode graph (KernelOptions.extend_rows_kv: "
                           "the engine's budget) or the eager extend layout"),
        ("--share-prefixes", "decode rows grouped by a shared prompt prefix, attended once a group "
                             "(EngineConfig.shared_prefix_attention, rollout/attention/prefix_kernel.py) or each row whole"),
    ):
        parser.add_argument(flag, nargs="+", default=["on"], choices=["on", "off"], help=what)
    parser.add_argument("--c-radix", nargs="+", default=["on", "off"], choices=["on", "off"],
                        help="(c)'s runs: with the radix cache, and the engine without it (its peer)")
    parser.add_argument("--blas", nargs="+", default=["default"], choices=["default", "cublas", "cublaslt"],
                        help="torch's BLAS for the matmuls (torch.backends.cuda.preferred_blas_library), set "
                             "before each engine is built and its graphs captured")
    parser.add_argument("--small-decode-rows", nargs="+", type=int, default=[None],
                        help="decode graphs of at most this many rows attend with the Triton kernel, larger ones "
                             "with FlashInfer (KernelOptions.small_decode_rows; default: the engine's)")
    args = parser.parse_args(argv)

    from rollout import Engine, EngineConfig, SamplingParams

    device = torch.device(args.device)
    cfg = SHAPES[args.shape]
    out = args.output_len
    model_dir = write_shape_dir(args.shape, prefix=f"bench-{args.shape}-")
    bw, flops = measure_ceilings(device)
    roof = Roofline(cfg, bw, flops)
    print(f"device copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s; "
          f"weights read per step {roof.weight_bytes / 1e9:.2f} GB", flush=True)
    def rand_prompts(count: int, length: int, g: torch.Generator) -> list[list[int]]:
        return torch.randint(100, cfg["vocab_size"] - 100, (count, length), generator=g).tolist()

    results: list[Result] = []
    hf_peer: dict[str, float] = {}
    if args.hf:  # first, so that the engine's KV pool can take the memory afterwards
        for w, (batch, input_len) in (("a", (256, 512)), ("b", (1, 128))):
            if w in args.workloads:
                try:
                    hf_peer[w] = hf_generate(model_dir, cfg, batch, input_len, args.hf_output_len, device)
                    print(f"transformers generate ({w}): {hf_peer[w]:.1f} tok/s", flush=True)
                except Exception:
                    traceback.print_exc()
    peer: dict[str, PeerTiming] = {}
    if args.peer:  # before the engines too: its static cache is freed before their KV pools are sized
        for w, (batch, input_len) in (("a", (256, 512)), ("b", (1, 128))):
            if w in args.workloads:
                try:
                    peer[w] = time_decode(cfg, batch, input_len, out, device, compile=device.type == "cuda",
                                          dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
                    d = roof.time([input_len] * batch, [out] * batch, 0)[0]
                    print(f"compiled peer ({w}): {peer[w].tok_s:.0f} tok/s of decode, {peer[w].step_ms:.2f} ms a step "
                          f"(compile and capture {peer[w].compile_seconds:.1f} s); decode roofline {batch * out / d:.0f} "
                          f"tok/s", flush=True)
                except Exception:
                    traceback.print_exc()
                _release()
    if args.hf_only:
        return

    def run_workloads(engine, label: str, make_engine) -> None:
        def record(name, outs, seconds, prompt_lens, output_lens, computed, compiled: CompileRecord, prefill=None,
                   steps=0, decode_ms=0.0, graph_share=0.0):
            r = Result(f"{name} [{label}]", sum(len(o.token_ids) for o in outs), seconds, steps,
                       *roof.time(prompt_lens, output_lens, computed), prefill, decode_ms,
                       len(compiled.names), compiled.seconds)
            results.append(r)
            print(f"{name}: {r.tok_s:.0f} tok/s ({r.seconds:.2f} s, {r.steps} steps), roofline {r.roofline_tok_s:.0f} tok/s"
                  + (f", prefill {prefill:.2f} s" if prefill is not None else "")
                  + f", decode {decode_ms:.2f} ms a step ({graph_share:.0%} of decode steps from graphs); "
                  + compiled.summary(), flush=True)

        for w in args.workloads:
            g = torch.Generator().manual_seed(ord(w))  # the same prompts and lengths for every engine config
            try:
                engine.flush_cache()
                steps0, computed0 = engine.counters.steps, engine.counters.computed_tokens
                if w == "a":
                    prompts, out_len = rand_prompts(256, 512, g), out
                    params = SamplingParams(temperature=0, max_new_tokens=out_len, ignore_eos=True)
                    outs, secs, prefill, dms, gshare, comp = run_engine(engine, prompts, params)
                    record(f"a: 256 x in 512 / out {out}", outs, secs, [512] * 256, [out_len] * 256, 256 * 512, comp,
                           prefill, steps=engine.counters.steps - steps0, decode_ms=dms, graph_share=gshare)
                elif w == "b":
                    params = SamplingParams(temperature=0, max_new_tokens=out, ignore_eos=True)
                    outs, secs, _, dms, gshare, comp = run_engine(engine, rand_prompts(1, 128, g), params)
                    record(f"b: batch 1, in 128 / out {out}", outs, secs, [128], [out], 128, comp,
                           steps=engine.counters.steps - steps0, decode_ms=dms, graph_share=gshare)
                elif w == "c":
                    prompts = rand_prompts(64, 1024, g)
                    params = SamplingParams(temperature=1.0, max_new_tokens=out, n=8, seed=0, ignore_eos=True)
                    for radix in (r == "on" for r in args.c_radix):
                        eng = engine if radix else make_engine(False)
                        eng.flush_cache()
                        steps0, computed0 = eng.counters.steps, eng.counters.computed_tokens
                        outs, secs, prefill, dms, gshare, comp = run_engine(eng, prompts, params)
                        computed = eng.counters.computed_tokens - computed0 - sum(len(o.token_ids) - 1 for o in outs)
                        record(f"c: 64 x n=8, in 1024 / out {out}, radix {'on' if radix else 'off'}", outs, secs,
                               [1024] * 512, [out] * 512, computed, comp, prefill, steps=eng.counters.steps - steps0,
                               decode_ms=dms, graph_share=gshare)
                        if not radix:
                            del eng
                            _release()
                elif w == "d":
                    lens_in = torch.randint(100, 1025, (256,), generator=g).tolist()
                    lens_out = torch.randint(100, 1025, (256,), generator=g).tolist()
                    prompts = [rand_prompts(1, n, g)[0] for n in lens_in]
                    params = [SamplingParams(temperature=0, max_new_tokens=o, ignore_eos=True) for o in lens_out]
                    outs, secs, _, dms, gshare, comp = run_engine(engine, prompts, params)
                    record("d: 256 x uniform[100,1024] in/out", outs, secs, lens_in, lens_out, sum(lens_in), comp,
                           steps=engine.counters.steps - steps0, decode_ms=dms, graph_share=gshare)
            except Exception:  # keep going: one failing workload must not lose the others' figures
                traceback.print_exc()

    max_tokens = None if device.type == "cuda" else 300_000  # CPU smoke: a bounded pool

    def engine_for(attention: str, overlap: bool, options: KernelOptions, radix: bool = True,
                   deterministic: bool = False, share: bool = True):
        return Engine(EngineConfig(deterministic=deterministic, model=model_dir, shared_prefix_attention=share,
                                   dtype="bfloat16" if device.type == "cuda" else "float32",
                                   device=args.device, load_format="dummy", max_total_tokens=max_tokens,
                                   attention=attention, page_size=16, enable_radix_cache=radix,
                                   max_running_requests=512, max_prefill_tokens=8192, overlap_schedule=overlap,
                                   **({"cuda_graph_max_bs": args.cuda_graph_max_bs} if args.cuda_graph_max_bs else {}),
                                   gpu_memory_fraction=args.mem_fraction, kernel_options=options))

    # in the order given, repeats included: `--deterministic off on on off` times each mode once
    # early and once late in the call, so a GPU whose clocks drift under load favours neither
    runs = []
    for mode in args.deterministic:
        if mode == "off":
            runs += [(a, o == "on", False) for a in args.attention for o in args.overlap]
        else:
            runs += [("auto", o == "on", True) for o in args.overlap]
    runs = [(*run, skinny, rs, silu, rope, rows, small, share) for rs in args.rotary_store for silu in args.silu_epilogue
            for rope in args.rope_epilogue for skinny in args.skinny for rows in args.prefill_rows
            for small in args.small_decode_rows for share in args.share_prefixes for run in runs]
    runs = [(*run, blas) for blas in args.blas for run in runs]
    blas_default = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
    for attention, overlap, deterministic, skinny, rotary_store, silu, rope, rows, small, share, blas in runs:
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library(blas_default if blas == "default" else blas)
        options = kernel_options(skinny=skinny, rotary_store=rotary_store, silu=silu, rope=rope, rows=rows,
                                 small=small)
        try:
            start = time.perf_counter()
            engine = engine_for(attention, overlap, options, deterministic=deterministic, share=share == "on")
            started = time.perf_counter() - start
        except Exception:
            traceback.print_exc()
            continue
        label = (f"{engine.runner.backend.name}{', overlap' if overlap else ''}{', cuBLAS' if skinny == 'off' else ''}"
                 f"{', own KV store' if rotary_store == 'off' else ''}{', own SiLU-mul' if silu == 'off' else ''}"
                 f"{', own rotary' if rope == 'off' else ''}{', eager prefill' if rows == 'off' else ''}"
                 f"{f', Triton decode to {small} rows' if small is not None else ''}"
                 f"{', prefixes unshared' if share == 'off' else ''}{f', {blas}' if blas != 'default' else ''}")
        # no local name for the graphs: they hold the model and the KV pool, and a name left
        # over kept the last engine's memory allocated while the next one was built (an H100
        # ran out of memory: BENCHMARKS.md, "H100, 2026-12-07 ...: the BLAS paths at M = 256, ...")
        n_graphs = None if engine.runner.graphs is None else len(engine.runner.graphs.graphs)
        print(f"engine ({label}): KV capacity {engine.kv.capacity} tokens, built in {started:.1f} s"
              f"{f' ({n_graphs} decode graphs)' if n_graphs is not None else ''}", flush=True)
        # warm-up outside the timings: kernel builds, mixed prefill+decode steps, batch 1
        warm = torch.Generator().manual_seed(1)
        greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
        engine.generate(input_ids=rand_prompts(8, 64, warm) + rand_prompts(1, 700, warm), sampling_params=greedy)
        engine.generate(input_ids=rand_prompts(1, 128, warm), sampling_params=greedy)
        run_workloads(engine, label, lambda radix: engine_for(attention, overlap, options, radix, deterministic,
                                                              share == "on"))
        del engine
        _release()

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n{args.shape}, {'bf16' if device.type == 'cuda' else 'fp32'}, {name}, "
          f"copy {bw / 1e9:.0f} GB/s, matmul {flops / 1e12:.0f} TFLOP/s")
    print(f"{'workload [engine]':<58} | {'tok/s':>8} | {'step ms':>7} | {'roofline':>8} | {'of roof':>7} | "
          f"{'+prefill':>8} | {'of that':>7} | {'decode ms':>9} | {'HF tok/s':>8} | {'peer ms':>7}")
    for r in results:
        key = r.name[0]
        hf = f"{hf_peer[key]:.0f}" if key in hf_peer and "radix off" not in r.name else ""
        peer_ms = f"{peer[key].step_ms:.2f}" if key in peer else ""  # its decode step, beside the engine's
        step_ms = 1e3 * r.seconds / max(1, r.steps)
        floor = r.output_tokens / (r.roofline_seconds + r.prefill_floor_seconds)
        print(f"{r.name:<58} | {r.tok_s:>8.0f} | {step_ms:>7.2f} | {r.roofline_tok_s:>8.0f} | "
              f"{r.tok_s / r.roofline_tok_s:>6.0%} | {floor:>8.0f} | {r.tok_s / floor:>6.0%} | {r.decode_step_ms:>9.2f} | {hf:>8} | {peer_ms:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bw": bw, "flops": flops, "hf": hf_peer,
                                               "peer": {w: vars(t) for w, t in peer.items()},
                                               "results": [vars(r) for r in results]}, indent=1))


if __name__ == "__main__":
    main()

"""Multi-LoRA benchmark (issue #10): the cost of adapters against the base model, in one run.

GPU (default: Llama-3.1-8B shape, random bf16 weights and adapters, no download):
  a  256 prompts x in 512 / out 256: the engine without LoRA; with LoRA on and base-only
     requests; with 8 rank-16 adapters on all seven modules, requests spread uniformly
     (goal: <= 15% slower than without LoRA)
  p  a's prefill alone (256 x 512 prompt tokens, 1 new token), prompt tok/s: how much of a's
     LoRA cost is prefill (eager steps, in-order LoRA ops) rather than decode (graphs)
  b  batch 1, in 128 / out 256: without LoRA vs one adapter (goal: <= 10% slower)
  s  LoRA-only sync of 8 rank-16 adapters from device tensors, synchronized, median of 5
     (goal: <= 5 ms for all 8), four ways: by name with 8 update_lora_adapter calls (the
     row measured before #10's second pass), by name in one update_lora_adapters call, and
     as flat buffers (lora.FlatLoraAdapter) in one call -- the trainer's own buffers (its
     LoRA parameters live in them: weightsync.flat_lora_parameters), or packed from the
     named tensors inside the timed region (a trainer that does not keep them flat)
CPU (--cpu): the real SmolLM2-135M with three adapters, the engine against peft's
  unmerged generate in the same run (tokens compared, tok/s of each).

    python -m benchmarks.lora [--shape llama8b] [--workloads a p b s]
    python -m benchmarks.lora --cpu [--prompts 8] [--new 32]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.common.adapters import MODULES, random_adapter
from benchmarks.common.compiles import CompileRecord, triton_compiles
from benchmarks.common.steady import split_steps
from rollout.kernels.options import KernelOptions

ROWS_OFF = ", eager prefill"  # a variant run with ModelRunner.extend_rows_kv = 0 (--prefill-rows off)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(engine, prompts: list[list[int]], params, lora_names) -> tuple[float, int, CompileRecord]:
    """(seconds, output tokens, the Triton compiles inside) to run the prompts to completion."""
    _sync(engine.device)
    with triton_compiles() as compiled:
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params, lora_name=lora_names)
        _sync(engine.device)
        secs = time.perf_counter() - start
    return secs, sum(len(o.token_ids) for o in outs), compiled


def gpu(args) -> None:
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.shapes import SHAPES, write_shape_dir

    device = torch.device(args.device)
    t0 = time.perf_counter()  # elapsed seconds on each row: what a time limit must cover
    dtype, dtype_name = (torch.bfloat16, "bfloat16") if device.type == "cuda" else (torch.float32, "float32")
    # --device cpu (tiny shape): a smoke run of the same code on small workloads
    batch_a, input_a, output_n = (256, 512, 256) if device.type == "cuda" else (16, 32, 16)
    cfg = SHAPES[args.shape]
    model_dir = write_shape_dir(args.shape, prefix=f"bench-lora-{args.shape}-")
    vocab = cfg["vocab_size"]

    def make(lora: bool, options: KernelOptions) -> Engine:
        return Engine(EngineConfig(model=model_dir, dtype=dtype_name, device=args.device, load_format="dummy", page_size=16,
                                   max_running_requests=512, max_prefill_tokens=8192, gpu_memory_fraction=args.mem_fraction,
                                   enable_lora=lora, max_loras_per_batch=8, max_lora_rank=args.rank,
                                   kernel_options=options))

    def prompts(count: int, length: int, seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(100, vocab - 100, (count, length), generator=g).tolist()

    greedy = lambda n: SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    names = [f"lora{i}" for i in range(8)]
    results: dict[str, float] = {}
    # --in-place-peer: a third engine whose graphs expand in place (no deferred deltas), so
    # the two LoRA launch modes are compared in one run
    engines = [(False, "no LoRA"), (True, "LoRA on")] + ([(True, "LoRA in-place")] if args.in_place_peer else [])
    # --apart-peer: a LoRA engine whose one-row steps run the adapter's shrink and expand apart
    # from the GEMV (the side stream, cuBLAS beside it) instead of the expand in its epilogue
    # (lora/hook.py one_row)
    engines += [(True, "LoRA apart")] if args.apart_peer else []
    # --base-again: the LoRA-free engine once more at the end; rows compare against the mean of
    # its two runs, so a drift of the machine over the run (clocks, heat) does not count as LoRA's
    engines += [(False, "no LoRA, again")] if args.base_again else []
    for lora, label in engines:
        if not lora and not {"a", "p", "b"} & set(args.workloads):
            continue  # the sync row alone needs no LoRA-free peer
        engine = make(lora, KernelOptions(lora_defer_max_rows=0 if label == "LoRA in-place" else None,
                                          lora_one_row_epilogue=label != "LoRA apart"))
        if lora:
            for k, name in enumerate(names):
                engine.load_lora_adapter(name, tensors=random_adapter(cfg, args.rank, k, device, dtype),
                                         config=dict(r=args.rank, lora_alpha=2 * args.rank, target_modules=MODULES))
        warm = prompts(8, 64, 1)
        engine.generate(input_ids=warm, sampling_params=greedy(16), lora_name=(names[:8] if lora else None))
        engine.generate(input_ids=warm[:1], sampling_params=greedy(16))
        # Each row runs twice and times the second: the first compiles the SGMV kernel variants
        # its prefill shapes pick (once per process in real use; decode graphs are captured).
        workloads = {
            "a": (prompts(batch_a, input_a, ord("a")), [("base requests", None)]
                  + ([("8 adapters, uniform", [names[i % 8] for i in range(batch_a)])] if lora else [])),
            "b": (prompts(1, 128, ord("b")), [("base", None)] + ([("1 adapter", names[0])] if lora else [])),
        }
        # --prefill-rows on off: each variant with small prefills as decode rows (a graph replay,
        # the engine's default: KernelOptions.extend_rows_kv) and with the eager extend layout, on
        # the same engine (its runner's extend_rows_kv, set between runs), so b's interleaved runs
        # compare the two on one engine
        workloads = {w: (work, [(what + ROWS_OFF * (mode == "off"), names_, mode) for mode in args.prefill_rows
                                for what, names_ in variants]) for w, (work, variants) in workloads.items()}
        if label == "LoRA on" and "s" in args.workloads:  # first: short, and a row a time limit must not lose
            from lora.flat import FlatLoraAdapter

            updates = {n: list(random_adapter(cfg, args.rank, 100 + k, device, dtype).items())
                       for k, n in enumerate(names)}
            mb = sum(t.numel() * t.element_size() for u in updates.values() for _, t in u) / 1e6
            flats = {n: FlatLoraAdapter.pack(u) for n, u in updates.items()}  # laid out once, as a trainer's are
            sync_rows = {
                "s: LoRA-only sync, 8 adapters, by name x8": lambda: [engine.update_lora_adapter(n, updates[n])
                                                                    for n in names],
                "s: LoRA-only sync, 8 adapters, by name x1": lambda: engine.update_lora_adapters(updates),
                "s: LoRA-only sync, 8 adapters, flat x1": lambda: engine.update_lora_adapters(flats),
                "s: LoRA-only sync, 8 adapters, flat+pack x1": lambda: engine.update_lora_adapters(
                    {n: FlatLoraAdapter.pack(u) for n, u in updates.items()}),
            }
            for key, sync in sync_rows.items():
                times = []
                for _ in range(6):
                    _sync(device)
                    start = time.perf_counter()
                    sync()
                    _sync(device)
                    times.append(time.perf_counter() - start)
                results[key] = 1e3 * statistics.median(times[1:])
                print(f"{key} ({mb:.0f} MB): {results[key]:.2f} ms (median of 5) [{time.perf_counter() - t0:.0f} s]",
                      flush=True)
            for key in ("s: LoRA-only sync, 8 adapters, by name x8", "s: LoRA-only sync, 8 adapters, flat x1"):
                profile = cProfile.Profile()  # where the host time of one round goes
                profile.enable()
                sync_rows[key]()
                _sync(device)
                profile.disable()
                print(f"profile of one round, {key}:")
                pstats.Stats(profile).sort_stats("tottime").print_stats(8)
        workloads["p"] = workloads["a"]  # a's prefill alone: where a's LoRA cost lies (prefill or decode)
        for workload in ("b", "a", "p"):  # shortest first: a time limit loses the diagnostic p first
            if workload not in args.workloads:
                continue
            work, variants = workloads[workload]
            new = greedy(1 if workload == "p" else output_n)
            for what, lora_names, rows in variants:
                engine.runner.extend_rows_kv = None if rows == "on" else 0
                # the whole workload once, untimed: its eager (mixed prefill + decode) steps pick SGMV
                # tilings by their row counts, and a variant first launched in a timed run would put
                # its compile (1-3 s) in the figure (once per process in real use)
                engine.flush_cache()
                warm_compiles = timed(engine, work, new, lora_names)[2]
                print(f"{workload} [{label}] {what}, warm-up run: {warm_compiles.summary()}", flush=True)
            # b is short: each variant three times, interleaved (base, adapter, base, ...), so the
            # same engine's variants see the same machine; the median of each
            runs: dict[str, list[tuple[float, int]]] = {what: [] for what, _, _ in variants}
            for _ in range(3 if workload == "b" else 1):
                for what, lora_names, rows in variants:
                    engine.runner.extend_rows_kv = None if rows == "on" else 0
                    engine.flush_cache()
                    runs[what].append(timed(engine, work, new, lora_names))
            for what, _, _ in variants:
                secs, toks, compiled = sorted(runs[what], key=lambda run: run[0])[len(runs[what]) // 2]
                if workload == "p":
                    toks = sum(len(w) for w in work)  # prompt tokens per second
                key = f"{workload} [{label}] {what}"
                results[key] = toks / secs
                print(f"{key}: {toks / secs:.1f} tok/s ({secs:.2f} s, {1e3 * secs / toks:.3f} ms/token; "
                      f"{compiled.summary()}) [{time.perf_counter() - t0:.0f} s]", flush=True)
            if args.split and workload == "a":
                for what, lora_names, rows in variants:
                    engine.runner.extend_rows_kv = None if rows == "on" else 0
                    engine.flush_cache()
                    for i, prompt in enumerate(work):
                        engine.add_request(prompt, new, lora_name=lora_names[i] if lora_names else None)
                    print(f"{workload} [{label}] {what}, step by step: {split_steps(engine).summary()}", flush=True)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    print(f"\n{args.shape}, {dtype_name}, {where}, adapters rank {args.rank} on all seven modules")
    print(f"{'row':<58} | {'tok/s':>9} | {'vs no LoRA':>10} | goal"
          + ("  (vs the mean of both no-LoRA runs)" if args.base_again else ""))
    for key, value in results.items():
        if key.startswith("s"):
            continue
        base_what = "base" + (" requests" if key[0] in "ap" else "") + (ROWS_OFF if key.endswith(ROWS_OFF) else "")
        base_key = f"{key[0]} [no LoRA] {base_what}"
        bases = [results[k] for k in (base_key, base_key.replace("[no LoRA]", "[no LoRA, again]")) if k in results]
        base = sum(bases) / len(bases) if bases else None
        rel = f"{value / base - 1:+.1%}" if base else ""
        same = results.get(key.split("]")[0] + "] " + base_what)  # this engine's
        rel += f" ({value / same - 1:+.1%} vs this engine's base)" if same and "adapter" in key else ""
        goal = {"a": ">= -15%", "b": ">= -10%"}.get(key[0], "") if "adapter" in key else ""
        print(f"{key:<58} | {value:>9.1f} | {rel:>10} | {goal}")
    for key, value in results.items():
        if key.startswith("s"):  # LoRA-only sync of 8 adapters
            print(f"{key:<58} | {value:>6.2f} ms | {'':>10} | <= 5 ms")
    if any(key.startswith("s") for key in results):
        print("  (by name xN: N calls of update_lora_adapter(name, named tensors); x1: one update_lora_adapters call;"
              "\n   flat: the trainer's LoRA parameters live in one buffer per adapter, weightsync.flat_lora_parameters;"
              "\n   flat+pack: FlatLoraAdapter.pack(named tensors) inside the timed region)")
    if device.type == "cuda":
        from lora.kernels.sgmv import pdl_enabled

        print(f"LoRA decode graphs: shrink on a side stream, expand with PDL: "
              f"{pdl_enabled(device, KernelOptions().lora_pdl)}")


def cpu(args) -> None:
    import copy

    import peft
    from transformers import AutoModelForCausalLM

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.model.fetch import fetch_default_model

    model_dir = str(fetch_default_model())
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    specs = {"a": dict(r=16, lora_alpha=32, target_modules=MODULES),
             "b": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
             "c": dict(r=4, lora_alpha=16, target_modules=["o_proj", "down_proj"], use_rslora=True)}
    model = None
    for k, (name, spec) in enumerate(specs.items()):
        config = peft.LoraConfig(**spec)
        model = peft.get_peft_model(copy.deepcopy(hf), config, adapter_name=name) if model is None else model
        if name != "a":
            model.add_adapter(name, config)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if f".{name}." in pname and "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.eval()
    engine = Engine(EngineConfig(model=model_dir, enable_lora=True, max_lora_rank=16, max_loras_per_batch=3))
    for name, spec in specs.items():
        model.set_adapter(name)
        state = peft.get_peft_model_state_dict(model, adapter_name=name)
        engine.load_lora_adapter(name, tensors=state, config=spec)
    tok = engine.tokenizer
    texts = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(args.prompts)]
    prompts = [tok.encode(t) for t in texts]
    names = [list(specs)[i % 3] for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_new_tokens=args.new, ignore_eos=True)
    engine.generate(input_ids=prompts[:2], sampling_params=SamplingParams(temperature=0, max_new_tokens=4), lora_name=names[:2])
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora_name=names)
    engine_s = time.perf_counter() - start
    start = time.perf_counter()
    same = 0
    with torch.no_grad():
        for prompt, name, out in zip(prompts, names, outs):  # peft batches one adapter at a time: one call each
            model.set_adapter(name)
            ids = torch.tensor([prompt])
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            same += ref == out.token_ids
    peft_s = time.perf_counter() - start
    n = args.prompts * args.new
    print(f"\nSmolLM2-135M, fp32, CPU ({torch.get_num_threads()} threads), {args.prompts} prompts x {args.new} tokens, "
          f"adapters a (r16, all), b (r8, q/v), c (r4 rslora, o/down) mixed")
    print(f"{'':<28} | {'seconds':>8} | {'tok/s':>7}")
    print(f"{'engine (one mixed batch)':<28} | {engine_s:>8.2f} | {n / engine_s:>7.1f}")
    print(f"{'peft generate (per prompt)':<28} | {peft_s:>8.2f} | {n / peft_s:>7.1f}")
    print(f"greedy tokens equal to peft: {same}/{args.prompts}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--workloads", nargs="+", default=["a", "p", "b", "s"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--base-again", action="store_true",
                        help="run the engine without LoRA again at the end; compare against the mean of both")
    parser.add_argument("--in-place-peer", action="store_true",
                        help="also run a LoRA engine without deferred deltas (lora/hook.py), in the same run")
    parser.add_argument("--mem-fraction", type=float, default=0.6)
    parser.add_argument("--apart-peer", action="store_true",
                        help="also run a LoRA engine whose one-row steps run the adapter's kernels apart from the "
                             "GEMV (KernelOptions.lora_one_row_epilogue = False), in the same run")
    parser.add_argument("--split", action="store_true",
                        help="after the timed rows of a, each variant once more step by step: its wall time split "
                             "into decode-graph steps and the rest (prefill, mixed steps)")
    parser.add_argument("--prefill-rows", nargs="+", default=["on"], choices=["on", "off"],
                        help="each (a)/(b)/(p) variant with small prefills as decode rows (on: the engine's default) "
                             "and/or the eager extend layout (off)")
    parser.add_argument("--cpu", action="store_true", help="SmolLM2 against peft on the CPU")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the GPU rows (with --shape tiny)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new", type=int, default=24)
    args = parser.parse_args(argv)
    cpu(args) if args.cpu else gpu(args)


if __name__ == "__main__":
    main()

"""Batch-1 decode with one adapter, over the one-row shrink's launch shapes (GPU).

    python -m benchmarks.kernels.lora_row [--shape llama8b --context 256 --steps 100 --rounds 3]
    python -m benchmarks.kernels.lora_row --device cpu     # a smoke run (tiny shape, interpreter)

At batch 1 an adapter's cost is the shrink kernel before each projection (lora/kernels/row.py)
on the step's chain: 128 launches a Llama-3-8B step. What a launch shape changes there is
latency, which no kernel-alone timing shows, so this times the engine itself: one engine
(overlap on, decode graphs, one rank-16 adapter on all seven modules), its decode graphs
re-captured for each (BLOCK_K, num_warps) of the shrink, and for each, in rounds that
interleave the shapes: a request under the adapter and one without it (the plain graph),
`steps` engine steps each (ms a step, wall), and the device time of one replay of the
adapter's graph alone (`do_bench`, its static inputs as the last step left them).

    python -m benchmarks.kernels.lora_row --parts [--max-running 512]

`--parts` splits the adapter's cost instead (the default shape; a diagnosis, not a result:
some parts' outputs are wrong): `full` as the engine runs it; `epilogue` the GEMVs with the
term (B and h loaded, the FMAs) but no shrink kernel (h a zeroed buffer made before the
capture); `shrink` the shrink kernels on the chain but GEMVs without the term;
`no-<module>` no adapter on that one module. `--max-running` builds the engine with graphs to
that many rows, as benchmarks.lora's (512) are. `--gemv-from F` adds the part `gemv-from-file`:
`full` with the skinny GEMV kernel of the file F (`git show REV:rollout/kernels/skinny.py >
F`), so a kernel change is timed before and after in one call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["1024:4", "512:4", "512:2", "256:2", "256:1", "2048:4", "1024:8"],
                    help="BLOCK_K:num_warps of the one-row shrink")
    ap.add_argument("--parts", action="store_true", help="split the adapter's cost: full / epilogue / shrink")
    ap.add_argument("--max-running", type=int, default=1, help="max_running_requests and cuda_graph_max_bs")
    ap.add_argument("--gemv-from", default=None, help="with --parts: also time the skinny GEMV kernel of this file")
    ap.add_argument("--only", nargs="+", default=None, metavar="PART",
                    help="with --parts: time these parts alone (of %s, and gemv-from-file)" % ", ".join(PARTS))
    args = ap.parse_args()
    from lora.kernels import row
    from rollout import Engine, EngineConfig, SamplingParams
    from benchmarks.common.adapters import load_random_adapters
    from benchmarks.common.steady import run_to_decode
    from rollout.model.shapes import SHAPES, write_shape_dir
    from rollout.model.cuda_graph import Variant

    cuda = args.device.startswith("cuda")
    if not cuda:
        args.shape, args.context, args.steps, args.rounds, args.shapes = "tiny", 16, 3, 1, args.shapes[:2]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = Engine(EngineConfig(model=write_shape_dir(args.shape, prefix=f"bench-row-{args.shape}-"),
                                 dtype="bfloat16" if cuda else "float32", device=args.device, load_format="dummy",
                                 page_size=16, max_running_requests=args.max_running,
                                 cuda_graph_max_bs=args.max_running, gpu_memory_fraction=0.6,
                                 cuda_graph=cuda, overlap_schedule=cuda, enable_lora=True, max_loras_per_batch=1,
                                 max_lora_rank=16))
    cfg = SHAPES[args.shape]
    (name,) = load_random_adapters(engine, cfg, 1)
    prompt = torch.randint(100, cfg["vocab_size"] - 100, (args.context,)).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=args.steps + 16, ignore_eos=True)
    runner = engine.runner

    def steps(lora: str | None) -> tuple[float, float | None]:
        """ms a step over `steps` steps of one request, then the device ms of one replay."""
        req = engine.add_request(prompt, params, lora_name=lora)
        run_to_decode(engine, warm_steps=3)
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        wall = 1e3 * (time.perf_counter() - start) / args.steps
        replay = None
        if cuda:
            from triton.testing import do_bench

            graph = runner.graphs.graphs[1, Variant(lora=lora is not None)]
            replay = float(do_bench(graph.replay, warmup=10, rep=100))
        engine.abort(req)
        while engine.has_unfinished():
            engine.step()
        return wall, replay

    variants = (PARTS + (["gemv-from-file"] if args.gemv_from else [])) if args.parts else args.shapes
    if args.parts and args.only:
        unknown = [p for p in args.only if p not in variants]
        if unknown:
            ap.error(f"--only {unknown}: not among {variants}")
        variants = args.only
    results: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for shape in (variants if r % 2 == 0 else list(reversed(variants))):
            if args.parts:
                _set_part(runner.lora, shape, args.gemv_from)
            else:
                block_k, warps = (int(v) for v in shape.split(":"))
                row.BLOCK_K, row.NUM_WARPS = block_k, warps
            if cuda:
                runner.capture_decode_graphs(1, runner.graphs.max_context)
            got = results.setdefault(shape, {"base": [], "lora": [], "base_dev": [], "lora_dev": []})
            for kind in ("base", "lora"):
                wall, dev = steps(name if kind == "lora" else None)
                got[kind].append(wall)
                if dev is not None:
                    got[kind + "_dev"].append(dev)
    med = statistics.median
    print(f"\n{args.shape}, batch 1, context ~{args.context}, one rank-16 adapter on all seven modules; "
          f"median of {args.rounds} rounds of {args.steps} steps (wall ms a step) and of the graph replays (device ms)")
    print(f"| {'part' if args.parts else 'BLOCK_K:warps'} | base step | adapter step | added | base replay | adapter replay | added |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape, got in results.items():
        b, a = med(got["base"]), med(got["lora"])
        dev = (f"{med(got['base_dev']):.3f} | {med(got['lora_dev']):.3f} | {med(got['lora_dev']) - med(got['base_dev']):+.3f}"
               if got["lora_dev"] else "- | - | -")
        print(f"| {shape} | {b:.3f} | {a:.3f} | {a - b:+.3f} ({a / b - 1:+.1%}) | {dev} |")


PARTS = ["full", "epilogue", "shrink", "no-qkv_proj", "no-o_proj", "no-gate_up_proj", "no-down_proj"]
_REAL_ONE_ROW = None
_GEMV: dict[str, object] = {}  # "now": the skinny module's kernel; "file": --gemv-from's


def _load_module(path: str):
    """A copy of a module from a file, under its own name (a dataclass needs it in sys.modules)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_row_gemv_from_file", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _set_part(pool, part: str, gemv_from: str | None = None) -> None:
    """Swap LoraHook.one_row (and the GEMV kernel) for the part timed next (the graphs are
    re-captured after it). epilogue: h is a zeroed buffer made here, before the capture (so
    no fill is captured)."""
    from lora.hook import LoraHook
    from lora.kernels.row import splits
    from rollout.kernels import skinny
    from rollout.kernels.low_rank import LowRank, OneRow

    global _REAL_ONE_ROW
    if _REAL_ONE_ROW is None:
        _REAL_ONE_ROW = LoraHook.one_row
    real = _REAL_ONE_ROW
    zeros = {m: torch.zeros((splits(s.in_features, pool.device), s.num_slices * pool.max_rank), dtype=torch.float32,
                            device=pool.device) for m, s in pool.shapes.items()}

    def epilogue(self, x):
        if self.pool.batch is None or x.shape[0] != 1:  # no adapter this step, or not the one-row path
            return real(self, x)
        slot = self.pool.batch.seg_slots[:1]
        return OneRow(LowRank(zeros[self.key[1]], self.pool.b[self.key], slot, self.pool.slot_ranks,
                              self.slice_offsets, self.pool.max_rank))

    def shrink(self, x):
        got = real(self, x)
        return OneRow(None) if got is not None and got.term is not None else got

    def without(module):
        def one_row(self, x):
            if self.key[1] == module and self.pool.batch is not None and x.shape[0] == 1:
                return OneRow(None)
            return real(self, x)
        return one_row

    _GEMV.setdefault("now", skinny._gemv_kernel)
    if gemv_from and "file" not in _GEMV:
        _GEMV["file"] = _load_module(gemv_from)._gemv_kernel
    skinny._gemv_kernel = _GEMV["file" if part == "gemv-from-file" else "now"]  # _launch reads the global
    fns = {"full": real, "gemv-from-file": real, "epilogue": epilogue, "shrink": shrink}
    LoraHook.one_row = fns[part] if part in fns else without(part[3:])


if __name__ == "__main__":
    main()

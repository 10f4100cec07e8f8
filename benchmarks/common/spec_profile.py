"""benchmarks.spec --gpu --profile-verify K: where a verify step's time goes against a decode step.

At one batch size (the first of --batches), the engine steps a running batch at steady state
without speculation (overlap off and on) and with a fixed drafter proposing K tokens every
step (overlap off, as a drafting step runs), each under torch.profiler. Per variant: wall ms
per step, device (kernel) ms per step, the gap (the device idle: host work not hidden), and
the top kernels by device time per step; with --profile-host N also the N Python functions of
most own time over the steps without overlap (cProfile). So "verify costs 1.5x decode" splits
into kernels that cost more and host time that is exposed.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common.steady import run_to_decode


def _device_us(event) -> float:
    # torch >= 2.4 names it device time; older builds only cuda time
    return float(getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0))


def profile_variant(engine, prompts, params, label: str, steps: int, top: int, host_top: int = 0) -> None:
    from rollout import SamplingParams

    warm = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    engine.generate(input_ids=prompts, sampling_params=warm)  # kernels and graphs of these shapes
    for p in prompts:
        engine.add_request(p, params)
    run_to_decode(engine, warm_steps=3)
    cuda = torch.device(engine.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    wall = 1e3 * (time.perf_counter() - start) / steps
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    kernels = [e for e in prof.key_averages() if _device_us(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    device = sum(_device_us(e) for e in kernels) / 1e3 / steps
    print(f"\n{label}: {wall:.2f} ms per step (unprofiled), kernels {device:.2f} ms per step, "
          f"device idle {wall - device:.2f} ms ({steps} steps each)")
    kernels.sort(key=_device_us, reverse=True)
    for e in kernels[:top]:
        print(f"  {_device_us(e) / 1e3 / steps:7.3f} ms  {e.count / steps:6.1f}/step  {e.key[:110]}")
    if host_top:  # the host's side: which Python functions the steps spend their wall time in
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [engine.step() for _ in range(steps)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(host_top)
    while engine.has_unfinished():
        engine.step()


def run(engine, prompts, make_speculator, k: int, steps: int = 20, top: int = 18, host_top: int = 0,
        make_tree=None, tree_nodes: tuple[int, ...] = ()) -> None:
    """`make_speculator(k)`: a Speculator whose drafter proposes k tokens every step
    (benchmarks.spec's FixedDrafter); `make_tree(k, nodes)`: one proposing a tree of `nodes` nodes,
    depth <= k, every step (benchmarks.spec's FixedTree), profiled for each of `tree_nodes`."""
    from rollout import SamplingParams
    from benchmarks.common.spec import use_speculation
    from rollout.core.hooks import NO_SPECULATION

    params = SamplingParams(temperature=0, max_new_tokens=3 * steps + 16, ignore_eos=True)
    trees = [(f"verify tree of {n} nodes, depth <= {k}", make_tree(k, n), False) for n in tree_nodes]
    print(f"\nprofile at batch {len(prompts)}: decode (overlap off / on) against verify k = {k}"
          + (f" and trees of {', '.join(map(str, tree_nodes))} nodes" if trees else ""))
    for label, spec, overlap in (("decode, overlap off", None, False), ("decode, overlap on", None, True),
                                 (f"verify k={k}", make_speculator(k), False), *trees):
        use_speculation(engine, NO_SPECULATION if spec is None else spec)
        # plain decoding overlaps as the variant says; a verify variant's steps without drafts as
        # the engine's plain steps do
        engine.loop.overlap = overlap if spec is None else engine.config.overlap_plain
        engine.runner.verify_rows_max = None
        profile_variant(engine, prompts, params, label, steps, top, host_top if overlap is False else 0)

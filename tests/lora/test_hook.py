"""LoraHook (lora/hook.py): a projection launches its shrink before the base matmul and its
expand after it; on CPU the halves simply run in order, on CUDA inside a graph capture the
shrink runs on a side stream (graph branches) and the replayed result equals the eager,
in-order one for any mix of adapters, with expand's programmatic dependent launch on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lora.pool import LoraPool
from rollout.batch import LoraInputs
from rollout.kernels.options import KernelOptions
from rollout.model.config import ModelConfig
from rollout.model.llama import Linear
from rollout.model.lora_segments import plan_segments
from rollout.model.shapes import SHAPES

MODEL = ModelConfig.from_dict(SHAPES["tiny"])
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIZES = {"qkv_proj": (64, 128), "o_proj": (64, 64), "gate_up_proj": (64, 256), "down_proj": (128, 64)}


def _inputs(slots: list[int], device: torch.device, num_slots: int) -> LoraInputs:
    plan = plan_segments(slots, [1] * len(slots), num_rows=len(slots), num_segments=num_slots)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return LoraInputs(t(plan.row_ids), t(plan.seg_indptr), t(plan.seg_slots), plan.num_lora_rows)


def _setup(device: torch.device, dtype: torch.dtype = torch.float32, options: KernelOptions = KernelOptions()):
    torch.manual_seed(0)
    pool = LoraPool(MODEL, 3, 8, MODULES, dtype, device, options=options)
    for t in (*pool.a_stack.values(), *pool.b_stack.values()):
        t.copy_(torch.randn(t.shape) * 0.1)
    pool.slot_ranks.copy_(torch.tensor([8, 4, 0], dtype=torch.int32))
    layers = {}
    for name, (fan_in, fan_out) in SIZES.items():
        linear = Linear(fan_in, fan_out, bias=False, options=options).to(device)
        linear.weight.data = (torch.randn(fan_out, fan_in) / fan_in**0.5).to(device, dtype)
        linear.lora = pool.hook(0, name)
        layers[name] = linear
    return pool, layers


def _forward(layers: dict[str, Linear], xs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [layers[name](xs[name]) for name in SIZES]


def test_linear_calls_begin_before_and_finish_after_its_matmul() -> None:
    calls = []

    class Recorder:
        def begin(self, x, defer=False):  # the LoraProjection protocol (rollout/model/llama.py)
            calls.append("begin")
            return x.sum()

        def finish(self, pending, out):
            calls.append(("finish", float(pending)))
            out += 1

    linear = Linear(4, 3, bias=False)
    linear.weight.data = torch.ones(3, 4)
    linear.matmul = lambda x, w, b, options: calls.append("matmul") or torch.nn.functional.linear(x, w, b)
    linear.lora = Recorder()
    y = linear(torch.ones(2, 4))
    assert calls == ["begin", "matmul", ("finish", 8.0)] and torch.equal(y, torch.full((2, 3), 5.0))


def test_cpu_runs_the_halves_in_order_and_ignores_concurrent() -> None:
    pool, layers = _setup(torch.device("cpu"))
    xs = {name: torch.randn(5, fan_in) for name, (fan_in, _) in SIZES.items()}
    base = [torch.nn.functional.linear(xs[n], layers[n].weight) for n in SIZES]
    pool.plan(_inputs([0, -1, 1, 2, 0], pool.device, 3), active=True, concurrent=True)
    assert not pool.concurrent, "CPU has no side stream"
    outs = _forward(layers, xs)
    # rows of base requests (1) and of an empty slot (3, rank 0) keep the base output exactly
    for out, ref in zip(outs, base):
        assert torch.equal(out[[1, 3]], ref[[1, 3]]) and not torch.allclose(out[[0, 2, 4]], ref[[0, 2, 4]])
    pool.plan(None, active=False)
    assert all(torch.equal(o, r) for o, r in zip(_forward(layers, xs), base))


def test_side_stream_only_up_to_concurrent_max_rows() -> None:
    # past CONCURRENT_MAX_ROWS a capture runs its LoRA ops in order (lora/pool.py's table);
    # the policy only reads the device's type, so a CPU pool posing as CUDA checks it here
    from types import SimpleNamespace

    from lora.pool import CONCURRENT_MAX_ROWS

    pool, _ = _setup(torch.device("cpu"))
    pool.device = SimpleNamespace(type="cuda")  # type: ignore[assignment]
    limit = CONCURRENT_MAX_ROWS
    assert limit == pool.concurrent_max_rows == 192
    for rows, concurrent, want in ((1, True, True), (limit, True, True), (limit + 1, True, False),
                                   (1, False, False)):
        pool.plan(_inputs([0] * rows, torch.device("cpu"), 3), active=True, concurrent=concurrent)
        assert pool.concurrent == want, (rows, concurrent)
    pool.plan(None, active=False, concurrent=True)  # a capture without adapters: nothing runs anyway
    assert pool.batch is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams and graph branches need CUDA")
def test_graph_with_side_stream_shrink_equals_in_order_eager() -> None:
    from lora.kernels import sgmv
    from rollout.kernels import pdl

    device = torch.device("cuda", torch.cuda.current_device())
    pool, layers = _setup(device, torch.bfloat16)
    xs = {name: torch.randn(16, fan_in, device=device, dtype=torch.bfloat16) for name, (fan_in, _) in SIZES.items()}
    static = _inputs([0] * 16, device, 3)
    with torch.inference_mode():
        pool.plan(static, active=True, concurrent=True)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            _forward(layers, xs)  # compile outside the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = _forward(layers, xs)
        assert pool._side_stream is not None
        for slots in ([1, -1, 0, 2] * 4, [0] * 16, [-1] * 15 + [1]):
            fresh = _inputs(slots, device, 3)
            for dst, src in zip((static.row_ids, static.seg_indptr, static.seg_slots),
                                (fresh.row_ids, fresh.seg_indptr, fresh.seg_slots)):
                dst.copy_(src)
            graph.replay()
            pool.plan(fresh, active=True, concurrent=False)
            want = _forward(layers, xs)
            pool.plan(static, active=True, concurrent=True)
            for got, ref in zip(outs, want):
                torch.testing.assert_close(got, ref, rtol=0, atol=0)  # same kernels, same order of sums
    assert sgmv.pdl_enabled(device) == (torch.cuda.get_device_capability(device)[0] >= 9 and pdl.triton_has_pdl())


def test_pdl_is_off_off_cuda() -> None:
    pytest.importorskip("triton")
    from lora.kernels import sgmv

    assert not sgmv.pdl_enabled(torch.device("cpu"))  # the interpreter runs the plain launch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs CUDA")
def test_expand_with_and_without_pdl_agree_bitwise() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    outs = {}
    for pdl in (True, False):
        pool, layers = _setup(device, torch.bfloat16, KernelOptions(lora_pdl=pdl))  # the same weights
        xs = {name: torch.randn(9, fan_in, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
              for name, (fan_in, _) in SIZES.items()}
        pool.plan(_inputs([2, 0, -1, 1, 0, 0, 1, -1, 0], device, 3), active=True)
        with torch.inference_mode():
            outs[pdl] = _forward(layers, xs)
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))

"""The one-row LoRA path (lora/hook.py `one_row`): at batch 1 the adapter's shrink is one small
kernel (lora/kernels/row.py) and its expand the base GEMV's epilogue (rollout/kernels/low_rank.py).

Checked here: the shrink against its torch twin (lora.ops.shrink_row_reference), what it must
leave alone (slot -1, blocks past the rank); the model's one-token forward through it against
the two halves apart (the SGMV kernels, the in-place expand: the path peft is checked against
in test_engine_lora.py) under the interpreter, which kernels run, that a base row in a LoRA
step is bit-equal to no adapter at all; and on a GPU a CUDA graph of it replayed under each
adapter. The epilogue's own arithmetic is in tests/kernels/test_skinny.py.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from lora import ops  # noqa: E402
from lora.kernels import row  # noqa: E402
from rollout.kernels.low_rank import MAX_SPLIT  # noqa: E402
from rollout.kernels.options import KernelOptions  # noqa: E402

from tests.lora.test_deferred import _forward, _inputs, _model  # noqa: E402

DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16


@pytest.fixture
def kernels_on() -> KernelOptions:
    """The fused, skinny and LoRA kernels on CPU tensors too (the interpreter)."""
    return KernelOptions() if ON_GPU else KernelOptions(fused=True, lora_triton=True)


def _shrink_case(k: int, num_slices: int, max_rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(DEVICE, DTYPE)
    a = torch.randn(3, num_slices * max_rank, k, generator=g).to(DEVICE, DTYPE)
    ranks = torch.tensor([max_rank, max(max_rank // 3, 1), 0], dtype=torch.int32, device=DEVICE)
    return x, a, ranks


@pytest.mark.parametrize("k,num_slices,max_rank", [(64, 1, 8), (72, 3, 8), (16, 2, 20), (100, 1, 33), (1100, 1, 8)],
                         ids=str)
def test_shrink_row_matches_the_reference_where_it_must_write(kernels_on, k, num_slices, max_rank):
    """Summed over its splits, h equals x . A_slot at every column below the slot's rank (K
    tails, a K shorter than one block and several splits under the interpreter's narrow K
    blocks, a K so long that the blocks widen to keep MAX_SPLIT partials, ranks past one block)."""
    x, a, ranks = _shrink_case(k, num_slices, max_rank, seed=k)
    for slot in (0, 1):
        s = torch.tensor([slot], dtype=torch.int32, device=DEVICE)
        h = ops.shrink_row(x, a, s, ranks, num_slices=num_slices, max_rank=max_rank, options=kernels_on)
        ref = ops.shrink_row_reference(x, a, s, ranks, num_slices=num_slices, max_rank=max_rank)
        assert h.dim() == 2 and h.shape[1] == num_slices * max_rank and ref.shape == (1, h.shape[1])
        assert ON_GPU or k <= row.INTERPRETER_BLOCK_K or h.shape[0] > 1, "the interpreter run should split K"
        assert h.shape[0] <= MAX_SPLIT
        rank = int(ranks[slot])
        keep = (torch.arange(max_rank, device=DEVICE) < rank).repeat(num_slices)
        torch.testing.assert_close(h.sum(0)[keep], ref[0][keep], rtol=1e-5, atol=1e-4)
        assert not torch.equal(ref[0][keep], torch.zeros_like(ref[0][keep]))


def test_shrink_row_leaves_h_alone_without_an_adapter(kernels_on, monkeypatch):
    """Slot -1 (a base request) or a rank-0 slot: no program writes h (torch.empty's contents
    stay: NaN here), the epilogue never reads it."""
    x, a, ranks = _shrink_case(64, 3, 8, seed=1)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *s, **kw: real_empty(*s, **kw).fill_(float("nan")))
    for slot in (-1, 2):
        h = ops.shrink_row(x, a, torch.tensor([slot], dtype=torch.int32, device=DEVICE), ranks, num_slices=3,
                           max_rank=8, options=kernels_on)
        assert torch.isnan(h).all(), slot


def test_shrink_row_refuses_bad_input():
    x, a, ranks = _shrink_case(64, 1, 8, seed=2)
    slot = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    for args, match in [
        ((torch.cat([x, x]), a, slot, ranks), r"x must be \[1x\*\]"),
        ((x, a[:, :4], slot, ranks), r"weights must be \[\*x8x64\]"),
        ((x, a, slot.long(), ranks), r"slot must be int32 \[1\]"),
        ((x, a, slot, ranks[:2]), r"slot_ranks must be int32 \[3\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            ops.shrink_row(*args, num_slices=1, max_rank=8)


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the LoRA and epilogue kernels a forward launches, in order."""
    from lora import hook
    from rollout.kernels import fused, rotary, skinny

    names: list[str] = []
    for module, name in ((hook, "shrink_row"), (hook, "sgmv_shrink"), (hook, "sgmv_expand"),
                         (skinny, "linear_rope_kv"), (skinny, "linear_silu_mul"), (rotary, "rotary_embedding"),
                         (fused, "silu_and_mul")):
        real = getattr(module, name)

        def record(*a, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            names.append(_name + ("+term" if kw.get("low_rank") is not None else ""))
            return _real(*a, **kw)

        monkeypatch.setattr(module, name, record)
    return names


def _tiny_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_GPU:
        from rollout.kernels import skinny

        monkeypatch.setattr(skinny, "tiles_for", lambda n, k: skinny.Tiles(16, 32, 4))  # interpreter-sized


class _PoolAttention:
    """A one-token stand-in attention backend with a KV pool, so qkv's rotary epilogue (which
    only folds where there is a store to make) runs: it returns v, repeated over q's heads."""

    def __init__(self, n_kv: int, d: int) -> None:
        from rollout.kernels import KVTarget

        k, v = (torch.zeros(4, n_kv, d, device=DEVICE, dtype=DTYPE) for _ in range(2))
        self.target = KVTarget(k, v, torch.tensor([2], device=DEVICE))

    def kv_target(self, layer_id: int):
        return self.target

    def forward(self, q, k, v, layer_id, stored=False):
        assert stored
        group = q.shape[1] // self.target.v_cache.shape[1]
        return self.target.v_cache[2:3].repeat_interleave(group, dim=1) + q * 0.5


def _one_token(model, backend=None) -> torch.Tensor:
    if backend is None:
        return _forward(model, DEVICE, 1)
    ids = torch.tensor([5], device=DEVICE)
    with torch.inference_mode():
        return model(ids, torch.tensor([3], device=DEVICE), backend)


def test_one_token_forward_takes_the_epilogue_and_matches_the_halves_apart(kernels_on, monkeypatch, launched):
    """One token under each adapter: a shrink kernel per projection, no SGMV, the SiLU-mul and
    rotary epilogues with the term; the output within the roundings of the in-place expand's
    (which peft checks); a base row and a rank-0 slot bit-equal to the step without adapters."""
    _tiny_tiles(monkeypatch)
    model, pool = _model("LlamaForCausalLM", DTYPE, DEVICE, kernels_on)
    # the same model and adapters with the halves apart (the epilogue off)
    apart_model, apart_pool = _model("LlamaForCausalLM", DTYPE, DEVICE, replace(kernels_on, lora_one_row_epilogue=False))
    backend = lambda: _PoolAttention(model.config.num_kv_heads, model.config.head_dim)  # noqa: E731
    layers = model.config.num_layers
    pool.plan(None, active=False)
    base = _one_token(model, backend())
    assert launched == ["linear_rope_kv", "linear_silu_mul"] * layers
    for slot in (0, 1, -1, 2):  # ranks 8 and 4, a base row, a rank-0 slot
        pool.plan(_inputs([slot], DEVICE), active=True)
        launched.clear()
        fused = _one_token(model, backend())
        per_layer = ["shrink_row", "linear_rope_kv+term", "shrink_row", "shrink_row", "linear_silu_mul+term",
                     "shrink_row"]
        assert launched == per_layer * layers, slot
        apart_pool.plan(_inputs([slot], DEVICE), active=True)
        launched.clear()
        apart = _one_token(apart_model, backend())
        assert "shrink_row" not in launched and "sgmv_expand" in launched
        if slot in (-1, 2):
            assert torch.equal(fused, base), slot
        else:
            assert not torch.equal(fused, base), f"slot {slot}: the adapter changed nothing"
            scale = apart.float().abs().max()
            assert (fused.float() - apart.float()).abs().max() <= 2e-2 * scale, slot


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_gpu_graph_of_the_one_row_path_replays_any_adapter(monkeypatch, launched):
    """A one-token forward captured once under slot 0 replays under each slot (and a base row)
    equal to the eager forward under it, bit for bit."""
    model, pool = _model("LlamaForCausalLM", DTYPE, DEVICE)
    static = _inputs([0], DEVICE)
    with torch.inference_mode():
        pool.plan(static, active=True, concurrent=True)
        stream = torch.cuda.Stream(DEVICE)
        stream.wait_stream(torch.cuda.current_stream(DEVICE))
        with torch.cuda.stream(stream):
            _one_token(model)  # compile outside the capture
        torch.cuda.current_stream(DEVICE).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = _one_token(model)
    assert "shrink_row" in launched and "sgmv_shrink" not in launched
    for slot in (1, -1, 2, 0):
        static.seg_slots.copy_(_inputs([slot], DEVICE).seg_slots)
        static.seg_indptr.copy_(_inputs([slot], DEVICE).seg_indptr)
        graph.replay()
        pool.plan(_inputs([slot], DEVICE), active=True, concurrent=False)
        want = _one_token(model)
        pool.plan(static, active=True, concurrent=True)
        torch.testing.assert_close(out, want, rtol=0, atol=0)

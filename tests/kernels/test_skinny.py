"""The skinny matmul (rollout/kernels/skinny.py) against F.linear in fp32, and the model's
dispatch to it (`kernels.linear`).

On CPU the kernel runs under TRITON_INTERPRET=1 on tiny shapes (float16 and bfloat16; the
interpreter truncates to bf16 where a GPU rounds). The shapes leave a K tail, a K shorter
than one tile and a last row block past N, and the tiles are shrunk so that several
programs and K steps run.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout import kernels  # noqa: E402
from rollout.kernels import skinny  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
# (N, K): K a multiple of the tile and not, and shorter than one; N past the last row block
SHAPES = [(40, 96), (64, 256), (7, 33), (17, 200), (48, 128), (24, 16)]
SMALL = [skinny.Tiles(16, 32, 4), skinny.Tiles(4, 64, 2, 2)]  # interpreter-sized: several programs, K steps
DTYPES = [torch.float16, torch.bfloat16]


def _case(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _check(y: torch.Tensor, x, w, b) -> None:
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == ref.shape and y.dtype == x.dtype
    # fp32 accumulation in another order, then one rounding (the interpreter truncates
    # instead of rounding to nearest): within two units of the output dtype's last place
    ulp = torch.finfo(x.dtype).eps * ref.abs().clamp_min(1.0)
    assert ((y.float() - ref).abs() <= 2 * ulp).all(), (y.float() - ref).abs().max()


@pytest.mark.parametrize("n,k", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_fp32_linear(n, k, bias):
    for dtype in DTYPES:
        x, w, b = _case(1, n, k, dtype, bias)
        for tiles in SMALL + ([None] if GPU else []):  # the default tiles are GPU-sized
            _check(skinny.linear(x, w, b, tiles=tiles), x, w, b)


def test_a_row_of_a_wider_activation():
    """x may be a view into a wider row (a slice of the step's activations), as F.linear allows."""
    x = _case(1, 40, 192, torch.float16, False)[0][:, 32:128]
    w = _case(1, 24, 96, torch.float16, False, seed=1)[1]
    _check(skinny.linear(x, w, tiles=SMALL[0]), x, w, None)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x[:0], w), "0 rows"),
    (lambda x, w: (x.new_zeros(2, x.shape[1]), w), "2 rows"),
    (lambda x, w: (x.float(), w.float()), "float16 or bfloat16"),
    (lambda x, w: (x, w.to(torch.bfloat16 if w.dtype == torch.float16 else torch.float16)), "share"),
    (lambda x, w: (x[:, :-1], w), r"\[M, K\] and \[N, K\]"),
    (lambda x, w: (x, w.t().contiguous().t()), "weight contiguous"),
    (lambda x, w: (x.new_zeros(1, 2 * x.shape[1])[:, ::2], w), "last dim"),
])
def test_refuses_bad_input(bad, match):
    x, w, _ = _case(1, 32, 32, torch.float16, False)
    with pytest.raises(ValueError, match=match):
        skinny.linear(*bad(x, w))


def test_refuses_a_bias_of_the_wrong_shape():
    x, w, _ = _case(1, 32, 32, torch.float16, False)
    with pytest.raises(ValueError, match=r"bias \[32\]"):
        skinny.linear(x, w, torch.zeros(31, dtype=x.dtype, device=DEVICE))


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    if not GPU:
        monkeypatch.setattr(kernels, "enabled", True)  # route CPU tensors as CUDA ones (interpreter)
    return calls


def test_dispatch_takes_one_16_bit_row_only(spy, monkeypatch):
    """kernels.linear: the skinny kernel for one 16-bit row (last dim contiguous) and a
    contiguous weight on the fused path; F.linear otherwise. Equal to F.linear either way."""
    monkeypatch.setattr(skinny, "tiles_for", lambda n, k: SMALL[0])  # interpreter-sized
    x, w, b = _case(3, 24, 64, torch.float16, True)
    for dtype in DTYPES:
        _check(kernels.linear(x[:1].to(dtype), w.to(dtype), b.to(dtype)), x[:1].to(dtype), w.to(dtype), b.to(dtype))
    assert spy == [1, 1]
    _check(kernels.linear(x, w, b), x, w, b)  # 3 rows: F.linear
    kernels.linear(x[:1].float(), w.float(), b.float())  # fp32: cuBLAS (or the CPU's matmul)
    kernels.linear(x[:1], w.t().contiguous().t(), b)  # a strided weight
    strided = x.new_zeros(1, 2 * x.shape[1])[:, ::2]  # x strided in its last dim
    strided.copy_(x[:1])
    _check(kernels.linear(strided, w, b), x[:1], w, b)
    monkeypatch.setattr(kernels, "skinny_matmul", False)  # off
    kernels.linear(x[:1], w, b)
    assert spy == [1, 1]


def test_dispatch_leaves_the_cpu_path_alone(monkeypatch):
    """Unforced, CPU tensors never reach the kernel (and never import triton through it)."""
    monkeypatch.setattr(kernels, "enabled", None)
    monkeypatch.setattr(skinny, "linear", lambda *a, **kw: pytest.fail("skinny kernel on the CPU path"))
    x, w, b = (t.cpu() for t in _case(1, 24, 64, torch.float16, True))
    assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.skipif(not GPU, reason="the model's own matmuls through the kernel need a GPU (bf16)")
def test_model_logits_with_and_without_the_kernel(monkeypatch):
    """A tiny bf16 model's logits of one row: through the skinny kernel and through cuBLAS."""
    from rollout.model.build import build_model, init_random_weights
    from rollout.model.config import ModelConfig
    from rollout.model.shapes import SHAPES

    cfg = ModelConfig.from_dict(SHAPES["tiny"])
    model = build_model(cfg, 64, torch.bfloat16, torch.device("cuda"))
    init_random_weights(model, seed=0)
    h = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with_kernel = model.logits(h)
    monkeypatch.setattr(kernels, "skinny_matmul", False)
    ref = model.logits(h)
    assert calls == [1] and (with_kernel - ref).abs().max() <= 2e-2 * ref.abs().max()

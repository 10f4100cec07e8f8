"""The skinny matmul (rollout/kernels/skinny.py) against F.linear in fp32, and the model's
dispatch to it (`kernels.linear`).

On CPU the kernel runs under TRITON_INTERPRET=1 on tiny shapes (float16 and bfloat16; the
interpreter truncates to bf16 where a GPU rounds). The shapes leave a K tail, a K shorter
than one tile and a last row block past N, and the tiles are shrunk so that several
programs and K steps run.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout import kernels  # noqa: E402
from rollout.kernels import skinny  # noqa: E402
from rollout.kernels.low_rank import OneRow  # noqa: E402
from rollout.kernels.options import KernelOptions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
FUSED = KernelOptions(fused=None if GPU else True)  # on CPU: CPU tensors routed as CUDA ones (interpreter)
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
    return calls


def test_dispatch_takes_one_16_bit_row_only(spy, monkeypatch):
    """kernels.linear: the skinny kernel for one 16-bit row (last dim contiguous) and a
    contiguous weight on the fused path; F.linear otherwise. Equal to F.linear either way."""
    monkeypatch.setattr(skinny, "tiles_for", lambda n, k: SMALL[0])  # interpreter-sized
    x, w, b = _case(3, 24, 64, torch.float16, True)
    for dtype in DTYPES:
        _check(kernels.linear(x[:1].to(dtype), w.to(dtype), b.to(dtype), FUSED), x[:1].to(dtype), w.to(dtype),
               b.to(dtype))
    assert spy == [1, 1]
    _check(kernels.linear(x, w, b, FUSED), x, w, b)  # 3 rows: F.linear
    kernels.linear(x[:1].float(), w.float(), b.float(), FUSED)  # fp32: cuBLAS (or the CPU's matmul)
    kernels.linear(x[:1], w.t().contiguous().t(), b, FUSED)  # a strided weight
    strided = x.new_zeros(1, 2 * x.shape[1])[:, ::2]  # x strided in its last dim
    strided.copy_(x[:1])
    _check(kernels.linear(strided, w, b, FUSED), x[:1], w, b)
    kernels.linear(x[:1], w, b, replace(FUSED, skinny_matmul=False))  # off
    assert spy == [1, 1]


def test_dispatch_leaves_the_cpu_path_alone(monkeypatch):
    """Unforced (the default options), CPU tensors never reach the kernel (and never import
    triton through it)."""
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
    model, cublas = (build_model(cfg, 64, torch.bfloat16, torch.device("cuda"), options=KernelOptions(skinny_matmul=on))
                     for on in (True, False))
    init_random_weights(model, seed=0)
    init_random_weights(cublas, seed=0)
    h = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with_kernel = model.logits(h)
    ref = cublas.logits(h)
    assert calls == [1] and (with_kernel - ref).abs().max() <= 2e-2 * ref.abs().max()


# ------------------------------------------------- SiLU-mul as the gate_up GEMV's epilogue

# (2I, K): one pair of rows, an I that the tiles' pairs do not divide, a K tail
SILU_SHAPES = [(2, 16), (14, 33), (40, 96), (34, 200)]


@pytest.mark.parametrize("n,k", SILU_SHAPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_silu_mul_epilogue_is_the_gemv_then_the_silu_kernel(n, k, bias):
    """linear_silu_mul = skinny.linear, then fused.silu_and_mul, bit for bit (the same tiles, the
    same roundings: gate_up's output, SiLU's, the product's), on [1, I]."""
    from rollout.kernels import fused

    for dtype in DTYPES:
        x, w, b = _case(1, n, k, dtype, bias, seed=n)
        for tiles in SMALL + [skinny.Tiles(2, 32, 1)] + ([None] if GPU else []):
            y = skinny.linear_silu_mul(x, w, b, tiles=tiles)
            assert y.shape == (1, n // 2)
            assert torch.equal(y, fused.silu_and_mul(skinny.linear(x, w, b, tiles=tiles))), (dtype, tiles)


def test_silu_mul_epilogue_refuses_odd_rows_and_tiles():
    x, w, _ = _case(1, 15, 32, torch.float16, False)
    with pytest.raises(ValueError, match="even number of rows"):
        skinny.linear_silu_mul(x, w)
    with pytest.raises(ValueError, match="block_n must be even"):
        skinny.linear_silu_mul(x, w[:14], tiles=skinny.Tiles(3, 32, 1))
    with pytest.raises(ValueError, match="2 rows"):
        skinny.linear_silu_mul(torch.cat([x, x]), w[:14])


class _NoDelta:
    """An adapter hook (lora/hook.py's protocol) with nothing to add: no adapter in the step."""

    def begin(self, x, defer):
        return None

    def finish(self, pending, out):
        return None

    def one_row(self, x):
        return OneRow()


class _Apart(_NoDelta):
    """An adapter hook whose kernels run apart from the matmul even at one row."""

    def one_row(self, x):
        return None


def _tiny_fp16_model(options: KernelOptions = FUSED):
    """The tiny model in fp16 (the same weights every time), built with `options`."""
    from rollout.model.build import build_model, init_random_weights
    from rollout.model.config import ModelConfig
    from rollout.model.shapes import SHAPES as MODEL_SHAPES

    cfg = ModelConfig.from_dict(MODEL_SHAPES["tiny"])
    model = build_model(cfg, 64, torch.float16, torch.device(DEVICE), options=options)
    init_random_weights(model, seed=0)
    return model, cfg


def _tiny_fp16_layer(monkeypatch, watched) -> tuple:
    """(the tiny model in fp16 with interpreter-sized GEMV tiles, its layer 0, its config, the
    list that each call of the `watched` (module, name) kernels appends its name to)."""
    monkeypatch.setattr(skinny, "tiles_for", lambda n, k: SMALL[0])  # interpreter-sized
    model, cfg = _tiny_fp16_model()
    launched: list[str] = []
    for mod, name in watched:
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **kw: launched.append(_n) or _r(*a, **kw))
    return model, model.layers[0], cfg, launched


def test_the_mlp_runs_silu_mul_in_the_gate_up_gemv(spy, monkeypatch):
    """A tiny fp16 model's MLP at one row: no SiLU-mul launch, the gate_up GEMV's epilogue
    instead, and the same output as the two kernels apart; not with an adapter on gate_up (its
    delta is added to gate_up before SiLU, unless its term rides in the GEMV: lora/hook.py
    one_row), nor for two rows or with the switch off."""
    from rollout.kernels import fused

    _, layer, cfg, launched = _tiny_fp16_layer(monkeypatch, ((fused, "silu_and_mul"), (skinny, "linear_silu_mul")))
    mlp = layer.mlp
    apart = _tiny_fp16_model(replace(FUSED, silu_epilogue=False))[0].layers[0].mlp  # the same weights
    x = _case(2, 8, cfg.hidden_size, torch.float16, False, seed=7)[0]

    def run(rows: torch.Tensor, mlp=mlp) -> tuple[torch.Tensor, list[str]]:
        launched.clear()
        with torch.inference_mode():
            out, delta = mlp(rows)
        assert delta is None
        return out, list(launched)

    out, kernels_run = run(x[:1])
    assert kernels_run == ["linear_silu_mul"]
    ref, kernels_run = run(x[:1], apart)  # the epilogue off
    assert kernels_run == ["silu_and_mul"] and torch.equal(out, ref)
    assert run(x)[1] == ["silu_and_mul"]  # two rows: cuBLAS (here the CPU's matmul), then the kernel
    mlp.gate_up_proj.lora = _Apart()
    assert run(x[:1])[1] == ["silu_and_mul"]
    mlp.gate_up_proj.lora = _NoDelta()  # an adapter hook with no adapter in the step
    assert run(x[:1])[1] == ["linear_silu_mul"]


# ----------------------------------------- the rotary and the K/V store as qkv's epilogue

# (q heads, kv heads, head_dim, K): GQA, a head count whose pairs the tiles do not divide and
# an odd half head, MHA, a head wider than a program's pairs; K tails
ROPE_SHAPES = [(4, 2, 8, 40), (3, 1, 6, 33), (2, 2, 4, 16), (2, 1, 16, 72)]
SLOTS = 9


# (dtype, tiles, (position, slot, index dtype)) of each call. A GPU runs every combination; the
# interpreter (seconds a launch) runs a table in which each dtype, tile shape and end of the
# position and slot ranges appears, since none of them depends on another.
_ROPE_TILES = SMALL + [skinny.Tiles(2, 32, 1)]
_ROPE_ENDS = [(0, 0, torch.int64), (47, SLOTS - 1, torch.int32)]
ROPE_RUNS = ([(dt, t, e) for dt in DTYPES for t in _ROPE_TILES + [None] for e in _ROPE_ENDS] if GPU else
             [(DTYPES[0], _ROPE_TILES[0], _ROPE_ENDS[0]), (DTYPES[1], _ROPE_TILES[1], _ROPE_ENDS[1]),
              (DTYPES[1], _ROPE_TILES[2], _ROPE_ENDS[0]), (DTYPES[0], _ROPE_TILES[2], _ROPE_ENDS[1])])


def _rope_case(n_q: int, n_kv: int, d: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    x, w, b = _case(1, (n_q + 2 * n_kv) * d, k, dtype, bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    freqs = torch.outer(torch.arange(48).float(), torch.rand(d // 2, generator=g) + 0.1)
    caches = torch.randn(2, SLOTS, n_kv, d, generator=g).to(DEVICE, dtype)
    return x, w, b, freqs.cos().to(DEVICE), freqs.sin().to(DEVICE), caches


def _ints(v: int, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor([v], dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("n_q,n_kv,d,k", ROPE_SHAPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_rope_kv_epilogue_is_the_gemv_then_the_rotary_with_its_store(n_q, n_kv, d, k, bias):
    """linear_rope_kv = skinny.linear, then rotary.rotary_embedding storing k and v, bit for bit:
    the same qkv row (q and k rotated, v as it is) and the same caches, where nothing but the
    token's slot is written."""
    from rollout.kernels import rotary

    for dtype, tiles, (pos, slot, int_dtype) in ROPE_RUNS:
        x, w, b, cos, sin, caches = _rope_case(n_q, n_kv, d, k, dtype, bias, seed=n_q * d + k)
        kc, vc = caches[0].clone(), caches[1].clone()
        rope = skinny.RopeKV(cos, sin, _ints(pos, int_dtype), kc, vc, _ints(slot, int_dtype), n_q, n_kv)
        y = skinny.linear_rope_kv(x, w, b, rope, tiles=tiles)
        qkv = skinny.linear(x, w, b, tiles=tiles)
        q, kk, v = qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1)
        ref_kc, ref_vc = caches[0].clone(), caches[1].clone()
        q, kk = rotary.rotary_embedding(q.view(1, n_q, d), kk.view(1, n_kv, d), cos, sin, _ints(pos),
                                        v=v.view(1, n_kv, d), k_cache=ref_kc, v_cache=ref_vc,
                                        slots=_ints(slot))
        case = (dtype, tiles, pos, slot)
        assert y.shape == qkv.shape and torch.equal(y, torch.cat([q.flatten(), kk.flatten(), v.flatten()]).view(1, -1)), case
        assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc), case
        others = torch.arange(SLOTS, device=DEVICE) != slot
        assert torch.equal(kc[others], caches[0][others]) and torch.equal(vc[others], caches[1][others]), case


def test_rope_kv_epilogue_refuses_bad_input():
    x, w, b, cos, sin, caches = _rope_case(4, 2, 8, 40, torch.float16, False, seed=3)
    kc, vc = caches[0].clone(), caches[1].clone()

    def rope(**kw):
        args = dict(cos=cos, sin=sin, positions=_ints(3), k_cache=kc, v_cache=vc, slots=_ints(1), n_q_heads=4,
                    n_kv_heads=2)
        return skinny.RopeKV(**{**args, **kw})

    for bad, match in [
        (dict(n_kv_heads=3), "rows, expected"),
        (dict(cos=cos.half()), "fp32"),
        (dict(sin=sin[:, :2]), "fp32"),
        (dict(k_cache=kc[:, :1]), "k_cache must be"),
        (dict(v_cache=vc.transpose(1, 2)), "v_cache must be"),
        (dict(positions=_ints(3).repeat(2)), "positions must be int"),
        (dict(slots=_ints(1).float()), "slots must be int"),
    ]:
        with pytest.raises(ValueError, match=match):
            skinny.linear_rope_kv(x, w, b, rope(**bad))
    with pytest.raises(ValueError, match="block_n must be even"):
        skinny.linear_rope_kv(x, w, b, rope(), tiles=skinny.Tiles(3, 32, 1))
    with pytest.raises(ValueError, match="2 rows"):
        skinny.linear_rope_kv(torch.cat([x, x]), w, b, rope())
    assert torch.equal(kc, caches[0]) and torch.equal(vc, caches[1])  # a refused call writes nothing


class _PoolBackend:
    """A stand-in attention backend with a KV pool: the rotary (or qkv's epilogue) stores the
    step's K/V at `slots`; forward returns q (what attention reads is the pool, checked apart)."""

    def __init__(self, n_kv: int, d: int, dtype: torch.dtype, rows: int) -> None:
        from rollout.kernels import KVTarget

        g = torch.Generator().manual_seed(5)
        caches = torch.randn(2, SLOTS, n_kv, d, generator=g).to(DEVICE, dtype)
        self.target = KVTarget(caches[0], caches[1], torch.arange(3, 3 + rows, device=DEVICE))
        self.stored: list[bool] = []

    def kv_target(self, layer_id: int):
        return self.target

    def forward(self, q, k, v, layer_id, stored=False):
        assert stored
        self.stored.append(stored)
        return q


def test_attention_runs_the_rotary_in_the_qkv_gemv(spy, monkeypatch):
    """A tiny fp16 model's attention at one row: no rotary launch, qkv's epilogue instead, with
    the same output and the same pool; not for two rows, with an adapter on qkv whose kernels
    run apart, with q/k norms
    (Qwen3: they come between the projection and the rotary), or with the switch off."""
    from rollout.kernels import rotary

    model, layer, cfg, launched = _tiny_fp16_layer(monkeypatch, ((rotary, "rotary_embedding"),
                                                                 (skinny, "linear_rope_kv")))
    attn = layer.self_attn
    apart, _ = _tiny_fp16_model(replace(FUSED, rope_epilogue=False))  # the same weights
    x = _case(2, 8, cfg.hidden_size, torch.float16, False, seed=7)[0]
    positions = torch.tensor([11, 12], device=DEVICE)

    def run(rows: int, model=model) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], list[str]]:
        launched.clear()
        attention = model.layers[0].self_attn
        backend = _PoolBackend(attention.num_kv_heads, attention.head_dim, torch.float16, rows)
        with torch.inference_mode():
            out, delta = attention(x[:rows], positions[:rows], model.rotary, backend)
        assert delta is None and backend.stored == [True]
        return out, (backend.target.k_cache, backend.target.v_cache), list(launched)

    out, pool, kernels_run = run(1)
    assert kernels_run == ["linear_rope_kv"]
    ref, ref_pool, kernels_run = run(1, apart)  # the epilogue off
    assert kernels_run == ["rotary_embedding"] and torch.equal(out, ref)
    assert torch.equal(pool[0], ref_pool[0]) and torch.equal(pool[1], ref_pool[1])
    assert run(2)[2] == ["rotary_embedding"]  # two rows: the matmul, then the rotary
    attn.qkv_proj.lora = _Apart()
    assert run(1)[2] == ["rotary_embedding"]
    attn.qkv_proj.lora = _NoDelta()
    assert run(1)[2] == ["linear_rope_kv"]
    attn.qkv_proj.lora = None
    attn.q_norm = attn.k_norm = layer.input_layernorm.__class__(attn.head_dim, 1e-6, FUSED).to(DEVICE, torch.float16)
    assert run(1)[2] == ["rotary_embedding"]


class _AdapterBeside:
    """An adapter hook whose begin() launched work that (concurrent) runs beside the matmul."""

    def __init__(self, concurrent: bool) -> None:
        self.concurrent = concurrent

    def begin(self, x, defer):
        return "pending"

    def finish(self, pending, out):
        assert pending == "pending"
        return None

    def one_row(self, x):
        return None


def test_a_projection_leaves_the_sms_to_adapter_kernels_beside_it(spy):
    """One row with an adapter's kernels on the side stream (the halves apart,
    KernelOptions.lora_one_row_epilogue = False): cuBLAS (F.linear), not the skinny GEMV, which launched
    early would hold every SM first. In order, or with no adapter in the step: the GEMV as
    always. The same output every way, within the matmuls' rounding."""
    from rollout.model.llama import Linear

    x, w, b = _case(1, 24, 64, torch.float16, True)
    proj = Linear(64, 24, bias=True, options=FUSED).to(DEVICE, torch.float16)
    with torch.no_grad():
        proj.weight.copy_(w)
        proj.bias.copy_(b)
    proj.lora = _AdapterBeside(concurrent=True)
    _check(proj(x), x, w, b)
    assert spy == []
    proj.lora = _AdapterBeside(concurrent=False)
    _check(proj(x), x, w, b)
    proj.lora = _NoDelta()  # no adapter in the step
    _check(proj(x), x, w, b)
    assert spy == [1, 1]

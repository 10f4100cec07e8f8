"""Fused Triton kernels (rollout.kernels.fused) against their torch twins in
rollout.model.llama: RMSNorm (+ residual add), SiLU-and-mul, and a tiny model forward with
the fused path forced on (the rotary and the KV store included; their own tests are in
test_rotary.py).

On CPU the kernels run under TRITON_INTERPRET=1 in float32 and float16. The interpreter
truncates fp32 -> bf16 instead of rounding to nearest, so bf16 gets only a loose smoke test
there; the exact bf16 checks run on a GPU (same file, `DEVICE == "cuda"`).

Tolerances (16-bit dtypes, in units in the last place (ulp) of the reference element):
* rms_norm: <= 2 ulp. The fp32 mean of squares may differ from torch's in the last bits
  (another summation order), which can flip the rounding of the normalized value to the
  dtype by 1 ulp; times a weight of magnitude < 2 and the final rounding, <= 2 ulp.
* silu_and_mul: <= 3 ulp. exp() may differ from torch's in the last fp32 bits, which can
  flip silu's rounding to the dtype by 1 ulp; times `up` (up to 2 ulp of the product) and
  the final rounding, <= 3 ulp.
Both flips are rare: fewer than 1% of elements may differ at all (a systematic rounding
error, e.g. truncation instead of round-to-nearest, differs in about half of them).
float32: 1e-6 relative. (The rotary: bit-identical in every dtype, test_rotary.py.)
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
pytest.importorskip("triton", reason="triton is not installed")

from rollout import kernels  # noqa: E402
from rollout.kernels import fused, rotary  # noqa: E402
from rollout.kernels.options import KernelOptions  # noqa: E402
from rollout.model.config import ModelConfig  # noqa: E402
from rollout.model.llama import LlamaModel, with_delta  # noqa: E402
from ulp_checks import DEVICE, ON_GPU, assert_matches, poisoned_outputs  # noqa: E402

# bf16 is exact only on a GPU (see the module docstring); fp16/fp32 everywhere.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
EPS = 1e-6


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # transformers' LlamaRMSNorm (what llama.RMSNorm's 16-bit path computes)
    r = x if residual is None else residual + x
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(r.dtype), r


def _weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(n, device=DEVICE)).clamp(-1.9, 1.9).to(dtype)  # |w| < 2: see tolerances


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    res = torch.randn(tokens, hidden, device=DEVICE).to(dtype) if with_residual else None
    w = _weight(hidden, dtype)
    x0, res0 = x.clone(), None if res is None else res.clone()
    with poisoned_outputs():
        got = fused.rms_norm(x, w, EPS, residual=res)
    ref_out, ref_res = _torch_rms_norm(x, w, res)
    if res is None:
        assert isinstance(got, torch.Tensor)
        out = got
    else:
        out, new_res = got
        assert_matches(new_res, ref_res, max_ulps=0)  # one add, rounded once: exact
        assert torch.equal(res, res0), "residual must not be modified"
    assert torch.equal(x, x0), "x must not be modified"
    if dtype == torch.float32:  # llama.RMSNorm's fp32 path is F.rms_norm
        assert_matches(out, F.rms_norm(ref_res, (hidden,), w, EPS), max_ulps=1)
    assert_matches(out, ref_out, max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_wide_rows_in_chunks(dtype: torch.dtype) -> None:
    # wider than one register tile (8192): the two-pass chunked path, non-multiple width
    tokens, hidden = 3, 9000
    x, res = (torch.randn(tokens, hidden, device=DEVICE).to(dtype) for _ in range(2))
    w = _weight(hidden, dtype)
    with poisoned_outputs():
        out, new_res = fused.rms_norm(x, w, EPS, residual=res)
    ref_out, ref_res = _torch_rms_norm(x, w, res)
    assert_matches(new_res, ref_res, max_ulps=0)
    assert_matches(out, ref_out, max_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_strided_heads(dtype: torch.dtype) -> None:
    # Qwen3's q/k norm: [T, H, D] views of the fused qkv output, normalized per head.
    tokens, heads, kv_heads, dim = 7, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    q = qkv[:, : heads * dim].reshape(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    w = _weight(dim, dtype)
    for x in (q, k):
        with poisoned_outputs():
            out = fused.rms_norm(x, w, EPS)
        assert_matches(out, _torch_rms_norm(x, w, None)[0], max_ulps=2)


# ------------------------------------------------------------------------- SiLU * up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 576, 1000])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_silu_and_mul(tokens: int, inter: int, dtype: torch.dtype) -> None:
    gate_up = (2.0 * torch.randn(tokens, 2 * inter, device=DEVICE)).to(dtype)
    x0 = gate_up.clone()
    with poisoned_outputs():
        out = fused.silu_and_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    assert torch.equal(gate_up, x0)
    assert_matches(out, F.silu(gate) * up, max_ulps=3)


# ------------------------------------------------------- deferred adapter deltas (lora/hook.py)
# A kernel given an fp32 delta must compute exactly what it computes on with_delta(input,
# delta): the input the in-place expand would have left (one rounding of input + delta).


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 9000])  # 9000: the wide-row path (two passes over chunks)
def test_rms_norm_adds_a_delta_on_load(hidden: int, dtype: torch.dtype) -> None:
    x, res = (torch.randn(6, hidden, device=DEVICE).to(dtype) for _ in range(2))
    delta = torch.randn(6, hidden, device=DEVICE)
    w = _weight(hidden, dtype)
    with poisoned_outputs():
        out, new_res = fused.rms_norm(x, w, EPS, residual=res, delta=delta)
    want_out, want_res = fused.rms_norm(with_delta(x, delta), w, EPS, residual=res)
    assert torch.equal(out, want_out) and torch.equal(new_res, want_res)
    assert not torch.equal(out, fused.rms_norm(x, w, EPS, residual=res)[0]), "the delta was not added"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_adds_a_delta_on_load(dtype: torch.dtype) -> None:
    gate_up = torch.randn(5, 2 * 1100, device=DEVICE).to(dtype)  # 1100: two column blocks, the last ragged
    delta = torch.randn(5, 2 * 1100, device=DEVICE)
    with poisoned_outputs():
        out = fused.silu_and_mul(gate_up, delta=delta)
    assert torch.equal(out, fused.silu_and_mul(with_delta(gate_up, delta)))
    assert not torch.equal(out, fused.silu_and_mul(gate_up))


def test_deltas_are_checked() -> None:
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    for bad in (torch.zeros(3, 64, dtype=torch.float16, device=DEVICE), torch.zeros(3, 65, device=DEVICE),
                torch.zeros(64, 3, device=DEVICE).T):
        with pytest.raises(ValueError, match="delta must be a contiguous float32"):
            fused.rms_norm(x, w, EPS, residual=x, delta=bad)
        with pytest.raises(ValueError, match="delta must be a contiguous float32"):
            fused.silu_and_mul(torch.randn(3, 64, device=DEVICE), delta=bad)


# ------------------------------------------------------------ bf16 smoke (interpreter)


@pytest.mark.skipif(ON_GPU, reason="on a GPU bf16 is in the exact tests")
def test_bf16_smoke_in_interpreter() -> None:
    # The interpreter truncates fp32 -> bf16 (no round-to-nearest), so this checks only the
    # bf16 plumbing (loads, stores, dtype dispatch) with a tolerance of a few bf16 ulps.
    bf16, tol = torch.bfloat16, dict(rtol=0.05, atol=0.05)
    x, res = torch.randn(7, 576).to(bf16), torch.randn(7, 576).to(bf16)
    w = _weight(576, bf16)
    out, new_res = fused.rms_norm(x, w, EPS, residual=res)
    ref_out, ref_res = _torch_rms_norm(x, w, res)
    torch.testing.assert_close(new_res, ref_res, **tol)
    torch.testing.assert_close(out, ref_out, **tol)
    gate_up = torch.randn(7, 2000).to(bf16)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), F.silu(gate_up[:, :1000]) * gate_up[:, 1000:], **tol)


# ------------------------------------------------------------------- argument checks


def test_rejects_bad_arguments() -> None:
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, torch.ones(32, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused.rms_norm(x, torch.ones(64, device=DEVICE), EPS, residual=x.half())
    with pytest.raises(ValueError, match="contiguous"):
        fused.rms_norm(torch.randn(64, 4, device=DEVICE).t(), torch.ones(64, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="even"):
        fused.silu_and_mul(torch.randn(4, 63, device=DEVICE))


# ----------------------------------------------------------------- tiny model forward


class _CausalAttention:
    """A stand-in attention backend: one sequence, causal, GQA by repeating kv heads."""

    def kv_target(self, layer_id: int) -> None:
        return None  # no pool: forward gets k and v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                stored: bool = False) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        return out.transpose(0, 1)


def _tiny_model(arch: str, dtype: torch.dtype, fused_on: bool) -> LlamaModel:
    """The same weights every time; `fused_on`: the kernels (on CPU tensors too, interpreted)
    or the torch path (on a GPU too)."""
    cfg = ModelConfig.from_dict({
        "architectures": [arch], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": EPS, "rope_theta": 10000.0, "tie_word_embeddings": False,
    })
    model = LlamaModel(cfg, max_positions=256, options=KernelOptions(fused=fused_on))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    model.to(DEVICE)
    for p in model.parameters():  # weights in the model dtype; rope tables stay fp32 (as the engine does)
        p.data = p.data.to(dtype)
    return model


def _forward(model: LlamaModel) -> torch.Tensor:
    ids = torch.arange(11, device=DEVICE) * 7 % model.config.vocab_size
    positions = torch.arange(11, device=DEVICE) + 3
    with torch.inference_mode():
        return model(ids, positions, _CausalAttention())  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_model_forward_fused_matches_torch(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Llama: plain; Qwen2: qkv bias; Qwen3: q/k norm on strided [T, H, D] views.
    calls: dict[str, int] = {}
    for module, name in ((fused, "rms_norm"), (fused, "silu_and_mul"), (rotary, "rotary_embedding")):
        real: Callable[..., object] = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    ref = _forward(_tiny_model(arch, torch.float32, False))
    assert not calls, "the torch path must not call the kernels"
    model = _tiny_model(arch, torch.float32, True)
    got = _forward(model)
    layers = model.config.num_layers
    norms = 2 * layers + 1 + (2 * layers if model.config.qk_norm else 0)
    assert calls == {"rms_norm": norms, "silu_and_mul": layers, "rotary_embedding": layers}
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_cpu_path_is_the_default() -> None:
    assert not kernels.use_fused(torch.zeros(2))  # CPU tensors: the torch path
    assert kernels.use_fused(torch.zeros(2, device=DEVICE)) == ON_GPU
    assert not kernels.use_fused(torch.zeros(2, dtype=torch.float64, device=DEVICE))  # unsupported dtype


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (bf16 is not exact in the interpreter)")
def test_model_forward_fused_bf16_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16: the kernels round where torch rounds, so only rare 1-ulp flips separate the two
    # paths; over two layers these stay at the bf16 noise level.
    ref = _forward(_tiny_model("Qwen3ForCausalLM", torch.bfloat16, False)).float()
    got = _forward(_tiny_model("Qwen3ForCausalLM", torch.bfloat16, True)).float()
    torch.testing.assert_close(got, ref, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("hidden", [4096, 8192, 16384])
def test_real_shapes_bf16_gpu(hidden: int) -> None:
    # H200-sized rows: decode batch of 256, Llama-3-8B-like MLP/heads, chunked norm at 16384.
    bf16, tokens = torch.bfloat16, 256
    x, res = (torch.randn(tokens, hidden, device=DEVICE).to(bf16) for _ in range(2))
    w = _weight(hidden, bf16)
    out, new_res = fused.rms_norm(x, w, EPS, residual=res)
    ref_out, ref_res = _torch_rms_norm(x, w, res)
    assert_matches(new_res, ref_res, max_ulps=0)
    assert_matches(out, ref_out, max_ulps=2)
    gate_up = (2.0 * torch.randn(tokens, 2 * 14336, device=DEVICE)).to(bf16)
    assert_matches(fused.silu_and_mul(gate_up), F.silu(gate_up[:, :14336]) * gate_up[:, 14336:], max_ulps=3)

"""Shared by the weightsync tests, and importable by spawned child processes.

Kept free of transformers/peft imports at module level: a spawned child imports this
module, and each of those imports costs seconds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class FakeEngine:
    """Stands in for the engine: consumes the whole stream (validate-then-apply), records it."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.updates: list[tuple[list[tuple[str, torch.Tensor]], bool]] = []
        self.version = 0
        self.fail_after = fail_after

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, full: bool = False) -> int:
        received = []
        for name, tensor in named_tensors:
            if self.fail_after is not None and len(received) >= self.fail_after:
                raise ValueError(f"fake engine rejects {name!r}")
            # Copy, as a real engine must: the sender may reuse or free what it lent us.
            received.append((name, tensor.detach().clone()))
        self.updates.append((received, full))
        self.version += 1
        return self.version

    @property
    def last(self) -> list[tuple[str, torch.Tensor]]:
        return self.updates[-1][0]


def tiny_llama(*, tie: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).to(dtype)


def assert_same_tensors(received: list[tuple[str, torch.Tensor]], expected: list[tuple[str, torch.Tensor]]) -> None:
    assert [name for name, _ in received] == [name for name, _ in expected]
    for (name, got), (_, want) in zip(received, expected):
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert torch.equal(
            got.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
            want.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        ), f"{name} differs"


def tiny_hf_like(*, seed: int = 0) -> torch.nn.Module:
    """A Llama-shaped stand-in (same parameter names, tied lm_head) without transformers.

    For spawned children, where importing transformers would cost ~3 s per process.
    """
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(32, 32, bias=False)
            self.k_proj = nn.Linear(32, 16, bias=False)
            self.v_proj = nn.Linear(32, 16, bias=False)
            self.o_proj = nn.Linear(32, 32, bias=False)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = Attention()
            self.input_layernorm = nn.RMSNorm(32)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            attn = self.self_attn
            mixed = attn.q_proj(hidden) + attn.o_proj(hidden) + attn.k_proj(hidden).repeat(1, 1, 2) + attn.v_proj(hidden).repeat(1, 1, 2)
            return self.input_layernorm(hidden + mixed)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(128, 32)
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.norm = nn.RMSNorm(32)

    class ForCausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Decoder()
            self.lm_head = nn.Linear(32, 128, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight  # tied, as with tie_word_embeddings

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            hidden = self.model.embed_tokens(input_ids)
            for layer in self.model.layers:
                hidden = layer(hidden)
            return self.lm_head(self.model.norm(hidden))

    torch.manual_seed(seed)
    return ForCausalLM()


def fsdp_unsupported_reason() -> str | None:
    """Why FSDP2 cannot run here (None: it can): it needs fully_shard and gloo."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as error:
        return f"torch.distributed.fsdp.fully_shard is unavailable: {error}"
    if not torch.distributed.is_gloo_available():
        return "torch was built without gloo"
    return None

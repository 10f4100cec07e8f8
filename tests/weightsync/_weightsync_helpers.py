"""Shared by the weightsync tests, and importable by spawned child processes.

Kept free of transformers/peft imports at module level: a spawned child imports this
module, and each of those imports costs seconds.
"""

from __future__ import annotations

import socket
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

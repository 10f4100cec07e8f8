"""The compiled peer of `benchmarks.rollout --peer` runs the same model as transformers: its
step-by-step logits match a full HF forward, and its greedy tokens HF's generate (CPU,
float32, eager: torch.compile only wraps this step on a GPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyModel, make_prompts
from benchmarks.common.compiled_peer import PeerDecoder, time_decode, weights_from_hf
from rollout.model.config import ModelConfig


@pytest.mark.parametrize("kind", ["llama", "llama3"])  # GQA 4/2; MHA with Llama-3 rope scaling and tied embeddings
def test_peer_logits_and_greedy_tokens_match_transformers(kind: str, tmp_path) -> None:
    model = TinyModel(kind, tmp_path)
    prompts = make_prompts(model.vocab_size, [9, 9], seed=3)  # lockstep rows: equal lengths
    new = 8
    expected = [model.greedy(p, new) for p in prompts]
    cfg = ModelConfig.from_dir(model.path)
    peer = PeerDecoder(cfg, weights_from_hf(model.hf), batch=2, max_len=9 + new)
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        for pos in range(9 + new - 1):
            tokens = torch.tensor([s[pos] for s in seqs])
            logits = peer.step(tokens, torch.tensor([pos]))
            ref = model.hf(torch.tensor([s[: pos + 1] for s in seqs])).logits[:, -1].float()
            torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
            if pos >= 8:  # past the prompt: the peer's own greedy choice
                for s, t in zip(seqs, logits.argmax(-1).tolist()):
                    s.append(t)
    assert [s[9:] for s in seqs] == expected


def test_time_decode_runs_eager_on_cpu() -> None:
    from rollout.model.shapes import SHAPES

    t = time_decode(SHAPES["tiny"], batch=3, start=5, steps=4, device=torch.device("cpu"), dtype=torch.float32,
                    compile=False)
    assert (t.batch, t.start, t.steps) == (3, 5, 4) and t.seconds > 0 and t.tok_s == pytest.approx(12 / t.seconds)

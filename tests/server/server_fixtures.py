"""Fixtures for the engine process: the tiny Llama with a character tokenizer (so prompts=,
text and stop strings can be checked), one launched engine process shared by the tests, and
an in-process Engine of the same configuration as the reference.

Not a conftest.py: tests/ has no packages, and a second module named `conftest` would
shadow tests/conftest.py for every `from conftest import ...` collected after it. Test
modules import these fixtures by name; the engine process is one per test session however
many modules import it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from conftest import TinyModel
from rollout import Engine, EngineConfig

# The shared engine process: LoRA on (the adapter tests use it; base requests run the same
# either way), one intra-op thread (the test process has the others; results do not depend
# on it), a 1 s client timeout (test_faults_client_death.py: a stopped client), a 1 MiB header
# cap (test_faults_wire.py: an oversized header).
ENGINE = dict(enable_lora=True, max_loras_per_batch=4, max_lora_rank=16)
SERVER_ARGS = ["--client-timeout-s", "1.0", "--max-header-bytes", str(1 << 20), "--log-level", "WARNING"]
_shared: dict[str, object] = {}  # one of each per session, whichever module asks first


def add_char_tokenizer(path: Path, vocab_size: int) -> None:
    """A tokenizer of `vocab_size` tokens: printable ASCII one character each, then letter
    pairs (the model may emit them; text prompts encode character by character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    pairs = [a + b for a in "etaoinshrdlu" for b in "etaoinshrdlu"]
    vocab = {token: i for i, token in enumerate((chars + pairs)[:vocab_size])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="~"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(path))


@pytest.fixture(scope="session")
def text_model(llama: TinyModel, tmp_path_factory) -> TinyModel:
    """The session's tiny Llama, copied with a tokenizer beside it."""
    if "text_model" in _shared:
        return _shared["text_model"]
    path = tmp_path_factory.mktemp("llama_text") / "model"
    shutil.copytree(llama.path, path)
    add_char_tokenizer(path, llama.vocab_size)
    copy = TinyModel.__new__(TinyModel)
    copy.__dict__.update(llama.__dict__, path=str(path))
    _shared["text_model"] = copy
    return copy


@pytest.fixture(scope="session")
def server(text_model: TinyModel, request):
    from rollout.server import RolloutClient

    if "server" not in _shared:
        client = RolloutClient.launch(text_model.path, server_args=SERVER_ARGS, num_threads=1, **ENGINE)
        _shared["server"] = client
        request.session.config.add_cleanup(client.close)
    return _shared["server"]


@pytest.fixture(scope="session")
def reference(text_model: TinyModel) -> Engine:
    if "reference" not in _shared:
        # one intra-op thread, as the server: a 2-thread fp32 matmul may split its sums
        # differently on some CPUs (AMD EPYC here), and the comparisons are bitwise
        _shared["reference"] = Engine(EngineConfig(model=text_model.path, num_threads=1, **ENGINE))
    return _shared["reference"]


def same_output(got, want, *, exact_logprobs: bool = True) -> None:
    """Equal in everything but the request id and the prefix-cache hits (the two engines
    have served different requests before). Log-probs are bit-equal when both engines ran
    the request in the same batches (a generate call against a generate call, the same
    prefix hits). Otherwise (requests added one by one, a prefix hit on one side only) the
    tokens are still equal, seeded per request, but a matmul over a different number of rows
    may round differently: then pass exact_logprobs=False (or differ in prefix hits) and they
    are compared to 1e-5."""
    import dataclasses

    skip = {"request_id", "num_cached_tokens"}
    if not exact_logprobs or got.num_cached_tokens != want.num_cached_tokens:
        skip |= {"logprobs", "top_logprobs"}
        assert got.logprobs == pytest.approx(want.logprobs, rel=1e-5, abs=1e-5), "logprobs"
        if want.top_logprobs is not None:
            assert [[t for t, _ in row] for row in got.top_logprobs] == [[t for t, _ in row] for row in want.top_logprobs]
    for f in dataclasses.fields(want):
        if f.name not in skip:
            assert getattr(got, f.name) == getattr(want, f.name), f.name


def wait_idle(server, timeout_s: float = 10.0):
    """The engine's stats once nothing runs or waits (aborts land within a loop turn)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)

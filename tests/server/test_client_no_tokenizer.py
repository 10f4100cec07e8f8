"""An engine process on a checkpoint without tokenizer files (an engine of this module's
own): token ids in and out, text None, as in-process; text prompts and stop strings are
refused with the in-process errors."""

from __future__ import annotations

import pytest
from conftest import TinyModel, make_prompts
from server_fixtures import same_output

from rollout import Engine, EngineConfig, SamplingParams
from rollout.server import RolloutClient

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def bare(llama: TinyModel):
    client = RolloutClient.launch(llama.path, server_args=["--log-level", "WARNING"], num_threads=1)
    yield client, Engine(EngineConfig(model=llama.path, num_threads=1))  # the same thread count: the same fp32 sums
    client.close()


def test_token_ids_in_and_out(bare, llama) -> None:
    client, reference = bare
    assert not client.model_info().has_tokenizer and reference.tokenizer is None
    prompts = make_prompts(llama.vocab_size, [4, 9], seed=90)
    outs = client.generate(input_ids=prompts, sampling_params=SAMPLED)
    for got, want in zip(outs, reference.generate(input_ids=prompts, sampling_params=SAMPLED), strict=True):
        same_output(got, want)
        assert got.text is None
    deltas = list(client.stream(prompts[0], SAMPLED))
    for i in range(2):
        mine = [d for d in deltas if d.request_id.endswith(f"-{i}")]
        assert all(d.text is None for d in mine)
        assert sum((d.token_ids for d in mine), []) == mine[-1].output.token_ids == outs[i].token_ids


def test_text_is_refused_as_in_process(bare) -> None:
    client, reference = bare
    for kwargs in (dict(prompts=["hi"]), dict(input_ids=[[1, 2]], sampling_params=SamplingParams(stop=["x"]))):
        with pytest.raises(ValueError) as want:
            reference.generate(**kwargs)
        with pytest.raises(ValueError) as got:
            client.generate(**kwargs)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="no tokenizer"):
        client.add_request(prompt="hi")
    assert client.stats().num_waiting == 0

"""RolloutClient.generate against in-process Engine.generate: the same tokens, log-probs,
versions and text for the same seeds, greedy and sampled, n > 1, token-id and text prompts,
stop strings; bad arguments raise the same exception type naming the field."""

from __future__ import annotations

from conftest import make_prompts
from server_fixtures import reference, same_output, server, text_model  # noqa: F401 (fixtures)

from rollout import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=7, ignore_eos=True, top_logprobs=3)


def _both(server, reference, exact_logprobs: bool = True, **kwargs):
    got = server.generate(**kwargs)
    want = reference.generate(**kwargs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        same_output(g, w, exact_logprobs=exact_logprobs)
    return got


def test_greedy_token_ids_equal_in_process(server, reference, text_model) -> None:
    prompts = make_prompts(text_model.vocab_size, [5, 12, 3], seed=1)
    outs = _both(server, reference, input_ids=prompts, sampling_params=GREEDY)
    assert [o.prompt_ids for o in outs] == prompts
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in outs)
    assert all(o.text is not None for o in outs)  # the engine has a tokenizer: the text thread decoded


def test_sampled_n_per_prompt_params_and_logprobs_equal_in_process(server, reference, text_model) -> None:
    prompts = make_prompts(text_model.vocab_size, [6, 9], seed=2)
    params = [SamplingParams(temperature=0.8, max_new_tokens=8, n=3, seed=11, ignore_eos=True, logprobs_mode="raw"),
              SAMPLED]
    outs = _both(server, reference, input_ids=prompts, sampling_params=params)
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1, "n=3 samples should differ"
    assert outs[3].top_logprobs is not None and len(outs[3].top_logprobs[0]) == 3


def test_text_prompts_equal_in_process(server, reference) -> None:
    outs = _both(server, reference, prompts=["hello there", "a"], sampling_params=SAMPLED)
    assert outs[0].prompt_ids == reference.tokenizer.encode("hello there")
    assert outs[0].text == reference.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)


def test_stop_strings_cut_the_output_as_in_process(server, reference) -> None:
    free = _both(server, reference, prompts=["stop me"], sampling_params=GREEDY)[0]
    text = free.text
    stop = text[4:6]  # a string the greedy text holds, not at its start
    assert len(text) >= 6 and stop.strip(), text
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, stop=[stop, "never-there"])
    got = _both(server, reference, prompts=["stop me"], sampling_params=params)[0]
    assert got.finish_reason == "stop" and stop not in got.text and text.startswith(got.text)
    assert len(got.token_ids) < len(free.token_ids) and len(got.logprobs) == len(got.token_ids)
    assert free.token_ids[: len(got.token_ids)] == got.token_ids


def test_stop_strings_on_sampled_requests_with_n(server, reference) -> None:
    free = _both(server, reference, prompts=["xyz"], sampling_params=SamplingParams(
        temperature=1.0, max_new_tokens=12, n=2, seed=3, ignore_eos=True))
    stop = free[1].text[5:7]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=3, ignore_eos=True, stop=[stop])
    # The engine process hears of a stop string a step or so after the token that made it
    # (text_worker.py): the stopped sample may run a step longer there, so the other one's
    # batches differ and its log-probs may round differently. Tokens are equal.
    got = _both(server, reference, exact_logprobs=False, prompts=["xyz"], sampling_params=params)
    assert got[1].finish_reason == "stop"


def test_empty_batch_and_introspection(server, reference, text_model) -> None:
    assert server.generate(input_ids=[], sampling_params=GREEDY) == []
    info = server.model_info()
    assert info.vocab_size == text_model.vocab_size and info.has_tokenizer and info.enable_lora
    assert info.context_len == reference.context_len and info.eos_token_ids == sorted(reference.eos_token_ids)
    health = server.health()
    assert health.ok and health.num_running == 0 and health.weight_version == reference.weight_version
    stats = server.stats()
    assert stats.kv_capacity_tokens == reference.stats().kv_capacity_tokens and stats.num_running == 0


def test_structured_output_equals_in_process_and_bad_regex_is_refused(server, reference) -> None:
    """The constraint travels with SamplingParams; the engine process compiles and masks as
    in-process does; its refusal of a bad regex is the same ValueError naming the field."""
    import re

    import pytest

    pytest.importorskip("xgrammar")
    params = SamplingParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){0,2}", temperature=1.0, n=2, seed=3, max_new_tokens=40)
    outs = _both(server, reference, prompts=["hello there"], sampling_params=params)
    for out in outs:  # the grammar ends on EOS (in this test tokenizer an ordinary character: decode without it)
        assert out.finish_reason == "stop" and out.token_ids[-1] in reference.eos_token_ids
        text = reference.tokenizer.decode(out.token_ids[:-1])
        assert re.fullmatch(params.regex, text), text
    with pytest.raises(ValueError, match=r"SamplingParams\.regex: refused by xgrammar"):
        server.generate(prompts=["a"], sampling_params=SamplingParams(regex="(unclosed"))

"""Drafters without a model: the n-gram index, prompt lookup, the suffix drafter's siblings
and history (bounded, keyed by prompt and adapter, kept or cleared on update), and the
per-request draft length policy."""

from __future__ import annotations

from rollout.request import Req, SamplingParams
from speculative.base import PAUSE_STEPS
from speculative.index import NgramIndex
from speculative.ngram import NgramDrafter
from speculative.suffix import History, SuffixDrafter


def _req(prompt: list[int], output: list[int], rid: str = "r", lora: str | None = None, max_new: int = 64) -> Req:
    req = Req(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new), seed=0, lora_name=lora)
    req.output_ids = list(output)
    req.num_computed_tokens = req.seq_len - 1  # decoding: everything but the last token has KV
    return req


def test_index_never_matches_the_current_suffix_and_keeps_the_latest_occurrence() -> None:
    index = NgramIndex(3)
    index.sync([1, 2, 3], [1, 2, 4, 1, 2])
    assert index.continuation((1, 2), 3) == [4, 1, 2]  # the latest earlier occurrence, not the suffix
    assert index.continuation((4, 1, 2), 2) == []  # only the current suffix: no continuation yet
    index.sync([1, 2, 3], [1, 2, 4, 1, 2, 9])
    assert index.continuation((1, 2), 1) == [9]


def test_ngram_drafter_prefers_the_longest_match() -> None:
    drafter = NgramDrafter(max_tokens=4, context_len=1000)
    req = _req([7, 1, 2, 3, 8, 2, 3, 9, 5], [1, 2, 3])
    # (1, 2, 3) occurred at 1 (-> 8, 2, 3, 9); (2, 3) alone last at 5 (-> 9, 5, 1, 2)
    assert drafter.propose(req, 4) == [8, 2, 3, 9]
    assert drafter.propose(_req([1, 2, 3], [4]), 4) == []


def test_propose_all_respects_limits_and_skips_requests_not_decoding() -> None:
    drafter = NgramDrafter(max_tokens=4, context_len=1000)
    near_end = _req([1, 2, 1, 2, 1, 2], [1], rid="end", max_new=3)  # room for 1 draft + the token after it
    prefill = _req([1, 2, 1, 2], [], rid="prefill")
    prefill.num_computed_tokens = 1
    drafter.propose_all([near_end, prefill])
    assert near_end.draft_tokens == [2] and prefill.draft_tokens == []


def test_draft_length_adapts_and_pauses() -> None:
    drafter = NgramDrafter(max_tokens=4, context_len=1000)
    req = _req([1, 2] * 8, [1])
    drafter.propose_all([req])
    assert req.spec_k == 4 and len(req.draft_tokens) == 4
    drafter.observe_step(req, 4, 0)
    assert req.spec_k == 2
    drafter.observe_step(req, 2, 0)
    drafter.observe_step(req, 1, 0)
    assert req.spec_k == 1 and req.spec_pause == PAUSE_STEPS
    for _ in range(PAUSE_STEPS):
        drafter.propose_all([req])
        assert req.draft_tokens == []
    drafter.propose_all([req])
    assert len(req.draft_tokens) == 1
    drafter.observe_step(req, 1, 1)
    assert req.spec_k == 2


def test_suffix_drafter_uses_siblings_and_history_of_the_same_prompt_only() -> None:
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=10_000)
    prompt = [50, 51, 52]
    done = _req(prompt, [10, 11, 12, 13, 14, 15], rid="earlier")
    drafter.observe_finished(done)  # an earlier rollout of this prompt
    req = _req(prompt, [10, 11, 12], rid="now")
    drafter.propose_all([req])
    assert req.draft_tokens == [13, 14, 15]
    other_prompt = _req([60, 61], [10, 11, 12], rid="other")
    drafter.propose_all([other_prompt])
    assert other_prompt.draft_tokens == []
    under_adapter = _req(prompt, [10, 11, 12], rid="adapter", lora="a")
    drafter.propose_all([under_adapter])
    assert under_adapter.draft_tokens == [], "an adapter's rollouts are not the base model's"
    sibling = _req(prompt, [20, 21, 22, 23, 24], rid="sibling")
    behind = _req(prompt, [20, 21], rid="behind")
    drafter.propose_all([sibling, behind])
    assert behind.draft_tokens == [22, 23, 24]


def test_history_is_bounded_and_cleared_on_update_when_asked() -> None:
    history = History(max_tokens=20)
    for i in range(5):
        history.add(("k", i), list(range(8)))
    assert history.num_tokens <= 20 and history.get(("k", 0)) == [] and history.get(("k", 4))
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1000, keep_on_update=False)
    drafter.observe_finished(_req([1], [2, 3, 4]))
    drafter.on_weight_update()
    assert drafter.history.num_tokens == 0
    keep = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1000, keep_on_update=True)
    keep.observe_finished(_req([1], [2, 3, 4]))
    keep.on_weight_update()
    assert keep.history.num_tokens == 4


def test_governor_turns_drafting_off_while_plain_decoding_is_faster_and_probes_again() -> None:
    from speculative.governor import SpeedGovernor

    gov = SpeedGovernor(window=2)

    def run(windows: int, spec_rate: float, plain_rate: float) -> list[bool]:
        modes = []
        for _ in range(windows * 2):
            modes.append(gov.drafting)
            gov.observe(1.0, int(spec_rate if gov.drafting else plain_rate))
        return modes[::2]

    assert run(2, 100, 50) == [True, False]  # first speculative window, then the baseline
    assert run(3, 100, 50) == [True, True, True], "speculation wins: it stays on"
    modes = run(12, 30, 50)  # conditions change: now plain decoding is faster
    assert modes.count(False) > modes.count(True) >= 2, modes  # off most of the time, probed now and then
    assert run(12, 100, 50)[-4:] == [True] * 4, "when speculation wins again it comes back"

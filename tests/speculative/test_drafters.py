"""Drafters without a model: the continuation index, prompt lookup, the suffix drafter's
siblings and history (one index per prompt, bounded, keyed by prompt and adapter, kept or
cleared on update, members that leave take their counts with them), the per-request draft
length policy and the governor."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.request import Req, SamplingParams
from speculative.base import PAUSE_STEPS
from speculative.groups import HISTORY_PER_PROMPT
from speculative.index import ContinuationIndex
from speculative.ngram import NgramDrafter
from speculative.speculator import Speculator
from speculative.suffix import SHARED_TREE_NODES, SuffixDrafter


def _req(prompt: list[int], output: list[int], rid: str = "r", lora: str | None = None, max_new: int = 64) -> Req:
    req = Req(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new), seed=0, lora_name=lora)
    req.output_ids = list(output)
    req.num_computed_tokens = req.seq_len - 1  # decoding: everything but the last token has KV
    return req


def test_index_never_matches_the_current_suffix_and_orders_continuations_by_recency() -> None:
    index = ContinuationIndex(3)
    seq = [1, 2, 3, 1, 2, 4, 1, 2]
    index.add(seq, 0, len(seq))
    assert index.counts((1, 2)) == {3: 1, 4: 1} and list(index.counts((1, 2)))[-1] == 4  # the latest last
    assert index.counts((4, 1, 2)) is None  # only the current suffix: no continuation yet
    seq.append(3)
    index.add(seq, len(seq) - 1, len(seq))
    assert index.counts((1, 2)) == {4: 1, 3: 2} and list(index.counts((1, 2)))[-1] == 3, "seen again: latest again"
    index.remove(seq, 0, len(seq))
    assert len(index) == 0, "removing what was added leaves nothing"


def test_ngram_drafter_prefers_the_longest_match() -> None:
    drafter = NgramDrafter(max_tokens=4, context_len=1000)
    req = _req([7, 1, 2, 3, 8, 2, 3, 9, 5], [1, 2, 3])
    # (1, 2, 3) occurred at 1 (-> 8, 2, 3, 9); (2, 3) alone last at 5 (-> 9, 5, 1, 2)
    assert drafter.propose(req, 4) == [8, 2, 3, 9]
    assert drafter.propose(_req([1, 2, 3], [4]), 4) == []


def test_propose_all_respects_limits_and_skips_requests_not_decoding() -> None:
    drafter = NgramDrafter(max_tokens=4, context_len=1000)
    spec = Speculator(drafter)
    near_end = _req([1, 2, 1, 2, 1, 2], [1], rid="end", max_new=3)  # room for 1 draft + the token after it
    prefill = _req([1, 2, 1, 2], [], rid="prefill")
    prefill.num_computed_tokens = 1
    spec.propose_all([near_end, prefill])
    assert near_end.draft_tokens == [2] and prefill.draft_tokens == []


def test_draft_length_adapts_and_pauses() -> None:
    drafter = NgramDrafter(max_tokens=4, context_len=1000)
    spec = Speculator(drafter)
    req = _req([1, 2] * 8, [1])
    spec.propose_all([req])
    assert req.spec_k == 4 and len(req.draft_tokens) == 4
    drafter.observe_step(req, 4, 0)
    assert req.spec_k == 2
    drafter.observe_step(req, 2, 0)
    drafter.observe_step(req, 1, 0)
    assert req.spec_k == 1 and req.spec_pause == PAUSE_STEPS
    for _ in range(PAUSE_STEPS):
        spec.propose_all([req])
        assert req.draft_tokens == []
    spec.propose_all([req])
    assert len(req.draft_tokens) == 1
    drafter.observe_step(req, 1, 1)
    assert req.spec_k == 2


def test_suffix_drafter_uses_siblings_and_history_of_the_same_prompt_first() -> None:
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=10_000)
    spec = Speculator(drafter)
    prompt = [50, 51, 52]
    done = _req(prompt, [10, 11, 12, 13, 14, 15], rid="earlier")
    drafter.observe_finished(done)  # an earlier rollout of this prompt
    drafter.observe_finished(_req([70], [10, 11, 12, 40, 41, 42], rid="elsewhere"))  # another prompt's, newer
    req = _req(prompt, [10, 11, 12], rid="now")
    spec.propose_all([req])
    assert req.draft_tokens == [13, 14, 15], "the prompt's own rollouts come first"
    under_adapter = _req(prompt, [10, 11, 12], rid="adapter", lora="a")
    spec.propose_all([under_adapter])
    assert under_adapter.draft_tokens == [], "an adapter's rollouts are not the base model's"
    sibling = _req(prompt, [20, 21, 22, 23, 24], rid="sibling")
    behind = _req(prompt, [20, 21], rid="behind")
    spec.propose_all([sibling, behind])
    assert behind.draft_tokens == [22, 23, 24]


@pytest.mark.parametrize("cross_prompt", [True, False])
def test_suffix_drafter_falls_back_on_other_prompts_rollouts_where_its_own_never_continued(cross_prompt: bool) -> None:
    """Only where the prompt's own index has no match, and (a tree as a chain) within
    SHARED_TREE_NODES; `may_draft_next` says so too, or a step would not wait for its token."""
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=10_000, cross_prompt=cross_prompt)
    spec = Speculator(drafter)
    drafter.observe_finished(_req([50, 51], [10, 11, 12, 13, 14, 15], rid="earlier"))
    own = _req([60, 61], [7, 8, 9], rid="own-history")
    drafter.observe_finished(own)
    new = _req([60, 61], [10, 11, 12], rid="new")
    spec.propose_all([new])
    assert new.draft_tokens == ([13, 14, 15] if cross_prompt else [])
    assert drafter.may_draft_next(_req([60, 61], [10, 11], rid="next")) == cross_prompt
    tokens, parents = drafter.propose_tree(_req([60, 61], [10, 11, 12], rid="tree"), 4, 32)
    assert (tokens, parents) == (([13, 14, 15], [-1, 0, 1]) if cross_prompt else ([], []))
    mine = _req([60, 61], [7, 8], rid="mine")
    spec.propose_all([mine])
    assert mine.draft_tokens == [9], "the prompt's own history matched: no fallback"
    nothing = _req([60, 61], [30, 31], rid="nothing")
    spec.propose_all([nothing])
    assert nothing.draft_tokens == [] and not drafter.may_draft_next(nothing)
    for i in range(40):  # a bushy shared index: the fallback tree stays small
        drafter.observe_finished(_req([80 + i], [10, 11, 100 + i, 5], rid=f"bush{i}"))
    tokens, _ = drafter.propose_tree(_req([60, 61], [3, 10, 11], rid="bushy"), 4, 32)
    assert len(tokens) == (SHARED_TREE_NODES if cross_prompt else 0)


def test_history_is_bounded_and_cleared_on_update_when_asked() -> None:
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=20)
    for i in range(5):  # five prompts of 1 + 8 tokens: the bound keeps the newest two
        drafter.observe_finished(_req([100 + i], list(range(8)), rid=f"p{i}"))
    history = drafter.history
    assert history.num_tokens <= 20 and history.responses(_req([100], [])) == [] and history.responses(_req([104], []))
    assert history.group(_req([100], [])).index.counts((0, 1)) is None, "the evicted prompt's counts left with it"
    assert history.shared(_req([100], [])).counts((0, 1)) == {2: 2}, "and left the shared index: two responses stay"
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1000)
    for i in range(HISTORY_PER_PROMPT + 3):  # per prompt: the newest HISTORY_PER_PROMPT responses
        drafter.observe_finished(_req([7], [1, 2], rid=f"same{i}"))
    assert len(drafter.history.responses(_req([7], []))) == HISTORY_PER_PROMPT
    assert drafter.history.group(_req([7], [])).index.counts((7, 1)) == {2: HISTORY_PER_PROMPT}
    assert drafter.history.shared(_req([7], [])).counts((1,)) == {2: HISTORY_PER_PROMPT}
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1000, keep_on_update=False)
    spec = Speculator(drafter)
    drafter.observe_finished(_req([1], [2, 3, 4]))
    drafter.on_weight_update()
    assert drafter.history.num_tokens == 0 and drafter.history.shared(_req([1], [])) is None
    after = _req([1], [2, 3], rid="after")
    spec.propose_all([after])
    assert after.draft_tokens == [], "cleared: the earlier rollout drafts no more"
    keep = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1000, keep_on_update=True)
    keep.observe_finished(_req([1], [2, 3, 4]))
    keep.on_weight_update()
    assert keep.history.num_tokens == 4


@pytest.mark.parametrize("keep", [False, True])
def test_an_adapter_update_clears_that_adapters_history_only(keep: bool) -> None:
    """keep_on_update=False drops what the updated adapter's old policy sampled; the base
    model's and other adapters' rollouts (same prompt) still draft. Either way the governor
    measures afresh."""
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1000, keep_on_update=keep)
    spec = Speculator(drafter)
    for lora in (None, "a", "b"):
        drafter.observe_finished(_req([1], [2, 3, 4], rid=f"done-{lora}", lora=lora))
    spec.governor.drafting = spec.governor.probing = False  # held off by an earlier verdict
    spec.policy_changed("a")
    assert spec.governor.drafting and spec.governor.probing
    drafts = {}
    for lora in (None, "a", "b"):
        req = _req([1], [2, 3], rid=f"new-{lora}", lora=lora)
        spec.propose_all([req])
        drafts[lora] = req.draft_tokens
    assert drafts == {None: [4], "a": [4] if keep else [], "b": [4]}
    for lora in (None, "a", "b"):  # another prompt: the fallback on each namespace's rollouts
        req = _req([9], [2, 3], rid=f"other-{lora}", lora=lora)
        spec.propose_all([req])
        drafts[lora] = req.draft_tokens
    assert drafts == {None: [4], "a": [4] if keep else [], "b": [4]}
    assert drafter.history.num_tokens == (12 if keep else 8)  # prompt + response, 4 tokens each


def test_siblings_that_stop_running_take_their_counts_and_finished_ones_stay() -> None:
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1000)
    spec = Speculator(drafter)
    prompt = [50, 51]
    aborted = _req(prompt, [1, 2, 3, 4], rid="aborted")
    finishing = _req(prompt, [1, 2, 5, 6], rid="finishing")
    me = _req(prompt, [9, 1, 2], rid="me")
    spec.propose_all([aborted, finishing, me])
    group = drafter.history.group(me)
    assert group.index.counts((1, 2)) == {3: 1, 5: 1} and set(group.members) == {aborted, finishing, me}
    finishing.finish_reason = "length"
    drafter.observe_finished(finishing)
    spec.propose_all([me])  # `aborted` is gone without finishing (an abort, a retraction)
    assert group.index.counts((1, 2)) == {5: 1}, "the aborted sample's counts left; the finished one is history"
    assert me.draft_tokens == [5, 6] and set(group.members) == {me}


def test_a_sample_whose_prompt_is_evicted_while_it_runs_recounts_and_still_becomes_history() -> None:
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=12)
    spec = Speculator(drafter)
    running = _req([1], [5, 6, 7], rid="running")
    spec.propose_all([running])
    first = drafter.history.group(running)
    for i in range(3):  # other prompts' rollouts: the least recently used group goes first
        drafter.observe_finished(_req([50 + i], [1, 2, 3, 4, 5], rid=f"other{i}"))
    assert first.evicted
    running.output_ids += [5, 6]
    running.num_computed_tokens += 2
    spec.propose_all([running])
    assert running.draft_tokens[:1] == [7], "its own tokens were counted again in a fresh group"
    assert drafter.history.group(running) is not first
    running.finish_reason = "length"
    drafter.observe_finished(running)
    assert drafter.history.responses(running) == [[5, 6, 7, 5, 6]] and drafter.tracked_requests() == 0


def test_governor_turns_drafting_off_while_plain_decoding_is_faster_and_probes_again() -> None:
    """Paired probes: drafting alternates on and off step by step (prefill steps are not
    measurements), the faster mode then holds; plain decoding's holds double while it wins."""
    from speculative.governor import SpeedGovernor

    gov = SpeedGovernor(probe=2, hold_on=6, first_off=4, max_off=16)

    def run(steps: int, spec_rate: float, plain_rate: float) -> list[bool]:
        modes = []
        for _ in range(steps):
            modes.append(gov.drafting)
            gov.observe(1.0, int(spec_rate if gov.drafting else plain_rate))
        return modes

    gov.observe(5.0, 3, decode_only=False)  # a prefill step: no measurement, the probe starts after it
    assert run(4, 100, 50) == [True, False, True, False], "the probe alternates, on the same batch"
    assert run(6, 100, 50) == [True] * 6, "speculation won: it holds"
    modes = run(60, 30, 50)  # conditions change: now plain decoding is faster
    assert modes[:4] == [True, False, True, False] and modes[4:8] == [False] * 4, modes[:8]
    assert modes.count(False) > 3 * modes.count(True) and modes.count(True) >= 6, modes  # probed now and then
    back = run(60, 100, 50)[-30:]  # when speculation wins again it comes back (probed every 10 steps)
    assert back.count(True) >= 24 and back[-10:].count(True) >= 8, back

    run(40, 30, 50)  # plain decoding wins again and again: its holds have grown
    while gov.probing or gov.drafting:
        run(1, 30, 50)
    assert gov._off_length > gov.first_off
    gov.restart()  # a weight update: the verdict was about the old policy
    assert gov.drafting and gov.probing and gov._off_length == gov.first_off
    assert run(4, 100, 50) == [True, False, True, False] and run(3, 100, 50) == [True] * 3, "measured at once"

    blocks = SpeedGovernor(probe=3, hold_on=6, first_off=4, blocks=True)  # plain steps overlapped (CUDA)
    for plain_rate, spec_rate in ((100, 50), (50, 100)):
        blocks.restart()
        modes = []
        for _ in range(6):
            modes.append(blocks.drafting)
            if blocks.drafting and modes[-2:] == [False, True]:  # the first drafting step drains the last plain one
                blocks.observe_drain(1.0, plain_rate)
            # an overlapped plain step reads back the one before it (the first: nothing in flight)
            tokens = spec_rate if blocks.drafting else plain_rate * (modes[-2:] == [False, False])
            blocks.observe(1.0, tokens, verified=blocks.drafting and tokens > 60)
        losing = spec_rate < plain_rate * 3 / 4 * 0.75  # the probe ends after 2 drafting steps (EARLY_STEPS)
        expected = [False] * 3 + [True] * 2 + [False] if losing else [False] * 3 + [True] * 3
        assert modes[-6:] == expected, "a block of each, plain first; no-draft steps stay drafting's"
        assert blocks.rate[False] == pytest.approx(plain_rate * 3 / 4), "the drain's wait and tokens are plain's"
        assert blocks.drafting == (spec_rate > plain_rate * 3 / 4) and not blocks.probing

    short = SpeedGovernor(probe=4, hold_on=6, first_off=4, blocks=True)
    for _ in range(4):
        short.observe(1.0, 100)  # the plain block
    short.observe(1.0, 80, verified=True)
    assert short.probing and short.drafting, "one drafting step is not enough to call it"
    short.observe(1.0, 80, verified=True)
    assert short.probing and short.drafting, "80% of plain's rate is not clearly losing: the block runs on"
    short.restart()
    for _ in range(4):
        short.observe(1.0, 100)
    short.observe(1.0, 60, verified=True)
    short.observe(1.0, 70, verified=True)
    assert not short.probing and not short.drafting, "clearly losing after two drafting steps: off at once"
    assert short.rate == {True: 65.0, False: 100.0}

    alternating = SpeedGovernor(probe=4, hold_on=6, first_off=4, max_off=64)  # CPU: no overlap to keep
    for _ in range(4):  # drafting, plain, drafting, plain: 2 steps of each, level
        alternating.observe(1.0, 100)
    assert alternating.probing, "drafting level with plain decoding is not losing: the probe runs on"
    hopeless = SpeedGovernor(probe=4, hold_on=6, first_off=4, max_off=64)
    modes = []
    for _ in range(4):
        modes.append(hopeless.drafting)
        hopeless.observe(1.0, 40 if hopeless.drafting else 100)
    assert modes == [True, False, True, False] and not hopeless.probing and not hopeless.drafting, \
        "2 steps of each, drafting at 40% of plain's rate: off without the rest of the probe"
    assert hopeless._hold == 8 and hopeless._off_length == 16, "hopeless: twice the hold, and it grows 4x"
    for _ in range(8):
        hopeless.observe(1.0, 100)
    assert hopeless.probing
    to_the_end = SpeedGovernor(probe=4, hold_on=6, first_off=4, max_off=64, early_stop=False)  # benches' "before"
    for _ in range(8):
        to_the_end.observe(1.0, 40 if to_the_end.drafting else 100)
        assert to_the_end.probing or to_the_end._steps == {True: 4, False: 4}
    assert not to_the_end.drafting and to_the_end._hold == 4 and to_the_end._off_length == 8

    early = SpeedGovernor(probe=2, hold_on=6, first_off=4)
    for _ in range(5):  # drafting on, but nothing repeats yet: these steps are plain decoding's
        early.observe(1.0, 50, verified=False)
    assert early.drafting and early.probing, "no forced plain steps while nothing is drafted"
    early.observe(1.0, 100, verified=True)
    early.observe(1.0, 100, verified=True)
    assert early.drafting and not early.probing and early.rate == {True: 100.0, False: 50.0}


def test_a_probe_with_nothing_to_draft_holds_briefly_and_drafts_appearing_end_the_hold() -> None:
    """Blocks (CUDA): a probe whose drafting block had no draft at all is no verdict on drafts.
    Plain decoding holds FIRST_OFF steps without the hold growing, and the suffix drafter's
    look finds drafts as soon as a sibling's finished rollout enters the history: the probe
    starts then, not after a doubled hold (the H200 bench: 0 verifies in 257 steps)."""
    from speculative.governor import CHECK_EVERY, SpeedGovernor

    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1 << 20)
    spec = Speculator(drafter)
    gov = spec.governor = SpeedGovernor(probe=2, hold_on=6, first_off=8, blocks=True)
    running = _req([1, 2], [5, 6], rid="second")

    def step(tokens_plain: int = 100, tokens_drafting: int = 90) -> bool:
        """One engine step as the loop runs it: proposals, then the step's speed."""
        spec.propose_all([running])
        verified = bool(running.draft_tokens)
        gov.observe(1.0, tokens_drafting if gov.drafting else tokens_plain, verified=verified)
        return verified

    for _ in range(3):  # probe after probe with nothing to draft (drafting costs overlap: slower)
        while gov.probing:
            assert not step()
        assert not gov.drafting and gov.idle and gov._hold == 8, "a short hold: nothing was drafted"
        assert gov._off_length == 8, "and it does not grow"
        for _ in range(8):
            assert not step()
    assert gov.probing
    while gov.probing:
        step()
    assert gov.idle and not gov.probing
    step()  # one step into the hold, then a sibling finishes: its rollout continues [.., 5, 6]
    done = _req([1, 2], [5, 6, 7, 8, 9], rid="first")
    done.finish_reason = "length"
    drafter.observe_finished(done)
    looked = 0
    while not gov.probing:
        looked += 1
        step()
    assert looked <= CHECK_EVERY, "the hold ended at the next look (one request: the window is it)"
    while gov.probing:
        step(100, 250)  # the drafting block now verifies drafts and wins
    assert gov.drafting and not gov.idle and running.draft_tokens == [7, 8, 9][: len(running.draft_tokens)]


def test_looks_during_a_hold_reprobe_only_when_drafts_spread() -> None:
    """A verdict holds for the mix it measured. Wrong drafts everywhere (the share the probe
    lost with) never end a hold early; a probe that lost with one request of 64 drafting ends
    its hold once the looks find drafts for half of 16 requests, not for one; a draft model
    looks at nothing (a look would be a forward)."""
    from speculative.draft_model import DraftModelDrafter
    from speculative.governor import LOOK_WINDOW, SpeedGovernor

    def lost(share: float) -> SpeedGovernor:
        gov = SpeedGovernor(probe=2, hold_on=6, first_off=8, max_off=512, blocks=True)
        for _ in range(2):
            gov.observe(1.0, 100)
        for _ in range(2):
            gov.observe(1.0, 40, verified=True, share=share)
        assert not gov.probing and not gov.drafting and not gov.idle and gov.probe_share == share
        return gov

    quick = SpeedGovernor(probe=4, hold_on=6, first_off=8, blocks=True)
    for _ in range(4):
        quick.observe(1.0, 100)
    quick.observe(1.0, 60, verified=True)
    assert quick.probing and quick.drafting, "one drafting step at 60% is not hopeless: the probe runs on"
    quick.restart()
    for _ in range(4):
        quick.observe(1.0, 100)
    quick.observe(1.0, 44, verified=True)  # a batch-64 verify of 4 wrong drafts on the H200
    assert not quick.probing and not quick.drafting and quick._hold == 16, "hopeless after one step: off, held 2x"

    poor = lost(1.0)
    for _ in range(LOOK_WINDOW):
        poor.looked(4, 4, 64)  # every request has (wrong) drafts, as in the probe
    assert not poor.probing, "the same share the probe lost with: the hold stands"
    one = lost(1 / 64)
    for found in (1, 0, 0, 0):  # one request in 16 repeats its context: no news
        one.looked(found, 4, 64)
    assert not one.probing
    for found in (4, 4, 0, 0):  # half of the next 16 would draft: drafts spread
        one.looked(found, 4, 64)
    assert one.probing and not one.drafting, "a probe at once (plain block first)"
    assert not one.check_due(), "no looks while probing"
    assert Speculator(object.__new__(DraftModelDrafter)).look([_req([1], [2])]) == (0, 0)


def test_may_match_after_is_exactly_whether_some_next_token_matches() -> None:
    """The look before a drain (Drafter.may_draft_next) must never say "no draft" where one
    more token would give one: checked against every next token of a small vocabulary."""
    import random

    rng = random.Random(3)
    for trial in range(200):
        vocab, min_n = rng.randint(2, 6), rng.choice([1, 2, 3])
        index = ContinuationIndex(4)
        for _ in range(rng.randint(0, 3)):
            seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            index.add(seq, 0, len(seq))
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        want = any(index.matches(context + [b], min_n) for b in range(vocab))
        assert index.may_match_after(context, min_n) == want, (trial, context, min_n)
    drafter = NgramDrafter(max_tokens=4, context_len=1000)
    spec = Speculator(drafter)
    req = _req([1, 2, 3, 1], [2])  # ... 1, 2 | next: 3 would repeat (2, 3) -> drafts "1"
    assert drafter.may_draft_next(req)
    assert not drafter.may_draft_next(_req([1, 2, 3], [4])), "4 never came before: no bigram can start with it"
    suffix = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=1 << 20)
    done = _req([9], [5, 6, 7], rid="done")
    done.finish_reason = "length"
    suffix.observe_finished(done)
    assert suffix.may_draft_next(_req([9], [5], rid="a")), "(5, 6) was followed by 7 in the history"
    assert not suffix.may_draft_next(_req([9], [7], rid="b")), "7 ended the history's rollout"
    first = _req([1, 2, 1, 2, 1], [])  # prefilled, its first token in flight: (1, next) may repeat (1, 2)
    first.num_inflight, first.num_computed_tokens = 1, 5
    assert not spec.nothing_to_draft([first]), "a request's first decode step can draft too"
    assert spec.nothing_to_draft([_req([1, 2, 3], [4])])


_op = st.one_of(
    st.tuples(st.just("finish"), st.integers(0, 5), st.sampled_from([None, "a"]),
              st.lists(st.integers(0, 6), min_size=0, max_size=12)),
    st.tuples(st.just("update"), st.just(0), st.sampled_from([None, "a"]), st.just([])),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=40), bound=st.integers(0, 60), keep=st.booleans())
def test_the_shared_index_always_counts_exactly_the_kept_responses(ops, bound: int, keep: bool) -> None:
    """Whatever finishes, is dropped (the per-prompt cap), evicted (the token bound) or
    cleared (a weight or adapter update), each namespace's shared index holds the counts
    of its kept responses, each after its prompt's tail, and nothing else."""
    drafter = SuffixDrafter(max_tokens=4, context_len=1000, history_tokens=bound, keep_on_update=keep)
    spec = Speculator(drafter)
    history = drafter.history
    for i, (kind, prompt, lora, output) in enumerate(ops):
        if kind == "finish":
            drafter.observe_finished(_req([90, 91, prompt], output, rid=f"r{i}", lora=lora))
        else:
            spec.policy_changed(lora)
        for namespace, shared in history._shared.items():
            expected = ContinuationIndex(shared.max_n)
            for group in history._groups.values():
                if group.key[0] == namespace:
                    head = group.prompt[-shared.max_n:]
                    for response in group.responses:
                        expected.add(head + response, len(head), len(head) + len(response))
            assert {h: dict(c) for h, c in shared._next.items()} == {h: dict(c) for h, c in expected._next.items()}

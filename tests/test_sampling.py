"""Sampling: the drawn distribution matches transformers' warpers, determinism, log-probs,
greedy rows and the counter-hash noise."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rollout.request import Req, SamplingParams
from rollout.sampling import SamplingBatch, filtered_logits, sample, uniform_noise

# Varied magnitudes, no ties (top-k breaks ties by rank, transformers keeps them), and not
# sorted, so filtering must scatter back to vocab order.
LOGITS = torch.tensor([0.3, 2.6, -1.7, 1.2, -0.4, 1.9, -3.0, 0.8, -6.0, 1.55, -0.9], dtype=torch.float32)
V = LOGITS.numel()
N = 20000
P_MIN = 1e-4

SETTINGS = {
    "t0.7": SamplingParams(temperature=0.7),
    "t1.3": SamplingParams(temperature=1.3),
    "topk3": SamplingParams(top_k=3),
    "topp0.8": SamplingParams(top_p=0.8),
    "minp0.2": SamplingParams(min_p=0.2),
    "minp0.12": SamplingParams(min_p=0.12),
    # top-p after top-k renormalisation keeps 3 tokens here; on the full distribution it
    # would keep 4, so the order matters
    "combo": SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
    # top-k 5 / 6 / 7 keeps 5 / 6 / 7 tokens through min-p here: off-by-ones show
    "combo2": SamplingParams(temperature=1.5, top_k=6, min_p=0.1),
}


def reference_probs(logits: torch.Tensor, p: SamplingParams, order: str = "transformers", k_delta: int = 0) -> torch.Tensor:
    """Filtered distribution, computed with transformers' own warpers in its order:
    temperature, top-k, top-p, min-p. `order` / `k_delta` build deliberately wrong variants
    (used to show the statistical test has power)."""
    scores = logits.reshape(1, -1).clone()
    ids = torch.zeros((1, 1), dtype=torch.long)
    temp = TemperatureLogitsWarper(p.temperature) if p.temperature not in (0.0, 1.0) else None
    top_k = TopKLogitsWarper(p.top_k + k_delta) if p.top_k > 0 else None
    top_p = TopPLogitsWarper(p.top_p) if p.top_p < 1.0 else None
    min_p = MinPLogitsWarper(p.min_p) if p.min_p > 0 else None
    chain = {"transformers": [temp, top_k, top_p, min_p], "top_p_first": [temp, top_p, top_k, min_p]}[order]
    for warper in chain:
        if warper is not None:
            scores = warper(ids, scores)
    return scores.double().softmax(dim=-1)[0]


def batch_for(params: list[SamplingParams], seeds: list[int], positions: list[int], vocab: int = V) -> SamplingBatch:
    """A SamplingBatch through the engine's own from_reqs (row i at sequence position positions[i])."""
    reqs = [
        Req(rid=str(i), prompt_ids=[0] * pos, params=p, seed=seed)
        for i, (p, seed, pos) in enumerate(zip(params, seeds, positions))
    ]
    return SamplingBatch.from_reqs(reqs, vocab, "cpu")


def repeated_batch(p: SamplingParams, n: int, seed_base: int) -> SamplingBatch:
    """n rows of the same params with distinct seeds and varied positions (built from one
    from_reqs row: building 20000 Req objects is slow for no gain)."""
    one = batch_for([p], [0], [1])
    g = torch.Generator().manual_seed(seed_base)
    seeds = torch.randint(0, 2**62, (n,), generator=g, dtype=torch.int64)
    positions = torch.randint(1, 4096, (n,), generator=g, dtype=torch.int64)
    assert len(set(seeds.tolist())) == n
    return SamplingBatch(
        temperatures=one.temperatures.expand(n).clone(),
        top_ks=one.top_ks.expand(n).clone(),
        top_ps=one.top_ps.expand(n).clone(),
        min_ps=one.min_ps.expand(n).clone(),
        seeds=seeds,
        positions=positions,
        greedy=one.greedy.expand(n).clone(),
        all_greedy=one.all_greedy,
        need_sort=one.need_sort,
        need_min_p=one.need_min_p,
        max_top_logprobs=0,
    )


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the support of `probs`; cells with expected
    count < 5 are pooled into one. p-value from scipy when installed, else the
    Wilson-Hilferty approximation: (X/k)^(1/3) is ~ Normal(1 - 2/(9k), 2/(9k)) for X ~ chi2(k)
    (at the 1e-4 tail it overstates p by at most ~1.5x for k = 2 and ~1.2x for k >= 6, so
    "p > 1e-4" is at worst "exact p > ~7e-5")."""
    n = float(counts.sum())
    support = probs > 0
    expected = probs[support] * n
    observed = counts[support].double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        observed = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = expected.numel() - 1
    if dof < 1:
        return 1.0
    try:
        from scipy.stats import chi2  # type: ignore[import-not-found]

        return float(chi2.sf(stat, dof))
    except ImportError:
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def drawn_counts(p: SamplingParams, seed_base: int) -> tuple[torch.Tensor, torch.Tensor]:
    sb = repeated_batch(p, N, seed_base)
    out = sample(LOGITS.expand(N, V).contiguous(), sb)
    return torch.bincount(out.token_ids, minlength=V), out


def test_chi_square_helper_sanity() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    assert chi_square_p_value(torch.tensor([5000, 3000, 2000, 0]), probs) > 0.99
    assert chi_square_p_value(torch.tensor([5150, 2950, 1900, 0]), probs) < 1e-2
    assert chi_square_p_value(torch.tensor([5400, 2800, 1800, 0]), probs) < P_MIN
    # Wilson-Hilferty vs known chi2 quantiles: chi2(3) sf(16.27) = 0.001, chi2(10) sf(29.59) = 0.001
    for stat, dof in ((16.27, 3), (29.59, 10)):
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        assert 0.0008 < 0.5 * math.erfc(z / math.sqrt(2)) < 0.0012


@pytest.mark.parametrize("name", list(SETTINGS))
def test_empirical_distribution_matches_transformers(name: str) -> None:
    p = SETTINGS[name]
    ref = reference_probs(LOGITS, p)
    counts, _ = drawn_counts(p, seed_base=zlib.crc32(name.encode()))
    # every token transformers filters out is never drawn
    zero = ref == 0
    assert int(counts[zero].sum()) == 0, f"drew filtered tokens {torch.nonzero(zero & (counts > 0)).flatten().tolist()}"
    p_value = chi_square_p_value(counts, ref)
    assert p_value > P_MIN, f"{name}: chi-square p = {p_value:.2e}\n counts {counts.tolist()}\n expected {(ref * N).tolist()}"


def test_statistical_test_has_power() -> None:
    """At this N the test above would catch plausible bugs: each wrong variant of the
    reference is rejected by the zero-support check or by chi-square on the real draws."""
    wrong_variants = [
        ("topk3", dict(k_delta=-1)),  # top-k off by one (keeps too few)
        ("topk3", dict(k_delta=+1)),  # top-k off by one (keeps too many)
        ("combo", dict(order="top_p_first")),  # top-p on the full distribution
        ("combo2", dict(k_delta=-1)),
        ("combo2", dict(k_delta=+1)),
        ("t0.7", None),  # temperature ignored
    ]
    for name, variant in wrong_variants:
        p = SETTINGS[name]
        counts, _ = drawn_counts(p, seed_base=zlib.crc32(name.encode()))
        wrong = reference_probs(LOGITS, p, **variant) if variant else reference_probs(LOGITS, SamplingParams())
        right = reference_probs(LOGITS, p)
        assert not torch.allclose(wrong, right), (name, variant)
        rejected = int(counts[wrong == 0].sum()) > 0 or chi_square_p_value(counts, wrong) < P_MIN
        assert rejected, (name, variant)


def test_filtered_logits_support_matches_transformers() -> None:
    """The kept set exactly (deterministic, no sampling): several rows at once."""
    params = list(SETTINGS.values()) + [SamplingParams(top_p=0.3), SamplingParams(top_k=1), SamplingParams(min_p=1.0)]
    sb = batch_for(params, list(range(len(params))), [3] * len(params))
    got = filtered_logits(LOGITS.expand(len(params), V), sb).double().softmax(dim=-1)
    for row, p in enumerate(params):
        ref = reference_probs(LOGITS, p)
        assert torch.equal(got[row] > 0, ref > 0), p
        torch.testing.assert_close(got[row], ref, atol=1e-6, rtol=1e-5)


# ---- determinism ------------------------------------------------------------------------------


def test_same_seed_same_token_regardless_of_batch() -> None:
    vocab = 50
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, vocab, generator=g) * 2
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=10),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.1),
        SamplingParams(temperature=0.0),
    ]
    for target in (SamplingParams(temperature=1.1, top_p=0.95), SamplingParams(), SamplingParams(min_p=0.05)):
        seed, pos = 123456789012345, 77
        results = set()
        # alone, then among other rows (which switch the sort / min-p paths on) at various indices
        for trial, (size, idx) in enumerate([(1, 0), (8, 0), (8, 5), (13, 12), (13, 3)]):
            rows = [others[(trial + j) % len(others)] for j in range(size)]
            seeds = [1000 * trial + j for j in range(size)]
            positions = [5 + j for j in range(size)]
            rows[idx], seeds[idx], positions[idx] = target, seed, pos
            batch_logits = logits[1 + trial : 1 + trial + size].clone()
            batch_logits[idx] = logits[0]
            out = sample(batch_logits, batch_for(rows, seeds, positions, vocab))
            results.add(
                (int(out.token_ids[idx]), float(out.processed_logprobs[idx]), float(out.raw_logprobs[idx]))
            )
        assert len(results) == 1, (target, results)

    def draws(s: int) -> list[int]:
        n = 64  # one seed over 64 positions: the request's token stream
        sb = batch_for([SamplingParams()] * n, [s] * n, list(range(1, n + 1)), vocab)
        return sample(logits[:1].expand(n, vocab).contiguous(), sb).token_ids.tolist()

    assert draws(42) == draws(42)
    assert draws(42) != draws(43)
    assert draws(42) != draws(42 + (1 << 32))  # the high seed bits matter
    # a different position with the same seed is a different draw too
    sb = batch_for([SamplingParams()] * 64, [42] * 64, [7] * 64, vocab)
    assert len(set(sample(logits[:1].expand(64, vocab).contiguous(), sb).token_ids.tolist())) == 1


def test_filter_off_rows_unaffected_by_batch_neighbours() -> None:
    """A row without top-p keeps its tiny-probability tail even when another row of the
    batch needs the sort path (float32 cumsum reaches 1.0 before the tail)."""
    logits = torch.tensor([[30.0, 0.0, -1.0, 0.5] + [0.0] * (V - 4)] * 2)
    p = SamplingParams(top_logprobs=3)
    alone = sample(logits, batch_for([p, p], [1, 2], [1, 1]))
    mixed = sample(logits, batch_for([p, SamplingParams(top_p=0.5, top_logprobs=3)], [1, 2], [1, 1]))
    assert torch.equal(alone.top_processed[0][0], mixed.top_processed[0][0])
    assert torch.isfinite(mixed.top_processed[0][0]).all()
    # top-k alone (top_p = 1) matches transformers, which keeps the tail inside the top k
    k = sample(logits, batch_for([SamplingParams(top_k=3, top_logprobs=3)] * 2, [1, 2], [1, 1]))
    ref = reference_probs(logits[0], SamplingParams(top_k=3)).log()
    torch.testing.assert_close(k.top_processed[0][0].double(), ref.topk(3).values, atol=1e-5, rtol=0)


# ---- log-probs --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["t0.7", "topk3", "topp0.8", "minp0.2", "combo"])
def test_logprobs_match_reference(name: str) -> None:
    p = SETTINGS[name]
    n = 500
    _, out = drawn_counts(p, seed_base=7)  # reuse the big batch; check a slice
    ref_processed = reference_probs(LOGITS, p).log()
    raw = torch.log_softmax(LOGITS.double(), dim=-1)
    tok = out.token_ids[:n]
    torch.testing.assert_close(out.processed_logprobs[:n].double(), ref_processed[tok], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.raw_logprobs[:n].double(), raw[tok], atol=1e-5, rtol=0)
    assert torch.isfinite(out.processed_logprobs).all()


def test_top_logprobs() -> None:
    p = SamplingParams(temperature=0.7, top_k=4, top_logprobs=6)
    sb = batch_for([p, SamplingParams(top_logprobs=2)], [1, 2], [3, 4])
    out = sample(LOGITS.expand(2, V).contiguous(), sb)
    raw = torch.log_softmax(LOGITS, dim=-1)
    vals, ids = out.top_raw
    assert vals.shape == (2, 6)
    torch.testing.assert_close(vals[0], raw.topk(6).values)
    assert torch.equal(ids[0], raw.topk(6).indices)
    pvals, pids = out.top_processed
    ref = reference_probs(LOGITS, p).log()
    torch.testing.assert_close(pvals[0][:4].double(), ref.topk(4).values, atol=1e-5, rtol=0)
    assert torch.isinf(pvals[0][4:]).all()  # filtered tokens report -inf


# ---- greedy -----------------------------------------------------------------------------------


def test_all_greedy() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g) * 3
    sb = batch_for([SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.5)] * 6, list(range(6)), [2] * 6)
    assert sb.all_greedy
    out = sample(logits, sb)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    raw = torch.log_softmax(logits, dim=-1).gather(-1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.raw_logprobs, raw)
    torch.testing.assert_close(out.processed_logprobs, raw)  # greedy reports the raw value


def test_mixed_greedy_and_sampled_batch() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, V, generator=g) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.4, top_k=3),
        SamplingParams(temperature=0.0, top_p=0.1),
        SamplingParams(top_p=0.7),
        SamplingParams(temperature=0.0, min_p=0.9),
        SamplingParams(min_p=0.3),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.0),
    ]
    greedy = [p.greedy for p in params]
    sb = batch_for(params, list(range(8)), [9] * 8)
    assert not sb.all_greedy and sb.need_sort and sb.need_min_p
    out = sample(logits, sb)
    raw = torch.log_softmax(logits, dim=-1)
    for row, p in enumerate(params):
        tok = int(out.token_ids[row])
        assert out.raw_logprobs[row] == raw[row, tok]
        if greedy[row]:
            assert tok == int(logits[row].argmax())
            assert out.processed_logprobs[row] == raw[row, tok]
        else:
            ref = reference_probs(logits[row], p)
            assert ref[tok] > 0
            assert abs(float(out.processed_logprobs[row]) - math.log(float(ref[tok]))) < 1e-5
    # sampled rows draw what they draw alone
    for row in range(8):
        alone = sample(logits[row : row + 1], batch_for([params[row]], [row], [9]))
        assert int(alone.token_ids[0]) == int(out.token_ids[row])


# ---- noise ------------------------------------------------------------------------------------


def test_uniform_noise_is_uniformish() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 12345, 987654321], dtype=torch.int64).repeat_interleave(5000)
    positions = torch.arange(20000, dtype=torch.int64) % 9973
    u32 = uniform_noise(seeds, positions, 64)
    assert u32.dtype == torch.float32 and u32.shape == (20000, 64)
    u = u32.double()
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    n = u.numel()
    # mean of n U(0,1): sd = sqrt(1/12/n) ~ 2.5e-4 here; 6 sd bound
    assert abs(float(u.mean()) - 0.5) < 6 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 0.002
    # per vocab column and per seed: no column or stream is biased (6 sd bounds)
    col = u.mean(dim=0)
    assert (col - 0.5).abs().max() < 6 * math.sqrt(1 / 12 / u.shape[0])
    per_seed = u.reshape(4, -1).mean(dim=1)
    assert (per_seed - 0.5).abs().max() < 6 * math.sqrt(1 / 12 / (n / 4))
    # 20 equal bins: chi-square uniformity
    hist = torch.histc(u, bins=20, min=0.0, max=1.0)
    assert chi_square_p_value(hist, torch.full((20,), 1 / 20, dtype=torch.float64)) > P_MIN
    # neighbouring positions / vocab ids are not correlated
    a, b = u[:-1].flatten(), u[1:].flatten()
    corr = float(((a - 0.5) * (b - 0.5)).mean() * 12)
    assert abs(corr) < 6 / math.sqrt(a.numel())


def test_uniform_noise_is_a_pure_function() -> None:
    seeds = torch.tensor([5, 5, 6, 5], dtype=torch.int64)
    positions = torch.tensor([10, 11, 10, 10], dtype=torch.int64)
    u = uniform_noise(seeds, positions, 32)
    assert torch.equal(u[0], u[3])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    # a row's noise does not depend on the vocab size beyond its own ids
    assert torch.equal(uniform_noise(seeds, positions, 8), u[:, :8])
    assert len(set(u[0].tolist())) == 32


def test_uniform_noise_equals_the_int64_definition() -> None:
    """The int32 in-place rounds give the bits of the int64 lanes masked to 32 bits (the hash
    as first written, and as kernels/race.py and speculative/noise.py compute it)."""
    from rollout.sampling import _MASK32, _mix32, row_keys

    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-2**63, 2**63 - 1, (30,), generator=g), torch.tensor([0, -1, 2**63 - 1])])
    positions = torch.cat([torch.randint(0, 2**40, (30,), generator=g), torch.tensor([0, 1, 2**32 + 5])])
    vocab = 70000  # ids past 2**16: the golden-ratio product overflows 32 bits
    key = row_keys(seeds, positions)
    ids = torch.arange(vocab, dtype=torch.int64)
    h = _mix32((key[:, None] ^ ((ids[None, :] * 0x9E3779B9) & _MASK32)) & _MASK32)
    h = _mix32(h ^ key[:, None])
    want = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    assert torch.equal(uniform_noise(seeds, positions, vocab), want)

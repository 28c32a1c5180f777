"""K policies on synthetic acceptance streams with scripted latencies: no models, no clocks, no sleeps."""

import random

import pytest

from edgespec.costmodel import Latencies
from edgespec.errors import EdgespecError
from edgespec.policy import AdaptiveK, FixedK

VERIFY = [0, 0.100, 0.104, 0.108, 0.112, 0.118, 0.124, 0.130, 0.138, 0.146]
T_DRAFT = 0.01


def simulate(policy, rates, rng, t_draft=T_DRAFT):
    """Run one round per entry of `rates` (i.i.d. acceptance for that round); return the K of each round."""
    ks = []
    for a in rates:
        k = policy.next_k()
        n = 0
        while n < k and rng.random() < a:
            n += 1
        policy.observe(k, k, n, k * t_draft, VERIFY[k + 1])
        ks.append(k)
    return ks


def profiled():
    return AdaptiveK(latencies=Latencies.linear(T_DRAFT, VERIFY), prior_acceptance=0.6, k_max=8)


def test_high_acceptance_gives_large_k():
    ks = simulate(profiled(), [0.9] * 60, random.Random(0))
    steady = sorted(ks[20:])
    assert steady[len(steady) // 2] >= 5 and min(steady) >= 3  # the cost-model optimum here is K=6


def test_drop_drives_k_to_zero_within_bounded_rounds_and_recovers():
    policy = profiled()
    rng = random.Random(1)
    simulate(policy, [0.9] * 40, rng)
    ks_low = simulate(policy, [0.02] * 80, rng)
    first_zero = ks_low.index(0)
    assert first_zero <= 15, ks_low
    # After that, speculation stays off except for occasional short probes.
    after = ks_low[first_zero:]
    assert sum(1 for k in after if k > 0) <= len(after) // 6
    assert all(k <= policy.probe_k for k in after)
    ks_back = simulate(policy, [0.9] * 120, rng)
    back = next(i for i, k in enumerate(ks_back) if k >= 3)
    assert back <= 80, ks_back
    settled = ks_back[back + 10:]
    assert sum(1 for k in settled if k < 3) <= 2, settled  # a rare dip after a rejection, no relapse
    assert sorted(settled)[len(settled) // 2] >= 5


def test_slow_draft_keeps_speculation_off():
    policy = AdaptiveK(latencies=Latencies.linear(0.2, VERIFY), prior_acceptance=0.9, k_max=8)
    ks = simulate(policy, [0.95] * 40, random.Random(2), t_draft=0.2)
    assert ks.count(0) >= 30


def test_one_slow_round_does_not_switch_speculation_off():
    """A preempted drafting step (50x its usual time) is noise, not a new latency: K stays up."""
    policy = profiled()
    rng = random.Random(3)
    simulate(policy, [0.9] * 30, rng)
    policy.observe(6, 6, 6, 50 * 6 * T_DRAFT, VERIFY[7])
    ks = simulate(policy, [0.9] * 10, rng)
    assert min(ks) >= 3, ks


def test_without_profile_calibrates_then_decides():
    policy = AdaptiveK(latencies=None, prior_acceptance=0.6, k_max=8)
    ks = simulate(policy, [0.9] * 40, random.Random(3))
    assert ks[:3] == [0, 2, 4]  # calibration rounds measure verify(1), verify(3), verify(5) and the draft
    assert min(ks[10:]) >= 3
    assert policy.verify[1] == pytest.approx(VERIFY[1])


def test_front_loaded_acceptance_chooses_small_k():
    policy = profiled()
    rng = random.Random(4)
    ks = []
    for _ in range(80):
        k = policy.next_k()
        n = 0
        # the first two drafts almost always pass, later ones almost never
        for i in range(k):
            if rng.random() < (0.97 if i < 2 else 0.05):
                n += 1
            else:
                break
        policy.observe(k, k, n, k * T_DRAFT, VERIFY[k + 1])
        ks.append(k)
    assert all(2 <= k <= 3 for k in ks[30:]), ks[30:]


def test_short_proposals_count_unproposed_positions_as_not_accepted_and_not_reached():
    policy = profiled()
    reached, accepted = list(policy.reached), list(policy.accepted)
    asked, proposed = list(policy.asked), list(policy.proposed)
    policy.observe(6, 2, 2, 0.02, VERIFY[3])  # the drafter stopped early (p-min) after 2 tokens, both passed
    d = policy.decay
    # position 2 was asked for with both drafts before it accepted, but nothing was proposed: not accepted
    assert policy.reached[:4] == pytest.approx([reached[0] * d + 1, reached[1] * d + 1, reached[2] * d + 1,
                                                reached[3] * d])
    assert policy.accepted[:3] == pytest.approx([accepted[0] * d + 1, accepted[1] * d + 1, accepted[2] * d])
    # and the proposal reached positions 0 and 1 of the 6 asked for
    assert policy.asked[:7] == pytest.approx([a * d + 1 for a in asked[:6]] + [asked[6] * d])
    assert policy.proposed[:3] == pytest.approx([proposed[0] * d + 1, proposed[1] * d + 1, proposed[2] * d])


def test_a_drafter_that_seldom_proposes_is_charged_only_for_what_it_proposes():
    """An n-gram lookup proposes 6 tokens in one round of five (all accepted), nothing otherwise: positions it
    does not reach cost nothing, so a large K still pays, and the expected cost is far below verify(K+1)."""
    policy = AdaptiveK(latencies=Latencies.linear(0.0, VERIFY), prior_acceptance=0.5, k_max=8)
    for r in range(100):
        k = policy.next_k()
        n = min(k, 6) if r % 5 == 0 else 0
        policy.observe(k, n, n, 0.0, VERIFY[n + 1])
    assert policy.reach()[0] == pytest.approx(0.2, abs=0.05)
    assert policy.next_k() >= 5
    lat = policy.latencies()
    assert lat.verify[7] < VERIFY[1] + 0.3 * (VERIFY[7] - VERIFY[1])


def test_a_seldom_proposing_drafter_is_not_locked_at_k_1():
    """An n-gram lookup matches one round in four and every match is accepted. After many rounds at K = 1
    (position 1's counts have aged away: they grow only while K > 1) position 1 must be judged by how often a
    proposal is accepted, not by the match rate, or K = 1 locks itself in."""
    steep = [0.0] + [0.100 * (1 + 0.1 * (n - 1)) for n in range(1, 10)]  # each verified row costs 10% more
    policy = AdaptiveK(latencies=Latencies.linear(0.0, steep), prior_acceptance=0.5, k_max=8, probe_every=1000)
    rng = random.Random(3)
    for _ in range(150):
        n = 1 if rng.random() < 0.25 else 0
        policy.observe(1, n, n, 0.0, steep[n + 1])
    assert policy.reach()[0] == pytest.approx(0.25, abs=0.1)
    assert policy.conditional_acceptance()[1] > 0.8
    assert policy.next_k() >= 2


def test_prior_fades_as_rounds_accumulate():
    policy = profiled()  # prior 0.6 per position
    for _ in range(30):
        policy.observe(4, 4, 4, 0.04, VERIFY[5])  # everything accepted
    assert policy.conditional_acceptance()[0] > 0.95


@pytest.mark.parametrize("k", [-1, 17])
def test_fixed_k_range(k):
    with pytest.raises(EdgespecError):
        FixedK(k)


def test_catch_up_must_be_repaid_by_the_rest_of_the_answer():
    """The draft model's lazy prefill of a long prompt is a one-off cost: with a short answer left, drafting
    would not repay it, so K stays 0; with a short lag (or a long answer ahead) the same acceptance drafts."""
    policy = profiled()
    simulate(policy, [0.9] * 20, random.Random(5))
    assert policy.next_k(remaining=400, lag=1) >= 3  # steady state: nothing to catch up
    policy.catch_up_per_token = 0.002  # 2 ms per unseen token, as measured from earlier catch-ups
    # 600 unseen tokens = 1.2 s; 20 tokens at 0.1 s save far less than that even at a large speed-up
    assert policy.next_k(remaining=20, lag=600) == 0
    assert policy.waiting == 1
    # a long answer ahead repays it
    assert policy.next_k(remaining=2000, lag=600) >= 3


def test_catch_up_price_is_measured_and_answer_lengths_cap_the_horizon():
    policy = profiled()
    simulate(policy, [0.9] * 20, random.Random(6))
    policy.observe(4, 4, 4, 0.04, VERIFY[5], catch_up_s=0.3, catch_up_tokens=300)
    assert policy.catch_up_per_token == pytest.approx(0.001)
    # three requests that each ended after about 10 tokens (the budget was 500 every time)
    for _ in range(3):
        policy.begin_request()
        remaining = 500
        while remaining > 490:
            k = policy.next_k(remaining=remaining, lag=1)
            policy.observe(k, k, k, k * T_DRAFT, VERIFY[k + 1])
            remaining -= k + 1
    policy.begin_request()  # the fourth request starts; the third is counted now
    assert policy.next_k(remaining=500, lag=1) > 0
    # the rounds before count as one long first answer; the three short ones follow
    assert len(policy.answer_lengths) == 4 and list(policy.answer_lengths)[1:] == [12, 12, 12]
    # 3000 unseen tokens = 3 s; ~12 tokens at 0.1 s save less than 1.2 s: not repaid, although 500 may follow
    assert policy.next_k(remaining=500, lag=3000) == 0
    assert policy.next_k(remaining=500, lag=2) > 0


def test_an_answer_cut_at_its_budget_does_not_shorten_the_next_answers_horizon():
    """The bench warms each configuration up on a 16-token answer: that answer was cut, not short. Counted as
    a length, it kept the draft model from starting on the next 128-token request (K = 0 where K = 3 won)."""
    policy = profiled()
    simulate(policy, [0.9] * 20, random.Random(8))
    policy.catch_up_per_token = 0.002  # a 500-token prompt costs the drafter 1 s to take in

    def answer(budget, stop_after):
        policy.begin_request()
        remaining, emitted = budget, 0
        while emitted < stop_after:
            k = min(policy.next_k(remaining=remaining, lag=1), remaining - 1)
            policy.observe(k, k, k, k * T_DRAFT, VERIFY[k + 1])
            remaining, emitted = remaining - (k + 1), emitted + k + 1
        policy.begin_request()  # the answer is counted (or not) when the next one begins

    policy.begin_request()
    policy.answer_lengths.clear()  # the simulated rounds above had no budget: forget them
    answer(budget=16, stop_after=16)  # cut at its budget
    assert list(policy.answer_lengths) == []
    assert policy.next_k(remaining=128, lag=500) > 0  # 128 tokens at ~1.3x save more than 1 s
    answer(budget=128, stop_after=10)  # ended on its own (EOS) after 10 tokens: a real length
    assert len(policy.answer_lengths) == 1
    assert policy.next_k(remaining=128, lag=500) == 0  # ~10 tokens would not repay 1 s


def test_probe_does_not_pay_a_long_catch_up():
    policy = AdaptiveK(latencies=Latencies.linear(0.2, VERIFY), prior_acceptance=0.9, k_max=8, probe_every=2)
    ks_lagging = [policy.next_k(remaining=100, lag=500) for _ in range(10)]
    assert ks_lagging == [0] * 10  # a prefill of 500 tokens would cost more than a round of plain decoding
    ks_caught_up = [policy.next_k(remaining=100, lag=1) for _ in range(10)]
    assert any(k > 0 for k in ks_caught_up)  # probes still happen when drafting can start at once


def test_speculation_comes_back_although_every_request_starts_far_behind():
    """In a chat where speculation went off, each new turn leaves the drafter behind by the whole previous
    answer: a probe must still come, once the time spent without speculation makes its catch-up cheap."""
    policy = profiled()
    rng = random.Random(7)
    simulate(policy, [0.02] * 60, rng)  # acceptance collapsed: speculation off
    policy.catch_up_per_token = 0.001
    ks = [policy.next_k(remaining=200, lag=400) for _ in range(300)]  # 0.4 s to catch up = 4 plain rounds
    first = next((i for i, k in enumerate(ks) if k > 0), None)
    assert first is not None and first <= 100, first  # (the probe interval has doubled to 64 by now)


def test_shadow_proposals_bring_speculation_back_without_probes():
    """A free drafter's proposals checked while K = 0 count as evidence: when they start matching, K comes
    back within a few reports, before any probe would have fired."""
    policy = AdaptiveK(latencies=Latencies.linear(0.0, VERIFY), prior_acceptance=0.5, k_max=8, probe_every=1000)
    for _ in range(30):
        k = policy.next_k()
        policy.observe(k, k, 0, 0.0, VERIFY[k + 1])  # nothing accepted: speculation goes off
    assert policy.next_k() == 0
    ks = []
    for _ in range(12):
        policy.observe_shadow(8, 8)  # the lookup keeps predicting the target's next 8 tokens
        ks.append(policy.next_k())
    assert ks[-1] >= 4 and ks.index(next(k for k in ks if k > 0)) <= 6, ks


def test_an_exact_targets_row_floor_prices_short_steps_as_min_rows():
    policy = profiled()
    policy.min_rows = 4  # the engine sets it from an exact target, whose short steps run padded to 4 rows
    lat = policy.latencies()
    assert lat.verify[1] == lat.verify[2] == lat.verify[3] == lat.verify[4] == pytest.approx(VERIFY[4])
    assert lat.verify[6] == pytest.approx(VERIFY[6])
    policy.observe(0, 0, 0, 0.0, 2 * VERIFY[4])  # a K = 0 round ran 4 rows, twice as slow as profiled
    assert policy.verify_scale == pytest.approx(2.0)
    assert policy.latencies().verify[1] == pytest.approx(2 * VERIFY[4])


def test_overlapped_rounds_charge_drafting_per_token_the_drafter_ran_for():
    """Overlapped, a round whose draft was ready (drafted ahead) reports the drafter's work on the tokens it
    drafted for the next round: the per-token cost is that work over those tokens, not over the K proposed."""
    policy = AdaptiveK(latencies=Latencies.linear(T_DRAFT, VERIFY), prior_acceptance=0.9, k_max=8, overlap=True)
    for _ in range(9):
        k = policy.next_k()
        policy.observe(k, k, k, (k + 1) * 3 * T_DRAFT, VERIFY[k + 1], drafted=k + 1)
    assert policy.draft_per_token == pytest.approx(3 * T_DRAFT)
    policy.observe(4, 4, 4, 0.0, VERIFY[5], drafted=0)  # nothing drafted anywhere: nothing learnt
    assert policy.draft_per_token == pytest.approx(3 * T_DRAFT)
    # drafting three times dearer than profiled keeps overlapped K where drafting K + 1 hides behind verifying;
    # had the ready rounds been taken for free drafting (the profile's per-token cost, at best), K would climb
    k = policy.next_k()
    policy.draft_per_token = T_DRAFT
    assert k <= 4 < policy.next_k()

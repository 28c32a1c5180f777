import pytest

from edgespec.costmodel import Latencies, best_k, expected_tokens, iid_survival, round_cost, speedup, speedups


def test_expected_tokens_iid_closed_form():
    a = 0.7
    for k in range(0, 8):
        assert expected_tokens(iid_survival(a, 8), k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_known_argmax():
    # cheap draft (10% of a target pass), flat verification, acceptance 0.8: the optimum is interior.
    lat = Latencies.linear(0.01, [0, 0.1, 0.1, 0.1, 0.1, 0.11, 0.12, 0.13, 0.15, 0.17])
    table = speedups(iid_survival(0.8, 8), lat)
    k, s = best_k(iid_survival(0.8, 8), lat)
    assert k == max(range(len(table)), key=table.__getitem__)
    # hand-checked: K=4: E = (1-.8^5)/.2 = 3.3616; cost .04 + .11 = .15; speed-up 3.3616*.1/.15 = 2.241
    assert speedup(iid_survival(0.8, 8), lat, 4) == pytest.approx(2.2411, abs=1e-3)
    assert 3 <= k <= 6 and s > 2


def test_k_zero_when_drafting_is_slower_than_the_target():
    lat = Latencies.linear(0.2, [0, 0.1] + [0.1] * 8)  # a draft token costs twice a target pass
    assert best_k(iid_survival(0.9, 8), lat) == (0, 1.0)


def test_k_zero_when_acceptance_is_nil():
    lat = Latencies.linear(0.001, [0, 0.1] + [0.1] * 8)
    assert best_k([0.0] * 8, lat)[0] == 0


def test_overlap_formula():
    lat = Latencies.linear(0.03, [0, 0.1, 0.1, 0.12, 0.14, 0.16, 0.18])
    assert round_cost(lat, 3) == pytest.approx(0.09 + 0.14)
    # optimistic form (every overlapped draft used): max(draft(K+1), verify(K+1))
    assert round_cost(lat, 3, overlap=True) == pytest.approx(max(0.12, 0.14))
    # with acceptance: the next draft is ready only when the block and the guess pass (survival[K])
    surv = [0.9, 0.8, 0.7, 0.6, 0.5]
    assert round_cost(lat, 3, overlap=True, survival=surv) == pytest.approx(max(0.12, 0.14) + (1 - 0.6) * 0.09)
    assert speedup(surv, lat, 3, overlap=True) > speedup(surv, lat, 3)
    # a guess that is never right leaves the sequential cost plus nothing saved
    never = [0.9, 0.8, 0.7, 0.0]
    assert round_cost(lat, 3, overlap=True, survival=never) >= round_cost(lat, 3)


def test_overlap_predicts_the_measured_qwen_gain_better_than_the_optimistic_form():
    # 1-thread latencies and acceptance measured on the Qwen pair (docs/bench/overlap/ before bac3fec): K=2: 1.17x.
    lat = Latencies([0, 0.0165, 0.0373, 0.0527], [0, 0.0484, 0.0577, 0.0691])
    surv = [0.75, 0.65]
    optimistic = expected_tokens(surv, 2) * lat.verify[1] / max(lat.draft[2], lat.verify[3])
    refined = speedup(surv, lat, 2, overlap=True)
    assert abs(refined - 1.17) < abs(optimistic - 1.17)


def test_per_position_acceptance_differs_from_iid():
    # Same average survival mass, different shape: high early, collapsing late favours a small K.
    lat = Latencies.linear(0.02, [0, 0.1] + [0.1] * 9)
    front_loaded = [0.95, 0.9, 0.2, 0.05, 0.01, 0.0, 0.0, 0.0]
    iid = iid_survival(0.8, 8)
    assert best_k(front_loaded, lat)[0] == 2
    assert best_k(iid, lat)[0] > 2


def test_margin_keeps_speculation_off_for_marginal_gains():
    lat = Latencies.linear(0.045, [0, 0.1] + [0.1] * 9)
    surv = iid_survival(0.5, 8)
    k, s = best_k(surv, lat)
    assert k > 0 and s < 1.05
    assert best_k(surv, lat, margin=0.05) == (0, 1.0)


def test_expected_latencies_charge_positions_by_how_often_proposals_reach_them():
    lat = Latencies.linear(0.01, [0, 0.10, 0.11, 0.13, 0.16, 0.20])
    assert lat.expected(None) is lat and lat.expected([1.0] * 4) is lat
    exp = lat.expected([0.5, 0.25, 0.0, 0.0])
    # verify(1) is always paid; position j adds reach[j] x (verify(j+2) - verify(j+1))
    assert exp.verify[:5] == pytest.approx([0, 0.10, 0.105, 0.11, 0.11])
    assert exp.draft[:5] == pytest.approx([0, 0.005, 0.0075, 0.0075, 0.0075])
    # a lookup that seldom proposes but is right when it does: charged as if it always proposed K=2 it loses,
    # charged for what it proposes it wins
    survival = [0.2, 0.2, 0.0, 0.0]
    assert speedup(survival, lat, 2) < 1.0 < speedup(survival, exp, 2)

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
    lat = Latencies.linear(0.03, [0, 0.1, 0.1, 0.12, 0.14, 0.16])
    assert round_cost(lat, 3) == pytest.approx(0.09 + 0.14)
    assert round_cost(lat, 3, overlap=True) == pytest.approx(0.14)
    assert round_cost(lat, 4, overlap=True) == pytest.approx(max(0.12, 0.16))
    surv = iid_survival(0.8, 4)
    assert speedup(surv, lat, 3, overlap=True) > speedup(surv, lat, 3)


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

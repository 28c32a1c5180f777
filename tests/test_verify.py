"""The accept/reject rules against the exact distribution, by enumeration and by Monte Carlo.

A negative control (a rule that always accepts) must fail the same checks, which shows the checks can fail.
"""

import pytest
import torch

from edgespec import verify
from edgespec.verify import acceptance_probability, residual_distribution, verify_greedy, verify_sampling


def d(*xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return t / t.sum()


# (p_target row, p_draft row) pairs over a 4-token vocabulary.
CASES = {
    "identical": (d(0.1, 0.2, 0.3, 0.4), d(0.1, 0.2, 0.3, 0.4)),
    "disjoint": (d(0.5, 0.5, 0, 0), d(0, 0, 0.3, 0.7)),
    "draft_zero_where_target_positive": (d(0.25, 0.25, 0.25, 0.25), d(0.0, 0.5, 0.5, 0.0)),
    "peaked_vs_flat": (d(0.97, 0.01, 0.01, 0.01), d(0.25, 0.25, 0.25, 0.25)),
    "flat_vs_peaked": (d(0.25, 0.25, 0.25, 0.25), d(0.01, 0.97, 0.01, 0.01)),
    "one_hot_draft": (d(0.2, 0.3, 0.1, 0.4), d(0, 1, 0, 0)),
}


def exact_emitted(p_target_row, p_draft_row, accept=acceptance_probability):
    """P(emitted token = y) at a drafted position: sum over drafts x of accept and reject paths."""
    v = p_target_row.shape[0]
    out = torch.zeros(v, dtype=torch.float64)
    residual = residual_distribution(p_target_row, p_draft_row)
    for x in range(v):
        px = p_draft_row[x].item()
        if px == 0:
            continue
        a = accept(p_target_row[x].item(), px)
        out[x] += px * a
        out += px * (1 - a) * residual
    return out


@pytest.mark.parametrize("name", CASES)
def test_exact_distribution_each_position(name):
    p_t, p_d = CASES[name]
    assert torch.allclose(exact_emitted(p_t, p_d), p_t, atol=1e-6)


def always_accept(p_target_x, p_draft_x):
    return 1.0


@pytest.mark.parametrize("name", [n for n in CASES if n != "identical"])
def test_negative_control_always_accept_fails_exact_check(name):
    p_t, p_d = CASES[name]
    assert not torch.allclose(exact_emitted(p_t, p_d, accept=always_accept), p_t, atol=1e-6)


def empirical_first_token(p_t, p_d, n, seed=0, rule=verify_sampling):
    """Draw the draft from p_draft, run the rule with K=2 (rows repeated), count the first emitted token,
    and the token at the bonus position when both drafts pass."""
    g = torch.Generator().manual_seed(seed)
    p_target = torch.stack([p_t, p_t, p_t])
    p_draft = torch.stack([p_d, p_d])
    first = torch.zeros(p_t.shape[0], dtype=torch.float64)
    bonus = torch.zeros(p_t.shape[0], dtype=torch.float64)
    drafts = torch.multinomial(p_d.float(), 2 * n, replacement=True, generator=g).view(n, 2).tolist()
    for tokens in drafts:
        verdict = rule(tokens, p_draft, p_target, g)
        emitted = tokens[: verdict.n_accepted] + [verdict.next_token]
        first[emitted[0]] += 1
        if verdict.n_accepted == 2:
            bonus[verdict.next_token] += 1
    return first / n, bonus / max(bonus.sum(), 1)


def within(emp, p, n, sigmas=5.0):
    bound = sigmas * torch.sqrt(p * (1 - p) / n) + 1e-9
    return bool(((emp - p).abs() <= bound).all())


@pytest.mark.parametrize("name", CASES)
def test_monte_carlo_matches_target(name):
    p_t, p_d = CASES[name]
    n = 20000
    first, _ = empirical_first_token(p_t, p_d, n, seed=1)
    assert within(first, p_t, n)


def test_monte_carlo_bonus_position_is_target():
    p_t, p_d = CASES["identical"]  # every draft passes, so the bonus row is sampled each time
    first, bonus = empirical_first_token(p_t, p_d, 20000, seed=2)
    assert within(bonus, p_t, 20000)


def test_monte_carlo_negative_control_fails(monkeypatch):
    monkeypatch.setattr(verify, "acceptance_probability", always_accept)
    for name in ["disjoint", "peaked_vs_flat", "flat_vs_peaked"]:
        p_t, p_d = CASES[name]
        first, _ = empirical_first_token(p_t, p_d, 20000, seed=1)
        assert not within(first, p_t, 20000), name


def test_bonus_row_is_used_when_all_accepted():
    p_t = torch.stack([d(0, 1, 0, 0), d(0, 0, 1, 0), d(0, 0, 0, 1)])
    p_d = torch.stack([d(0, 1, 0, 0), d(0, 0, 1, 0)])
    verdict = verify_sampling([1, 2], p_d, p_t, torch.Generator().manual_seed(0))
    assert (verdict.n_accepted, verdict.next_token) == (2, 3)


def test_zero_mass_residual_falls_back_to_target():
    p = d(0.5, 0.5, 0, 0)
    assert torch.allclose(residual_distribution(p, p.clone()), p)


def test_acceptance_probability_edges():
    assert acceptance_probability(0.3, 0.0) == 1.0
    assert acceptance_probability(0.0, 0.0) == 0.0
    assert acceptance_probability(0.0, 0.5) == 0.0
    assert acceptance_probability(0.2, 0.4) == pytest.approx(0.5)
    assert acceptance_probability(0.9, 0.4) == 1.0


def test_greedy_rule():
    logits = torch.tensor([[0, 5, 0.0], [0, 0, 5.0], [5, 0, 0.0]])
    assert verify_greedy([1, 2], logits).__dict__ == {"n_accepted": 2, "next_token": 0}
    assert verify_greedy([1, 0], logits).__dict__ == {"n_accepted": 1, "next_token": 2}
    assert verify_greedy([0, 2], logits).__dict__ == {"n_accepted": 0, "next_token": 1}
    assert verify_greedy([], logits[:1]).__dict__ == {"n_accepted": 0, "next_token": 1}
    with pytest.raises(ValueError):
        verify_greedy([1], logits)


@pytest.mark.parametrize("name", CASES)
def test_a_guessed_bonus_is_distributed_as_the_target(name):
    """An overlapped drafter's guess g ~ p_guess at the bonus position, judged by the rule: the bonus is still
    distributed as p_target's bonus row (Monte Carlo, and exactly: the bonus position is a drafted one)."""
    p_t, p_g = CASES[name]
    assert torch.allclose(exact_emitted(p_t, p_g), p_t, atol=1e-6)
    g = torch.Generator().manual_seed(3)
    n = 20000
    guesses = torch.multinomial(p_g.float(), n, replacement=True, generator=g).tolist()
    one = torch.stack([d(1, 0, 0, 0)])  # one draft (token 0), certain on both sides: it always passes
    target = torch.stack([d(1, 0, 0, 0), p_t])
    bonus = torch.zeros(4, dtype=torch.float64)
    kept = 0
    for x in guesses:
        verdict = verify_sampling([0], one, target, g, guess=(x, p_g))
        assert verdict.n_accepted == 1
        bonus[verdict.next_token] += 1
        kept += verdict.next_token == x
    assert within(bonus / n, p_t, n)
    # the guess is kept as often as a draft is accepted: sum_x min(p_guess(x), p_target(x))
    keep = torch.minimum(p_t, p_g).sum().item()
    assert abs(kept / n - keep) <= 5 * (keep * (1 - keep) / n) ** 0.5 + 1e-9


def test_a_guess_is_kept_far_more_often_than_an_independent_draw_would_match_it():
    p = d(0.4, 0.3, 0.2, 0.1)  # the same distribution on both sides: the rule keeps every guess
    g = torch.Generator().manual_seed(4)
    one, target = torch.stack([d(1, 0, 0, 0)]), torch.stack([d(1, 0, 0, 0), p])
    guesses = torch.multinomial(p.float(), 2000, replacement=True, generator=g).tolist()
    assert all(verify_sampling([0], one, target, g, guess=(x, p)).next_token == x for x in guesses)
    # (a fresh draw from p would have matched the guess with probability sum p^2 = 0.30)


def test_a_draw_takes_the_token_whose_cumulative_weight_passes_the_uniform_and_never_one_of_zero_weight(monkeypatch):
    """`_draw` inverts the CDF with one uniform from the generator: u = 0 gives the first token of positive weight,
    a u that rounds up to the total the last one (zero-weight tokens around them are never drawn), and in between
    the token whose cumulative weight first passes u x total."""
    from edgespec import verify

    dist = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    for u, token in ((0.0, 1), (0.2499, 1), (0.25, 3), (0.74, 3), (0.75, 4), (1.0, 4)):
        # u = 1.0 stands for a uniform just under 1 that rounds up to the total once scaled
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.tensor(u, dtype=k.get("dtype")))
        assert verify._draw(dist, torch.Generator()) == token, u
    monkeypatch.undo()
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[verify._draw(dist * 3.0, gen)] += 1  # unnormalised weights are fine
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts / counts.sum(), (dist / dist.sum()).float(), atol=0.03)


@pytest.mark.parametrize("vocab", [49152, 151936, 8 * 256 + 1])  # whole blocks; a tail block; a one-token tail
def test_the_two_level_draw_takes_the_token_the_flat_inverse_cdf_takes(monkeypatch, vocab):
    """Over a large vocabulary `_draw` finds the block, then the token in it. With integer weights every sum is
    exact, so for any uniform it must take exactly the token of the flat inverse CDF: zero-weight tokens and
    whole zero-weight blocks never, the first token of positive weight at u = 0, the last at a u that rounds up
    to the total (1.0 here)."""
    from edgespec import verify

    gen = torch.Generator().manual_seed(vocab)
    dist = torch.randint(0, 4, (vocab,), generator=gen).double()
    dist[: 3 * 256] = 0  # leading empty blocks
    dist[5 * 256: 7 * 256] = 0  # empty blocks in the middle
    dist[-300:] = 0  # trailing zeros across a block boundary
    cdf = torch.cumsum(dist, 0)
    total = float(cdf[-1])

    def flat(u):
        i = int(torch.searchsorted(cdf, u * total, right=True))
        return i if i < vocab else int(torch.nonzero(dist > 0)[-1])

    boundaries = [float(cdf[j]) / total for j in range(0, vocab, 97)]  # u landing exactly on running sums
    uniforms = [0.0, 1.0, *boundaries, *torch.rand(2000, generator=gen, dtype=torch.float64).tolist()]
    for u in uniforms:
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.tensor(u, dtype=k.get("dtype")))
        token = verify._draw(dist, torch.Generator())
        assert token == flat(u), u
        assert dist[token] > 0
    monkeypatch.undo()
    assert verify._draw(dist.float(), torch.Generator().manual_seed(1)) in range(vocab)  # float32 weights too


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_rule_refuses_target_rows_with_nan_or_plus_inf_anywhere_and_allows_minus_inf(bad, temperature):
    """One NaN or +inf in any row, at any place (not only where the argmax is), is the target's error; -inf is a
    token the model rules out."""
    from edgespec.engine import judge
    from edgespec.errors import EdgespecError
    from edgespec.drafters.base import Draft
    from edgespec.sampling import SamplingParams

    params = SamplingParams(temperature=temperature)
    for row, col in [(0, 0), (1, 7), (2, 95)]:
        logits = torch.randn(3, 96)
        logits[row, col] = bad
        with pytest.raises(EdgespecError, match=r"the target \(torch x\) computed logits that are not finite"):
            judge(Draft([3, 4]), logits, params, torch.Generator().manual_seed(0), target="torch x")
    logits = torch.randn(3, 96)
    logits[1, 5] = float("-inf")
    judge(Draft([3, 4]), logits, params, torch.Generator().manual_seed(0), target="torch x")

import pytest
import torch

from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams, probs_from_logits


def test_temperature_one_is_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(probs_from_logits(logits, SamplingParams(temperature=1.0)), torch.softmax(logits, -1))


def test_temperature_scales():
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(probs_from_logits(logits, SamplingParams(temperature=0.5)), torch.softmax(logits * 2, -1))


def test_greedy_is_one_hot_argmax():
    p = probs_from_logits(torch.tensor([[0.1, 3.0, 2.0]]), SamplingParams())
    assert p.tolist() == [[0.0, 1.0, 0.0]]


def test_top_k_keeps_k_best():
    p = probs_from_logits(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    assert p[0] == 0 and p[3] == 0
    assert torch.allclose(p[1:3], torch.softmax(torch.tensor([4.0, 3.0]), -1))


def test_top_p_keeps_the_crossing_token():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = probs_from_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.7))
    # 0.5 < 0.7, 0.5 + 0.3 crosses: keep the first two, renormalised
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probs_from_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.allclose(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_batched_rows_are_independent():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p.sum(-1), torch.ones(2))
    assert p[0, 0] == 0 and p[1, 2] == 0


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0}, {"top_p": 1.5}])
def test_bad_params_are_one_line_errors(kwargs):
    with pytest.raises(EdgespecError) as err:
        SamplingParams(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spread,top_p", [(4.0, 0.9), (4.0, 0.5), (0.2, 0.95), (0.2, 0.3)])
def test_top_p_among_the_most_likely_tokens_equals_the_whole_sort(monkeypatch, spread, top_p):
    """A real vocabulary (152k for Qwen) looks for the nucleus among the TOP_P_CANDIDATES most likely tokens first
    (a peaked row: there), a flat row falls back to the whole sort: both bitwise what the whole sort gives."""
    from edgespec import sampling

    torch.manual_seed(0)
    logits = torch.randn(5, 20_000) * spread
    params = SamplingParams(temperature=0.7, top_p=top_p)
    fast = probs_from_logits(logits, params)
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 20_000)  # the whole sort, as before
    whole = probs_from_logits(logits, params)
    assert torch.equal(fast, whole)
    kept = (fast > 0).sum(-1)
    assert (kept >= 1).all() and (kept < 20_000).all()


def test_top_p_finds_the_nucleus_among_the_candidates_when_it_is_there(monkeypatch):
    from edgespec import sampling

    calls = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: calls.append(1) or real_sort(*a, **k))
    logits = torch.zeros(2, 20_000)
    logits[:, :10] = 20.0  # ten tokens hold nearly all the mass
    p = sampling.probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert not calls and ((p > 0).sum(-1) == 10).all()
    flat = sampling.probs_from_logits(torch.zeros(1, 20_000), SamplingParams(temperature=1.0, top_p=0.9))
    assert calls and int((flat > 0).sum()) in range(17_999, 18_002)  # 90% of a flat row: the whole sort's answer


def test_top_p_among_the_candidates_works_on_any_batch_shape():
    """The draft model's rows come one at a time ([V]), the target's as [K+1, V]: the candidates' path (a peaked
    row of a large vocabulary) gives each row what it gives that row alone, whatever the leading dimensions
    (mutants: topk or cumsum over `dim=+1`, an error on one row and the wrong axis on three dimensions)."""
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 20_000) * 4.0
    params = SamplingParams(temperature=0.7, top_p=0.9)
    rows = [probs_from_logits(row, params) for row in logits.reshape(6, -1)]
    assert all(row.shape == (20_000,) and 0 < int((row > 0).sum()) < 1_024 for row in rows)  # the candidates' path
    assert torch.equal(probs_from_logits(logits, params), torch.stack(rows).reshape(2, 3, -1))
    assert torch.equal(probs_from_logits(logits[0], params), torch.stack(rows[:3]))

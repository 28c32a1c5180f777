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

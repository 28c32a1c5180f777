"""Tests that kill mutants which survived the rest of the suite (scripts/mutation.sh, docs/mutation.md).

Each asserts behaviour a user relies on; the mutant it was written against is named in its docstring.
"""

import pytest
import torch

from edgespec.sampling import SamplingParams, probs_from_logits
from edgespec.verify import verify_greedy, verify_sampling


# --- edgespec/sampling.py

def test_greedy_probs_are_one_hot_over_the_last_axis_whatever_the_batch_shape():
    """probs_from_logits takes logits [..., V]: a single row and a [B, K, V] batch both get the one-hot argmax
    along V (mutants: `argmax(+1)`, `shape[+1]`, which only agree with -1 on 2-D input)."""
    row = torch.tensor([0.1, 3.0, 2.0, -1.0])
    assert probs_from_logits(row, SamplingParams()).tolist() == [0.0, 1.0, 0.0, 0.0]
    batch = torch.tensor([[[0.0, 1.0, 5.0], [9.0, 1.0, 0.0]], [[0.0, 7.0, 5.0], [1.0, 1.5, 2.0]]])  # [2, 2, 3]
    p = probs_from_logits(batch, SamplingParams())
    assert p.shape == (2, 2, 3)
    assert p.argmax(-1).tolist() == [[2, 0], [1, 2]] and torch.equal(p.sum(-1), torch.ones(2, 2))


def test_top_p_one_filters_nothing_even_a_token_below_the_float_resolution_of_the_cumulative_mass():
    """top_p == 1 means no filter: a token whose probability is too small to move a float32 running sum must
    keep its (tiny, nonzero) mass, or the output is no longer the target's distribution (mutants `top_p <= 1`,
    `top_p < 2`: the filter then drops every token whose mass-before rounds to 1)."""
    logits = torch.tensor([30.0, 0.0, 1.0])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1.0))
    assert torch.equal(p, torch.softmax(logits, -1))
    assert (p > 0).all()


# --- edgespec/verify.py

def test_greedy_rule_shape_error_names_rows_needed_and_given():
    """A wrong number of target rows is a programming error whose message says what was needed and what came
    (mutants replace the message with None or print the wrong counts)."""
    with pytest.raises(ValueError, match=r"^need 3 target rows for 2 drafts, got 4$"):
        verify_greedy([1, 2], torch.zeros(4, 5))


@pytest.mark.parametrize("draft_rows,target_rows", [(2, 4), (1, 3), (3, 3)])
def test_sampling_rule_refuses_rows_that_do_not_fit_the_drafts(draft_rows, target_rows):
    """Two drafts need two draft rows AND three target rows: either one wrong is refused, not read past its end
    or silently ignored (mutant: `or` -> `and`, which let a wrong draft row count through)."""
    with pytest.raises(ValueError, match=f"^need 2 draft rows and 3 target rows, got {draft_rows} and {target_rows}$"):
        verify_sampling([1, 2], torch.full((draft_rows, 4), 0.25), torch.full((target_rows, 4), 0.25),
                        torch.Generator().manual_seed(0))


def test_sampling_rule_draws_only_from_the_generator_it_is_given():
    """Every draw (the uniforms, the corrections, the bonus, a guess's uniform and its residual) comes from the
    request's generator, so a seeded request is reproducible whatever else touched torch's global RNG, and it
    leaves that global RNG alone (mutants: any of those draws without `generator=`)."""
    uniform = torch.full((8,), 1 / 8)
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 1]), 8).float()
    peaked = torch.tensor([0.65] + [0.05] * 7)
    scenarios = {
        "rejections": ([0, 1], one_hot, uniform.repeat(3, 1), None),  # drafts kept 1 in 8 times: corrections
        "bonus": ([0, 1], uniform.repeat(2, 1), uniform.repeat(3, 1), None),  # always accepted: the bonus draw
        # always accepted, then a guess at the bonus position kept or replaced from its residual
        "guess": ([0, 1], uniform.repeat(2, 1), uniform.repeat(3, 1), (0, peaked)),
    }

    def verdicts(global_seed, drafts, p_draft, p_target, guess):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        gen = torch.Generator().manual_seed(7)
        out = [verify_sampling(drafts, p_draft, p_target, gen, guess) for _ in range(40)]
        assert torch.equal(torch.get_rng_state(), state), "the rule consumed the global RNG"
        return [(v.n_accepted, v.next_token) for v in out]

    for name, args in scenarios.items():
        first = verdicts(1, *args)
        assert first == verdicts(2, *args), name
        assert len({t for _, t in first}) > 3, name  # the tokens really were drawn (not a constant)


class _ZeroUniform:
    """torch.rand stand-in whose every uniform is exactly 0.0: the one value where `u < a` and `u <= a` part."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return torch.zeros((), dtype=kwargs.get("dtype") or torch.float32)


def test_a_token_the_target_gives_no_mass_is_never_accepted_even_at_a_zero_uniform(monkeypatch):
    """Acceptance is `u < min(1, p_target/p_draft)` with u in [0, 1): a draft (or a guess at the bonus) that the
    target gives probability 0 has acceptance 0 and must be rejected for every u, u = 0 included, or the output
    could contain a token the target never emits (mutants: `u <= ...` for the drafts and for the guess)."""
    fake = _ZeroUniform()
    monkeypatch.setattr(torch, "rand", fake)
    p_target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    p_draft = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    v = verify_sampling([0], p_draft, p_target, torch.Generator().manual_seed(0))
    assert v.n_accepted == 0 and v.next_token in (1, 2)
    # all drafts kept, the guess 3 has zero target mass at the bonus position
    p_target = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    p_draft = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    v = verify_sampling([1], p_draft, p_target, torch.Generator().manual_seed(0),
                        guess=(3, torch.tensor([0.0, 0.0, 0.0, 1.0])))
    assert v.n_accepted == 1 and v.next_token in (0, 1)
    assert fake.calls == 3  # one uniform per examined draft, one for the guess (the first call rejected at once)

"""Drafts that stop early: at an end-of-answer token, and after a token the draft model is unsure of (p_min).

Both only shorten proposals, so the output must stay the target's: token for token when greedy, in
distribution when sampling. The tests also check that the stops really happen (a stop that never fires would
pass every equivalence check)."""

import pytest
import torch
from test_engine import V, chi_square_p, hf_greedy
from tiny import perturbed, tiny_llama

from edgespec.drafters import Draft, NgramDrafter, TorchDrafter
from edgespec.engine import STOP_EOS, SpeculativeEngine, cut_at_eos
from edgespec.errors import EdgespecError
from edgespec.lm import TorchLM
from edgespec.policy import AdaptiveK, FixedK, check_p_min
from edgespec.sampling import SamplingParams, probs_from_logits
from edgespec.target import TorchTarget

PROMPTS = [[1, 5, 9, 3], [1, 7, 7, 7, 20, 11, 4, 9, 13], [1, 30, 12, 6, 6, 6, 6, 25]]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(vocab_size=32, seed=0)
    target.generation_config.eos_token_id = None
    return target, perturbed(target, 0.5)


def confidences(model, context, tokens):
    """The draft model's top probability at each proposed position, computed by a plain forward pass (not the
    drafter's cache): position i is the distribution after context + tokens[:i]."""
    with torch.no_grad():
        logits = model(torch.tensor([context + tokens])).logits[0]
    probs = torch.softmax(logits.float(), -1)
    return [float(probs[len(context) - 1 + i].max()) for i in range(len(tokens))]


@pytest.mark.parametrize("p_min", [0.3, 0.6, 0.9])
def test_a_proposal_ends_at_the_first_token_below_p_min(models, p_min):
    _, draft = models
    stops = 0
    for prompt in PROMPTS:
        drafter = TorchDrafter(draft)
        drafter.begin(prompt)
        proposal = drafter.propose(8, SamplingParams(), torch.Generator(), p_min=p_min)
        conf = confidences(draft, prompt, proposal.tokens)
        assert proposal.tokens, "a proposal always keeps its first token"
        assert all(c >= p_min for c in conf[:-1])  # every token but the last was confident enough
        assert len(proposal) == 8 or conf[-1] < p_min  # it stopped at K, or after the first unsure token
        stops += len(proposal) < 8
        # the tokens are the draft's greedy choices, as without p_min
        plain = TorchDrafter(draft)
        plain.begin(prompt)
        assert plain.propose(8, SamplingParams(), torch.Generator()).tokens[: len(proposal)] == proposal.tokens
    if p_min >= 0.6:
        assert stops > 0, "no proposal stopped early: the test would not exercise the stop"


@pytest.mark.parametrize("p_min", [0.5, 0.8, 0.95])
def test_greedy_with_p_min_equals_target_only(models, p_min):
    target, draft = models
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(draft))
    short = 0
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, 40)
        for policy in [FixedK(k, p_min=p_min) for k in (1, 3, 8)] + [AdaptiveK(k_max=8, p_min=p_min)]:
            got = engine.run(prompt, max_new_tokens=40, policy=policy)
            assert got.token_ids == expected, (prompt, policy)
            m = got.metrics
            short += m.num_draft_tokens < sum(m.k_per_round)
    assert short > 0, "no draft stopped early"


def test_p_min_zero_drafts_k_every_round(models):
    target, draft = models
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(draft))
    steps = list(engine.generate(PROMPTS[1], max_new_tokens=40, policy=FixedK(4)))
    # every round drafted the K it asked for (4, less only near the token budget)
    assert all(s.n_drafted == s.k for s in steps)
    assert sum(s.k == 4 for s in steps) >= len(steps) - 4


def test_the_drafter_does_not_draft_past_an_end_of_answer(models):
    target, _ = models
    prompt = PROMPTS[1]
    reference = hf_greedy(target, prompt, 30)
    # an EOS inside a round's block (with the target as its own draft, a round of K=8 emits 9 tokens)
    eos_pos = next(i for i in range(5, 30) if reference[i] not in reference[:i] and i % 9 <= 5)
    eos = reference[eos_pos]
    drafter = TorchDrafter(target)  # the target drafting for itself: its chain would reach the EOS
    engine = SpeculativeEngine(TorchTarget(target), drafter, eos_token_ids=[eos])
    steps = list(engine.generate(prompt, max_new_tokens=30, policy=FixedK(8)))
    assert [t for s in steps for t in s.tokens] == reference[: eos_pos + 1]
    assert steps[-1].stop_reason == STOP_EOS
    # the round that emitted the EOS proposed nothing after it: its draft ended at the EOS instead of running
    # on to K = 8 (its drafts were all accepted, so it emitted exactly what it drafted)
    last = steps[-1]
    assert last.n_drafted == len(last.tokens) == eos_pos % 9 + 1 <= 6


def test_an_ngram_draft_is_cut_after_an_end_of_answer():
    draft = Draft([5, 6, 2, 7, 8], torch.eye(9)[[5, 6, 2, 7, 8]], catch_up_s=0.25, drafted=5)
    cut = cut_at_eos(draft, frozenset({2}))
    assert cut.tokens == [5, 6, 2]
    assert torch.equal(cut.p_draft, draft.p_draft[:3])
    assert (cut.catch_up_s, cut.drafted) == (0.25, 5)
    assert cut_at_eos(draft, frozenset({9})) is draft
    assert cut_at_eos(Draft([2]), frozenset({2})).tokens == [2]


def test_ngram_drafts_take_p_min_and_ignore_it(models):
    target, _ = models
    engine = SpeculativeEngine(TorchTarget(target), NgramDrafter())
    for prompt in PROMPTS:
        got = engine.run(prompt, max_new_tokens=30, policy=FixedK(4, p_min=0.9))
        assert got.token_ids == hf_greedy(target, prompt, 30)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.5", True, float("nan")])
def test_bad_p_min_is_a_one_line_error(bad):
    with pytest.raises(EdgespecError, match="p_min"):
        check_p_min(bad)
    with pytest.raises(EdgespecError, match="p_min"):
        AdaptiveK(p_min=bad)


# -- sampling ------------------------------------------------------------------------------------------------
# The first three tokens of four with K = 3 (a round drafts at most the tokens left but one): whether the proposal stops after its second token depends on the
# token the drafter sampled first, so the stop is data-dependent, and the third token is where it could bias.

def exact_three_token_distribution(model, prompt, params):
    lm = TorchLM(model)
    lm.reset()
    p1 = probs_from_logits(lm.feed(prompt, 1)[0], params).double()
    table = torch.zeros(V, V, V, dtype=torch.float64)
    for a in range(V):
        lm.crop(len(prompt))
        p2 = probs_from_logits(lm.feed([a], 1)[0], params).double()
        for b in range(V):
            lm.crop(len(prompt) + 1)
            p3 = probs_from_logits(lm.feed([b], 1)[0], params).double()
            table[a, b] = p1[a] * p2[b] * p3
    return table.flatten()


def second_position_confidences(model, prompt, params):
    lm = TorchLM(model)
    lm.reset()
    first = float(probs_from_logits(lm.feed(prompt, 1)[0], params).max())
    second = []
    for a in range(V):
        lm.crop(len(prompt))
        second.append(float(probs_from_logits(lm.feed([a], 1)[0], params).max()))
    return first, second


def test_sampling_with_p_min_matches_target():
    target, draft = tiny_llama(vocab_size=V, seed=3, init=0.15), tiny_llama(vocab_size=V, seed=4, init=0.15)
    prompt = [1, 2, 2]  # (one where the draft's first position is surer than half its second positions)
    params = SamplingParams(temperature=1.0)
    first, second = second_position_confidences(draft, prompt, params)
    # p_min between the second position's confidences: some first tokens stop the draft there, others not
    p_min = (sorted(second)[V // 2 - 1] + sorted(second)[V // 2]) / 2
    assert first >= p_min and min(second) < p_min, (first, second)
    exact = exact_three_token_distribution(target, prompt, params)
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(draft))
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    lengths = set()
    for i in range(3000):
        p = SamplingParams(params.temperature, seed=5000 + i)
        steps = list(engine.generate(prompt, params=p, max_new_tokens=4, policy=FixedK(3, p_min=p_min)))
        lengths.add(steps[0].n_drafted)
        ids = [t for s in steps for t in s.tokens]
        counts[(ids[0] * V + ids[1]) * V + ids[2]] += 1
    assert {2, 3} <= lengths, lengths  # both the early stop and the full draft happened
    assert chi_square_p(counts, exact) > 1e-3

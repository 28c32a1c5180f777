"""Tests that kill mutants which survived the rest of the suite (scripts/mutation.sh, docs/mutation.md).

Each asserts behaviour a user relies on; the mutant it was written against is named in its docstring.
"""

import re

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
    # one uniform per examined draft, one for the guess, one per draw from a residual (the inverse of its CDF)
    assert fake.calls == 5


# --- edgespec/engine.py

class _Recorder:
    """A target or drafter stand-in that only records `reset` (all SpeculativeEngine.reset touches)."""

    vocab_size = None

    def __init__(self, log, name):
        self.log, self.name = log, name

    def reset(self):
        self.log.append(self.name)


def test_engine_reset_drops_both_caches_and_works_without_a_drafter():
    """reset() empties the target's and the drafter's caches, and with no drafter just the target's
    (mutant: `if self.drafter is None`, which skipped the drafter and crashed without one)."""
    from edgespec.engine import SpeculativeEngine

    log = []
    SpeculativeEngine(_Recorder(log, "target"), _Recorder(log, "drafter")).reset()
    assert log == ["target", "drafter"]
    log.clear()
    SpeculativeEngine(_Recorder(log, "target")).reset()
    assert log == ["target"]


def test_vocab_mismatch_error_names_the_fix():
    """The one-line error for a draft model with another vocabulary says what to do instead (mutants rewrote
    the advice's text)."""
    from edgespec.engine import check_vocab_sizes
    from edgespec.errors import EdgespecError

    with pytest.raises(EdgespecError, match=r"draft 40 tokens, target 32\).*same tokenizer, or --draft ngram$"):
        check_vocab_sizes(40, 32)
    check_vocab_sizes(32, 32)  # the same size is accepted
    check_vocab_sizes(32, 40)  # and a target with more rows (one tokenizer, embeddings padded differently)


class _Repeater:
    """A drafter that proposes `token` K times whatever the context, recording every commit it hears."""

    def __new__(cls, token):
        from edgespec.drafters import Draft, DrafterBase

        class Repeater(DrafterBase):
            def __init__(self):
                self.commits = []

            def begin(self, prompt_ids): pass
            def propose(self, k, params, generator, *, p_min=0.0): return Draft([token] * k)
            def commit(self, n_accepted, next_token): self.commits.append((n_accepted, next_token))
            def reset(self): pass

        return Repeater()


def test_k_is_capped_by_the_room_left_in_the_context():
    """A round verifies K+1 positions past the committed text, so K stays below the context's room whatever
    the policy asks and whatever the drafter would propose; the answer ends exactly at the context end
    (mutant: `room = max_context + len(seq)`, which let K = 6 run past it with a drafter that does not cap
    itself)."""
    from tiny import tiny_llama

    from edgespec.engine import STOP_CONTEXT, SpeculativeEngine
    from edgespec.policy import FixedK
    from edgespec.target import TorchTarget

    target = TorchTarget(tiny_llama(vocab_size=32, seed=0), max_context=24)
    engine = SpeculativeEngine(target, _Repeater(3))
    prompt = [5, 9, 14, 3, 7, 1, 11, 4, 8, 6, 12, 10, 13, 15, 16, 17, 18, 19, 20]  # 19 of 24 positions
    length, ks = len(prompt), []
    for step in engine.generate(prompt, max_new_tokens=50, policy=FixedK(6)):
        assert step.k <= 24 - length - 1, (step.k, length)
        ks.append(step.k)
        length += len(step.tokens)
    assert length == 24 and step.stop_reason == STOP_CONTEXT
    assert ks[0] == 4  # the policy's 6 cut to the room (5 positions: 4 drafts and the bonus)


def test_a_guess_round_tells_the_drafter_each_token_as_not_proposed_by_it():
    """On an exact target a K = 0 round fills its padding rows with guesses the drafter never proposed, so it
    hears the round's tokens one by one with n_accepted = 0, never as accepted drafts of its own (mutant:
    `(1, t)`, which told it one of its (nonexistent) drafts was kept)."""
    from tiny import tiny_llama

    from edgespec.engine import SpeculativeEngine
    from edgespec.policy import FixedK
    from edgespec.target import TorchTarget

    target = TorchTarget(tiny_llama(vocab_size=32, seed=0))
    target.lm.min_rows = 2  # a short step runs as two rows: one padding row for a guess
    drafter = _Repeater(3)
    prompt = [5, 9, 14, 3] * 4
    steps = list(SpeculativeEngine(target, drafter).generate(prompt, max_new_tokens=12, policy=FixedK(0)))
    assert any(s.n_drafted == 1 for s in steps)  # guess rounds happened
    assert drafter.commits == [(0, t) for s in steps for t in s.tokens]


def test_cut_at_eos_keeps_the_draft_up_to_its_first_end_of_answer():
    """Nothing after an EOS can be emitted, so the draft is cut right after the first one, wherever it is,
    its p_draft rows with it, and a draft without p_draft stays without (mutants: scanning `tokens[:-2]`, which
    missed an EOS second to last; `p_draft[...]` taken of None)."""
    from edgespec.drafters import Draft
    from edgespec.engine import cut_at_eos

    eos = frozenset({2})
    assert cut_at_eos(Draft([5, 2, 7]), eos).tokens == [5, 2]
    assert cut_at_eos(Draft([5, 2, 7]), eos).p_draft is None
    assert cut_at_eos(Draft([2, 2, 7, 8]), eos).tokens == [2]
    assert cut_at_eos(Draft([5, 7, 2]), eos).tokens == [5, 7, 2]  # an EOS last needs no cut
    rows = torch.eye(4)[[1, 2, 3]]
    cut = cut_at_eos(Draft([1, 2, 3], p_draft=rows), eos)
    assert cut.tokens == [1, 2] and torch.equal(cut.p_draft, rows[:2])


def test_the_shadow_proposal_gets_the_requests_sampling_params():
    """While K = 0 a free drafter is still consulted in the shadow, through the same protocol call as a real
    proposal: it gets the request's SamplingParams, the draft generator and p_min 0, like any other proposal
    (mutant: `propose(k_max, None, ...)`, under which a lookup that reads its params fails in the shadow)."""
    from tiny import tiny_llama

    from edgespec.drafters import NgramDrafter
    from edgespec.engine import SpeculativeEngine
    from edgespec.policy import AdaptiveK
    from edgespec.sampling import SamplingParams
    from edgespec.target import TorchTarget

    class Off(AdaptiveK):
        def next_k(self, **state):
            return 0

    class Spy(NgramDrafter):
        def __init__(self):
            super().__init__(min_ngram=1, weak_ngram=0)
            self.seen = []

        def propose(self, k, params, generator, *, p_min=0.0):
            self.seen.append((k, params, isinstance(generator, torch.Generator), p_min))
            return super().propose(k, params, generator, p_min=p_min)

    drafter, params = Spy(), SamplingParams(temperature=0.7, top_k=5, seed=3)
    steps = list(SpeculativeEngine(TorchTarget(tiny_llama(vocab_size=32, seed=0)), drafter).generate(
        [5, 9, 14, 3] * 4, params=params, max_new_tokens=10, policy=Off(k_max=8)))
    assert all(s.notice is None and s.k == 0 for s in steps)
    assert drafter.seen and all(seen == (8, params, True, 0.0) for seen in drafter.seen)


# the tiny target's greedy continuation of [5, 9, 14, 3], 30 tokens: it ends inside a "2, 10, 2, 10" loop that
# the target keeps up for 16 more tokens, so the lookup's guesses are right and whole rounds are accepted
LOOPING = [5, 9, 14, 3, 14, 28, 21, 13, 27, 27, 6, 25, 0, 20, 2, 10, 16, 0, 0, 0, 0, 29, 5, 8, 13, 25, 28, 21, 10,
           17, 15, 2, 10, 2]


@pytest.mark.parametrize("max_context,max_new_tokens", [(200, 7), (38, 100), (39, 100)])
def test_guesses_never_go_past_the_budget_or_the_context(max_context, max_new_tokens):
    """An exact target's padding rows are filled with guesses only as far as a token could still be emitted:
    never more guesses than the budget leaves after the round's own token, never past the context end (mutants:
    rows taken without `remaining`, which verified guesses that could only be cut away and counted them as
    drafted and accepted, or without `room`, which verified past the context)."""
    from tiny import tiny_llama

    from edgespec.drafters import NgramDrafter
    from edgespec.engine import SpeculativeEngine
    from edgespec.policy import FixedK
    from edgespec.target import TorchTarget

    target = TorchTarget(tiny_llama(vocab_size=32, seed=0), max_context=max_context)
    target.lm.min_rows = 4  # three padding rows a round
    prompt = LOOPING
    length, generated, n_guessed = len(prompt), 0, 0
    for step in SpeculativeEngine(target, NgramDrafter()).generate(prompt, max_new_tokens=max_new_tokens,
                                                                     policy=FixedK(0)):
        assert step.n_drafted + 1 <= min(max_new_tokens - generated, max_context - length), step
        assert step.n_from_draft <= step.n_accepted <= step.n_drafted
        n_guessed += step.n_drafted
        length, generated = length + len(step.tokens), generated + len(step.tokens)
    assert n_guessed >= 2 and length == min(len(prompt) + max_new_tokens, max_context)


def test_the_policy_hears_a_guess_round_as_a_round_without_drafts():
    """Guesses on an exact target's padding rows cost nothing and were not asked for by the policy: it hears
    such a round as K = 0 with nothing drafted or accepted, or it would learn acceptance from free guesses
    (mutant: `_observe(..., guess=None, ...)`, which reported the guesses as drafts)."""
    from tiny import tiny_llama

    from edgespec.drafters import NgramDrafter
    from edgespec.engine import SpeculativeEngine
    from edgespec.policy import FixedK
    from edgespec.target import TorchTarget

    class Recording(FixedK):
        def __init__(self):
            super().__init__(0)
            self.heard = []

        def observe(self, k, n_drafted, n_accepted, draft_s, verify_s, **kw):
            self.heard.append((k, n_drafted, n_accepted, kw.get("drafted")))
            super().observe(k, n_drafted, n_accepted, draft_s, verify_s, **kw)

    target = TorchTarget(tiny_llama(vocab_size=32, seed=0))
    target.lm.min_rows = 4
    policy = Recording()
    steps = list(SpeculativeEngine(target, NgramDrafter()).generate(LOOPING, max_new_tokens=12, policy=policy))
    assert any(s.n_drafted > 0 and s.n_accepted > 0 for s in steps)  # accepted guesses happened
    assert policy.heard == [(0, 0, 0, 0)] * len(steps)


class _Asking:
    """A fixed-K policy that records what the engine tells it before each round."""

    def __new__(cls, k):
        from edgespec.policy import MAX_K, FixedK

        class Asking(FixedK):
            def __init__(self):
                super().__init__(min(k, MAX_K))  # FixedK refuses more; next_k below asks for `k` anyway
                self.asked = []

            def next_k(self, *, remaining, lag=0):
                self.asked.append((remaining, lag))
                return k

        return Asking()


def _lagging_repeater(token, lag):
    drafter = _Repeater(token)
    type(drafter).lag = lag  # a draft model that has not yet taken in `lag` tokens of context
    return drafter


def test_the_policy_hears_the_budget_left_and_the_drafters_lag_and_k_stays_within_both_limits():
    """next_k gets the tokens still to generate and the drafter's lag (mutants passed remaining=None or dropped
    lag), and whatever it asks, K stays at most MAX_K and below the budget left (mutants dropped either cap or
    loosened the budget's to remaining + 1)."""
    from tiny import tiny_llama

    from edgespec.engine import SpeculativeEngine
    from edgespec.policy import MAX_K
    from edgespec.target import TorchTarget

    target = TorchTarget(tiny_llama(vocab_size=32, seed=0), max_context=200)
    policy = _Asking(100)
    engine = SpeculativeEngine(target, _lagging_repeater(3, 7))
    steps = list(engine.generate([5, 9, 14, 3], max_new_tokens=40, policy=policy))
    generated = 0
    for step, (remaining, lag) in zip(steps, policy.asked, strict=True):
        assert remaining == 40 - generated and lag == 7
        assert step.k == min(MAX_K, remaining - 1), (step.k, remaining)
        generated += len(step.tokens)
    assert steps[0].k == MAX_K and generated == 40


def test_a_proposals_catch_up_time_reaches_its_step_in_milliseconds():
    """Step.catch_up_ms is the drafter's catch-up seconds times 1000 (mutants divided or scaled it)."""
    from tiny import tiny_llama

    from edgespec.drafters import Draft
    from edgespec.engine import SpeculativeEngine
    from edgespec.policy import FixedK
    from edgespec.target import TorchTarget

    drafter = _Repeater(3)
    type(drafter).propose = lambda self, k, params, generator, *, p_min=0.0: Draft([3] * k, catch_up_s=0.25)
    engine = SpeculativeEngine(TorchTarget(tiny_llama(vocab_size=32, seed=0), max_context=64), drafter)
    steps = list(engine.generate([5, 9, 14, 3], max_new_tokens=6, policy=FixedK(2)))
    assert [s.catch_up_ms for s in steps if s.k] and all(s.catch_up_ms == 250.0 for s in steps if s.k)


@pytest.mark.parametrize("off_cpu", ["logits", "p_draft", "guess"])
def test_judge_names_the_rows_that_are_off_the_cpu(off_cpu):
    """The device contract's check says which rows broke it (mutants dropped or rewrote each name, or skipped
    the guess's check when it had a row)."""
    from edgespec.drafters import Draft
    from edgespec.engine import judge

    where = {name: ("meta" if name == off_cpu else "cpu") for name in ("logits", "p_draft", "guess")}
    logits = torch.zeros(3, 8, device=where["logits"])
    draft = Draft([1, 2], p_draft=torch.full((2, 8), 1 / 8, device=where["p_draft"]))
    guess = (4, torch.full((8,), 1 / 8, device=where["guess"]))
    name = {"logits": "the target's logits", "p_draft": "the drafter's p_draft",
            "guess": "the drafter's p_draft (its guess at the bonus token)"}[off_cpu]
    with pytest.raises(RuntimeError, match=rf"^{re.escape(name)} are on meta, but the rule runs on the CPU"):
        judge(draft, logits, SamplingParams(temperature=0.7), torch.Generator().manual_seed(0), guess)


def test_the_policy_hears_the_targets_own_time_and_the_catch_up_apart():
    """`_observe`'s contract, checked on its own (the scripted per-thread clocks of test_overlap.py cannot show a
    wait for the drafter: a waiting thread's clock stands still there): the engine thread's wait for the drafter
    comes off the target's time, drafting done ahead is added to the drafting, and the catch-up (the draft
    model's prefill) reaches the policy apart, seconds and tokens (mutants: `verify_s += ahead.wait_s`;
    `catch_up_s=None` or left out; `catch_up_tokens` left out)."""
    from edgespec.drafters.base import Draft
    from edgespec.engine import _observe
    from edgespec.policy import PolicyBase
    from edgespec.scheduler import Ahead
    from edgespec.verify import Verdict

    class Heard(PolicyBase):
        def observe(self, *args, **kwargs):
            self.heard = (args, kwargs)

    policy = Heard()
    draft = Draft([4, 5, 6], catch_up_s=0.25, catch_up_tokens=40, drafted=1)
    _observe(policy, 3, draft, Verdict(2, 9), False, draft_s=0.5, verify_s=0.75, ahead=Ahead(0.125, 4, 0.0625))
    (k, n_drafted, n_accepted, draft_s, verify_s), kwargs = policy.heard
    assert (k, n_drafted, n_accepted) == (3, 3, 2)
    assert draft_s == 0.5 - 0.25 + 0.125 and verify_s == 0.75 - 0.0625
    assert kwargs == {"catch_up_s": 0.25, "catch_up_tokens": 40, "drafted": 1 + 4}
    # sequential (nothing ahead): the target's time as measured, the catch-up still apart
    _observe(policy, 3, draft, Verdict(2, 9), False, draft_s=0.5, verify_s=0.75, ahead=None)
    (_, _, _, draft_s, verify_s), kwargs = policy.heard
    assert (draft_s, verify_s) == (0.25, 0.75) and kwargs == {"catch_up_s": 0.25, "catch_up_tokens": 40, "drafted": 1}


def test_generate_defaults_to_256_tokens_of_the_target_alone():
    """Without a budget or a policy, `generate` writes up to 256 tokens with no drafting (mutants: 257, FixedK(1))."""
    from tiny import tiny_llama

    from edgespec.engine import STOP_LENGTH, SpeculativeEngine
    from edgespec.target import TorchTarget

    engine = SpeculativeEngine(TorchTarget(tiny_llama(vocab_size=32, seed=0, max_pos=512)), _Repeater(3))
    steps = list(engine.generate([5, 9, 14]))  # no end-of-answer token given to the engine: runs to the budget
    assert sum(len(s.tokens) for s in steps) == 256 and steps[-1].stop_reason == STOP_LENGTH
    assert all(s.k == 0 and s.n_drafted == 0 for s in steps)


@pytest.mark.parametrize("prompt, budget, message", [
    ([], 4, "the prompt is empty; give at least one token of prompt text"),
    (list(range(1, 25)), 4, "the prompt has 24 tokens but the model's context holds 24; shorten the prompt (or the "
                            "chat history)"),
    ([5, 9], 0, "max_new_tokens=0 must be at least 1"),
])
def test_a_request_the_engine_cannot_run_is_refused_with_its_reason_and_fix(prompt, budget, message):
    from tiny import tiny_llama

    from edgespec.engine import SpeculativeEngine
    from edgespec.errors import EdgespecError
    from edgespec.target import TorchTarget

    engine = SpeculativeEngine(TorchTarget(tiny_llama(vocab_size=32, seed=0), max_context=24))
    with pytest.raises(EdgespecError) as err:
        engine.run(prompt, max_new_tokens=budget)
    assert str(err.value) == message


def test_the_target_reserves_room_for_the_prompt_and_the_budget_up_to_its_context():
    """Before the prefill the target is told how long this request can grow (a backend may allocate its cache
    once): prompt + budget, capped at the context (mutant: prompt - budget)."""
    from tiny import tiny_llama

    from edgespec.engine import SpeculativeEngine
    from edgespec.target import TorchTarget

    target = TorchTarget(tiny_llama(vocab_size=32, seed=0), max_context=64)
    asked, reserve = [], target.reserve
    target.reserve = lambda total: (asked.append(total), reserve(total))[1]
    engine = SpeculativeEngine(target)
    engine.run([5, 9, 14], max_new_tokens=10)
    engine.run([5, 9, 14], max_new_tokens=100)
    assert asked == [13, 64]


def test_requests_without_a_seed_draw_from_different_random_streams():
    """An unseeded request seeds its generators from fresh entropy: twelve sampled answers on near-flat
    distributions all differ (mutants that squeezed the seed to a few values, `torch.seed() / 2**62` or
    `% 2 * 62`, allow at most four different answers)."""
    from tiny import tiny_llama

    from edgespec.engine import SpeculativeEngine
    from edgespec.target import TorchTarget

    engine = SpeculativeEngine(TorchTarget(tiny_llama(vocab_size=32, seed=0, init=0.02)))
    answers = {tuple(engine.run([5, 9], params=SamplingParams(temperature=1.0), max_new_tokens=8).token_ids)
               for _ in range(12)}
    assert len(answers) >= 6, answers


def test_only_a_free_drafter_is_asked_for_shadow_proposals():
    """While K is 0, a policy that learns from shadow proposals hears a free drafter's (an n-gram lookup); a
    model drafter is never asked (it would pay a draft model's step for nothing), and without a drafter there
    is nothing to ask (mutant: `drafts.free or policy.learns_from_shadow`, which asked the model drafter, and
    crashed without one)."""
    from tiny import tiny_llama

    from edgespec.drafters import NgramDrafter
    from edgespec.engine import SpeculativeEngine
    from edgespec.policy import FixedK
    from edgespec.target import TorchTarget

    class Listening(FixedK):
        learns_from_shadow = True

        def __init__(self):
            super().__init__(0)
            self.shadows = 0

        def observe_shadow(self, n_proposed, n_matched):
            self.shadows += 1

    target = TorchTarget(tiny_llama(vocab_size=32, seed=0))
    plain = SpeculativeEngine(target).run(LOOPING, max_new_tokens=12, policy=FixedK(0)).token_ids
    model_drafter = _Repeater(3)
    model_drafter.propose = lambda *a, **kw: pytest.fail("a model drafter was asked for a shadow proposal")
    for drafter in (model_drafter, None):
        policy = Listening()
        assert SpeculativeEngine(target, drafter).run(LOOPING, max_new_tokens=12, policy=policy).token_ids == plain
        assert policy.shadows == 0
    policy = Listening()  # the control: a free drafter is asked, and the policy hears how it fared
    SpeculativeEngine(target, NgramDrafter()).run(LOOPING, max_new_tokens=12, policy=policy)
    assert policy.shadows > 0

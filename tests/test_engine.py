"""The engine end to end on tiny random models: greedy equivalence, stops, rollback, sampling distribution."""

import pytest
import torch
from scipy.stats import chisquare
from tiny import perturbed, tiny_llama

from edgespec import verify
from edgespec.drafters import ModelDrafter, NgramDrafter, TorchDrafter
from edgespec.engine import STOP_CONTEXT, STOP_EOS, STOP_LENGTH, STOP_STRING, Generation, SpeculativeEngine
from edgespec.errors import EdgespecError
from edgespec.lm import TorchLM
from edgespec.policy import AdaptiveK, FixedK, PolicyBase
from edgespec.sampling import SamplingParams, probs_from_logits
from edgespec.target import TorchTarget

PROMPTS = [[1, 5, 9, 3], [1, 7, 7, 7, 20, 11, 4, 9, 13], [1, 30, 2 + 10, 6, 6, 6, 6, 25]]


def hf_greedy(model, prompt, n, eos=None):
    """Target-only greedy decoding by transformers itself: the reference, independent of our loop."""
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=eos, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(vocab_size=32, seed=0)
    target.generation_config.eos_token_id = None
    return {
        "target": target,
        "close": perturbed(target, 0.5),
        "foreign": tiny_llama(vocab_size=32, seed=7),
    }


def run_clean(engine, prompt, **kwargs):
    """`engine.run`, also asserting that the drafter never failed: a fallback to the target alone would give
    target-only's output and pass any equivalence check on its own."""
    result = Generation()
    for step in engine.generate(prompt, **kwargs):
        assert step.notice is None, step.notice
        result.token_ids.extend(step.tokens)
        result.metrics.add(step)
        result.stop_reason = step.stop_reason
    return result


def drafter_for(name, models):
    if name == "ngram":
        return NgramDrafter()
    if name == "self":
        return TorchDrafter(models["target"])
    return TorchDrafter(models[name])


@pytest.mark.parametrize("draft_name", ["close", "foreign", "self", "ngram"])
def test_greedy_equals_target_only_for_every_k(models, draft_name):
    target = models["target"]
    engine = SpeculativeEngine(TorchTarget(target), drafter_for(draft_name, models))
    accepted = 0
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, 40)
        for k in range(0, 9):
            got = run_clean(engine, prompt, max_new_tokens=40, policy=FixedK(k))
            assert got.token_ids == expected, (draft_name, prompt, k)
            assert got.stop_reason == STOP_LENGTH
            accepted += got.metrics.num_accepted_tokens
    if draft_name != "foreign":  # (an unrelated random model may never be right)
        assert accepted > 0  # drafts were accepted: the rollback after a partial accept ran


def test_self_draft_accepts_everything(models):
    engine = SpeculativeEngine(TorchTarget(models["target"]), TorchDrafter(models["target"]))
    for k in (1, 3, 8):
        m = engine.run(PROMPTS[0], max_new_tokens=9 * 6, policy=FixedK(k)).metrics
        assert m.acceptance_rate == 1.0
        # Every full round emits K+1 tokens; only rounds shortened by max_new_tokens can emit fewer.
        full = [kk for kk in m.k_per_round if kk == k]
        assert m.num_accepted_tokens == m.num_draft_tokens
        assert m.tau == pytest.approx(m.num_emitted_tokens / m.num_target_forwards)
        assert len(full) >= len(m.k_per_round) - 1
        if (9 * 6) % (k + 1) == 0:
            assert m.tau == k + 1


def test_close_draft_accepts_partially(models):
    engine = SpeculativeEngine(TorchTarget(models["target"]), TorchDrafter(models["close"]))
    m = engine.run(PROMPTS[1], max_new_tokens=60, policy=FixedK(4)).metrics
    assert 0 < m.acceptance_rate < 1  # otherwise the greedy-equivalence test would not exercise rollback
    assert sum(m.accepted_per_position) == m.num_accepted_tokens
    assert m.accepted_per_position == sorted(m.accepted_per_position, reverse=True)


def test_eos_inside_an_accepted_block(models):
    target = models["target"]
    prompt = PROMPTS[1]
    reference = hf_greedy(target, prompt, 30)
    # Pick a token the target emits mid-way as EOS: with the target as its own draft and K=8 it falls
    # inside an accepted block; nothing after it may be emitted.
    eos_pos = next(i for i in range(5, 30) if reference[i] not in reference[:i] and i % 9 not in (0, 8))
    eos = reference[eos_pos]
    expected = hf_greedy(target, prompt, 30, eos=eos)
    assert expected == reference[: eos_pos + 1]
    for drafter in (TorchDrafter(target), TorchDrafter(models["close"]), NgramDrafter()):
        engine = SpeculativeEngine(TorchTarget(target), drafter, eos_token_ids=[eos])
        steps = list(engine.generate(prompt, max_new_tokens=30, policy=FixedK(8)))
        got = [t for s in steps for t in s.tokens]
        assert got == expected
        assert steps[-1].stop_reason == STOP_EOS


def test_max_new_tokens_mid_block_never_overshoots(models):
    target = models["target"]
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(target))
    for n in (1, 2, 5, 7, 13):
        got = engine.run(PROMPTS[0], max_new_tokens=n, policy=FixedK(8))
        assert got.token_ids == hf_greedy(target, PROMPTS[0], n)
        assert got.stop_reason == STOP_LENGTH


def test_stop_callback(models):
    engine = SpeculativeEngine(TorchTarget(models["target"]), NgramDrafter())
    seen = []

    def stop(ids):
        seen.append(len(ids))
        return len(ids) >= 6

    got = engine.run(PROMPTS[0], max_new_tokens=50, policy=FixedK(3), stop=stop)
    assert got.stop_reason == STOP_STRING
    assert 6 <= len(got.token_ids) <= 6 + 3
    assert seen == sorted(seen)


@pytest.mark.parametrize("overlap", [False, True])
def test_context_end_stops_with_reason(models, overlap):
    target = models["target"]  # max_position_embeddings = 128
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(models["close"]), overlap=overlap)
    prompt = PROMPTS[1]
    got = run_clean(engine, prompt, max_new_tokens=500, policy=FixedK(6))
    assert got.stop_reason == STOP_CONTEXT
    assert len(prompt) + len(got.token_ids) == 128
    assert got.token_ids == hf_greedy(target, prompt, 128 - len(prompt))
    assert got.metrics.num_accepted_tokens > 0


def test_eos_exactly_at_the_budget_stops_as_eos_and_one_past_it_as_length(models):
    """The answer's n-th token is the EOS: with max_new_tokens = n it ends as "eos" (the EOS is emitted), with
    n - 1 as "length" (the EOS lies beyond the budget), at every K and with or without overlap."""
    target = models["target"]
    prompt = PROMPTS[1]
    reference = hf_greedy(target, prompt, 30)
    n = next(i for i in range(6, 30) if reference[i] not in reference[:i]) + 1
    eos = reference[n - 1]
    for overlap in (False, True):
        engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(target), eos_token_ids=[eos], overlap=overlap)
        for k in (0, 1, 3, 8):
            at = run_clean(engine, prompt, max_new_tokens=n, policy=FixedK(k))
            assert at.token_ids == reference[:n] and at.stop_reason == STOP_EOS, (k, overlap)
            before = run_clean(engine, prompt, max_new_tokens=n - 1, policy=FixedK(k))
            assert before.token_ids == reference[:n - 1] and before.stop_reason == STOP_LENGTH, (k, overlap)


def test_prompt_longer_than_context_is_one_line_error(models):
    engine = SpeculativeEngine(TorchTarget(models["target"]))
    with pytest.raises(EdgespecError) as err:
        engine.run([1] * 128, max_new_tokens=4)
    assert "context" in str(err.value) and "\n" not in str(err.value)


def test_vocab_mismatch_is_one_line_error(models):
    with pytest.raises(EdgespecError) as err:
        SpeculativeEngine(TorchTarget(models["target"]), TorchDrafter(tiny_llama(vocab_size=40)))
    msg = str(err.value)
    assert "40" in msg and "32" in msg and "\n" not in msg


@pytest.mark.parametrize("k", [-1, 17, 2.5, True])
def test_bad_k(k):
    with pytest.raises(EdgespecError):
        FixedK(k)


@pytest.mark.parametrize("backend", ["lm", "target", "drafter"])
def test_rollback_equals_fresh_prefill(models, backend):
    """After any accept length, the next-token logits equal those of a fresh prefill of the accepted text: the
    backend's `crop`, the target's `rollback` (through its prefix mirror) and the drafter's `commit`."""
    model = models["target"]
    prompt = PROMPTS[1]
    block = [3, 8, 13, 21, 4, 6]
    for keep in range(0, len(block) + 1):
        fresh = TorchLM(model)
        fresh.reset()
        expected = fresh.feed(prompt + block[:keep] + [17], 1)[0]
        if backend == "lm":
            lm = TorchLM(model)
            lm.reset()
            lm.feed(prompt, 0)
            lm.feed(block, len(block))
            lm.crop(len(prompt) + keep)
            after = lm.feed([17], 1)[0]
        elif backend == "target":
            target = TorchTarget(model)
            target.prefill(prompt[:-1])
            target.verify([prompt[-1], *block])  # a round verifying the last token and six drafts
            target.rollback(len(prompt) + keep)
            assert target.length == len(prompt) + keep
            after = target.verify([17])[0]
            # and a prefill of the accepted text reuses the rolled-back cache as it stands
            target.rollback(len(prompt) + keep)
            target.prefill(prompt + block[:keep])
            assert target.length == len(prompt) + keep
            assert torch.allclose(target.verify([17])[0], expected, atol=1e-5), keep
        else:
            continue
        assert torch.allclose(after, expected, atol=1e-5), keep
    if backend == "drafter":
        # The drafter's own rollback path: propose K, commit n, then its next proposal equals a fresh one.
        for n in range(0, 5):
            d = TorchDrafter(models["close"])
            d.begin(prompt)
            proposed = d.propose(4, SamplingParams(), torch.Generator()).tokens
            d.commit(n, 9)
            again = d.propose(3, SamplingParams(), torch.Generator()).tokens
            fresh = TorchDrafter(models["close"])
            fresh.begin(prompt + proposed[:n] + [9])
            assert again == fresh.propose(3, SamplingParams(), torch.Generator()).tokens


def test_new_prompt_reuses_common_prefix(models):
    """A second request that extends the first (the next chat turn) gives the same output as a cold start."""
    target = models["target"]
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(models["close"]))
    first = engine.run(PROMPTS[1], max_new_tokens=10, policy=FixedK(3)).token_ids
    follow = PROMPTS[1] + first + [5, 6]
    assert engine.run(follow, max_new_tokens=12, policy=FixedK(3)).token_ids == hf_greedy(target, follow, 12)
    # and a different prompt afterwards
    assert engine.run(PROMPTS[2], max_new_tokens=12, policy=FixedK(3)).token_ids == hf_greedy(target, PROMPTS[2], 12)


class Recording(FixedK):
    """A fixed K that records what the engine tells it after each round."""

    def __init__(self, ks):
        super().__init__(0)
        self.ks, self.seen = list(ks), []

    def next_k(self, **state):
        return self.ks.pop(0) if self.ks else 0

    def observe(self, k, n_drafted, n_accepted, draft_s, verify_s, **catch_up):
        self.seen.append((k, n_drafted, draft_s))


def test_drafter_prefill_is_lazy_and_timed_apart(models):
    """A request that never drafts never feeds the draft model; the first proposal's catch-up on the prompt
    (and on tokens decoded without drafting) is timed apart, so the policy's per-token cost excludes it."""
    target = models["target"]
    drafter = TorchDrafter(models["close"])
    engine = SpeculativeEngine(TorchTarget(target), drafter)
    prompt = PROMPTS[1] * 4
    assert engine.run(prompt, max_new_tokens=6, policy=FixedK(0)).token_ids == hf_greedy(target, prompt, 6)
    assert drafter.lm.length == 0  # nothing was fed to the draft model

    # Plain rounds first, then drafting: the first proposal catches up on the prompt and the plain tokens.
    drafter.begin(prompt)
    first = drafter.propose(3, SamplingParams(), torch.Generator())
    assert first.catch_up_s > 0
    drafter.commit(1, 9)
    assert drafter.propose(3, SamplingParams(), torch.Generator()).catch_up_s == 0.0  # a steady round

    # The engine hands the policy the proposal time less the catch-up: a drafter claiming its whole
    # (tiny) proposal time was a 100 s catch-up shows the policy 0 s of drafting.
    class Claims100s(ModelDrafter):
        def propose(self, k, params, gen, *, p_min=0.0):
            draft = super().propose(k, params, gen, p_min=p_min)
            draft.catch_up_s = 100.0 if draft.catch_up_s else 0.0
            return draft

    policy = Recording([0, 0, 0, 3, 3])
    engine = SpeculativeEngine(TorchTarget(target), Claims100s(TorchLM(models["close"], name="draft")))
    got = engine.run(prompt, max_new_tokens=20, policy=policy).token_ids
    assert got == hf_greedy(target, prompt, 20)
    assert [k for k, _, _ in policy.seen[:5]] == [0, 0, 0, 3, 3]
    assert policy.seen[3][2] == 0.0 and policy.seen[4][2] > 0  # the catch-up round, then a steady one


# --- sampling: the distribution of the first two generated tokens equals the target's -------------------

V = 8


@pytest.fixture(scope="module")
def small_vocab():
    return tiny_llama(vocab_size=V, seed=3, init=0.15), tiny_llama(vocab_size=V, seed=4, init=0.15)


def exact_two_token_distribution(model, prompt, params):
    lm = TorchLM(model)
    lm.reset()
    p1 = probs_from_logits(lm.feed(prompt, 1)[0], params).double()
    table = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        if p1[a] == 0:
            continue
        lm.crop(len(prompt))
        p2 = probs_from_logits(lm.feed([a], 1)[0], params).double()
        table[a] = p1[a] * p2
    return table.flatten()


def sampled_counts(engine, prompt, params, k, n):
    counts = torch.zeros(V * V, dtype=torch.float64)
    for i in range(n):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=1000 + i)
        ids = engine.run(prompt, params=p, max_new_tokens=2, policy=FixedK(k)).token_ids
        counts[ids[0] * V + ids[1]] += 1
    return counts


def chi_square_p(counts, expected_probs):
    n = counts.sum()
    keep = expected_probs * n >= 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected_probs[keep] * n, (expected_probs[~keep].sum() * n).view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * (obs.sum() / exp.sum())  # float rounding of the exact table: make the totals agree
    return chisquare(obs.numpy(), exp.numpy()).pvalue


SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)]
N_SAMPLES = 1500


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "top_p0.9"])
def test_sampling_distribution_matches_target(small_vocab, params):
    target, draft = small_vocab
    prompt = [1, 2, 3]
    exact = exact_two_token_distribution(target, prompt, params)
    spec = SpeculativeEngine(TorchTarget(target), TorchDrafter(draft))
    assert chi_square_p(sampled_counts(spec, prompt, params, 2, N_SAMPLES), exact) > 1e-3
    plain = SpeculativeEngine(TorchTarget(target))
    assert chi_square_p(sampled_counts(plain, prompt, params, 0, N_SAMPLES), exact) > 1e-3


def test_sampling_with_ngram_one_hot_draft(small_vocab):
    target, _ = small_vocab
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # the lookup proposes 3, 1, ... : one-hot p_draft
    params = SAMPLING[0]
    exact = exact_two_token_distribution(target, prompt, params)
    spec = SpeculativeEngine(TorchTarget(target), NgramDrafter())
    assert chi_square_p(sampled_counts(spec, prompt, params, 2, N_SAMPLES), exact) > 1e-3


def test_sampling_negative_control_broken_rule_fails(small_vocab, monkeypatch):
    target, draft = small_vocab
    prompt = [1, 2, 3]
    params = SAMPLING[0]
    exact = exact_two_token_distribution(target, prompt, params)
    monkeypatch.setattr(verify, "acceptance_probability", lambda pt, pd: 1.0)
    spec = SpeculativeEngine(TorchTarget(target), TorchDrafter(draft))
    assert chi_square_p(sampled_counts(spec, prompt, params, 2, N_SAMPLES), exact) < 1e-3


def test_ngram_lookup_proposes_little_on_weak_matches():
    """Longest suffix match wins, most recent occurrence first; a 1-token match proposes nothing, a 2-token
    match at most two tokens, a longer one up to K."""
    params, gen = SamplingParams(), torch.Generator()
    d = NgramDrafter()
    d.begin([5, 6, 7, 8, 9, 10, 11, 1, 7])  # only "7" recurs: a 1-gram match
    assert d.propose(4, params, gen).tokens == []
    d.begin([5, 6, 7, 8, 9, 10, 11, 1, 6, 7])  # "6 7" recurs: a 2-gram match, capped at 2
    assert d.propose(4, params, gen).tokens == [8, 9]
    d.begin([5, 6, 7, 8, 9, 10, 11, 12, 1, 5, 6, 7])  # "5 6 7": a 3-gram match, up to K
    assert d.propose(4, params, gen).tokens == [8, 9, 10, 11]
    d.begin([1, 2, 3, 40, 41, 42, 43, 1, 2, 3, 50, 51, 52, 53, 1, 2, 3])  # the most recent occurrence wins
    assert d.propose(3, params, gen).tokens == [50, 51, 52]
    d.commit(2, 60)  # two accepted, then the target's own token: the lookup continues from there
    assert d.propose(3, params, gen).tokens == []  # "51 60" never occurred before: no match ...
    d.commit(0, 1)
    d.commit(0, 2)
    d.commit(0, 3)  # ... but "1 2 3" now recurs, and its most recent occurrence is followed by 50 51 60
    assert d.propose(3, params, gen).tokens == [50, 51, 60]


def test_a_free_drafter_is_checked_in_the_shadow_while_speculation_is_off(models):
    """With K = 0 the n-gram lookup is still consulted; each proposal is scored against the tokens the target
    then emits (the matching prefix) and reported to the policy; the output stays target-only's."""
    from edgespec.policy import AdaptiveK

    class Off(AdaptiveK):
        def __init__(self):
            super().__init__(k_max=8)
            self.reports = []

        def next_k(self, **state):
            return 0

        def observe_shadow(self, n_proposed, n_matched):
            self.reports.append((n_proposed, n_matched))

    class Spy(NgramDrafter):
        """Records each proposal with the length of the context it continues (counted from the protocol's
        calls: the prompt, then every commit's accepted tokens and the target's token)."""

        def __init__(self):
            super().__init__(min_ngram=1, weak_ngram=0)  # proposes on any match: many shadow proposals
            self.proposals = []

        def begin(self, prompt_ids):
            super().begin(prompt_ids)
            self.at = len(prompt_ids)

        def propose(self, k, params, generator, *, p_min=0.0):
            draft = super().propose(k, params, generator, p_min=p_min)
            self.proposals.append((self.at, list(draft.tokens)))
            return draft

        def commit(self, n_accepted, next_token):
            super().commit(n_accepted, next_token)
            self.at += n_accepted + 1

    target = models["target"]
    prompt = PROMPTS[1] * 3
    drafter, policy = Spy(), Off()
    out = SpeculativeEngine(TorchTarget(target), drafter).run(prompt, max_new_tokens=40, policy=policy).token_ids
    assert out == hf_greedy(target, prompt, 40)
    full = prompt + out
    expected = []
    for at, tokens in drafter.proposals:
        matched = 0
        while matched < len(tokens) and at + matched < len(full) and full[at + matched] == tokens[matched]:
            matched += 1
        if tokens and at + min(matched + 1, len(tokens)) > len(full):
            continue  # the answer ended before this proposal was decided
        expected.append((len(tokens), matched))
    assert policy.reports == expected and len(expected) >= 3
    assert any(m > 0 for _, m in expected)


def test_a_free_drafter_failing_in_the_shadow_leaves_the_target_alone(models):
    """A lookup that raises while consulted at K = 0 is a drafter failure like any other: one notice, and the
    answer finishes on the target alone, identical to target-only."""
    from edgespec.policy import AdaptiveK

    class Off(AdaptiveK):
        def next_k(self, **state):
            return 0

    class Broken(NgramDrafter):
        def propose(self, k, params, generator, *, p_min=0.0):
            raise RuntimeError("lookup table gone")

    target = models["target"]
    steps = list(SpeculativeEngine(TorchTarget(target), Broken()).generate(
        PROMPTS[1], max_new_tokens=12, policy=Off(k_max=8)))
    assert [t for s in steps for t in s.tokens] == hf_greedy(target, PROMPTS[1], 12)
    notices = [s.notice for s in steps if s.notice]
    assert len(notices) == 1 and "lookup table gone" in notices[0] and "target alone" in notices[0]


def test_the_engine_tells_the_policy_where_each_request_begins(models):
    """AdaptiveK learns how long answers run (the horizon a draft model's catch-up must be repaid over) from
    the engine's begin_request call, whatever budgets the requests carry (here the first stops early, leaving
    more of its budget than the second has: inferring a new request from `remaining` going up missed that)."""
    from edgespec.policy import AdaptiveK

    policy = AdaptiveK(k_max=4)
    engine = SpeculativeEngine(TorchTarget(models["target"]), drafter_for("close", models))
    first = engine.run(PROMPTS[0], max_new_tokens=200, policy=policy, stop=lambda ids: len(ids) >= 10).token_ids
    assert 10 <= len(first) < 20 and list(policy.answer_lengths) == []
    engine.run(PROMPTS[1], max_new_tokens=50, policy=policy)
    assert list(policy.answer_lengths) == [len(first)]


# ---- an exact target (short steps padded to min_rows rows): K = 0 rounds fill the padding with guesses ------

class Alternate(PolicyBase):
    """K = 0 and K = 3 in turn."""

    k_max = 3

    def begin_request(self, *, min_rows=1):
        self.round = 0

    def next_k(self, remaining, lag=0):
        self.round += 1
        return 0 if self.round % 2 else 3

    def observe(self, *args, **kwargs):
        pass


def exact_like(model, rows=2):
    """An exact torch target whose short steps run as `rows` rows (over a fixed-length cache)."""
    target = TorchTarget(model)
    target.lm.min_rows = rows
    return target


def test_k0_rounds_on_an_exact_target_guess_the_next_token_and_stay_target_only(models):
    target = models["target"]
    for drafter in (TorchDrafter(models["close"]), NgramDrafter()):
        engine = SpeculativeEngine(exact_like(target), drafter)
        for prompt in PROMPTS:
            expected = hf_greedy(target, prompt, 40)
            steps = list(engine.generate(prompt, max_new_tokens=40, policy=FixedK(0)))
            assert [t for s in steps for t in s.tokens] == expected
            assert all(s.k == 0 for s in steps)
            guessed = [s for s in steps if s.n_drafted == 1]
            assert guessed and any(s.n_accepted == 1 and len(s.tokens) == 2 for s in guessed)
            # the drafter heard every token: guess rounds between drafted rounds keep target-only's output
            mixed = list(engine.generate(prompt, max_new_tokens=40, policy=Alternate()))
            assert [t for s in mixed for t in s.tokens] == expected
            assert any(s.k == 3 for s in mixed) and any(s.k == 0 and len(s.tokens) == 2 for s in mixed)
    # With the target as its own drafter every drafted token is accepted, unless a guess round left the
    # drafter's view of the text behind.
    engine = SpeculativeEngine(exact_like(target), TorchDrafter(target))
    for prompt in PROMPTS:
        mixed = list(engine.generate(prompt, max_new_tokens=60, policy=Alternate()))
        assert any(s.k == 0 and len(s.tokens) == 2 for s in mixed)
        assert all(s.n_accepted == s.n_drafted for s in mixed if s.k == 3)


def test_k0_rounds_fill_every_padding_row_with_guesses(models):
    target = models["target"]
    engine = SpeculativeEngine(exact_like(target, rows=4), NgramDrafter())
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, 40)
        steps = list(engine.generate(prompt, max_new_tokens=40, policy=FixedK(0)))
        assert [t for s in steps for t in s.tokens] == expected
        assert max(s.n_drafted for s in steps) <= 3  # three padding rows at most
    # a repeating prompt gives full three-token guesses, and they are accepted when the target repeats too
    prompt = [5, 9, 14, 3] * 6
    steps = list(engine.generate(prompt, max_new_tokens=30, policy=FixedK(0)))
    assert [t for s in steps for t in s.tokens] == hf_greedy(target, prompt, 30)
    assert any(s.n_drafted == 3 for s in steps)
    # --k auto learns that a short step costs what four rows do
    policy = AdaptiveK()
    list(engine.generate(prompt, max_new_tokens=10, policy=policy))
    assert policy.min_rows == 4


def test_no_guess_without_a_drafter_or_on_a_one_row_target(models):
    target = models["target"]
    alone = [s.n_drafted for s in SpeculativeEngine(exact_like(target)).generate(PROMPTS[1], max_new_tokens=20)]
    plain = SpeculativeEngine(TorchTarget(target), NgramDrafter())
    one_row = [s.n_drafted for s in plain.generate(PROMPTS[1], max_new_tokens=20, policy=FixedK(0))]
    assert set(alone) == {0} and set(one_row) == {0}


def test_sampling_with_guess_rounds_matches_target(small_vocab):
    target, _ = small_vocab
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # the one-token lookup guesses 3, then whatever follows
    params = SAMPLING[0]
    exact = exact_two_token_distribution(target, prompt, params)
    spec = SpeculativeEngine(exact_like(target), NgramDrafter())
    assert chi_square_p(sampled_counts(spec, prompt, params, 0, N_SAMPLES), exact) > 1e-3

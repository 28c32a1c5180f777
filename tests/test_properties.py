"""Property tests (hypothesis): the sampling rule is exact, and the engine is token-identical to greedy.

(a) The rule: for random target and draft models (each position's row depends on the tokens before it) with
zeros, ties, top-k and top-p masks and supports that differ, the exact distribution of a round's output,
continued by the target alone to K+1 tokens, equals the target's own distribution of K+1 tokens. Exactly, not
by sampling: `exact_verdicts` walks every branch of `verify_sampling`'s random draws (accept or reject at
each uniform, every token a categorical draw can give) through the real function, weighting each by its
probability. A rule that draws its correction from p_target instead of the residual fails the same check.

(b) The engine with tiny random models, over random sequences of K, drafters (n-gram lookup, a torch model
drafter: close, foreign, the target itself), EOS ids, budgets and overlap, emits exactly what the target
alone emits greedily, and no step carries a fallback notice.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import perturbed, tiny_llama

from edgespec import verify
from edgespec.sampling import SamplingParams, probs_from_logits

RULE = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENGINE = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------ (a) the rule, exactly


class _Branch(Exception):
    """The walk reached a random draw its script does not cover: these are the choices there."""

    def __init__(self, choices):
        self.choices = choices


class _TorchWithScriptedRand:
    """`torch` as `verify` sees it, but `rand` returns 0.0 (accept: u < a for any a > 0) or 1.0 (reject: no
    a <= 1 exceeds it) as the script says."""

    def __init__(self, walk):
        self._walk = walk

    def rand(self, *args, **kwargs):
        return torch.tensor(self._walk.uniform(), dtype=torch.float64)

    def __getattr__(self, name):
        return getattr(torch, name)


class _Walk:
    def __init__(self, script):
        self.script, self.at = script, 0
        self.weight = 1.0
        self.decisions: list[str] = []  # "A"/"R" for each uniform, in order
        self.rates: list[float] = []  # the acceptance probability of each, in order

    def _next(self, choices):
        if self.at == len(self.script):
            raise _Branch(choices)
        choice = self.script[self.at]
        self.at += 1
        return choice

    def uniform(self):
        decision = self._next(["A", "R"])
        self.decisions.append(decision)
        return 0.0 if decision == "A" else 1.0

    def draw(self, dist, generator):
        dist = dist.double()
        token = self._next([t for t in range(dist.shape[0]) if dist[t] > 0])
        self.weight *= dist[token].item()
        return token

    def probability(self):
        p = self.weight
        for decision, a in zip(self.decisions, self.rates):
            p *= a if decision == "A" else 1.0 - a
        return p


def exact_verdicts(draft_tokens, p_draft, p_target, guess=None) -> dict[tuple[int, int], float]:
    """{(n_accepted, next_token): probability} of `verify.verify_sampling`, every branch of its draws walked."""
    out: dict[tuple[int, int], float] = defaultdict(float)
    scripts = [[]]
    real_rate = verify.acceptance_probability
    while scripts:
        walk = _Walk(scripts.pop())

        def rate(pt, pd, walk=walk):
            a = real_rate(pt, pd)
            walk.rates.append(a)
            return a

        with mock.patch.object(verify, "torch", _TorchWithScriptedRand(walk)), \
                mock.patch.object(verify, "_draw", walk.draw), mock.patch.object(verify, "acceptance_probability", rate):
            try:
                verdict = verify.verify_sampling(draft_tokens, p_draft, p_target, torch.Generator(), guess=guess)
            except _Branch as branch:
                if walk.probability() > 0:
                    scripts += [walk.script + [c] for c in branch.choices]
                continue
        p = walk.probability()
        if p > 0:
            out[(verdict.n_accepted, verdict.next_token)] += p
    return out


class Model:
    """Next-token rows as a function of the tokens before them (a prefix), drawn once per prefix from a seed:
    logits on a few levels (ties), some tokens masked out (zeros, different supports in different models),
    then temperature, top-k and top-p through `probs_from_logits`; rows in float64, normalised."""

    def __init__(self, vocab, seed, params: SamplingParams, levels, mask_rate, same_as=None, same_rate=0.0):
        self.vocab, self.seed, self.params, self.levels, self.mask_rate = vocab, seed, params, levels, mask_rate
        self.same_as, self.same_rate = same_as, same_rate
        self.rows = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.rows:
            g = torch.Generator().manual_seed(hash((self.seed, prefix)) % 2**62)
            if self.same_as is not None and torch.rand((), generator=g).item() < self.same_rate:
                self.rows[prefix] = self.same_as(prefix)  # equal rows: ratio 1, an empty residual
                return self.rows[prefix]
            logits = torch.randint(0, self.levels, (self.vocab,), generator=g).double() * 1.5
            mask = torch.rand(self.vocab, generator=g) < self.mask_rate
            mask[torch.randint(0, self.vocab, (), generator=g)] = False  # at least one token stays
            logits[mask] = float("-inf")
            row = probs_from_logits(logits, self.params).double()
            self.rows[prefix] = row / row.sum()
        return self.rows[prefix]


def target_joint(p: Model, length: int, prefix: tuple[int, ...] = ()) -> dict[tuple[int, ...], float]:
    """The target alone continuing `prefix` to `length` tokens: every sequence and its exact probability."""
    out = {prefix: 1.0}
    for _ in range(length - len(prefix)):
        nxt = {}
        for seq, w in out.items():
            row = p(seq)
            for t in range(p.vocab):
                if row[t] > 0:
                    nxt[seq + (t,)] = w * row[t].item()
        out = nxt
    return out


def round_then_target(p: Model, q: Model, k: int, with_guess: bool) -> dict[tuple[int, ...], float]:
    """The exact distribution of the first K+1 output tokens: one speculative round (drafts x ~ q, the rule
    against p on the drafted prefix), then the target alone for what the round left."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    continuation: dict[tuple[int, ...], dict] = {}
    for x in itertools.product(range(q.vocab), repeat=k):  # the draft's rows may be fewer than the target's
        qx = 1.0
        for i in range(k):
            qx *= q(x[:i])[x[i]].item()
        if qx == 0:
            continue
        p_draft = torch.stack([q(x[:i]) for i in range(k)])
        p_target = torch.stack([p(x[:i]) for i in range(k + 1)])
        guesses = [(None, 1.0)]
        if with_guess:  # an overlapped drafter's own sample at the bonus position, judged by the rule
            row = q(x)
            guesses = [((g, row), row[g].item()) for g in range(q.vocab) if row[g] > 0]
        for guess, wg in guesses:
            for (n, token), w in exact_verdicts(list(x), p_draft, p_target, guess).items():
                emitted = x[:n] + (token,)
                if emitted not in continuation:
                    continuation[emitted] = target_joint(p, k + 1, emitted)
                for seq, wc in continuation[emitted].items():
                    out[seq] += qx * wg * w * wc
    return out



def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


sampling_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 2.0]),
    top_k=st.integers(0, 4),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2]),
)


@RULE
@given(vocab=st.integers(2, 4), k=st.integers(1, 3), seed=st.integers(0, 2**32), target_params=sampling_params,
       draft_params=sampling_params, levels=st.integers(1, 4), mask_target=st.sampled_from([0.0, 0.3, 0.6]),
       mask_draft=st.sampled_from([0.0, 0.3, 0.6]), same_rate=st.sampled_from([0.0, 0.5]), with_guess=st.booleans())
def test_the_rules_output_is_distributed_exactly_as_the_target(vocab, k, seed, target_params, draft_params, levels,
                                                               mask_target, mask_draft, same_rate, with_guess):
    if with_guess and vocab ** k > 27:
        k -= 1  # the walk over every guess as well: keep one example well under a second
    p = Model(vocab, seed, target_params, levels, mask_target)
    q = Model(vocab, seed + 1, draft_params, levels, mask_draft, same_as=p, same_rate=same_rate)
    got = round_then_target(p, q, k, with_guess)
    expected = target_joint(p, k + 1)
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert max_gap(got, expected) < 1e-9


@RULE
@given(draft_vocab=st.integers(2, 3), extra=st.integers(1, 2), k=st.integers(1, 2), seed=st.integers(0, 2**32),
       target_params=sampling_params, draft_params=sampling_params, levels=st.integers(1, 4),
       mask_draft=st.sampled_from([0.0, 0.3]), with_guess=st.booleans())
def test_the_rule_is_exact_when_the_target_has_more_rows_than_the_draft(draft_vocab, extra, k, seed, target_params,
                                                                         draft_params, levels, mask_draft, with_guess):
    """Two models over one tokenizer with embeddings of different sizes (Qwen2.5-7B's 152,064 rows against
    0.5B's 151,936): the draft's rows are narrower, the rule reads its distribution as zero on the target's extra
    rows, and the output is still distributed exactly as the target's (which does give those rows mass here)."""
    p = Model(draft_vocab + extra, seed, target_params, levels, 0.0)
    q = Model(draft_vocab, seed + 1, draft_params, levels, mask_draft)
    assert q(()).shape[0] < p(()).shape[0]
    got = round_then_target(p, q, k, with_guess)
    expected = target_joint(p, k + 1)
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert max_gap(got, expected) < 1e-9


def test_unequal_widths_are_widened_with_zeros():
    p_t = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]], dtype=torch.float64)
    p_d = torch.tensor([[0.6, 0.4]], dtype=torch.float64)
    # draft 0: accepted with 0.2/0.6; rejected, the residual max(0, p_t - (0.6, 0.4, 0)) = (0, 0, 0.5)
    # accepted (1/3): the bonus from p_t[1]
    assert exact_verdicts([0], p_d, p_t) == pytest.approx({(1, 0): 0.1 / 3, (1, 1): 0.1 / 3, (1, 2): 0.8 / 3,
                                                           (0, 2): 2 / 3})
    # the other way round (a wider draft) the target's rows are widened: its extra tokens have probability zero
    wide_t, wide_d = verify.common_width(p_t[:, :2], torch.full((1, 3), 1 / 3))
    assert wide_t.shape == (2, 3) and wide_t[:, 2].eq(0).all() and wide_d.shape == (1, 3)


@pytest.mark.parametrize("with_guess", [False, True])
def test_the_exact_check_fails_for_a_correction_drawn_from_the_target(with_guess):
    """Negative control: the residual replaced by p_target itself (a classic bug) is caught by the same check."""
    p = Model(3, 11, SamplingParams(1.0), 3, 0.0)
    q = Model(3, 12, SamplingParams(1.0), 3, 0.0)
    with mock.patch.object(verify, "residual_distribution", lambda p_t, p_d: p_t):
        got = round_then_target(p, q, 2, with_guess)
    assert max_gap(got, target_joint(p, 3)) > 1e-3


def test_the_exact_walk_covers_every_branch():
    """The walk itself: one draft, both rows known, every verdict's probability by hand."""
    p_t = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    p_d = torch.tensor([[0.0, 0.25, 0.75]], dtype=torch.float64)
    # draft 1: accepted with min(1, 0.5/0.25) = 1; then the bonus from p_t[1]
    assert exact_verdicts([1], p_d, p_t) == pytest.approx({(1, 0): 0.2, (1, 1): 0.3, (1, 2): 0.5})
    # draft 2: p_t = 0, rejected; the residual max(0, p_t - p_d) = (0.5, 0.25, 0) normalised
    assert exact_verdicts([2], p_d, p_t) == pytest.approx({(0, 0): 2 / 3, (0, 1): 1 / 3})


# ------------------------------------------------------------------------------ (b) the engine, greedy


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(vocab_size=32, seed=0, max_pos=256)
    target.generation_config.eos_token_id = None
    return {"target": target, "close": perturbed(target, 0.5), "foreign": tiny_llama(vocab_size=32, seed=7)}


_reference: dict[tuple[int, ...], list[int]] = {}
BUDGET = 32


def greedy_reference(model, prompt) -> list[int]:
    """Target-only greedy by transformers itself, BUDGET tokens, no EOS (cut afterwards for each case)."""
    key = tuple(prompt)
    if key not in _reference:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=BUDGET, min_new_tokens=0, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        _reference[key] = out[0, len(prompt):].tolist()
    return _reference[key]


class DrawnK:
    """A K policy that plays a drawn sequence of K, round after round (cycling). `shadow`: while K is 0, it
    hears how a free drafter's proposals would have fared (the engine then consults the drafter anyway)."""

    p_min = 0.0

    def __init__(self, ks, shadow=False):
        self.ks, self.i = ks, 0
        self.k_max = max(max(ks), 1)
        self.learns_from_shadow = shadow

    def begin_request(self, *, min_rows=1):
        self.i = 0

    def next_k(self, *, remaining=None, lag=0):
        k = self.ks[self.i % len(self.ks)]
        self.i += 1
        return k

    def observe(self, *args, **kwargs):
        pass

    def observe_shadow(self, *args, **kwargs):
        pass


PROMPTS = [[1, 5, 9, 3], [1, 7, 7, 7, 20, 11, 4, 9, 13], [1, 30, 12, 6, 6, 6, 6, 25], [1, 4]]


@ENGINE
@given(data=st.data(), prompt=st.sampled_from(PROMPTS), drafter=st.sampled_from(["ngram", "close", "foreign", "self"]),
       ks=st.lists(st.integers(0, 9), min_size=1, max_size=6), budget=st.integers(1, BUDGET),
       overlap=st.booleans(), shadow=st.booleans())
def test_the_engine_is_token_identical_to_target_only_greedy(models, data, prompt, drafter, ks, budget, overlap,
                                                             shadow):
    from edgespec.drafters import NgramDrafter, TorchDrafter
    from edgespec.engine import STOP_EOS, STOP_LENGTH, SpeculativeEngine
    from edgespec.target import TorchTarget

    reference = greedy_reference(models["target"], prompt)
    # EOS: none, a token the answer emits at a drawn position (first occurrence), or one it never emits
    eos_at = data.draw(st.one_of(st.none(), st.integers(0, budget - 1), st.just(-1)), label="eos_at")
    if eos_at is None:
        eos = []
    elif eos_at == -1:
        eos = [next(t for t in range(32) if t not in reference)]
    else:
        eos = [reference[eos_at]]
    expected = reference[:budget]
    if eos and eos[0] in expected:
        expected = expected[: expected.index(eos[0]) + 1]
    d = NgramDrafter() if drafter == "ngram" else TorchDrafter(models["target" if drafter == "self" else drafter])
    engine = SpeculativeEngine(TorchTarget(models["target"]), d, eos_token_ids=eos, overlap=overlap)
    steps = list(engine.generate(prompt, max_new_tokens=budget, policy=DrawnK(ks, shadow)))
    assert [t for s in steps for t in s.tokens] == expected
    assert [s.notice for s in steps] == [None] * len(steps)
    assert steps[-1].stop_reason == (STOP_EOS if eos and expected[-1] == eos[0] else STOP_LENGTH)
    if drafter == "self":  # the target drafting for itself: every proposed token is accepted
        assert all(s.n_accepted == s.n_drafted for s in steps)
        if any(k > 0 for k in ks) and len(expected) >= 8:  # a round with K > 0 comes within the first 6
            assert sum(s.n_accepted for s in steps) > 0


# ------------------------------------------------------------------ (c) the n-gram drafter's index, exactly

@settings(max_examples=300, deadline=None)
@given(data=st.data(), alphabet=st.integers(2, 6), prompt_len=st.integers(0, 40),
       sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)), weak=st.tuples(st.integers(0, 3), st.integers(0, 3)))
def test_the_ngram_drafters_index_proposes_what_a_scan_of_the_context_finds(data, alphabet, prompt_len, sizes,
                                                                          weak):
    """The drafter's incremental index against `lookup`, the plain backwards scan, through begin (a new prompt,
    or the same chat grown by a turn), proposals of every K, partial accepts and reset."""
    from edgespec.drafters.ngram import NgramDrafter, lookup

    min_n, extra = sizes
    d = NgramDrafter(max_ngram=min_n + extra, min_ngram=min_n, weak_ngram=weak[0], weak_cap=weak[1])
    tokens = st.integers(0, alphabet - 1)
    ids = data.draw(st.lists(tokens, min_size=prompt_len, max_size=prompt_len), label="prompt")
    d.begin(ids)
    for _ in range(data.draw(st.integers(1, 30), label="rounds")):
        action = data.draw(st.sampled_from(["round", "round", "round", "grow", "new", "reset"]), label="action")
        if action == "grow":  # the next turn of a chat: the history so far and more
            ids = ids + data.draw(st.lists(tokens, min_size=1, max_size=6), label="turn")
            d.begin(ids)
        elif action == "new":
            ids = data.draw(st.lists(tokens, min_size=1, max_size=20), label="new prompt")
            d.begin(ids)
        elif action == "reset":
            d.reset()
            ids = data.draw(st.lists(tokens, min_size=1, max_size=20), label="after reset")
            d.begin(ids)
        else:
            k = data.draw(st.integers(0, 8), label="k")
            want = lookup(ids, k, max_ngram=min_n + extra, min_ngram=min_n, weak_ngram=weak[0],
                          weak_cap=weak[1]) if k > 0 else []
            got = d.propose(k, SamplingParams(), torch.Generator()).tokens
            assert got == want, (ids, k)
            n_accepted = data.draw(st.integers(0, len(got)), label="accepted")
            nxt = data.draw(tokens, label="next")
            d.commit(n_accepted, nxt)
            ids = ids + got[:n_accepted] + [nxt]

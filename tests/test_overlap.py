"""Overlapped drafting (the drafter drafts round i+1 on its own thread while the target verifies round i).

The engine suites' key checks re-run with overlap on, deterministic restart logic with scripted fakes, and a
drafter that fails mid-request."""

import threading

import pytest
import torch
from test_engine import (
    N_SAMPLES, PROMPTS, SAMPLING, chi_square_p, exact_two_token_distribution, hf_greedy, models, run_clean,
    sampled_counts,
    small_vocab,
)
from tiny import perturbed, tiny_llama  # noqa: F401

from edgespec.drafters import NgramDrafter, TorchDrafter
from edgespec.drafters.base import Draft, DrafterBase
from edgespec.engine import STOP_EOS, STOP_LENGTH, SpeculativeEngine
from edgespec.policy import FixedK
from edgespec.target import TorchTarget

__all__ = ["models", "small_vocab"]  # fixtures imported from test_engine


@pytest.mark.parametrize("draft_name", ["close", "self", "foreign"])
def test_overlap_greedy_equals_target_only(models, draft_name):
    target = models["target"]
    drafter = TorchDrafter(target if draft_name == "self" else models[draft_name])
    engine = SpeculativeEngine(TorchTarget(target), drafter, overlap=True)
    accepted = 0
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, 40)
        for k in (1, 2, 4, 8):
            got = run_clean(engine, prompt, max_new_tokens=40, policy=FixedK(k))
            assert got.token_ids == expected, (draft_name, prompt, k)
            assert got.stop_reason == STOP_LENGTH
            accepted += got.metrics.num_accepted_tokens
    if draft_name != "foreign":
        assert accepted > 0  # drafts were accepted, so rollbacks after partial accepts ran overlapped


def test_overlap_with_eos_and_max_new_tokens(models):
    target = models["target"]
    prompt = PROMPTS[1]
    reference = hf_greedy(target, prompt, 30)
    eos = reference[11] if reference[11] not in reference[:11] else reference[17]
    expected = hf_greedy(target, prompt, 30, eos=eos)
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(target), eos_token_ids=[eos], overlap=True)
    steps = list(engine.generate(prompt, max_new_tokens=30, policy=FixedK(8)))
    assert [t for s in steps for t in s.tokens] == expected and steps[-1].stop_reason == STOP_EOS
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(models["close"]), overlap=True)
    for n in (1, 5, 13):
        assert engine.run(PROMPTS[0], max_new_tokens=n, policy=FixedK(6)).token_ids == hf_greedy(target, PROMPTS[0], n)


def test_overlap_self_draft_has_drafts_ready():
    """With the target as its own draft every guess is right: after the first round, drafting costs nothing
    on the critical path (the next draft is already in the chain)."""
    target = tiny_llama(vocab_size=32, seed=0)
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(target), overlap=True)
    m = engine.run(PROMPTS[0], max_new_tokens=40, policy=FixedK(4)).metrics
    assert m.acceptance_rate == 1.0 and m.tau == pytest.approx(5.0)


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "top_p0.9"])
def test_overlap_sampling_distribution_matches_target(small_vocab, params):
    target, draft = small_vocab
    prompt = [1, 2, 3]
    exact = exact_two_token_distribution(target, prompt, params)
    spec = SpeculativeEngine(TorchTarget(target), TorchDrafter(draft), overlap=True)
    assert chi_square_p(sampled_counts(spec, prompt, params, 2, N_SAMPLES), exact) > 1e-3


def test_overlap_sampling_is_reproducible_with_a_seed(small_vocab):
    from edgespec.sampling import SamplingParams

    target, draft = small_vocab
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(draft), overlap=True)
    runs = [engine.run([1, 2, 3], params=SamplingParams(temperature=1.0, seed=5), max_new_tokens=20,
                       policy=FixedK(3)).token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


# --- scripted fakes: the restart logic, deterministically -----------------------------------------------

class ScriptedTarget:
    """Greedy target over a fixed answer: position p's argmax is ANSWER[p - base]."""

    vocab_size = 8
    max_context = 64
    description = "scripted"
    min_rows = 1

    def reserve(self, total):
        pass

    def __init__(self, answer):
        self.answer = answer
        self.ids = []
        self.verify_calls = []

    @property
    def length(self):
        return len(self.ids)

    def prefill(self, ids):
        self.ids = list(ids)
        self.base = len(ids) + 1

    def verify(self, tokens):
        self.verify_calls.append(list(tokens))
        start = len(self.ids)
        self.ids.extend(tokens)
        rows = []
        for i in range(len(tokens)):
            nxt = self.answer[start + i + 1 - self.base]
            rows.append(torch.nn.functional.one_hot(torch.tensor(nxt), self.vocab_size).float() * 10)
        return torch.stack(rows)

    def rollback(self, length):
        del self.ids[length:]

    def reset(self):
        self.ids = []

    def synchronize(self):
        pass


class ScriptedDrafter(DrafterBase):
    """Proposes from its own script of the answer (wrong where the script says), records every call, and
    can be told to fail on a given call."""

    vocab_size = 8
    can_draft_ahead = True
    name = "scripted"
    description = "scripted"

    def __init__(self, script, fail_on=None):
        self.script = script
        self.calls = []
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def reset(self):
        pass

    def begin(self, prompt_ids):
        self.pos = 0
        self.chain = []

    def _extend(self, total):
        with self.lock:
            self.calls.append(("extend", self.pos, total))
            if self.fail_on is not None and len(self.calls) >= self.fail_on:
                raise RuntimeError("draft session lost")
            while len(self.chain) < total:
                self.chain.append(self.script[self.pos + len(self.chain)])

    def propose(self, k, params, generator, *, p_min=0.0):
        self._extend(k)
        return Draft(list(self.chain[:k]))

    def propose_ahead(self, total, params, generator, *, p_min=0.0):
        before = len(self.chain)
        self._extend(total)
        return len(self.chain) - before, 0.0

    def commit(self, n, nxt):
        if n < len(self.chain) and self.chain[n] == nxt:
            self.pos += n + 1
            self.chain = self.chain[n + 1:]
        else:
            self.pos += n + 1
            self.chain = []


ANSWER = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2]


def test_restart_logic_reuses_a_correct_guess_and_redrafts_after_a_wrong_one():
    script = list(ANSWER)
    script[7] = 0  # the drafter is wrong about the token at position 7
    target, drafter = ScriptedTarget(ANSWER), ScriptedDrafter(script + [0] * 40)
    engine = SpeculativeEngine(target, drafter, overlap=True)
    steps = list(engine.generate([5], max_new_tokens=16, policy=FixedK(3)))
    assert [t for s in steps for t in s.tokens] == ANSWER
    # Round 1 drafts 1,2,3 and, while verifying, 4 (guess) + 5,6,7. The guess is right, so round 2 verifies
    # 5,6,7 without drafting; its bonus (1 at position 7) contradicts the chain's 0: round 3 drafts afresh.
    assert target.verify_calls[0] == [5, 1, 2, 3]
    assert target.verify_calls[1] == [4, 5, 6, 7]
    assert drafter.calls[:4] == [("extend", 0, 3), ("extend", 0, 7), ("extend", 4, 3), ("extend", 4, 7)]
    assert drafter.calls[4][0:2] == ("extend", 8)
    assert steps[0].n_accepted == 3 and steps[1].n_accepted == 3


def test_drafter_failure_falls_back_to_the_target_alone():
    target, drafter = ScriptedTarget(ANSWER), ScriptedDrafter(ANSWER + [0] * 40, fail_on=3)
    engine = SpeculativeEngine(target, drafter, overlap=True)
    steps = list(engine.generate([5], max_new_tokens=16, policy=FixedK(3)))
    assert [t for s in steps for t in s.tokens] == ANSWER  # identical to target-only
    notices = [s.notice for s in steps if s.notice]
    assert len(notices) == 1 and "draft session lost" in notices[0] and "target alone" in notices[0]
    first_failed = next(i for i, s in enumerate(steps) if s.notice)
    assert all(s.n_drafted == 0 for s in steps[first_failed + 1:])
    # and the engine is ready for the next request (the drafter gets a fresh start)
    drafter.fail_on = None
    assert [t for s in engine.generate([5], max_new_tokens=8, policy=FixedK(3)) for t in s.tokens] == ANSWER[:8]


def test_sequential_drafter_failure_also_falls_back():
    target, drafter = ScriptedTarget(ANSWER), ScriptedDrafter(ANSWER + [0] * 40, fail_on=2)
    engine = SpeculativeEngine(target, drafter, overlap=False)
    steps = list(engine.generate([5], max_new_tokens=16, policy=FixedK(2)))
    assert [t for s in steps for t in s.tokens] == ANSWER
    assert sum(1 for s in steps if s.notice) == 1


def test_cancel_mid_request_leaves_no_thread(models):
    engine = SpeculativeEngine(TorchTarget(models["target"]), TorchDrafter(models["close"]), overlap=True)
    gen = engine.generate(PROMPTS[1], max_new_tokens=40, policy=FixedK(4))
    next(gen)
    gen.close()  # what the chat's Escape does
    assert not [t for t in threading.enumerate() if t.name.startswith("edgespec-draft")]
    assert engine.run(PROMPTS[1], max_new_tokens=20, policy=FixedK(4)).token_ids == hf_greedy(models["target"], PROMPTS[1], 20)


def test_ngram_drafter_runs_sequentially_under_overlap(models):
    engine = SpeculativeEngine(TorchTarget(models["target"]), NgramDrafter(), overlap=True)
    assert engine.run(PROMPTS[2], max_new_tokens=30, policy=FixedK(4)).token_ids == hf_greedy(models["target"], PROMPTS[2], 30)


def test_overlapped_draft_model_takes_in_the_prompt_while_the_target_does(models):
    """Sequential speculation feeds the prompt to the draft model at its first drafted round (a catch-up, in
    decode time); overlapped, the drafter's thread does it during the target's prefill, so no round catches up."""
    prompt = PROMPTS[1]
    expected = hf_greedy(models["target"], prompt, 20)
    for overlap, caught_up in ((False, True), (True, False)):
        engine = SpeculativeEngine(TorchTarget(models["target"]), TorchDrafter(models["close"]), overlap=overlap)
        steps = list(engine.generate(prompt, max_new_tokens=20, policy=FixedK(3)))
        assert [t for s in steps for t in s.tokens] == expected
        assert (steps[0].catch_up_ms > 0) is caught_up and all(s.catch_up_ms == 0 for s in steps[1:])


class PrefillingDrafter(ScriptedDrafter):
    """A scripted drafter with a prefill step (as the model drafter has), which can fail."""

    def __init__(self, script, prefill_error=None):
        super().__init__(script)
        self.prefill_error = prefill_error
        self.prefilled = 0

    def prefill(self):
        self.prefilled += 1
        if self.prefill_error:
            raise self.prefill_error


def test_a_drafter_failing_in_its_early_prefill_falls_back_to_the_target_alone():
    drafter = PrefillingDrafter(ANSWER + [0] * 40, prefill_error=RuntimeError("draft session lost"))
    engine = SpeculativeEngine(ScriptedTarget(ANSWER), drafter, overlap=True)
    steps = list(engine.generate([5], max_new_tokens=16, policy=FixedK(3)))
    assert drafter.prefilled == 1 and [t for s in steps for t in s.tokens] == ANSWER
    assert "draft session lost" in steps[0].notice and all(s.n_drafted == 0 for s in steps)


def test_a_target_failing_in_prefill_leaves_no_drafter_thread():
    class BrokenTarget(ScriptedTarget):
        def prefill(self, ids):
            raise RuntimeError("out of memory")

    drafter = PrefillingDrafter(ANSWER + [0] * 40)
    engine = SpeculativeEngine(BrokenTarget(ANSWER), drafter, overlap=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        list(engine.generate([5], max_new_tokens=16, policy=FixedK(3)))
    assert drafter.prefilled == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("edgespec-draft")]


class Recorder(FixedK):
    """A fixed K that keeps what the engine reports after each round."""

    def __init__(self, k):
        super().__init__(k)
        self.seen = []

    def observe(self, k, n_drafted, n_accepted, draft_s, verify_s, *, drafted=None, **catch_up):
        self.seen.append((n_drafted, drafted, draft_s, verify_s))


class ThreadClocks:
    """A scripted clock per thread (no sleeps): `spend` moves only the calling thread's clock, so a thread that
    waits for another sees no time pass and every duration the engine reads is exactly what was scripted."""

    def __init__(self):
        self.now = {}

    def spend(self, seconds):
        key = threading.get_ident()
        self.now[key] = self.now.get(key, 0.0) + seconds

    def perf_counter(self):
        return self.now.get(threading.get_ident(), 0.0)


class SlowDrafter(ScriptedDrafter):
    """A scripted drafter that spends `per_token` seconds of its thread's clock per drafted token and says how
    many it drafted."""

    per_token = 0.02

    def __init__(self, script, clocks):
        super().__init__(script)
        self.clocks = clocks

    def _extend(self, total):
        n = max(total - len(self.chain), 0)
        self.clocks.spend(n * self.per_token)
        super()._extend(total)
        return n

    def propose(self, k, params, generator, *, p_min=0.0):
        n = self._extend(k)
        return Draft(list(self.chain[:k]), drafted=n)

    def propose_ahead(self, total, params, generator, *, p_min=0.0):
        return self._extend(total), 0.0


class SlowTarget(ScriptedTarget):
    per_verify = 0.004

    def __init__(self, answer, clocks):
        super().__init__(answer)
        self.clocks = clocks

    def verify(self, tokens):
        self.clocks.spend(self.per_verify)
        return super().verify(tokens)


def test_overlapped_rounds_report_the_drafting_done_ahead_and_the_targets_own_time():
    """Once a guess hits, the next draft is ready and costs nothing on the engine's thread: the policy must
    still hear what drafting cost (on the drafter's thread) and the target's time without the wait for the
    drafter, or the cost model sees free drafting and a slow target and asks for ever larger K."""
    clocks = ThreadClocks()
    policy = Recorder(3)
    engine = SpeculativeEngine(SlowTarget(ANSWER, clocks), SlowDrafter(ANSWER + [0] * 40, clocks), overlap=True,
                               clock=clocks.perf_counter)
    assert [t for s in engine.generate([5], max_new_tokens=16, policy=policy) for t in s.tokens] == ANSWER
    first, *rest = policy.seen
    assert first[:2] == (3, 3 + 4)  # K drafted here, then the guess and the next K ahead
    assert first[2] == pytest.approx(7 * SlowDrafter.per_token) and first[3] == pytest.approx(SlowTarget.per_verify)
    for n_drafted, drafted, draft_s, verify_s in rest[:-1]:
        # every guess hits: nothing drafted on the engine's thread, K + 1 tokens ahead on the drafter's
        assert (n_drafted, drafted) == (3, 4)
        assert draft_s == pytest.approx(4 * SlowDrafter.per_token)
        assert verify_s == pytest.approx(SlowTarget.per_verify)


def test_overlapped_model_drafter_counts_every_drafted_token(models):
    target = models["target"]
    policy = Recorder(4)
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(target), overlap=True)
    engine.run(PROMPTS[0], max_new_tokens=31, policy=policy)  # self-drafted: every guess hits
    assert [s[:2] for s in policy.seen[:-1]] == [(4, 4 + 5)] + [(4, 5)] * (len(policy.seen) - 2)


def test_overlapped_sampling_keeps_a_guess_the_target_agrees_with():
    """Sampling, the target as its own draft: the drafter's guess at each round's bonus token is judged by the
    rule (p_target / p_draft = 1: kept), so the next round's draft is always ready, as in greedy. A bonus drawn
    apart from the guess would have matched it only sometimes, and each miss drafts the round again."""
    from edgespec.sampling import SamplingParams

    target = tiny_llama(vocab_size=32, seed=0)
    policy = Recorder(3)
    engine = SpeculativeEngine(TorchTarget(target), TorchDrafter(target), overlap=True)
    m = engine.run(PROMPTS[0], params=SamplingParams(temperature=1.0, seed=7), max_new_tokens=32, policy=policy).metrics
    assert m.acceptance_rate == 1.0
    assert [s[:2] for s in policy.seen] == [(3, 3 + 4)] + [(3, 4)] * (len(policy.seen) - 1)

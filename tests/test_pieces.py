"""The engine's named pieces, each alone: the protocols' conformance, the drafter guard, the shadow probe, the
exact target's row guesses, the cut at EOS and budget, and the schedulers."""

import threading

import pytest
import torch
from tiny import tiny_llama

from edgespec.drafters import Draft, Drafter, DrafterBase, NgramDrafter, TorchDrafter
from edgespec.drafters.guard import GuardedDrafter
from edgespec.engine import STOP_EOS, STOP_LENGTH, SpeculativeEngine, cut_emitted, row_guesses
from edgespec.lm import CausalLM, TorchLM
from edgespec.policy import AdaptiveK, FixedK, KPolicy, PolicyBase, ShadowProbe
from edgespec.sampling import SamplingParams
from edgespec.scheduler import THREAD_PREFIX, Overlapped, Sequential
from edgespec.target import Target, TorchTarget


def test_every_shipped_piece_implements_its_protocol_whole():
    model = tiny_llama(vocab_size=32, seed=0)
    assert isinstance(TorchDrafter(model), Drafter) and isinstance(NgramDrafter(), Drafter)
    assert isinstance(TorchTarget(model), Target) and isinstance(TorchLM(model), CausalLM)
    assert isinstance(FixedK(2), KPolicy) and isinstance(AdaptiveK(), KPolicy)
    # the capabilities say what each drafter can do
    assert (NgramDrafter().free, NgramDrafter().can_draft_ahead, NgramDrafter().uses_p_min) == (True, False, False)
    d = TorchDrafter(model)
    assert (d.free, d.can_draft_ahead, d.uses_p_min) == (False, True, True)
    # a drafter written against the base class gets the "cannot" defaults, and is a Drafter
    class Minimal(DrafterBase):
        def begin(self, prompt_ids): pass
        def propose(self, k, params, generator, *, p_min=0.0): return Draft([])
        def commit(self, n_accepted, next_token): pass
        def reset(self): pass
    m = Minimal()
    assert isinstance(m, Drafter) and m.lag == 0 and m.peek(0) is None
    with pytest.raises(NotImplementedError, match="cannot draft ahead"):
        m.propose_ahead(3, SamplingParams(), torch.Generator())


class Exploding(DrafterBase):
    """Fails in the named method, counting calls."""

    def __init__(self, where):
        self.where, self.calls = where, []

    def _maybe(self, name):
        self.calls.append(name)
        if name == self.where:
            raise RuntimeError(f"boom in {name}")

    def begin(self, prompt_ids): self._maybe("begin")
    def propose(self, k, params, generator, *, p_min=0.0):
        self._maybe("propose")
        return Draft([1, 2][:k])
    def commit(self, n_accepted, next_token): self._maybe("commit")
    def reset(self): pass


@pytest.mark.parametrize("where", ["begin", "propose", "commit"])
def test_the_guard_turns_a_failure_anywhere_into_one_notice_and_silence(where):
    inner = Exploding(where)
    guard = GuardedDrafter(inner)
    guard.begin([1, 2, 3], frozenset({7}))
    assert inner.stop_ids == frozenset({7})
    draft = guard.propose(2, SamplingParams(), torch.Generator(), 0.0)
    guard.commit(len(draft), 5)
    guard.propose(2, SamplingParams(), torch.Generator(), 0.0)
    notice = guard.take_notice()
    assert not guard.active and f"boom in {where}" in notice and "target alone" in notice
    assert guard.take_notice() is None  # once
    assert inner.calls[-1] == where  # nothing was asked of it after it failed
    guard.begin([1], frozenset())  # the next request gives it a fresh chance
    assert guard.active or where == "begin"


def test_shadow_probe_reports_each_proposal_once_decided():
    class Log(PolicyBase):
        def __init__(self):
            self.reports = []

        def observe_shadow(self, n_proposed, n_matched):
            self.reports.append((n_proposed, n_matched))

    policy = Log()
    probe = ShadowProbe(policy)
    assert probe.wants_proposal(0)
    probe.start([4, 5, 6])
    assert not probe.wants_proposal(0)  # one proposal at a time
    probe.see([4])
    probe.see([5, 9])  # matched 2, then a miss: decided
    assert policy.reports == [(3, 2)] and probe.wants_proposal(0)
    probe.start([])
    assert policy.reports == [(3, 2), (0, 0)]  # an empty proposal is reported at once
    probe.start([1, 2])
    probe.see([1, 2])
    assert policy.reports[-1] == (2, 2)
    probe.start([3])
    assert not probe.wants_proposal(2) and probe.tokens is None  # speculation back on: dropped, not reported
    assert len(policy.reports) == 3


def test_row_guesses_look_up_down_to_one_token_of_context():
    assert row_guesses([1, 2, 3, 1, 2], 3).tokens == [3, 1, 2]
    assert row_guesses([5, 9, 4, 9], 2).tokens == [4, 9]  # a one-token match is enough here
    assert row_guesses([1, 2, 3], 3).tokens == []


@pytest.mark.parametrize("tokens, eos, remaining, expected", [
    ([4, 5, 6], set(), 10, ([4, 5, 6], None)),
    ([4, 2, 6], {2}, 10, ([4, 2], STOP_EOS)),
    ([4, 5, 6], set(), 2, ([4, 5], STOP_LENGTH)),
    ([4, 5, 2], {2}, 3, ([4, 5, 2], STOP_EOS)),  # EOS exactly at the budget: EOS wins
    ([4, 2, 6], {2}, 1, ([4], STOP_LENGTH)),
])
def test_cut_emitted_at_eos_and_budget(tokens, eos, remaining, expected):
    assert cut_emitted(tokens, frozenset(eos), remaining) == expected


def test_the_sequential_scheduler_runs_nothing_aside():
    s = Sequential()
    guard = GuardedDrafter(NgramDrafter())
    s.start_prefill(guard)
    s.finish_prefill()
    s.draft_ahead(guard, 3, SamplingParams(), torch.Generator(), 0.0)
    assert s.collect() is None


def test_the_overlapped_scheduler_drafts_ahead_on_its_own_thread_and_closes_it():
    model = tiny_llama(vocab_size=32, seed=0)
    guard = GuardedDrafter(TorchDrafter(model))
    guard.begin([1, 5, 9, 3], frozenset())
    s = Overlapped(clock=lambda: 0.0)
    s.start_prefill(guard)
    s.finish_prefill()
    draft = guard.propose(3, SamplingParams(), torch.Generator(), 0.0)
    threads = []
    s.draft_ahead(guard, len(draft), SamplingParams(), torch.Generator(), 0.0)
    threads = [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]
    ahead = s.collect()
    assert threads and ahead.tokens == 2 * len(draft) + 1 - len(draft)  # the chain grew to 2K+1
    assert guard.peek(2 * len(draft)) is not None and s.collect() is None
    s.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def test_a_drafter_failing_in_begin_or_commit_falls_back_to_the_target_alone():
    """Not only `propose`: a failure anywhere in the drafter's protocol ends speculation for that request, with
    one notice, and the answer is target-only's."""
    model = tiny_llama(vocab_size=32, seed=0)
    model.generation_config.eos_token_id = None
    prompt = [1, 5, 9, 3, 1, 5, 9]
    alone = SpeculativeEngine(TorchTarget(model)).run(prompt, max_new_tokens=20).token_ids
    for where in ("begin", "commit"):
        class Failing(NgramDrafter):
            def begin(self, prompt_ids):
                if where == "begin":
                    raise RuntimeError("begin broke")
                super().begin(prompt_ids)

            def commit(self, n_accepted, next_token):
                if where == "commit":
                    raise RuntimeError("commit broke")
                super().commit(n_accepted, next_token)

        for overlap in (False, True):
            engine = SpeculativeEngine(TorchTarget(model), Failing(min_ngram=1), overlap=overlap)
            steps = list(engine.generate(prompt, max_new_tokens=20, policy=FixedK(3)))
            assert [t for s in steps for t in s.tokens] == alone
            notices = [s.notice for s in steps if s.notice]
            assert len(notices) == 1 and f"{where} broke" in notices[0]
            failed_at = next(i for i, s in enumerate(steps) if s.notice)
            assert all(s.n_drafted == 0 for s in steps[failed_at + 1:])

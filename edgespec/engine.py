"""The speculative decoding loop: the only place that orders draft, verify and rollback.

Each round: K from the policy, K drafts from the drafter, ONE target pass over the K+1 positions (the last
committed token plus the drafts, so the bonus token comes free), the rule from `edgespec.verify`, then both
caches roll back to the accepted length. `generate` yields one `Step` per round.

The engine knows token ids only: no tokenizer, no chat template, no text. Stop strings are checked by a
callback from outside. With K = 0 (or no drafter) the same loop is plain decoding, token for token.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from .drafters.base import Draft, Drafter
from .drafters.guard import GuardedDrafter
from .drafters.ngram import lookup
from .errors import EdgespecError
from .lm import EXACT_CHECKED_ROWS
from .metrics import SpecMetrics
from .policy import MAX_K, FixedK, KPolicy, ShadowProbe
from .sampling import SamplingParams, probs_from_logits
from .scheduler import Ahead, Overlapped, Sequential
from .target import Target, check_finite
from .verify import Verdict, accept_greedy, verify_sampling

STOP_EOS = "eos"
STOP_LENGTH = "length"
STOP_STRING = "stop"
STOP_CONTEXT = "context"


@dataclass
class Step:
    """One round. `tokens` is what this round emits (drafts kept, then the target's token), already cut at
    EOS / max_new_tokens; its first `n_from_draft` tokens came from the drafter."""

    tokens: list[int]
    n_from_draft: int
    k: int  # K the policy asked for
    n_drafted: int  # tokens the drafter actually proposed (it may propose fewer than K)
    n_accepted: int  # drafts the rule accepted (before any cut at EOS / max_new_tokens)
    draft_ms: float
    verify_ms: float
    prefill_ms: float = 0.0  # only on the first step of a request
    elapsed_s: float = 0.0  # since generate() was called
    stop_reason: str | None = None
    notice: str | None = None  # e.g. the drafter failed and the request continues on the target alone
    catch_up_ms: float = 0.0  # of draft_ms: the draft model taking in context it had not seen (its lazy prefill)


@dataclass
class Generation:
    """Everything a finished request produced, for callers that don't stream."""

    token_ids: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    metrics: SpecMetrics = field(default_factory=SpecMetrics)


@dataclass
class _Request:
    """What one request carries from round to round."""

    seq: list[int]  # prompt + generated: the committed context
    params: SamplingParams
    max_new_tokens: int
    policy: KPolicy
    stop: Callable[[list[int]], bool] | None
    verify_rng: torch.Generator  # the rule's draws ...
    draft_rng: torch.Generator  # ... never depend on how many numbers the drafter consumed
    scheduler: Sequential | Overlapped
    probe: ShadowProbe | None
    start: float
    generated: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0  # reported by the first step only


class SpeculativeEngine:
    """The loop. Its pieces: the drafter behind a `GuardedDrafter` (a failure ends speculation, not the answer),
    a scheduler (`Sequential`, or `Overlapped`: the drafter drafts the next round on its own thread while the
    target verifies, see `edgespec.scheduler`), the policy's `ShadowProbe` (a free drafter consulted while K = 0),
    `row_guesses` (an exact target's padding rows filled with guesses) and `cut_emitted` (EOS and budget).
    `clock` is what every duration is read from (tests give a scripted one)."""

    def __init__(self, target: Target, drafter: Drafter | None = None, *, eos_token_ids: Iterable[int] = (),
                 overlap: bool = False, clock: Callable[[], float] = time.perf_counter):
        self.target = target
        self.drafter = drafter
        self.overlap = overlap
        self.clock = clock
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        if drafter is not None and drafter.vocab_size is not None:
            check_vocab_sizes(drafter.vocab_size, target.vocab_size)
        self._drafts = GuardedDrafter(drafter) if drafter is not None else None

    def generate(
        self,
        prompt_ids: list[int],
        *,
        params: SamplingParams = SamplingParams(),
        max_new_tokens: int = 256,
        policy: KPolicy | None = None,
        stop: Callable[[list[int]], bool] | None = None,
    ) -> Iterator[Step]:
        """Yield one `Step` per round until EOS, `max_new_tokens`, `stop(generated_ids)` or the context end.
        A target whose steps must run on one thread of their own (`Target.runner`: llama.cpp's) runs the whole
        loop there, a round ahead of the caller (`Runner.stream`), rather than handing it every step."""
        rounds = self._rounds(prompt_ids, params, max_new_tokens, policy or FixedK(0), stop)
        runner = getattr(self.target, "runner", None)
        yield from rounds if runner is None else runner.stream(rounds)

    def _rounds(self, prompt_ids, params, max_new_tokens, policy, stop) -> Iterator[Step]:
        r = self._begin(prompt_ids, params, max_new_tokens, policy, stop)
        try:
            self._prefill(r)
            while True:
                step = self._round(r)
                yield step
                if step.stop_reason is not None:
                    return
        finally:
            r.scheduler.close()  # also on cancel (the caller closed the generator) or a target failure

    def _round(self, r: _Request) -> Step:
        """One round: K, propose, verify K+1 positions in one pass, judge, roll back, emit."""
        target, drafts, clock = self.target, self._drafts, self.clock
        remaining, room = r.max_new_tokens - len(r.generated), target.max_context - len(r.seq)
        k = self._next_k(r, remaining, room)
        if r.probe is not None and r.probe.wants_proposal(k):
            shadow = drafts.propose(r.policy.k_max, r.params, r.draft_rng, 0.0)
            if drafts.active:
                r.probe.start(shadow.tokens)

        t0 = clock()
        guess = False
        if k > 0:
            draft = cut_at_eos(drafts.propose(k, r.params, r.draft_rng, r.policy.p_min), self.eos_token_ids)
        elif self._drafting() and (rows := min(target.min_rows, remaining, room)) >= 2:
            draft = row_guesses(r.seq, rows - 1)  # an exact target runs a lone token as `min_rows` rows anyway
            guess = len(draft) > 0
        else:
            draft = Draft([])
        t1 = clock()
        if not guess:
            r.scheduler.draft_ahead(drafts, len(draft), r.params, r.draft_rng, r.policy.p_min)
        logits = target.verify([r.seq[-1], *draft.tokens])
        # Greedy judges while the drafter drafts on; sampling judges the drafter's guess at the bonus token as
        # one more draft, so it waits for the drafter first.
        if r.params.greedy:
            verdict = judge(draft, logits, r.params, r.verify_rng, target=target.description)
        ahead = r.scheduler.collect()
        if not r.params.greedy:
            bonus = drafts.peek(len(draft)) if ahead is not None else None
            verdict = judge(draft, logits, r.params, r.verify_rng, bonus if bonus and bonus[1] is not None else None,
                            target=target.description)
        target.rollback(len(r.seq) + verdict.n_accepted)
        if self._drafting():
            for n, token in _commits(draft, verdict, guess):
                drafts.commit(n, token)
        target.synchronize()  # the rollback's device work counts in this round (verify itself returns CPU rows)
        t2 = clock()

        emitted, reason = cut_emitted([*draft.tokens[:verdict.n_accepted], verdict.next_token],
                                      self.eos_token_ids, remaining)
        r.seq.extend(emitted)
        r.generated.extend(emitted)
        if r.probe is not None:
            r.probe.see(emitted)
        if reason is None and len(r.seq) >= target.max_context:
            reason = STOP_CONTEXT
        if reason is None and r.stop is not None and r.stop(r.generated):
            reason = STOP_STRING
        _observe(r.policy, k, draft, verdict, guess, t1 - t0, t2 - t1, ahead)
        step = Step(tokens=emitted, n_from_draft=min(verdict.n_accepted, len(emitted)), k=k,
                    n_drafted=len(draft), n_accepted=verdict.n_accepted, draft_ms=(t1 - t0) * 1000,
                    verify_ms=(t2 - t1) * 1000, prefill_ms=r.prefill_ms, elapsed_s=clock() - r.start,
                    stop_reason=reason, notice=drafts.take_notice() if drafts is not None else None,
                    catch_up_ms=draft.catch_up_s * 1000)
        r.prefill_ms = 0.0
        return step

    def _begin(self, prompt_ids, params: SamplingParams, max_new_tokens: int, policy: KPolicy,
               stop) -> _Request:
        """Check the request and set up its state (nothing runs on a model yet)."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise EdgespecError("the prompt is empty; give at least one token of prompt text")
        if len(prompt_ids) >= self.target.max_context:
            raise EdgespecError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds {self.target.max_context}; "
                "shorten the prompt (or the chat history)"
            )
        if max_new_tokens < 1:
            raise EdgespecError(f"max_new_tokens={max_new_tokens} must be at least 1")
        policy.begin_request(min_rows=self.target.min_rows)
        seed = params.seed if params.seed is not None else int(torch.seed() % 2**62)
        drafts = self._drafts
        overlapped = self.overlap and drafts is not None and drafts.can_draft_ahead
        free = drafts is not None and drafts.free and policy.learns_from_shadow
        return _Request(seq=prompt_ids, params=params, max_new_tokens=max_new_tokens, policy=policy, stop=stop,
                        verify_rng=torch.Generator().manual_seed(seed),
                        draft_rng=torch.Generator().manual_seed(seed + 1),
                        scheduler=Overlapped(self.clock) if overlapped else Sequential(),
                        probe=ShadowProbe(policy) if free else None, start=self.clock())

    def _prefill(self, r: _Request) -> None:
        """The target takes in the prompt (and, overlapped, the drafter beside it on its own thread)."""
        self.target.reserve(min(len(r.seq) + r.max_new_tokens, self.target.max_context))
        if self._drafts is not None:
            self._drafts.begin(r.seq, self.eos_token_ids)
            if self._drafts.active:
                r.scheduler.start_prefill(self._drafts)
        self.target.prefill(r.seq[:-1])
        r.scheduler.finish_prefill()
        self.target.synchronize()  # or the prefill's device time would land in the first round's verify_ms
        r.prefill_ms = (self.clock() - r.start) * 1000

    def _drafting(self) -> bool:
        return self._drafts is not None and self._drafts.active

    def _next_k(self, r: _Request, remaining: int, room: int) -> int:
        """K from the policy, kept inside the budget and the context (a round emits at most K+1 tokens and
        grows the target's cache to len(seq)+K). The policy also hears how far behind the drafter is: a draft
        model's lazy prefill of a long prompt must be repaid by the rest of the answer."""
        if not self._drafting():
            return 0
        k = r.policy.next_k(remaining=remaining, lag=self._drafts.lag)
        if self.target.min_rows > 1:  # an exact target: no step of more rows than `exact_rows` checked
            k = min(k, EXACT_CHECKED_ROWS - 1)
        return max(min(k, MAX_K, remaining - 1, room - 1), 0)

    def reset(self) -> None:
        """Drop both caches, so the next request prefills from scratch."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def run(self, prompt_ids: list[int], **kwargs) -> Generation:
        """Generate to the end and return the ids, the stop reason and the metrics."""
        result = Generation()
        for step in self.generate(prompt_ids, **kwargs):
            result.token_ids.extend(step.tokens)
            result.metrics.add(step)
            result.stop_reason = step.stop_reason
        return result


def judge(draft: Draft, logits: torch.Tensor, params: SamplingParams, rng: torch.Generator,
          guess: tuple[int, torch.Tensor] | None = None, *, target: str = "target") -> Verdict:
    """The rule on one round: greedy, or rejection sampling (a deterministic proposal is a one-hot p_draft).
    Everything it reads is on the CPU (the device contract in `edgespec.target`). The target's rows must be
    finite (`check_finite`, its error naming `target`): checked in the pass the rule makes over them anyway
    (greedy: the argmax; a separate pass over a 49k row costs 0.1 ms right after a llama.cpp step, 1%)."""
    _check_on_cpu("the target's logits", logits)
    if draft.p_draft is not None:
        _check_on_cpu("the drafter's p_draft", draft.p_draft)
    if guess is not None and guess[1] is not None:
        _check_on_cpu("the drafter's p_draft (its guess at the bonus token)", guess[1])
    rows = logits.detach().float().numpy()
    if params.greedy:
        choice = rows.argmax(-1)  # (NaN counts as the maximum: a row holding one yields it)
        check_finite(float(rows[np.arange(len(choice)), choice].sum()), target)
        return accept_greedy(draft.tokens, choice.tolist())
    check_finite(float(rows.sum()), target)
    p_target = probs_from_logits(logits, params)
    if draft.p_draft is not None:
        p_draft = draft.p_draft
    else:
        p_draft = torch.nn.functional.one_hot(torch.tensor(draft.tokens, dtype=torch.long), p_target.shape[-1]).float()
    return verify_sampling(draft.tokens, p_draft, p_target, rng, guess)


def _check_on_cpu(what: str, tensor: torch.Tensor) -> None:
    """A backend that breaks the device contract fails here, by name, greedy or not: a greedy argmax would work on
    any device, and the broken contract would surface only at the first sampled request, deep in the rule."""
    if tensor.device.type != "cpu":
        raise RuntimeError(f"{what} are on {tensor.device}, but the rule runs on the CPU: a Target returns CPU "
                           f"logits and a Drafter CPU rows (the device contract, edgespec/target.py)")


def row_guesses(seq: list[int], n: int) -> Draft:
    """Up to `n` guesses at the next tokens (prompt lookup down to one token of context) for an exact target's
    padding rows: a lone token runs as `min_rows` rows anyway, and accepted by the same rule, guesses are tokens
    for nothing."""
    return Draft(lookup(seq, n))


def _commits(draft: Draft, verdict: Verdict, guess: bool) -> list[tuple[int, int]]:
    """What the drafter hears of a round: (accepted, next token). It proposed nothing in a guess round, so
    there it hears the round's tokens one by one."""
    if guess:
        return [(0, t) for t in [*draft.tokens[:verdict.n_accepted], verdict.next_token]]
    return [(verdict.n_accepted, verdict.next_token)]


def _observe(policy: KPolicy, k: int, draft: Draft, verdict: Verdict, guess: bool, draft_s: float,
             verify_s: float, ahead: Ahead | None) -> None:
    """The policy's costs: the drafter's work per drafted token wherever it ran (on this thread, or ahead on its
    own while the target verified) and the target's own time, without the wait for the drafter. (A hit's draft
    came for free on this thread: timing only this thread would call drafting free, and auto K climbed to 8
    where 2 was best.) A catch-up (the draft model's prefill) is not a cost per token; a guess round is a K = 0
    round to the policy: what it costs is what a plain step costs here."""
    drafted = len(draft) if draft.drafted is None else draft.drafted
    draft_s = max(draft_s - draft.catch_up_s, 0.0)
    if ahead is not None:
        verify_s -= ahead.wait_s
        if ahead.tokens is not None:
            draft_s, drafted = draft_s + ahead.seconds, drafted + ahead.tokens
    policy.observe(k, 0 if guess else len(draft), 0 if guess else verdict.n_accepted, draft_s, verify_s,
                   catch_up_s=draft.catch_up_s, catch_up_tokens=draft.catch_up_tokens, drafted=0 if guess else drafted)


def cut_emitted(tokens: list[int], eos_token_ids: frozenset[int], remaining: int) -> tuple[list[int], str | None]:
    """A round's tokens cut after the first end-of-answer token and at the budget, with the stop reason."""
    reason = None
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            tokens, reason = tokens[: i + 1], STOP_EOS
            break
    if len(tokens) >= remaining:
        if len(tokens) > remaining:
            reason = None  # the end of answer was past the budget: cut away with it
        tokens, reason = tokens[:remaining], reason or STOP_LENGTH
    return tokens, reason


def cut_at_eos(draft: Draft, eos_token_ids: frozenset[int]) -> Draft:
    """The draft up to and including its first end-of-answer token: nothing after one can be emitted (if the
    target accepts it the answer ends there; if not, the rest is rejected with it), so verifying it is waste."""
    for i, token in enumerate(draft.tokens[:-1]):
        if token in eos_token_ids:
            return dataclasses.replace(draft, tokens=draft.tokens[: i + 1],
                                       p_draft=None if draft.p_draft is None else draft.p_draft[: i + 1])
    return draft


def check_vocab_sizes(draft_vocab: int | None, target_vocab: int | None) -> None:
    """Draft token ids are fed to the target: the draft's rows may not outnumber the target's. Fewer are fine
    (two sizes of one family share a tokenizer but pad their embeddings differently): the rule reads the draft's
    distribution as zero on the target's extra rows (`verify.common_width`). The tokenizers themselves are
    compared before the models load (`runtime.validate_pair`)."""
    if draft_vocab is not None and target_vocab is not None and draft_vocab > target_vocab:
        raise EdgespecError(
            f"the draft model has more vocabulary rows than the target can take (draft {draft_vocab} tokens, "
            f"target {target_vocab}); use a smaller draft model of the target's family, with the same tokenizer, "
            "or --draft ngram"
        )

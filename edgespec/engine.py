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

import torch

from .drafters.base import Draft, Drafter
from .drafters.ngram import lookup
from .errors import EdgespecError
from .metrics import SpecMetrics
from .policy import MAX_K, FixedK, KPolicy
from .sampling import SamplingParams, probs_from_logits
from .target import Target
from .verify import Verdict, verify_greedy, verify_sampling

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


class SpeculativeEngine:
    """`overlap=True`: while the target verifies round i, the drafter (on its own thread) already drafts round
    i+1 as if all of round i were accepted and the target's next token were the drafter's own guess. When
    verification agrees the next draft is ready; otherwise it is thrown away and drafted again from the
    corrected prefix. When sampling, the drafter's guess is judged by the rule as one more draft at the bonus
    position (kept as often as a draft is accepted; an independent bonus draw matched it in about 63% of SmolLM2's
    T = 0.7 rounds against the ~88% the cost model assumes). The drafter's work always runs to completion before the
    round ends, so the random draws do not depend on timing, and the output is the same as sequential
    speculation's in distribution (greedy: token for token). Needs a drafter with `propose_ahead` (model
    drafters); others run sequentially."""

    def __init__(self, target: Target, drafter: Drafter | None = None, *, eos_token_ids: Iterable[int] = (),
                 overlap: bool = False):
        self.target = target
        self.drafter = drafter
        self.overlap = overlap
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        draft_vocab = getattr(drafter, "vocab_size", None)
        if draft_vocab is not None:
            check_vocab_sizes(draft_vocab, target.vocab_size)

    def generate(
        self,
        prompt_ids: list[int],
        *,
        params: SamplingParams = SamplingParams(),
        max_new_tokens: int = 256,
        policy: KPolicy | None = None,
        stop: Callable[[list[int]], bool] | None = None,
    ) -> Iterator[Step]:
        """Yield one `Step` per round until EOS, `max_new_tokens`, `stop(generated_ids)` or the context end."""
        target, drafter = self.target, self.drafter
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise EdgespecError("the prompt is empty; give at least one token of prompt text")
        if len(prompt_ids) >= target.max_context:
            raise EdgespecError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds {target.max_context}; "
                "shorten the prompt (or the chat history)"
            )
        if max_new_tokens < 1:
            raise EdgespecError(f"max_new_tokens={max_new_tokens} must be at least 1")
        policy = policy or FixedK(0)
        if hasattr(policy, "begin_request"):  # a policy written against the older protocol may lack it
            policy.begin_request()
        if hasattr(policy, "min_rows"):  # an exact target's short steps cost what `min_rows` rows do
            policy.min_rows = getattr(target, "min_rows", 1)
        seed = params.seed if params.seed is not None else int(torch.seed() % 2**62)
        # Two generators: the rule's draws never depend on how many numbers the drafter consumed.
        verify_rng = torch.Generator().manual_seed(seed)
        draft_rng = torch.Generator().manual_seed(seed + 1)

        ahead_pool = None
        if self.overlap and drafter is not None and hasattr(drafter, "propose_ahead"):
            from concurrent.futures import ThreadPoolExecutor

            ahead_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-draft")
        notice = None
        start = time.perf_counter()
        if hasattr(target, "reserve"):  # an exact target sizes its cache from the whole request
            target.reserve(min(len(prompt_ids) + max_new_tokens, target.max_context))
        early = None
        # A drafter that can stop its chain at an end of answer learns the target's EOS ids (drafting past one
        # is work for tokens that can never be emitted); with `p_min` > 0 it also stops after a token its own
        # model is unsure of (the policy's `p_min`; fixed K keeps its K).
        p_min = float(getattr(policy, "p_min", 0.0) or 0.0)
        if drafter is not None:
            if hasattr(drafter, "stop_ids"):
                drafter.stop_ids = self.eos_token_ids
            drafter.begin(prompt_ids)
            if ahead_pool is not None and hasattr(drafter, "prefill"):
                # Overlapped: the draft model takes in the prompt on its own thread while the target does
                # (sequential speculation leaves it to the first drafted round, so K = 0 never pays it).
                early = ahead_pool.submit(drafter.prefill)
        try:
            target.prefill(prompt_ids[:-1])
        except BaseException:
            if ahead_pool is not None:  # no drafter thread outlives the request (it finishes its prefill first)
                ahead_pool.shutdown(wait=True)
            raise
        if early is not None:
            try:
                early.result()
            except Exception as err:  # noqa: BLE001 - as for any drafter failure: finish on the target alone
                drafter, notice = None, _drafter_failed(err)
        prefill_ms = (time.perf_counter() - start) * 1000

        seq = list(prompt_ids)
        generated: list[int] = []
        # A free drafter (an n-gram lookup: microseconds, nothing to roll back) is still asked while the policy
        # has speculation off: its proposal is checked against the tokens the target goes on to emit, and the
        # policy learns from that what drafting would have gained, so it can switch speculation back on.
        # Matching the target's own token is accepting: for a one-hot draft P(match) = p_target(draft) = P(accept).
        shadow_ok = drafter is not None and getattr(drafter, "free", False) and hasattr(policy, "observe_shadow")
        shadow: list[int] | None = None
        shadow_hits = 0
        try:
            while True:
                remaining = max_new_tokens - len(generated)
                room = target.max_context - len(seq)
                # A round emits at most K+1 tokens and grows the target cache to len(seq)+K: stay inside both.
                if drafter is not None:
                    # The policy also hears how many tokens are left and how far behind the drafter is: a
                    # draft model's lazy prefill of a long prompt must be repaid by the rest of the answer.
                    k = policy.next_k(remaining=remaining, lag=getattr(drafter, "lag", 0))
                    k = max(min(k, MAX_K, remaining - 1, room - 1), 0)
                else:
                    k = 0

                if k > 0:
                    shadow = None  # speculation is back on: its rounds say the rest
                elif shadow_ok and drafter is not None and shadow is None:
                    try:
                        shadow, shadow_hits = drafter.propose(policy.k_max, params, draft_rng).tokens, 0
                    except Exception as err:  # noqa: BLE001 - as for any proposal: finish on the target alone
                        drafter, notice, shadow = None, _drafter_failed(err), None
                    else:
                        if not shadow:
                            policy.observe_shadow(0, 0)
                            shadow = None

                t0 = time.perf_counter()
                draft = Draft([])
                guess = False
                if k > 0:
                    try:
                        draft = _cut_at_eos(drafter.propose(k, params, draft_rng, **({"p_min": p_min} if p_min else {})),
                                            self.eos_token_ids)
                    except Exception as err:  # noqa: BLE001 - any drafter failure: finish on the target alone
                        drafter, notice = None, _drafter_failed(err)
                elif drafter is not None and (rows := getattr(target, "min_rows", 1)) >= 2 and min(remaining, room) >= 2:
                    # An exact target runs a lone token as `rows` rows anyway: fill the others with guesses at the
                    # next tokens (prompt lookup down to one token of context) instead of repeats; accepted by
                    # the same rule, they are tokens for nothing.
                    draft = Draft(lookup(seq, min(rows, remaining, room) - 1))
                    guess = len(draft) > 0
                t1 = time.perf_counter()
                ahead = None
                if ahead_pool is not None and drafter is not None and len(draft) > 0 and not guess:
                    # Draft the next round (its first token is the guess at the target's next token).
                    ahead = ahead_pool.submit(_timed_ahead, drafter, 2 * len(draft) + 1, params, draft_rng, p_min)
                logits = target.verify([seq[-1], *draft.tokens])
                # Sampling: the drafter's guess at the bonus token is judged by the rule as one more draft (below),
                # so the rule must wait for it; greedy needs no guess and judges while the drafter drafts on.
                early_judge = ahead is None or params.greedy
                if early_judge:
                    verdict = self._judge(draft, logits, params, verify_rng)
                # The policy's costs: the drafter's work per drafted token wherever it ran (on this thread, or
                # ahead on its own while the target verified) and the target's own time, without the wait for
                # the drafter. (A hit's draft came for free on this thread: timing only this thread would call
                # drafting free, and auto K climbed to 8 where 2 was best.)
                drafted = len(draft) if draft.drafted is None else draft.drafted
                draft_s = max(t1 - t0 - draft.catch_up_s, 0.0)
                wait_s = 0.0
                if ahead is not None:
                    t_wait = time.perf_counter()
                    try:
                        ahead_s, ahead_n = ahead.result()
                    except Exception as err:  # noqa: BLE001 - as above
                        drafter, notice = None, _drafter_failed(err)
                    else:
                        if ahead_n is not None:
                            draft_s, drafted = draft_s + ahead_s, drafted + ahead_n
                    wait_s = time.perf_counter() - t_wait
                if not early_judge:
                    peek = getattr(drafter, "peek", None) if drafter is not None else None
                    bonus = peek(len(draft)) if peek is not None else None
                    verdict = self._judge(draft, logits, params, verify_rng,
                                          bonus if bonus is not None and bonus[1] is not None else None)
                target.rollback(len(seq) + verdict.n_accepted)
                if drafter is not None:
                    if guess:  # the drafter proposed nothing: it hears the round's tokens one by one
                        for token in [*draft.tokens[: verdict.n_accepted], verdict.next_token]:
                            drafter.commit(0, token)
                    else:
                        drafter.commit(verdict.n_accepted, verdict.next_token)
                t2 = time.perf_counter()

                emitted = [*draft.tokens[: verdict.n_accepted], verdict.next_token]
                reason = None
                for i, token in enumerate(emitted):
                    if token in self.eos_token_ids:
                        emitted, reason = emitted[: i + 1], STOP_EOS
                        break
                if len(generated) + len(emitted) >= max_new_tokens:
                    emitted = emitted[:remaining]
                    reason = reason or STOP_LENGTH
                seq.extend(emitted)
                generated.extend(emitted)
                if shadow is not None and k == 0:
                    for token in emitted:  # two with an accepted guess
                        hit = token == shadow[shadow_hits]
                        shadow_hits += hit
                        if not hit or shadow_hits == len(shadow):
                            policy.observe_shadow(len(shadow), shadow_hits)
                            shadow = None
                            break
                if reason is None and len(seq) >= target.max_context:
                    reason = STOP_CONTEXT
                if reason is None and stop is not None and stop(generated):
                    reason = STOP_STRING
                # The policy learns the cost per drafted token: a catch-up (the draft model's prefill) is not.
                # (a guess round is a K = 0 round to the policy: what it costs is what a plain step costs here)
                policy.observe(k, 0 if guess else len(draft), 0 if guess else verdict.n_accepted,
                               draft_s, t2 - t1 - wait_s, catch_up_s=draft.catch_up_s,
                               catch_up_tokens=draft.catch_up_tokens, drafted=0 if guess else drafted)
                yield Step(
                    tokens=emitted,
                    n_from_draft=min(verdict.n_accepted, len(emitted)),
                    k=k,
                    n_drafted=len(draft),
                    n_accepted=verdict.n_accepted,
                    draft_ms=(t1 - t0) * 1000,
                    verify_ms=(t2 - t1) * 1000,
                    prefill_ms=prefill_ms,
                    elapsed_s=time.perf_counter() - start,
                    stop_reason=reason,
                    notice=notice,
                    catch_up_ms=draft.catch_up_s * 1000,
                )
                prefill_ms, notice = 0.0, None
                if reason is not None:
                    return
        finally:
            # Also on cancel (the caller closed the generator): no drafter thread outlives the request.
            if ahead_pool is not None:
                ahead_pool.shutdown(wait=True)

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

    @staticmethod
    def _judge(draft: Draft, logits: torch.Tensor, params: SamplingParams, rng: torch.Generator,
               guess: tuple[int, torch.Tensor] | None = None) -> Verdict:
        if params.greedy:
            return verify_greedy(draft.tokens, logits)
        p_target = probs_from_logits(logits, params)
        if draft.p_draft is not None:
            p_draft = draft.p_draft
        else:  # a deterministic proposal is a one-hot distribution
            p_draft = torch.nn.functional.one_hot(
                torch.tensor(draft.tokens, dtype=torch.long), p_target.shape[-1]
            ).float()
        return verify_sampling(draft.tokens, p_draft, p_target, rng, guess)


def _timed_ahead(drafter, total: int, params: SamplingParams, rng: torch.Generator,
                 p_min: float = 0.0) -> tuple[float, int | None]:
    """Run `drafter.propose_ahead` (on the drafter's thread): the seconds it drafted for (its catch-up on unseen
    context left out) and how many tokens (None: a drafter that does not say)."""
    start = time.perf_counter()
    out = drafter.propose_ahead(total, params, rng, **({"p_min": p_min} if p_min else {}))
    seconds = time.perf_counter() - start
    if not isinstance(out, tuple):
        return seconds, None
    n, catch_up_s = out
    return max(seconds - catch_up_s, 0.0), int(n)


def _cut_at_eos(draft: Draft, eos_token_ids: frozenset[int]) -> Draft:
    """The draft up to and including its first end-of-answer token: nothing after one can be emitted (if the
    target accepts it the answer ends there; if not, the rest is rejected with it), so verifying it is waste."""
    for i, token in enumerate(draft.tokens[:-1]):
        if token in eos_token_ids:
            return dataclasses.replace(draft, tokens=draft.tokens[: i + 1],
                                       p_draft=None if draft.p_draft is None else draft.p_draft[: i + 1])
    return draft


def _drafter_failed(err: BaseException) -> str:
    return f"the drafter failed ({type(err).__name__}: {err}); this answer continues on the target alone"


def check_vocab_sizes(draft_vocab: int | None, target_vocab: int | None) -> None:
    """Draft token ids index the target's distribution: the two vocabularies must be the same size."""
    if draft_vocab != target_vocab:
        raise EdgespecError(
            f"draft and target vocabularies differ (draft {draft_vocab} tokens, target {target_vocab}); "
            "use a draft model from the same family with the same tokenizer, or --draft ngram"
        )

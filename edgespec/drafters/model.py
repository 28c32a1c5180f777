"""A drafter that runs a (smaller) causal LM: any `CausalLM` backend, torch or ONNX Runtime.

It decodes K tokens one at a time from its own cache, then crops that cache to the accepted length on
`commit`. Tokens committed but not yet in its cache (the prompt, the target's correction, or many tokens while
speculation was off) are fed in one batch at the next `propose`: a request that never drafts (K = 0 from the
profile) never pays the draft model's prefill. Such a catch-up is timed apart (`Draft.catch_up_s`) so K
policies do not mistake a prefill for a slow draft token.
"""

from __future__ import annotations

import time

import torch

from ..lm import CausalLM, TorchLM
from ..sampling import SamplingParams, probs_from_logits
from ..target import CachedPrefix
from .base import Draft, DrafterBase

CATCH_UP = 2  # a first feed longer than this is a catch-up (timed apart), not part of drafting


class ModelDrafter(DrafterBase):
    can_draft_ahead = True  # prefill / propose_ahead on the drafter's own thread when overlapped
    uses_p_min = True  # its proposals stop after an unsure token (p_min) and at an end of answer (stop_ids)

    def __init__(self, lm: CausalLM, *, name: str = "model"):
        self.lm = lm
        self.name = name
        self.description = lm.description
        self.vocab_size = lm.vocab_size
        self.max_context = lm.max_context
        self._cache = _OwnRows(lm)
        self._ids: list[int] = []  # committed context
        # Proposed tokens beyond the committed context, in order, with their p_draft rows (None when greedy).
        # The cache holds at most ids + chain[:-1]. The chain can run ahead of what the engine asked for
        # (`propose_ahead`, used to draft the next round while the target verifies this one).
        self._chain: list[int] = []
        self._rows: list[torch.Tensor | None] = []
        self._conf: list[float] = []  # the draft distribution's top probability at each chain position
        # Token ids that end an answer (the engine sets them from the target's EOS ids): the chain never runs
        # past one, since nothing drafted after an end of answer can be emitted.
        self.stop_ids: frozenset[int] = frozenset()

    def begin(self, prompt_ids: list[int]) -> None:
        self._ids = list(prompt_ids)
        self._chain, self._rows, self._conf = [], [], []
        self._cache.trim(self._ids[:-1])  # keep what a previous request left in common; feed lazily

    def reset(self) -> None:
        self._ids, self._chain, self._rows, self._conf = [], [], [], []
        self._cache.sync([])

    def prefill(self) -> None:
        """Take in the committed context now (all but its last token, which the first proposal feeds) instead of
        lazily at the first proposal. The overlapped engine calls it on the drafter's own thread while the target
        takes in the prompt, so the draft model's prefill costs no time of its own."""
        self._cache.sync(self._ids[:-1])

    @property
    def lag(self) -> int:
        """Committed tokens not yet in the draft model's cache (the next proposal feeds them first)."""
        return max(len(self._ids) - len(self._cache.ids), 0)

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator, *, p_min: float = 0.0) -> Draft:
        """Up to `k` tokens; fewer when the chain reaches an end-of-answer token or, with `p_min` > 0, a token
        the draft model gave less than `p_min` of its probability (llama.cpp's --draft-p-min: that token is
        still proposed, but nothing after it). Proposing fewer never changes what the target emits."""
        # The drafter cannot look past its own window; proposing less is always allowed.
        k = min(k, self.max_context - len(self._ids))
        if k <= 0:
            return Draft([])
        before = len(self._chain)
        catch_up_s, catch_up_tokens = self._extend(k, params, generator, p_min)
        n = self._usable(k, p_min)
        return Draft(list(self._chain[:n]), None if params.greedy else torch.stack(self._rows[:n]), catch_up_s,
                     catch_up_tokens, drafted=max(len(self._chain) - before, 0))

    def propose_ahead(self, total: int, params: SamplingParams, generator: torch.Generator, *,
                      p_min: float = 0.0) -> tuple[int, float]:
        """Extend the chain to `total` tokens (as if everything proposed so far will be accepted), stopping where
        `propose` would. Returns how many tokens that drafted and the seconds of it spent catching up on unseen
        context."""
        before = len(self._chain)
        catch_up_s, _ = self._extend(min(total, self.max_context - len(self._ids)), params, generator, p_min)
        return max(len(self._chain) - before, 0), catch_up_s

    def _usable(self, k: int, p_min: float) -> int:
        """How many of the chain's first `k` tokens a proposal may use: up to and including the first
        end-of-answer token or the first token drafted with confidence below `p_min`."""
        for i in range(min(k, len(self._chain))):
            if self._ends_proposal(i, p_min):
                return i + 1
        return min(k, len(self._chain))

    def peek(self, i: int) -> tuple[int, torch.Tensor | None] | None:
        """The chain's token at position `i` past the committed context and its draft distribution row (None
        when greedy); None when the chain does not reach that far. After `propose_ahead`, position K is the
        drafter's guess at the token the target adds to a round of K drafts."""
        return (self._chain[i], self._rows[i]) if i < len(self._chain) else None

    def _extend(self, total: int, params: SamplingParams, generator: torch.Generator,
                p_min: float = 0.0) -> tuple[float, int]:
        """Grow the chain to `total` tokens, or until its last token ends the answer or was drafted with less
        than `p_min` confidence; return the seconds spent catching up on unseen context and how many tokens
        that was."""
        catch_up_s, catch_up_tokens = 0.0, 0
        while len(self._chain) < total and not (self._chain and self._ends_proposal(len(self._chain) - 1, p_min)):
            context = self._ids + self._chain
            new = context[len(self._cache.ids):]
            # A steady round feeds 1-2 tokens first (the target's token, perhaps the last accepted draft);
            # more is context the drafter has not seen yet.
            start = time.perf_counter() if len(new) > CATCH_UP else 0.0
            logits = self._cache.feed(new, 1)[-1].to("cpu", torch.float32)  # the device contract: CPU rows
            if start:
                catch_up_s += time.perf_counter() - start
                catch_up_tokens += len(new)
            if params.greedy:
                token, row = int(logits.argmax()), None
                conf = float(torch.softmax(logits.float(), -1)[token]) if p_min > 0 else 1.0
            else:
                row = probs_from_logits(logits, params)
                token = int(torch.multinomial(row, 1, generator=generator))
                conf = float(row.max())
            self._chain.append(token)
            self._rows.append(row)
            self._conf.append(conf)
        return catch_up_s, catch_up_tokens

    def _ends_proposal(self, i: int, p_min: float) -> bool:
        """Chain position `i` is the last a proposal may use: an end-of-answer token, or drafted below `p_min`."""
        return self._chain[i] in self.stop_ids or self._conf[i] < p_min

    def commit(self, n_accepted: int, next_token: int) -> None:
        chain = self._chain
        if n_accepted < len(chain) and chain[n_accepted] == next_token:
            # The chain already went this way (it ran ahead and guessed the target's token): keep the rest.
            self._ids.extend(chain[: n_accepted + 1])
            self._chain, self._rows = chain[n_accepted + 1:], self._rows[n_accepted + 1:]
            self._conf = self._conf[n_accepted + 1:]
            return
        keep = len(self._ids) + n_accepted
        self._ids.extend(chain[:n_accepted])
        self._ids.append(next_token)
        self._chain, self._rows, self._conf = [], [], []
        if len(self._cache.ids) > keep:
            self._cache.crop(keep)


class _OwnRows(CachedPrefix):
    """The draft model's cache, fed only ids its embedding has. A draft model may have fewer rows than the target
    (one tokenizer, embeddings padded differently: `engine.check_vocab_sizes`), and a target that samples one of
    its extra rows gives the draft a token it cannot embed: that one is fed as id 0 (`ids` keep the real token).
    The drafts after it may be worse, never wrong: the rule is exact whatever the draft proposes."""

    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor:
        rows = self.lm.vocab_size
        logits = self.lm.feed([t if t < rows else 0 for t in ids], logits_for)
        self.ids.extend(ids)
        return logits


def TorchDrafter(model, *, max_context: int | None = None) -> ModelDrafter:
    """A drafter running a transformers causal LM under PyTorch."""
    return ModelDrafter(TorchLM(model, max_context=max_context, name="draft"), name="torch")

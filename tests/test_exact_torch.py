"""--exact on a torch target: a fixed-length (static) KV cache and short steps padded to the row count that
`edgespec.lm.exact_rows` measures, so that greedy output is bitwise the same at every K.

The real-weight tests use SmolLM2-135M in bfloat16, where plain decoding and verification round differently
(the bench finds plain target-only output differing from the exact one on most prompts).
"""

import pytest
import torch
from tiny import save_tiny_checkpoint, tiny_llama

from edgespec.lm import EXACT_ROW_COUNTS, TorchLM, exact_rows
from edgespec.policy import FixedK
from edgespec.runtime import RuntimeSpec, build_runtime
from edgespec.session import ChatSession

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Rewrite more formally: the meeting got moved cause the boss was sick, so we do it monday."}],
]


@pytest.fixture(scope="module")
def exact_rt():
    spec = RuntimeSpec(pair="smollm2-135m", draft="int4", target_backend="torch", target_device="cpu",
                       dtype="bfloat16", exact=True)
    return build_runtime(spec, progress=lambda _: None)


def test_exact_rows_are_bitwise_the_same_whatever_the_split_on_real_bf16_weights(exact_rt):
    lm = exact_rt.engine.target.lm
    assert lm.min_rows in EXACT_ROW_COUNTS and lm.dtype == torch.bfloat16
    ids = ChatSession(exact_rt.engine, exact_rt.tokenizer).encode(PROMPTS[1])
    prompt, tokens = ids[:-9], ids[-9:]
    lm.reserve(len(ids) + 20)
    lm.reset()
    lm.feed(prompt, 0)
    block = lm.feed(tokens, len(tokens))
    lm.crop(len(prompt))
    split = torch.cat([lm.feed(tokens[i:j], j - i) for i, j in ((0, 1), (1, 3), (3, 4), (4, 8), (8, 9))])
    assert torch.equal(split, block)  # bitwise: what makes greedy output independent of K
    assert lm.length == len(ids)  # the padding rows are not kept
    lm.crop(len(prompt) + 5)
    assert torch.equal(lm.feed(tokens[5:6], 1), block[5:6])  # a rollback keeps exactly the cached rows


def test_exact_torch_target_greedy_speculation_equals_its_target_only_bitwise(exact_rt):
    from edgespec.engine import SpeculativeEngine

    engine = exact_rt.engine
    accepted = guessed = 0
    alone_engine = SpeculativeEngine(engine.target, None, eos_token_ids=engine.eos_token_ids)
    for messages in PROMPTS:
        ids = ChatSession(engine, exact_rt.tokenizer).encode(messages)
        alone = alone_engine.run(ids, max_new_tokens=32)  # the reference: the exact target alone
        assert len(alone.token_ids) > 5
        for k in (1, 3, 6):
            spec = engine.run(ids, max_new_tokens=32, policy=FixedK(k))
            assert spec.token_ids == alone.token_ids, (messages[0]["content"], k)
            accepted += spec.metrics.num_accepted_tokens
        # K = 0 with a drafter: guess rounds fill the padding rows with prompt-lookup guesses
        steps = list(engine.generate(ids, max_new_tokens=32, policy=FixedK(0)))
        assert [t for s in steps for t in s.tokens] == alone.token_ids
        guessed += sum(s.n_accepted for s in steps)
    assert accepted > 0 and guessed > 0


def test_generate_exact_on_a_torch_target_runs(tmp_path, capsys):
    from edgespec.cli import main

    hf = save_tiny_checkpoint(tmp_path / "tiny", tiny_llama(vocab_size=96, seed=0, max_pos=512))
    args = ["generate", "--target", str(hf), "--target-backend", "torch", "--draft", "ngram", "--k", "3",
            "--prompt", "abc abc abc", "--max-new-tokens", "12", "--exact"]
    assert main(args) == 0
    assert "tok/s" in capsys.readouterr().err


def test_no_exact_row_count_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    import edgespec.lm
    from edgespec.cli import main

    monkeypatch.setattr(edgespec.lm, "exact_rows", lambda lm: None)
    hf = save_tiny_checkpoint(tmp_path / "tiny", tiny_llama(vocab_size=96, seed=0, max_pos=512))
    args = ["generate", "--target", str(hf), "--target-backend", "torch", "--draft", "none", "--prompt", "hi",
            "--exact"]
    assert main(args) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("edgespec: error: --exact: this target") and "drop --exact" in last
    assert "Traceback" not in err


class RowNoise:
    """A fake LM whose logits carry a rounding error as real kernels do: one that depends on the step's row
    count below `exact_from` rows, or (`exact_from` None) one that depends on where the step starts."""

    vocab_size = 8

    def __init__(self, exact_from):
        self.exact_from, self.min_rows, self._n = exact_from, 1, 0

    @property
    def length(self):
        return self._n

    def reserve(self, total):
        pass  # (a CausalLM: nothing to size)

    def reset(self):
        self._n = 0

    def crop(self, length):
        self._n = length

    def feed(self, ids, logits_for):
        rows, start = max(len(ids), self.min_rows), self._n
        self._n += len(ids)
        logits = torch.arange(start, self._n, dtype=torch.float32)[:, None].repeat(1, self.vocab_size)
        if self.exact_from is None:
            logits = logits + start * 1e-3
        elif rows < self.exact_from:
            logits = logits + rows * 1e-3
        return logits[len(ids) - logits_for:]


@pytest.mark.parametrize("exact_from, expected", [(1, 2), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (None, None)])
def test_exact_rows_finds_the_fewest_rows_that_make_steps_exact(exact_from, expected):
    lm = RowNoise(exact_from)
    assert exact_rows(lm) == expected
    assert lm.min_rows == (expected or 1)


def test_exact_cache_pads_short_steps_but_not_at_the_context_end():
    lm = TorchLM(tiny_llama(vocab_size=32, seed=0, max_pos=128), min_rows=4)
    lm.reserve(100)
    lm.feed(list(range(3, 30)) * 4 + [5] * 18, 0)  # 126 tokens
    assert lm.length == 126 and lm.feed([9], 1).shape == (1, 32) and lm.length == 127  # no room for 3 pad rows
    assert lm.feed([9], 1).shape == (1, 32) and lm.length == 128


def test_exact_cache_outgrown_is_refilled_at_a_longer_length():
    model = tiny_llama(vocab_size=32, seed=0, max_pos=2048)
    ids = [(7 * i) % 29 + 3 for i in range(300)]
    grown = TorchLM(model, min_rows=4)
    grown.reserve(40)  # a 256-position cache, outgrown below
    grown.feed(ids[:40], 0)
    short = grown._static_len
    logits = torch.cat([grown.feed(ids[i:i + 20], 20) for i in range(40, 300, 20)])
    assert grown.length == 300 and grown._static_len > short
    fresh = TorchLM(model, min_rows=4)
    fresh.reserve(300)
    fresh.feed(ids[:40], 0)
    expected = fresh.feed(ids[40:], 260)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # the rows fed after the refill were computed against the same cache length as the fresh one's
    assert grown._static_len == fresh._static_len


def test_an_exact_target_never_runs_a_step_of_more_rows_than_exact_rows_checked():
    """Past `EXACT_CHECKED_ROWS` rows a step may take other kernels (Qwen 1.5B Q4_K_M on llama.cpp did at 9 and
    10 rows), so K stays below it on an exact target, whatever the policy asks; a plain target keeps K = 8."""
    from edgespec.drafters import TorchDrafter
    from edgespec.engine import SpeculativeEngine
    from edgespec.lm import EXACT_CHECKED_ROWS
    from edgespec.target import ModelTarget

    model = tiny_llama(vocab_size=32, seed=3, max_pos=256)
    for min_rows, most in ((EXACT_CHECKED_ROWS, EXACT_CHECKED_ROWS - 1), (1, 8)):
        target = ModelTarget(TorchLM(model, min_rows=min_rows))
        engine = SpeculativeEngine(target, TorchDrafter(model))  # the same model drafts: every draft accepted
        steps = list(engine.generate([5, 6, 7, 8], max_new_tokens=40, policy=FixedK(8)))
        assert max(s.n_drafted for s in steps) == most, min_rows

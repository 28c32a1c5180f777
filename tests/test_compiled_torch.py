"""--compile on a torch target (`edgespec.compiled_lm`), on the CPU with the real inductor backend (gcc builds its
kernels): compiled logits equal eager ones, greedy output is the target-only output at every K, a rollback to
every accept length leaves nothing stale behind, and nothing recompiles after the warm-up.

Inductor compiles are slow on a small shared CPU, so one compiled model serves the module, with three widths
instead of six (1, 3, 9: K = 1..8 still run padded and unpadded steps) and a short context, and the test that
builds a runtime uses the same checkpoint, widths and context, so inductor's cache serves its compiles.
"""

import contextlib

import pytest
import torch
from tiny import perturbed
from torch._dynamo.utils import counters

import edgespec.compiled_lm
from edgespec.compiled_lm import CompiledTorchLM, compiled_lm
from edgespec.drafters import ModelDrafter
from edgespec.engine import SpeculativeEngine
from edgespec.lm import TorchLM
from edgespec.loading import load_causal_lm
from edgespec.policy import FixedK
from edgespec.runtime import RuntimeSpec, build_runtime, planned_torch_detail
from edgespec.target import ModelTarget

WIDTHS = (1, 3, 9)
CONTEXT = 256  # every step attends over the whole static cache: a short one keeps the tests fast
PROMPT = [1, 40, 41, 42, 7, 40, 41, 42, 9, 12, 30, 31, 40, 41, 42]  # long enough to run eagerly (> 9 tokens)


@contextlib.contextmanager
def no_new_graphs():
    """Dynamo compiles nothing inside the block (its counter of graphs, for the whole process)."""
    before = counters["stats"]["unique_graphs"]
    yield
    assert counters["stats"]["unique_graphs"] == before, "recompiled after the warm-up"


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_causal_lm(tiny_checkpoints["target"])


@pytest.fixture(scope="module")
def compiled(model):
    lines = []
    lm = compiled_lm(model, widths=WIDTHS, context=CONTEXT, report=lines.append)
    assert lm.settings.backend == "inductor" and lm.settings.mode == "default"  # no CUDA graphs on the CPU
    assert lm.graphs_since_warm_up() == 0 and lm.warm_up_s > 0
    widths = [line.split(",")[0] for line in lines if line.startswith("target: width")]
    assert widths == [f"target: width {w} compiled ({i}/3" for i, w in enumerate(WIDTHS, 1)]  # one line a width
    assert lines[-1].startswith("target: compiled in ")
    return lm


def test_compiled_logits_equal_eager_ones_at_every_step_size(compiled, model):
    eager = TorchLM(model)
    with no_new_graphs():
        compiled.reset()
        torch.testing.assert_close(compiled.feed(PROMPT, 3), eager.feed(PROMPT, 3), atol=1e-4, rtol=1e-4)
        for n in range(1, 10):  # 1..9 rows: every width, padded and not
            tokens = [(5 * n + i) % 90 + 5 for i in range(n)]
            torch.testing.assert_close(compiled.feed(tokens, n), eager.feed(tokens, n), atol=1e-4, rtol=1e-4)
        assert compiled.length == eager.length == len(PROMPT) + 45  # the padding rows are not kept
        compiled.min_rows = 2  # as `exact_rows` sets it: a lone token then runs at width 3
        assert compiled.min_rows == 3 and compiled.length == 0
        eager.reset()
        eager.feed(PROMPT, 0)
        compiled.feed(PROMPT, 0)
        torch.testing.assert_close(compiled.feed([50], 1), eager.feed([50], 1), atol=1e-4, rtol=1e-4)
    compiled.min_rows = 1


def test_greedy_output_is_the_target_only_output_at_every_k(compiled, model):
    target = ModelTarget(compiled)
    drafter = ModelDrafter(TorchLM(perturbed(model, 0.3)), name="torch")
    alone = SpeculativeEngine(target, None, eos_token_ids=[]).run(PROMPT, max_new_tokens=16).token_ids
    eager = SpeculativeEngine(ModelTarget(TorchLM(model)), None, eos_token_ids=[]).run(PROMPT, max_new_tokens=16)
    assert alone == eager.token_ids and len(alone) == 16  # and the compiled target decodes as the eager one
    engine = SpeculativeEngine(target, drafter, eos_token_ids=[])
    accepted = 0
    with no_new_graphs():
        for k in range(1, 9):
            result = engine.run(PROMPT, max_new_tokens=16, policy=FixedK(k))
            assert result.token_ids == alone, k
            assert result.metrics.notices == []  # the drafter never failed (a fallback would pass on its own)
            accepted += result.metrics.num_accepted_tokens
    assert accepted > 0


def test_rollback_after_every_accept_length_leaves_nothing_stale(compiled, model):
    """A K = 8 round (width 9) of drafts unlike the target's, rolled back to keep a = 0..8 of them: the next
    step's logits are those of the kept sequence fed afresh to an eager model."""
    drafts = [(11 * i) % 90 + 5 for i in range(8)]
    with no_new_graphs():
        for a in range(9):
            compiled.reset()
            compiled.feed(PROMPT, 0)
            compiled.feed([60, *drafts], 9)
            compiled.crop(len(PROMPT) + 1 + a)
            kept = [*PROMPT, 60, *drafts[:a]]
            assert compiled.length == len(kept)
            fresh = TorchLM(model)
            fresh.feed(kept, 0)
            torch.testing.assert_close(compiled.feed([70, 71], 2), fresh.feed([70, 71], 2), atol=1e-4, rtol=1e-4)


def test_a_compiled_runtime_is_described_as_planned_and_runs(tiny_checkpoints, monkeypatch):
    monkeypatch.setattr(edgespec.compiled_lm, "COMPILE_WIDTHS", WIDTHS)
    monkeypatch.setattr(edgespec.compiled_lm, "COMPILE_CONTEXT", CONTEXT)
    spec = RuntimeSpec(target=str(tiny_checkpoints["target"]), target_backend="torch", target_device="cpu",
                       draft="ngram", compile=True)
    lines = []
    rt = build_runtime(spec, progress=lines.append)
    lm = rt.engine.target.lm
    assert isinstance(lm, CompiledTorchLM) and lm.widths == WIDTHS and lm.max_context == CONTEXT
    assert rt.target_description.endswith(planned_torch_detail(spec)) and planned_torch_detail(spec).endswith(
        "torch cpu float32 compiled")
    assert any(line.startswith("target: compiled in") for line in lines)
    with no_new_graphs():
        assert len(rt.engine.run(PROMPT, max_new_tokens=8, policy=FixedK(4)).token_ids) == 8
    # not given: off on the CPU; a profile of the eager target is not matched by a compiled one
    assert not planned_torch_detail(RuntimeSpec(target=spec.target, target_backend="torch",
                                                target_device="cpu")).endswith("compiled")


def test_compile_flag_reaches_every_command():
    from edgespec.cli import build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["bench"], ["profile"], ["chat"]):
        assert RuntimeSpec.from_args(parser.parse_args([*command, "--compile"])).compile is True
        assert RuntimeSpec.from_args(parser.parse_args([*command, "--no-compile"])).compile is False
        assert RuntimeSpec.from_args(parser.parse_args(command)).compile is None


def test_compile_on_a_backend_that_cannot_is_a_one_line_error(tiny_checkpoints, capsys):
    from edgespec.cli import main

    args = ["generate", "--target", str(tiny_checkpoints["target"]), "--target-backend", "onnx", "--compile",
            "--draft", "none", "--prompt", "hi"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("edgespec: error: --compile compiles a torch target") and "Traceback" not in "".join(err)


def test_eager_and_compiled_for_the_gpu_check_agree_on_one_model(model):
    from edgespec.compiled_lm import eager_and_compiled

    lines = []
    eager, compiled = eager_and_compiled(model.config, device="cpu", dtype=torch.float32, widths=WIDTHS,
                                         context=CONTEXT, report=lines.append)
    assert compiled.model is eager.model and compiled.description == "torch cpu float32 compiled"
    assert lines[-1].startswith("compiled: compiled in ")
    with no_new_graphs():
        for lm in (eager, compiled):
            lm.feed(PROMPT, 0)
        torch.testing.assert_close(compiled.feed([50, 51, 52, 53], 4), eager.feed([50, 51, 52, 53], 4),
                                   atol=1e-4, rtol=1e-4)

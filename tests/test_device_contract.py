"""The device contract (target.py, drafters/base.py): the rule runs on the CPU, on float32 rows, with CPU
generators, so a target on a GPU hands the engine CPU logits and a drafter CPU `p_draft` rows.

There is no GPU here, so `OnGpu` stands in for one: a tensor subclass that behaves towards the rest of torch as
a CUDA tensor does (its device reads cuda:0, mixing it with a CPU tensor of one or more dimensions raises, a draw
from it with a CPU generator raises, `.numpy()` raises, `.cpu()`/`.to("cpu")` give a plain CPU tensor). A
backend whose logits are `OnGpu` is a target or drafter on a GPU as far as the engine can tell, and every path
of the engine (greedy and sampling, K = 0 and 4, sequential and overlapped, each drafter) runs over it."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from tiny import perturbed, save_tiny_checkpoint, tiny_llama

from edgespec.drafters import ModelDrafter, NgramDrafter
from edgespec.engine import Generation, SpeculativeEngine
from edgespec.lm import TorchLM
from edgespec.policy import FixedK
from edgespec.sampling import SamplingParams
from edgespec.target import ModelTarget

FAKE_CUDA = torch.device("cuda", 0)
PROMPT = [1, 5, 9, 3, 5, 9, 3, 7]
NEW_TOKENS = 24


class OnGpu(torch.Tensor):
    """A tensor that refuses to mix with CPU tensors the way a CUDA tensor does (see the module's text)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return FAKE_CUDA
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _moves_to_cpu(args[1:], kwargs)):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(x, OnGpu) for x in leaves):
            for x in leaves:
                if isinstance(x, torch.Tensor) and not isinstance(x, OnGpu) and x.dim() > 0:
                    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                       f"devices, cuda:0 and cpu! ({getattr(func, '__name__', func)})")
                if isinstance(x, torch.Generator) and x.device.type == "cpu":
                    raise RuntimeError("Expected a 'cuda' device type for generator but found 'cpu'")
        return super().__torch_function__(func, types, args, kwargs)


def _moves_to_cpu(args, kwargs) -> bool:
    if args and isinstance(args[0], torch.Tensor):  # .to(other_tensor)
        return not isinstance(args[0], OnGpu)
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return device is not None and device.type == "cpu"


class OnGpuLM:
    """A `CausalLM` whose logits come back on the (fake) GPU, as `TorchLM`'s do on CUDA."""

    def __init__(self, lm):
        self.lm = lm
        self.vocab_size, self.max_context, self.min_rows = lm.vocab_size, lm.max_context, lm.min_rows
        self.description = "torch cuda float32"

    @property
    def length(self) -> int:
        return self.lm.length

    def reserve(self, total: int) -> None:
        self.lm.reserve(total)

    def feed(self, ids, logits_for):
        return self.lm.feed(ids, logits_for).as_subclass(OnGpu)

    def crop(self, length: int) -> None:
        self.lm.crop(length)

    def reset(self) -> None:
        self.lm.reset()


def test_the_stand_in_refuses_what_cuda_refuses():
    """Checks on the stand-in itself: without these refusals the contract tests below would prove nothing."""
    x = torch.softmax(torch.randn(3, 8), -1).as_subclass(OnGpu)
    assert x.device == FAKE_CUDA and isinstance(x * 2, OnGpu) and isinstance(x[0], OnGpu)
    with pytest.raises(RuntimeError, match="same device"):
        x - torch.rand(3, 8)
    with pytest.raises(RuntimeError, match="generator"):
        torch.multinomial(x[0], 1, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="numpy"):
        x.numpy()
    for back in (x.cpu(), x.to("cpu"), x.to("cpu", torch.float32), x.to(device="cpu"), x.to(torch.rand(1))):
        assert type(back) is torch.Tensor and back.device.type == "cpu" and torch.equal(back, x.cpu())
    assert isinstance(x.to(torch.float64), OnGpu)
    assert x[0, 1].item() == pytest.approx(float(x.cpu()[0, 1]))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from edgespec.convert import hf_to_onnx

    target = tiny_llama(vocab_size=96, seed=0, hidden=64, max_pos=256)  # ORT: head size a multiple of 16
    target.generation_config.eos_token_id = None
    hf = save_tiny_checkpoint(tmp_path_factory.mktemp("contract") / "target", target)
    return {"target": target, "close": perturbed(target, 0.05),
            "int4": hf_to_onnx(hf, precision="int4", last_logits_only=True)}


def _drafter(name, pair):
    from edgespec.onnx_lm import OnnxLM

    if name == "ngram":
        return NgramDrafter()
    if name == "onnx":
        return ModelDrafter(OnnxLM(pair["int4"], threads=1, name="draft"), name="int4")
    if name == "torch":
        return ModelDrafter(OnGpuLM(TorchLM(pair["close"], name="draft")), name="torch")
    return None


def _run(engine, params, k):
    """The engine's run, also asserting the drafter never failed (a drafter dropped on a device mismatch would
    leave the target alone to finish, and greedy output would still be right)."""
    out = Generation()
    for step in engine.generate(PROMPT, params=params, max_new_tokens=NEW_TOKENS, policy=FixedK(k)):
        assert step.notice is None, step.notice
        out.token_ids.extend(step.tokens)
        out.metrics.add(step)
    return out


@pytest.fixture(scope="module")
def target_only(pair):
    engine = SpeculativeEngine(ModelTarget(TorchLM(pair["target"], name="target")))
    return engine.run(PROMPT, max_new_tokens=NEW_TOKENS).token_ids


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "t0.7"])
@pytest.mark.parametrize("drafter", ["none", "ngram", "onnx", "torch"])
def test_a_gpu_target_runs_every_path_of_the_engine(pair, target_only, drafter, temperature, overlap):
    target = ModelTarget(OnGpuLM(TorchLM(pair["target"], name="target")))
    engine = SpeculativeEngine(target, _drafter(drafter, pair), overlap=overlap)
    params = SamplingParams(temperature=temperature, seed=3)
    for k in (0, 4) if drafter != "none" else (0,):
        out = _run(engine, params, k)
        assert len(out.token_ids) == NEW_TOKENS
        if temperature == 0:
            assert out.token_ids == target_only, (drafter, k)
        if k and drafter in ("onnx", "torch"):
            assert out.metrics.num_accepted_tokens > 0  # the drafter drafted and was heard, not dropped


def test_logits_off_the_cpu_are_refused_where_the_rule_runs(pair):
    """A target that breaks the contract fails at the rule with a message naming it, greedy too (where a CUDA
    argmax would work, but the rule would then run on a device the rest of it does not)."""
    from edgespec.engine import judge
    from edgespec.drafters.base import Draft

    logits = torch.randn(3, 96).as_subclass(OnGpu)
    for params in (SamplingParams(), SamplingParams(temperature=0.7)):
        with pytest.raises(RuntimeError, match="on the CPU"):
            judge(Draft([4, 5]), logits, params, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="p_draft"):
        judge(Draft([4, 5], p_draft=torch.softmax(torch.randn(2, 96), -1).as_subclass(OnGpu)), logits.cpu(),
              SamplingParams(temperature=0.7), torch.Generator().manual_seed(0))


# --- honest timings: a GPU runs what it is given after the call that gave it has returned ----------------

class Device:
    """A fake clock and a fake GPU queue: queued work costs time only when someone waits for it."""

    def __init__(self):
        self.now, self.queued = 0.0, 0.0

    def __call__(self) -> float:
        return self.now

    def wait(self) -> None:
        self.now, self.queued = self.now + self.queued, 0.0


class Queued(OnGpu):
    """An `OnGpu` whose copy to the CPU waits for the device's queue, as a CUDA copy does."""

    device: Device

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _moves_to_cpu(args[1:], kwargs or {})):
            cls.device.wait()
        return super().__torch_function__(func, types, args, kwargs)


class QueuedLM(OnGpuLM):
    """A `CausalLM` on the fake GPU: a feed queues 0.1 s a token, a crop 0.25 s, and neither waits."""

    def __init__(self, lm, device: Device):
        super().__init__(lm)
        self.device = Queued.device = device

    def feed(self, ids, logits_for):
        self.device.queued += 0.1 * len(ids)
        return self.lm.feed(ids, logits_for).as_subclass(Queued)

    def crop(self, length: int) -> None:
        self.device.queued += 0.25
        self.lm.crop(length)


class Recording(FixedK):
    def __init__(self, k):
        super().__init__(k)
        self.verify_s = []

    def observe(self, k, n_drafted, n_accepted, draft_s, verify_s, **kwargs):
        self.verify_s.append(verify_s)


def test_the_engines_timings_are_the_devices_time(pair):
    """prefill_ms holds the prefill's device time (not the first round's verify_ms), and each round's verify_ms
    (what auto K learns from) holds its verification and its rollback, to the fake device's second."""
    device = Device()
    target = ModelTarget(QueuedLM(TorchLM(pair["target"], name="target"), device), synchronize=device.wait)
    engine = SpeculativeEngine(target, NgramDrafter(), clock=device)
    policy = Recording(4)
    steps = list(engine.generate(PROMPT, max_new_tokens=12, policy=policy))
    assert steps[0].prefill_ms == pytest.approx(0.1 * (len(PROMPT) - 1) * 1000)
    for step, verify_s in zip(steps, policy.verify_s, strict=True):
        assert step.verify_ms == pytest.approx((0.1 * (1 + step.n_drafted) + 0.25) * 1000), step
        assert verify_s == pytest.approx(step.verify_ms / 1000)
    assert device.queued == 0


def test_each_step_reports_its_draft_time_and_the_time_since_the_request_began(pair):
    """draft_ms is the drafter's own time (ms), elapsed_s the time from the request's start to the end of the step:
    prefill and every round before it (mutants scaling or summing the draft time, or dropping prefill_ms or
    elapsed_s, survived the engine's other tests)."""
    device = Device()

    class Timed(ModelDrafter):  # a close draft model (plain CPU torch: only this clock's 7 ms a token count)
        def propose(self, k, *args, **kwargs):
            draft = super().propose(k, *args, **kwargs)
            device.now += 0.007 * (1 + len(draft))
            return draft

    device.now = 100.0  # a clock that does not start at 0, as perf_counter does not
    target = ModelTarget(QueuedLM(TorchLM(pair["target"], name="target"), device), synchronize=device.wait)
    steps = list(SpeculativeEngine(target, Timed(TorchLM(pair["close"], name="draft")), clock=device).generate(PROMPT, max_new_tokens=NEW_TOKENS,
                                                                              policy=FixedK(4)))
    prefill_s = 0.1 * (len(PROMPT) - 1)
    assert steps[0].prefill_ms == pytest.approx(prefill_s * 1000) and all(s.prefill_ms == 0 for s in steps[1:])
    elapsed = prefill_s
    for step in steps:
        assert step.draft_ms == pytest.approx(7 * (1 + step.n_drafted) if step.k else 0.0), step  # K=0: no proposal
        elapsed += (step.draft_ms + step.verify_ms) / 1000
        assert step.elapsed_s == pytest.approx(elapsed), step
    assert sum(s.n_drafted for s in steps) > 0 and steps[-1].stop_reason == "length"


def test_the_profiles_latencies_are_the_devices_time(pair, monkeypatch):
    from edgespec import profiling

    device = Device()
    target = ModelTarget(QueuedLM(TorchLM(pair["target"], name="target"), device), synchronize=device.wait)
    monkeypatch.setattr(profiling.time, "perf_counter", device)
    med, _ = profiling.measure_verify(target, PROMPT, range(1, 4), repeats=3)
    assert med == pytest.approx([0.0, *[(0.1 * n + 0.25) * 1000 for n in (1, 2, 3)]])
    assert profiling.measure_prefill(target, PROMPT, repeats=3) == pytest.approx(0.1 * (len(PROMPT) - 1) * 1000)


def test_a_torch_target_on_cuda_waits_for_its_own_device():
    from edgespec.target import synchronizer

    wait = synchronizer("cuda:1")
    assert wait.func is torch.cuda.synchronize and wait.args == (torch.device("cuda", 1),)
    synchronizer("cpu")()  # nothing to wait for, and no CUDA needed

"""A target on a GPU: bf16 where the GPU computes it, weights loaded straight onto the device, a memory budget
checked before the weights load, and logits checked to be finite. No GPU here: what the machine would say
(compute capability, free memory, integrated or not) is injected; the models, files and engine are real."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny import save_tiny_checkpoint, tiny_llama

from edgespec import budget
from edgespec.engine import SpeculativeEngine
from edgespec.errors import EdgespecError
from edgespec.lm import TorchLM
from edgespec.loading import pick_dtype
from edgespec.target import ModelTarget

GIB = 1024 ** 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_llama(vocab_size=96, seed=0, hidden=64, max_pos=512)
    return model, save_tiny_checkpoint(tmp_path_factory.mktemp("budget") / "tiny", model)


@pytest.fixture
def gpu(monkeypatch):
    """What torch would say about a GPU: its compute capability, free/total memory, integrated or not."""
    state = SimpleNamespace(capability=(9, 0), free=80 * GIB, integrated=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state.capability)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state.free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(is_integrated=state.integrated))
    return state


def test_auto_dtype_is_bf16_where_the_gpu_computes_it(gpu):
    cuda = torch.device("cuda", 0)
    assert pick_dtype("auto", cuda) == torch.bfloat16  # sm90 (H100)
    gpu.capability = (8, 7)  # Jetson Orin
    assert pick_dtype("auto", cuda) == torch.bfloat16
    gpu.capability = (7, 5)  # T4, RTX 20xx: no native bf16
    assert pick_dtype("auto", cuda) == torch.float16
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("float16", cuda) == torch.float16  # what the user asks for wins


def test_weights_load_straight_onto_the_gpu(checkpoint, gpu, monkeypatch):
    """device_map puts each tensor on the GPU as it is read, in the dtype it will run in: no CPU copy first."""
    from transformers import AutoModelForCausalLM

    from edgespec import loading

    calls = []

    class Loaded:
        def eval(self):
            return self

        def to(self, *args, **kwargs):
            raise AssertionError("moved after loading: the weights went through the CPU first")

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        return Loaded()

    monkeypatch.setattr(loading, "check_device", lambda device, flag: "cuda:1")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    loading.load_causal_lm(checkpoint[1], device="cuda:1")
    assert calls == [{"dtype": torch.bfloat16, "device_map": {"": "cuda:1"}}]


def test_a_checkpoints_parameters_are_counted_from_its_headers(checkpoint):
    model, path = checkpoint
    assert budget.checkpoint_parameters(path) == sum(p.numel() for p in model.parameters())


def test_the_targets_need_is_weights_kv_and_working_memory(checkpoint):
    model, path = checkpoint
    cfg = model.config
    need = budget.torch_need("the target", path, 2, "bfloat16", context=300)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert need.parts == {
        "weights (bfloat16)": 2 * sum(p.numel() for p in model.parameters()),
        "KV cache at 300 tokens": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 300 * 2,
        "working memory": budget.TORCH_WORKSPACE,
    }
    assert "KV cache at 512 tokens" in budget.torch_need("the target", path, 2, "bfloat16").parts  # its longest


def test_what_does_not_fit_is_one_line_naming_each_part():
    need = budget.Need("the target", {"weights (bfloat16)": 14 * GIB, "KV cache at 32768 tokens": 2 * GIB,
                                      "working memory": GIB // 2})
    budget.check_fits(need, 17 * GIB, "cuda:0", "use a smaller model")
    with pytest.raises(EdgespecError) as err:
        budget.check_fits(need, 12 * GIB, "cuda:0", "use a smaller model")
    message = str(err.value)
    assert "\n" not in message
    assert message == ("the target does not fit: it needs 16.50 GiB (weights (bfloat16) 14.00 GiB + KV cache at "
                       "32768 tokens 2.00 GiB + working memory 0.50 GiB) and cuda:0 has 12.00 GiB free; use a "
                       "smaller model")


def test_unified_memory_is_budgeted_against_the_ram(gpu, monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=6 * GIB))
    assert budget.available("cuda:0") == (80 * GIB, "cuda:0", False)
    gpu.integrated = True  # a Jetson: the GPU allocates from the same RAM as everything else
    free, where, unified = budget.available("cuda:0")
    assert (free, unified) == (6 * GIB, True) and "unified memory" in where
    gpu.free = 4 * GIB
    assert budget.available("cuda:0")[0] == 4 * GIB


def test_the_runtime_checks_the_budget_before_loading_the_weights(checkpoint, gpu):
    """A model that does not fit stops before a byte of it loads (load_causal_lm would fail here: no CUDA)."""
    from edgespec.runtime import RuntimeSpec, _build_lm, _Source

    gpu.free = 1024 ** 2
    with pytest.raises(EdgespecError, match=r"the target does not fit: .* cuda:0 has 0.00 GiB free; .*--dtype"):
        _build_lm(_Source(hf_dir=checkpoint[1]), "torch", "cuda:0", RuntimeSpec(), "fp32", "target", print)


def test_a_cpu_machine_is_not_budgeted(monkeypatch):
    from edgespec import hardware

    monkeypatch.setattr(hardware, "_jetson_model", lambda: None)

    def need():
        raise AssertionError("a CPU-only load was budgeted")

    budget.check_before_loading("cpu", need, "")
    monkeypatch.setattr(hardware, "_jetson_model", lambda: "NVIDIA Jetson AGX Orin")
    with pytest.raises(EdgespecError, match="the draft does not fit"):  # a Jetson's CPU draft shares the GPU's RAM
        budget.check_before_loading("cpu", lambda: budget.Need("the draft", {"weights": 1 << 62}), "fix")


def test_an_onnx_models_need_comes_from_its_export(tmp_path, monkeypatch):
    import json

    from edgespec.convert import hf_to_onnx

    model = tiny_llama(vocab_size=96, seed=0, hidden=64, max_pos=512)
    onnx_dir = hf_to_onnx(save_tiny_checkpoint(tmp_path / "m", model), precision="int4", last_logits_only=True)
    need = budget.onnx_need("the draft", onnx_dir, context=400)
    decoder = json.loads((onnx_dir / "genai_config.json").read_text())["model"]["decoder"]
    files = sum(p.stat().st_size for p in onnx_dir.iterdir() if p.name.startswith("model.onnx"))
    kv = 2 * decoder["num_hidden_layers"] * decoder["num_key_value_heads"] * decoder["head_size"] * 400 * 4
    assert need.parts == {"weights": files, "KV cache at 400 tokens": kv, "ONNX Runtime arena": budget.ORT_ARENA_MIN}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logits_that_overflow_are_an_error_naming_dtype(temperature):
    """A real float16 overflow: a tiny model whose activations pass float16's 65504 computes inf and NaN. The
    rule finds it greedy (in its argmax) and sampling."""
    from edgespec.sampling import SamplingParams

    model = tiny_llama(vocab_size=96, seed=0, hidden=64).half()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1e4)
    engine = SpeculativeEngine(ModelTarget(TorchLM(model, name="target")))
    with pytest.raises(EdgespecError, match=r"not finite .*--dtype bfloat16 or --dtype float32") as err:
        engine.run([1, 5, 9, 3], max_new_tokens=4, params=SamplingParams(temperature=temperature, seed=0))
    assert "torch cpu float16" in str(err.value) and "\n" not in str(err.value)

"""ONNX Runtime on a GPU, as far as a CPU machine can check it: the export built for the CUDA provider (float16
attention, cached apart from the CPU export), `cuda:N` honoured, and a CUDA provider that did not start caught by
name instead of ORT's silent fall back to the CPU. The exports and sessions are real; only whether ORT was built
with CUDA is injected where a test needs the opposite of this machine."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from tiny import save_tiny_checkpoint, tiny_llama

from edgespec import convert, onnx_lm
from edgespec.convert import hf_to_onnx
from edgespec.errors import EdgespecError
from edgespec.onnx_lm import OnnxLM, ort_providers
from edgespec.runtime import onnx_export


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_llama(vocab_size=96, seed=0, hidden=64, max_pos=256)  # head size 16: ORT's attention needs it
    return model, save_tiny_checkpoint(tmp_path_factory.mktemp("cuda-export") / "tiny", model)


@pytest.fixture(scope="module")
def cuda_fp16(checkpoint):
    return hf_to_onnx(checkpoint[1], precision="fp16", execution_provider="cuda")


def test_cuda_n_is_the_providers_device_id():
    assert ort_providers("cpu") == ["CPUExecutionProvider"]
    assert ort_providers("cuda") == [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
    assert ort_providers("cuda:3") == [("CUDAExecutionProvider", {"device_id": 3}), "CPUExecutionProvider"]
    with pytest.raises(EdgespecError, match="'cpu', 'cuda' or 'cuda:N'"):
        ort_providers("gpu")


def test_a_model_runs_on_cuda_from_an_export_built_for_it():
    assert onnx_export("fp32", "cuda:1") == {"precision": "fp16", "execution_provider": "cuda"}
    assert onnx_export("int4", "cuda") == {"precision": "int4", "execution_provider": "cuda"}
    assert onnx_export("fp32", "cpu") == {"precision": "fp32"}  # the CPU export's cache key is unchanged


def test_the_cuda_export_is_float16_cached_apart_and_computes_the_models_logits(checkpoint, cuda_fp16, monkeypatch):
    model, hf = checkpoint
    manifest = onnx_lm._read_manifest(cuda_fp16)
    assert manifest["execution_provider"] == "cuda" and manifest["precision"] == "fp16"
    lm = OnnxLM(cuda_fp16, threads=1)  # ORT's CPU provider runs the float16 graph too: its numbers, checked here
    assert lm._kv_dtype is np.float16  # the KV cache is float16, as the CUDA provider's attention wants it
    ids = [1, 5, 9, 3, 7, 7, 2, 11]
    got = lm.feed(ids, len(ids))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    assert got.dtype == torch.float32 and (got - expected).abs().max() < 0.05
    assert torch.equal(got.argmax(-1), expected.argmax(-1))

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a cached export")

    monkeypatch.setattr(convert, "_run_builder", no_build)
    assert hf_to_onnx(hf, precision="fp16", execution_provider="cuda") == cuda_fp16
    with pytest.raises(AssertionError, match="rebuilt"):  # the CPU export is another entry
        hf_to_onnx(hf, precision="fp16")


def test_the_cuda_int4_export_leaves_out_the_cpu_tuned_extras(checkpoint, monkeypatch, tmp_path):
    seen = {}

    def capture(hf_dir, out, options, **kwargs):
        seen.update(options)
        raise EdgespecError("captured")

    monkeypatch.setattr(convert, "_run_builder", capture)
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    with pytest.raises(EdgespecError, match="captured"):
        hf_to_onnx(checkpoint[1], precision="int4", execution_provider="cuda", last_logits_only=True)
    args = convert._builder_args(checkpoint[1], tmp_path / "out", seen)
    assert args[args.index("-e") + 1] == "cuda" and args[args.index("-p") + 1] == "int4"
    assert "accuracy_level=0" in args and not any(a.startswith(("op_types_to_quantize", "matmul_mixed")) for a in args)
    with pytest.raises(EdgespecError, match="float16/bfloat16 only"):
        hf_to_onnx(checkpoint[1], precision="fp32", execution_provider="cuda")


def test_a_cuda_provider_that_did_not_start_is_named(cuda_fp16, monkeypatch):
    """ORT built without CUDA (this machine's) told to use it: the session quietly runs on the CPU; OnnxLM says
    which library is missing instead of running a GPU model on the CPU under a description that says cuda."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.warns(UserWarning, match="CUDAExecutionProvider"), pytest.raises(EdgespecError) as err:
        OnnxLM(cuda_fp16, device="cuda:0")
    message = str(err.value)
    assert "\n" not in message and "CUDA provider did not start" in message
    assert "libonnxruntime_providers_cuda.so" in message and "CPU build" in message


def test_the_library_the_cuda_provider_cannot_load_is_named(tmp_path, monkeypatch):
    broken = tmp_path / "libonnxruntime_providers_cuda.so"
    broken.write_bytes(b"not a shared object")
    monkeypatch.setattr(onnx_lm, "_cuda_provider_library", lambda ort: broken)
    assert onnx_lm.cuda_provider_problem(ort).startswith("libonnxruntime_providers_cuda.so cannot load: ")


def test_onnx_runtime_not_installed_is_one_line_naming_the_extras(cuda_fp16, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what `import onnxruntime` meets when it is absent
    with pytest.raises(EdgespecError, match=r"not installed; `pip install 'edgespec\[cpu\]'`"):
        OnnxLM(cuda_fp16)
    monkeypatch.setattr(convert.importlib.metadata, "version",
                        lambda dist: (_ for _ in ()).throw(convert.importlib.metadata.PackageNotFoundError(dist)))
    with pytest.raises(EdgespecError, match=r"edgespec\[cpu\]"):
        convert._builder_version()

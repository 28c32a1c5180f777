"""The hardware description and device checks. CUDA is faked absent or present so the tests mean the same
on a laptop, a CI runner and a GPU box."""

from __future__ import annotations

import pytest
import torch

from edgespec import hardware
from edgespec.errors import EdgespecError


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_describe_has_the_facts(no_cuda):
    hw = hardware.describe()
    d = hw.to_dict()
    for key in ("system", "cpu_model", "cpu_flags", "cores_physical", "cores_logical", "memory_total",
                "memory_available", "cuda_available", "cuda_devices", "torch", "transformers", "onnxruntime",
                "ort_providers", "jetson", "unified_memory"):
        assert key in d
    assert hw.cores_logical >= hw.cores_physical >= 1 and hw.cores_usable >= 1
    assert hw.memory_total > 0 and 0 < hw.memory_available <= hw.memory_total
    assert hw.cuda_available is False and hw.cuda_devices == [] and hw.cuda_note
    assert hw.torch == torch.__version__
    assert "CPUExecutionProvider" in hw.ort_providers
    assert all(isinstance(v, bool) for v in hw.cpu_flags.values())


def test_description_holds_no_hostname(no_cuda):
    import socket

    name = socket.gethostname()
    if len(name) >= 4:  # a very short name could occur by chance in a version string
        assert name not in repr(hardware.describe().to_dict())


def test_format_devices_is_a_readable_report(no_cuda):
    text = hardware.format_devices(hardware.describe())
    assert len(text.splitlines()) >= 5
    assert "memory" in text and "cuda" in text and "onnxruntime" in text


def test_format_devices_lists_gpus_and_jetson(no_cuda):
    hw = hardware.describe()
    hw.cuda_devices = [{"index": 0, "name": "Orin", "total_memory": 8 << 30, "capability": "8.7",
                        "integrated": True}]
    hw.jetson = "NVIDIA Jetson Orin Nano Developer Kit"
    text = hardware.format_devices(hw)
    assert "cuda:0" in text and "Orin" in text and "8.7" in text and "unified memory" in text


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_a_gpu_says_to_use_cpu(no_cuda, name):
    with pytest.raises(EdgespecError) as err:
        hardware.check_device(name)
    message = str(err.value)
    assert "\n" not in message and "cpu" in message and "--target-device" in message


def test_require_cuda_names_the_flag(no_cuda):
    with pytest.raises(EdgespecError) as err:
        hardware.require_cuda(flag="--draft-device")
    assert "--draft-device cpu" in str(err.value)


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "gpu", ""])
def test_unknown_device_names_the_valid_ones(no_cuda, name):
    with pytest.raises(EdgespecError) as err:
        hardware.check_device(name)
    assert "cpu, cuda" in str(err.value)


def test_cpu_and_auto(no_cuda):
    assert hardware.check_device(" CPU ") == "cpu"
    assert hardware.check_device("auto") == "cpu"


def test_with_a_gpu(one_gpu):
    assert hardware.check_device("cuda") == "cuda"
    assert hardware.check_device("cuda:0") == "cuda:0"
    assert hardware.check_device("auto") == "cuda"
    with pytest.raises(EdgespecError) as err:
        hardware.check_device("cuda:2")
    assert "cuda:0..cuda:0" in str(err.value)


def test_cpu_flags_parse_x86_and_arm(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx avx2 avx512_bf16\n")
    monkeypatch.setattr(hardware, "_CPUINFO", info)
    flags = hardware.cpu_flags()
    assert flags["avx2"] and flags["avx512_bf16"] and not flags["amx_bf16"]
    assert hardware._cpu_model() == "Test CPU"

    info.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\n")
    flags = hardware.cpu_flags()
    assert flags["asimddp"] and flags["i8mm"] and not flags["sve"]


def test_jetson_is_read_from_the_device_tree(monkeypatch, tmp_path, no_cuda):
    model = tmp_path / "model"
    model.write_bytes(b"NVIDIA Jetson AGX Orin Developer Kit\x00")
    monkeypatch.setattr(hardware, "_DEVICE_TREE_MODEL", model)
    hw = hardware.describe()
    assert hw.jetson == "NVIDIA Jetson AGX Orin Developer Kit" and hw.unified_memory

    model.write_bytes(b"Raspberry Pi 5 Model B\x00")
    assert hardware.describe().jetson is None


def test_the_overlap_split_gives_the_draft_its_own_cores():
    assert hardware.overlap_split(1) is None  # nothing to split
    assert hardware.overlap_split(2) == (1, 1)
    assert hardware.overlap_split(4) == (3, 1)
    assert hardware.overlap_split(16) == (12, 4)
    assert hardware.overlap_split(8, target_on_gpu=True) == (None, 7)  # one core launches the GPU's kernels
    assert hardware.overlap_split(1, target_on_gpu=True) == (None, 1)


def test_devices_says_how_overlap_splits_the_cores(no_cuda):
    hw = hardware.describe()
    hw.cores_usable = 4
    assert "target 3 threads, draft 1 thread" in hardware.format_devices(hw)
    hw.cores_usable = 1
    assert "overlap       no" in hardware.format_devices(hw)

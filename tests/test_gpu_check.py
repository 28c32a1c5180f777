"""scripts/gpu_check.py, the check a lent GPU machine runs: `--smoke` runs every section's code on the CPU with
tiny shapes (the device run needs a GPU), and the run's bookkeeping (a failed section recorded and the next one
run, the time guard) is checked on real sections."""

import json
import os
import subprocess
import sys
from pathlib import Path

from edgespec.paths import cache_dir

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
ALL = ["versions", "engine", "rule", "verify", "compiled", "draft", "ort_cuda", "cost_model"]


def run(out: Path, *args: str) -> dict:
    # The shared model cache: the tiny exports are built once across runs (their key is their content).
    env = {**os.environ, "EDGESPEC_CACHE": str(cache_dir())}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu-check.json").read_text())


def test_the_smoke_run_runs_every_section_on_the_cpu(tmp_path):
    r = run(tmp_path)
    sections = r["sections"]
    assert list(sections) == ALL
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(ALL, "ok"), \
        {n: s.get("error") for n, s in sections.items()}

    engine = sections["engine"]["data"]
    assert engine["failures"] == 0 and engine["notices"] == 0
    assert engine["greedy_identical"] == "18/18"
    for run_ in engine["runs"]:
        assert run_["tokens"] == 16
        if run_["drafter"] in ("onnx-int4-cpu", "onnx-fp16-gpu", "torch-gpu") and run_["k"] == 4:
            assert run_["accepted"] > 0, run_  # the model drafters drafted and were heard

    for name in ("1.5b", "7b"):
        for key in ("verify", "compiled"):
            table = sections[key]["data"][name]["verify_ms"]
            assert len(table) == 10 and all(t > 0 for t in table[1:]), (key, name, table)
        assert sections["compiled"]["data"][name]["graphs_since_warm_up"] == 0
    timings = sections["verify"]["data"]["1.5b"]["timings"]["synchronised"]
    assert timings["rounds"] > 1 and timings["rounds_engine_below_device"] == 0
    assert timings["prefill_engine_ms"] >= timings["prefill_device_ms"]

    tables = sections["draft"]["data"]["propose_ms"]
    assert set(tables) == {"1t-alone", "1t-beside-target"} and all(len(t) == 9 for t in tables.values())
    ort = sections["ort_cuda"]["data"]
    assert ort["providers"] == ["CPUExecutionProvider"]
    assert ort["kernel_runs_by_provider"]["CPUExecutionProvider"]["GroupQueryAttention"] > 0
    predicted = sections["cost_model"]["data"]["predicted"]
    assert len(predicted) == 4 * 2 * 2 * 2  # 4 verify tables (1.5b, 7b; eager, compiled) x 2 draft x 2 bands x 2
    assert all(p["by_k"][0] == 1.0 and len(p["by_k"]) == 9 for p in predicted.values())
    md = (tmp_path / "gpu-check.md").read_text()
    assert md.startswith("# GPU check") and "| cost_model | ok |" in md


def test_a_failed_section_is_recorded_the_next_runs_and_the_time_guard_skips(tmp_path):
    r = run(tmp_path, "--sections", "cost_model,versions,engine", "--budget-s", "20")
    sections = r["sections"]
    assert list(sections) == ["cost_model", "versions", "engine"]
    assert sections["cost_model"]["status"] == "failed" and "no verify and draft tables" in sections["cost_model"]["error"]
    assert sections["versions"]["status"] == "ok" and sections["versions"]["data"]["torch"]
    assert sections["engine"]["status"] == "skipped" and sections["engine"]["reason"].startswith("time guard")

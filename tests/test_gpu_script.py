"""The GPU script's code path, run on the CPU with tiny shapes (the real run needs a lent GPU machine)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_bench.py"


def test_gpu_script_smoke_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--targets", "1.5b", "--k-max", "3",
         "--repeats", "3", "--draft-threads", "1", "--context", "32", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "EDGESPEC_CACHE": str(tmp_path / "c")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "gpu-bench.json").read_text())
    target = data["targets"]["1.5b-float32-cpu"]
    assert len(target["verify_ms"]) == 5 and all(t > 0 for t in target["verify_ms"][1:])
    draft = data["drafts"]["0.5b-int4-cpu-1t"]["propose_ms"]
    assert len(draft) == 4 and all(t >= 0 for t in draft)
    for vals in target["predicted"].values():
        assert vals[0] == 1.0 and len(vals) == 4
    assert (tmp_path / "gpu-bench.md").read_text().startswith("# GPU latency run")

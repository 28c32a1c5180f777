"""GPU latency run for when a GPU machine is lent: FP16 targets of real shapes on CUDA, the INT4 draft on the CPU.

With random-weight models of real shapes (weights do not change latency): Qwen2.5-1.5B and -7B configs as FP16
torch targets on the GPU, and the Qwen2.5-0.5B config exported to INT4 ONNX (onnxruntime-genai's builder) and
run on the CPU execution provider. It measures the target's time to verify n = 1..K_max+1 tokens and the
draft's time to propose k tokens, then combines them with the per-position acceptance measured on the CPU
with the real Qwen2.5-Coder weights (the committed `edgespec profile` of that pair) to predict the speed-up
for each K, sequential and overlapped. Writes `gpu-bench.json` and `gpu-bench.md` to --out.

On the GPU machine (no internet; carry the onnxruntime-genai wheel in .whl/, see docs/gpu.md):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    EDGESPEC_CACHE=/tmp/es PYTHONPATH=/tmp/site:. python3 scripts/gpu_bench.py --out $OUT
A CPU smoke run of the same code with tiny shapes: python scripts/gpu_bench.py --tiny --device cpu --out /tmp/g
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

QWEN = {  # the published Qwen2.5 shapes
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
TINY = {  # same code path, shapes small enough for a CPU smoke test
    "0.5b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "7b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}


def qwen(shape: dict, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # initialise on the GPU directly: a 7B model in seconds, not minutes
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def timed(fn, repeats: int, sync) -> tuple[float, float]:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))] - times[int(0.1 * (len(times) - 1))]


def verify_table(model, context: int, k_max: int, repeats: int, sync) -> tuple[list[float], list[float]]:
    from edgespec.lm import TorchLM

    lm = TorchLM(model, name="target")
    lm.reset()
    vocab = lm.vocab_size
    lm.feed([(i * 7919) % vocab for i in range(context)], 0)
    med, spread = [0.0], [0.0]
    for n in range(1, k_max + 2):
        block = [(i * 104729) % vocab for i in range(n)]

        def step():
            lm.feed(block, n)
            lm.crop(context)

        m, s = timed(step, repeats, sync)
        med.append(round(m, 3))
        spread.append(round(s, 3))
    return med, spread


def draft_table(shape: dict, context: int, k_max: int, repeats: int, threads: int, workdir: Path) -> tuple[list[float], str]:
    from edgespec.convert import hf_to_onnx
    from edgespec.drafters import ModelDrafter
    from edgespec.onnx_lm import OnnxLM
    from edgespec.profiling import measure_propose

    model = qwen(shape, "cpu", torch.float16 if shape["hidden_size"] >= 512 else torch.float32)
    hf_dir = workdir / "draft-hf"
    model.save_pretrained(hf_dir)
    _tokenizer_files(hf_dir, shape["vocab_size"])
    del model
    onnx_dir = hf_to_onnx(hf_dir, precision="int4", last_logits_only=True)  # as the runtime builds drafters
    lm = OnnxLM(onnx_dir, threads=threads, name="draft")
    drafter = ModelDrafter(lm, name="int4")
    ids = [(i * 7919) % lm.vocab_size for i in range(context)]
    return measure_propose(drafter, ids, k_max, repeats), lm.description


def _tokenizer_files(path: Path, vocab: int) -> None:
    """The builder wants a tokenizer beside the weights; a word-level one of the right size will do."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(min(vocab, 1000))}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", bos_token="t2").save_pretrained(path)


def acceptance(profile_glob: str) -> tuple[dict, str]:
    from edgespec.profiling import read_profile

    for path in sorted(glob.glob(profile_glob)):
        prof = read_profile(Path(path))
        if "int4" in prof.data["drafters"]:
            return {band: prof.survival("int4", band) for band in ("greedy", "sampling")}, path
    return {"greedy": [0.8 ** (i + 1) for i in range(16)], "sampling": [0.6 ** (i + 1) for i in range(16)]}, \
        "none found: an assumed i.i.d. 0.8 / 0.6, NOT a measurement"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-bench-out"))
    ap.add_argument("--targets", default="1.5b,7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--draft-threads", default="4,16", help="ORT CPU threads for the draft, comma list")
    ap.add_argument("--profile-glob", default=str(Path(__file__).resolve().parent.parent / "edgespec" / "data" / "profiles" / "*qwen2.5-coder-1.5b-onnx.toml"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test of this script on a CPU")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("EDGESPEC_CACHE", tempfile.mkdtemp(prefix="edgespec-gpu-"))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA device here; use --device cpu --tiny for a smoke run")
    shapes = TINY if args.tiny else QWEN
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    from edgespec.costmodel import Latencies, speedups

    started = time.time()
    result = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "none"},
              "settings": vars(args), "targets": {}, "drafts": {}}
    import onnxruntime

    result["machine"]["onnxruntime"] = onnxruntime.__version__
    with tempfile.TemporaryDirectory() as work:
        for threads in [int(t) for t in args.draft_threads.split(",")]:
            table, desc = draft_table(shapes["0.5b"], args.context, args.k_max, max(5, args.repeats // 2), threads, Path(work))
            result["drafts"][f"0.5b-int4-cpu-{threads}t"] = {"propose_ms": table, "description": desc}
            print(f"draft 0.5b int4, {threads} threads: propose ms {table}", flush=True)
    surv, source = acceptance(args.profile_glob)
    result["acceptance"] = {"survival": surv, "source": source}
    for name in args.targets.split(","):
        model = qwen(shapes[name], args.device, dtype)
        med, spread = verify_table(model, args.context, args.k_max, args.repeats, sync)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        entry = {"verify_ms": med, "verify_spread_ms": spread, "predicted": {}}
        for draft, d in result["drafts"].items():
            lat = Latencies([t / 1000 for t in d["propose_ms"]], [t / 1000 for t in med])
            for band, s in surv.items():
                for overlap in (False, True):
                    key = f"{draft}/{band}/{'overlap' if overlap else 'sequential'}"
                    entry["predicted"][key] = [round(x, 3) for x in speedups(s[: args.k_max], lat, overlap=overlap)]
        result["targets"][f"{name}-{str(dtype).removeprefix('torch.')}-{args.device}"] = entry
        print(f"target {name}: verify ms {med}", flush=True)
    result["wall_s"] = round(time.time() - started, 1)
    (out / "gpu-bench.json").write_text(json.dumps(result, indent=1))
    (out / "gpu-bench.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = ["# GPU latency run (random weights, real shapes)", "",
             f"GPU: {r['machine']['gpu']}; CPU threads available: {r['machine']['cpu_count']}; torch {r['machine']['torch']}; "
             f"onnxruntime {r['machine']['onnxruntime']}; wall {r['wall_s']} s", "",
             f"Acceptance from: {r['acceptance']['source']}", ""]
    for name, t in r["targets"].items():
        lines.append(f"## target {name}")
        lines.append("verify ms, n = 1..: " + " ".join(f"{x:.2f}" for x in t["verify_ms"][1:]))
        for key, vals in t["predicted"].items():
            best = max(range(len(vals)), key=vals.__getitem__)
            lines.append(f"- {key}: best K={best} ({vals[best]:.2f}x); by K: " + " ".join(f"{v:.2f}" for v in vals))
        lines.append("")
    for name, d in r["drafts"].items():
        lines.append(f"draft {name}: propose ms, k = 1..: " + " ".join(f"{x:.2f}" for x in d["propose_ms"][1:]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

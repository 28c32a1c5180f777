"""Choose the quantised export settings by measurement: agreement with FP32 and latency of a few variants.

For each variant (block size, symmetric or not, MatMulNBits accuracy level, LM head and embedding
precision, INT8) this builds the ONNX
model through `edgespec.convert.hf_to_onnx` (cached, so a rerun only measures), then reports:
- teacher-forced argmax agreement with the FP32 ONNX export of the same checkpoint, on prose, on code and
  on chat answers that the FP32 model itself generated greedily (the text a draft has to predict);
- ms for one step of 1 token and of 5 tokens after a 64-token prefix, on 1 thread (median of interleaved
  rounds, so load from other processes spreads over every variant alike);
- size on disk.

    python scripts/int4_sweep.py --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf [--rounds 40]

Prints a markdown table (docs/int4-choice.md holds the one the defaults in edgespec/convert.py come from).
It does not change any default itself.
"""

from __future__ import annotations

import argparse
import inspect
import json.encoder
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgespec.convert import gguf_to_hf, hf_to_onnx
from edgespec.onnx_lm import OnnxLM


def int4(block_size=32, symmetric=False, accuracy_level=4, lm_head_int8=False, quantize_embedding=False):
    """hf_to_onnx options; the defaults here are the builder's plain INT4 (LM head INT4, embedding float32)."""
    return {"precision": "int4", "block_size": block_size, "symmetric": symmetric, "accuracy_level": accuracy_level,
            "lm_head_int8": lm_head_int8, "quantize_embedding": quantize_embedding}


# The first four change one setting each from the plain INT4 baseline.
VARIANTS = [
    ("int4 block 32, asym, acc 4", int4()),
    ("int4 block 32, sym, acc 4", int4(symmetric=True)),
    ("int4 block 128, asym, acc 4", int4(block_size=128)),
    ("int4 block 32, asym, acc 0", int4(accuracy_level=0)),
    ("int4 block 32, asym, acc 4, int8 LM head, int4 embedding", int4(lm_head_int8=True, quantize_embedding=True)),
    ("int8 block 32, asym, acc 4", {"precision": "int8", "block_size": 32, "symmetric": False, "accuracy_level": 4}),
]

PROSE = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We "
    "are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is altogether fitting "
    "and proper that we should do this. But, in a larger sense, we can not dedicate -- we can not consecrate "
    "-- we can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated "
    "it, far above our poor power to add or detract. The world will little note, nor long remember what we "
    "say here, but it can never forget what they did here. It is for us the living, rather, to be dedicated "
    "here to the unfinished work which they who fought here have thus far so nobly advanced. It is rather for "
    "us to be here dedicated to the great task remaining before us -- that from these honored dead we take "
    "increased devotion to that cause for which they gave the last full measure of devotion -- that we here "
    "highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a "
    "new birth of freedom -- and that government of the people, by the people, for the people, shall not "
    "perish from the earth."
)
PROMPTS = [
    "What is the difference between a list and a tuple in Python?",
    "Write a short poem about the sea.",
    "Explain how a refrigerator keeps food cold.",
    "Give me three tips for a job interview.",
]


def agreement(lm: OnnxLM, ref: list[torch.Tensor], texts: list[tuple[list[int], int]]) -> float:
    """Share of positions (from each text's `start`) where `lm` and the reference pick the same argmax."""
    same = total = 0
    for (ids, start), ref_argmax in zip(texts, ref):
        lm.reset()
        got = lm.feed(ids, len(ids)).argmax(-1)
        same += int((got[start:] == ref_argmax[start:]).sum())
        total += len(ids) - start
    return same / total


def greedy(lm: OnnxLM, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    lm.reset()
    out = []
    logits = lm.feed(prompt, 1)[-1]
    for _ in range(n):
        token = int(logits.argmax())
        if token in eos:
            break
        out.append(token)
        logits = lm.feed([token], 1)[-1]
    return out


def step_ms(lm: OnnxLM, prefix: list[int], n: int) -> float:
    lm.reset()
    lm.feed(prefix, 0)
    start = time.perf_counter()
    lm.feed(prefix[:n], n)
    elapsed = time.perf_counter() - start
    lm.crop(len(prefix))
    return elapsed * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="GGUF file to convert (or use --hf)")
    parser.add_argument("--hf", type=Path, help="transformers checkpoint dir")
    parser.add_argument("--rounds", type=int, default=40, help="timing rounds (each times every variant)")
    parser.add_argument("--gen", type=int, default=96, help="tokens of greedy FP32 answer per chat prompt")
    args = parser.parse_args()
    if not (args.gguf or args.hf):
        parser.error("give --gguf or --hf")
    hf_dir = args.hf or gguf_to_hf(args.gguf)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    paths = {"fp32": hf_to_onnx(hf_dir, precision="fp32")}
    fp32 = OnnxLM(paths["fp32"], threads=1, name="fp32")
    eos = set(fp32.eos_token_ids)
    code = inspect.getsource(json.encoder)
    texts = {
        "prose": [(tok(PROSE).input_ids[:400], 1)],
        "code": [(tok(code).input_ids[:400], 1)],
        "chat": [],
    }
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        answer = greedy(fp32, ids, args.gen, eos)
        # Row i predicts token i+1: the positions that predict the answer start at the last prompt token.
        texts["chat"].append((ids + answer, len(ids) - 1))
    refs = {}
    for kind, items in texts.items():
        refs[kind] = []
        for ids, _ in items:
            fp32.reset()
            refs[kind].append(fp32.feed(ids, len(ids)).argmax(-1))

    models = {"fp32": fp32}
    for key, options in VARIANTS:
        paths[key] = hf_to_onnx(hf_dir, **options)
        models[key] = OnnxLM(paths[key], threads=1)

    rows = {}
    for key, lm in models.items():
        rows[key] = {kind: agreement(lm, refs[kind], items) for kind, items in texts.items()}
        positions = sum(len(ids) - start for items in texts.values() for ids, start in items)
        same = sum(rows[key][k] * sum(len(i) - s for i, s in texts[k]) for k in texts)
        rows[key]["all"] = same / positions
        rows[key]["MB"] = sum(f.stat().st_size for f in paths[key].glob("model.onnx*")) / 1e6

    prefix = texts["prose"][0][0][:64]
    times = {key: {1: [], 5: []} for key in models}
    for lm in models.values():  # warm up: first runs allocate and pack weights
        for n in (1, 5):
            step_ms(lm, prefix, n)
    for _ in range(args.rounds):
        for key, lm in models.items():
            for n in (1, 5):
                times[key][n].append(step_ms(lm, prefix, n))

    counts = {k: sum(len(i) - s for i, s in v) for k, v in texts.items()}
    print(f"\nagreement positions: prose {counts['prose']}, code {counts['code']}, chat {counts['chat']} "
          f"(FP32 greedy answers to {len(PROMPTS)} prompts); timing: median of {args.rounds} rounds, 1 thread\n")
    print("| variant | agree prose | agree code | agree chat | agree all | ms n=1 | ms n=5 | MB on disk |")
    print("|---|---|---|---|---|---|---|---|")
    for key, row in rows.items():
        name = "fp32 (reference)" if key == "fp32" else key
        t1, t5 = statistics.median(times[key][1]), statistics.median(times[key][5])
        print(f"| {name} | {row['prose']:.3f} | {row['code']:.3f} | {row['chat']:.3f} | {row['all']:.3f} "
              f"| {t1:.1f} | {t5:.1f} | {row['MB']:.0f} |")


if __name__ == "__main__":
    main()

"""Plain-loop overhead: edgespec's target-only loop (K=0, the `--no-spec` path) vs transformers' own greedy
`generate`, on the same model, prompt and thread count. A benchmark, not a test: run it on a quiet machine.

    python scripts/bench_loop.py --target DIR [--tokens 64] [--repeats 5] [--threads 2] [--dtype float32]

Prints tokens/s for both (median of interleaved repeats), their ratio, whether the outputs are identical,
and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from edgespec.engine import SpeculativeEngine
    from edgespec.loading import load_causal_lm, load_tokenizer
    from edgespec.policy import FixedK
    from edgespec.target import TorchTarget

    model = load_causal_lm(args.target, dtype=args.dtype)
    tok = load_tokenizer(args.target)
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    engine = SpeculativeEngine(TorchTarget(model))  # no EOS: both sides generate exactly --tokens tokens
    x = torch.tensor([ids])

    def ours():
        t = time.perf_counter()
        out = engine.run(ids, max_new_tokens=args.tokens, policy=FixedK(0)).token_ids
        return time.perf_counter() - t, out

    def theirs():
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens,
                                 min_new_tokens=args.tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        return time.perf_counter() - t, out[0, len(ids):].tolist()

    load_before = os.getloadavg()
    ours(), theirs()  # warm-up
    t_ours, t_theirs = [], []
    for _ in range(args.repeats):  # interleaved so drift hits both alike
        a, out_a = ours()
        b, out_b = theirs()
        t_ours.append(a)
        t_theirs.append(b)
    load_after = os.getloadavg()
    ours_tps = args.tokens / statistics.median(t_ours)
    theirs_tps = args.tokens / statistics.median(t_theirs)
    print(f"model {args.target} dtype {args.dtype} threads {args.threads} prompt {len(ids)} tokens, {args.tokens} new")
    print(f"edgespec --no-spec loop : {ours_tps:6.2f} tok/s  (runs: {', '.join(f'{args.tokens / t:.2f}' for t in t_ours)})")
    print(f"transformers generate   : {theirs_tps:6.2f} tok/s  (runs: {', '.join(f'{args.tokens / t:.2f}' for t in t_theirs)})")
    print(f"ratio ours/theirs       : {ours_tps / theirs_tps:.3f}")
    print(f"identical output        : {out_a == out_b}")
    print(f"load average before {load_before[0]:.2f} after {load_after[0]:.2f}")


if __name__ == "__main__":
    main()

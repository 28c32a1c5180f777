"""Compare n-gram lookup settings without timing noise: replay the target's greedy outputs through its latencies.

    python scripts/ngram_sim.py [--pair qwen2.5-coder-1.5b] [--outputs FILE[,FILE...]] [--profile PATH]
                                [--max-new-tokens 128] [--temperature T --seed S]

Greedy decoding makes the target's output independent of the drafter, so it is generated once per bench prompt
(all 56, target-only; `--outputs` keeps it for later runs). Each `NgramDrafter` setting then proposes, at every
output position, what it would propose there (its lookup on prompt + output so far, up to K_MAX tokens), and a
round at that position with K accepts the matching prefix of min(K, proposal) tokens. Drafting is free; each
round is charged verify(proposal + 1) from the profile. Fixed K per category, and `--k auto` (one AdaptiveK
kept across prompts, as in the bench and the chat), speed-up over plain decoding (decode only).

Sampling (`--temperature`, outputs drawn by target-only sampling, seed S + prompt index) replays exactly too, for
a one-hot drafter like this one: under the rejection rule a draft x is accepted with probability p_target(x), and
when it is rejected the residual excludes x, so "accepted" is exactly "the emitted token equals the draft" and
every (output, acceptance) pair has the law of a real speculative run. Every configuration then sees the same
answers, where in `edgespec bench` at T > 0 each configuration draws answers of its own (a rag answer of 33
tokens in one, a 128-token copy of the context in another), which swamps the differences between K values.
Several outputs files (comma-separated, e.g. two seeds) are replayed as one set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

K_MAX = 8
SETTINGS = {  # name: NgramDrafter keyword arguments
    "n=1..3 (old default)": {"max_ngram": 3, "min_ngram": 1, "weak_ngram": 0},
    "n=2..5": {"max_ngram": 5, "min_ngram": 2, "weak_ngram": 0},
    "n=3..5": {"max_ngram": 5, "min_ngram": 3, "weak_ngram": 0},
    "n=2..5, 2-gram cap 2 (default)": {},
    "n=1..5, 1-gram cap 1, 2-gram cap 2": {"max_ngram": 5, "min_ngram": 1, "weak_ngram": 0, "caps": {1: 1, 2: 2}},
}


def generate_outputs(pair: str, max_new: int, temperature: float = 0.0, seed: int = 0) -> list[dict]:
    from edgespec import bench
    from edgespec.policy import FixedK
    from edgespec.runtime import RuntimeSpec, build_runtime
    from edgespec.sampling import SamplingParams
    from edgespec.session import ChatSession

    rt = build_runtime(RuntimeSpec(pair=pair, draft="ngram"))
    session = ChatSession(rt.engine, rt.tokenizer)
    out = []
    for i, p in enumerate(bench.load_prompts(None)):
        ids = session.encode(p["messages"])
        rt.engine.reset()
        params = SamplingParams(temperature=temperature, seed=seed + i)
        gen = rt.engine.run(ids, params=params, max_new_tokens=max_new, policy=FixedK(0)).token_ids
        out.append({"id": p["id"], "category": p["category"], "prompt": ids, "gen": gen})
        print(f"{p['id']}: {len(gen)} tokens", file=sys.stderr)
    return out


def proposals(outputs: list[dict], options: dict) -> list[tuple[str, list[int], list[int]]]:
    """Per prompt: (category, matched tokens m_i, proposal length l_i) at every output position."""
    import torch

    from edgespec.drafters import NgramDrafter
    from edgespec.sampling import SamplingParams

    options = dict(options)
    caps = options.pop("caps", None)
    drafter = NgramDrafter(**options)
    out = []
    for p in outputs:
        gen, ms, ls = p["gen"], [], []
        for i in range(len(gen)):
            drafter.begin(p["prompt"] + gen[:i])
            prop = drafter.propose(K_MAX, SamplingParams(), torch.Generator()).tokens
            if caps and prop:
                prop = prop[:caps.get(_match_length(drafter), K_MAX)]
            m = 0
            while m < len(prop) and i + m < len(gen) and prop[m] == gen[i + m]:
                m += 1
            ms.append(m)
            ls.append(len(prop))
        out.append((p["category"], ms, ls))
    return out


def _match_length(drafter) -> int:
    ids = drafter._ids
    for n in range(min(drafter.max_ngram, len(ids) - 1), drafter.min_ngram - 1, -1):
        suffix = ids[len(ids) - n:]
        if any(ids[s:s + n] == suffix for s in range(len(ids) - n - 1, -1, -1)):
            return n
    return 0


def replay(policy, ms: list[int], ls: list[int], verify: list[float]) -> float:
    """As the engine: at K = 0 the free lookup's proposal is checked against the tokens that follow and
    reported (`observe_shadow`) once it is decided (a mismatch, or all matched)."""
    i, t, n = 0, 0.0, len(ms)
    shadow = None  # (position decided at, proposed, matched)
    learns = policy.learns_from_shadow
    policy.begin_request()
    while i < n:
        k = max(0, min(policy.next_k(remaining=n - i), n - i - 1, K_MAX))
        if learns and k > 0:
            shadow = None
        elif learns and shadow is None:
            proposed = min(ls[i], K_MAX)
            matched = min(ms[i], proposed)
            shadow = (i + min(matched + 1, proposed), proposed, matched) if proposed else None
            if not proposed:
                policy.observe_shadow(0, 0)
        d = min(k, ls[i])
        a = min(d, ms[i])
        t += verify[d + 1]
        policy.observe(k, d, a, 0.0, verify[d + 1])
        i += a + 1
        if shadow is not None and i >= shadow[0]:
            policy.observe_shadow(shadow[1], shadow[2])
            shadow = None
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="qwen2.5-coder-1.5b")
    ap.add_argument("--outputs", default=None, help="JSON file: read the outputs from it if it exists, else write it")
    ap.add_argument("--profile", default=None, help="profile TOML for verify latencies (default: this machine's)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample the target's outputs (seed --seed + prompt index) instead of greedy decoding")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from edgespec.policy import FixedK
    from edgespec.profiling import policy_from_profile, read_profile
    from edgespec.runtime import RuntimeSpec, select_profile

    paths = [Path(p) for p in args.outputs.split(",")] if args.outputs else []
    path = paths[0] if len(paths) == 1 else None
    if paths and all(p.exists() for p in paths):
        outputs = [o for p in paths for o in json.loads(p.read_text())]
    else:
        outputs = generate_outputs(args.pair, args.max_new_tokens, args.temperature, args.seed)
        if path is not None:
            path.write_text(json.dumps(outputs))
    profile = (read_profile(Path(args.profile)) if args.profile else
               select_profile(RuntimeSpec(pair=args.pair, draft="ngram"), None, 0.0, choose_drafter=False))
    verify = list(profile.latencies("ngram").verify)
    cats = sorted({p["category"] for p in outputs})
    print(f"profile {profile.path}; {len(outputs)} outputs, "
          + (f"sampled at T={args.temperature} (the profile's prior for that band)" if args.temperature else "greedy")
          + "; verify ms "
          + " ".join(f"{v * 1000:.1f}" for v in verify[1:]))
    for name, options in SETTINGS.items():
        traces = proposals(outputs, options)
        speed = {}
        shared = policy_from_profile(profile, "ngram", args.temperature)
        for k in [*range(K_MAX + 1), "auto"]:
            speed[k] = {}
            for c in cats:
                tokens = sum(len(ms) for cc, ms, _ in traces if cc == c)
                secs = sum(replay(shared if k == "auto" else FixedK(k), ms, ls, verify)
                           for cc, ms, ls in traces if cc == c)
                speed[k][c] = tokens / secs
        print(f"\n### {name}: decode speed-up over plain decoding per category")
        print("| K | " + " | ".join(cats) + " |")
        print("|---|" + "---:|" * len(cats))
        for k in speed:
            print(f"| {k} | " + " | ".join(f"{speed[k][c] / speed[0][c]:.3f}" for c in cats) + " |")
        best = {c: max(speed[k][c] for k in range(K_MAX + 1)) for c in cats}
        print("| auto / best fixed K | " + " | ".join(f"{speed['auto'][c] / best[c]:.3f}" for c in cats) + " |")
        print("mean matched tokens per position: " + ", ".join(
            f"{c} {statistics.mean(m for cc, ms, _ in traces if cc == c for m in ms):.2f}" for c in cats))


if __name__ == "__main__":
    main()

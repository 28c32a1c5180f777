"""Compare K policies without timing noise: replay greedy acceptance traces through a latency table.

    python scripts/policy_sim.py [--pair smollm2-135m] [--drafter int8] [--profile PATH] [--all-prompts]
                                 [--max-new-tokens 128] [--traces FILE] [--catch-up-ms MS]

With greedy decoding on both sides the whole run is determined by one number per output position i: how many
of the drafter's greedy tokens from the context prompt + output[:i] match the target's output (m_i, up to
k_max). A round at position i with K drafts accepts min(K, m_i) and moves on by that plus one. This script
records m_i for every position of every bench prompt once (real models, real outputs), then replays any K
policy over the traces, charging each round draft(K) + verify(K+1) from a profile's latency table. Fixed K
and `--k auto` (the same AdaptiveK the runtime builds) are compared per category on identical inputs.

It answers "does the policy pick K well for the acceptance it sees"; how right the latency table is for a
real run is `edgespec bench`'s question, not this one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def record_traces(pair: str, drafter_name: str, max_new: int, all_prompts: bool, k_max: int,
                  categories: list[str] | None = None) -> list[dict]:
    import torch

    from edgespec import bench
    from edgespec.policy import FixedK
    from edgespec.runtime import RuntimeSpec, build_runtime, extra_drafter
    from edgespec.sampling import SamplingParams
    from edgespec.session import ChatSession

    rt = build_runtime(RuntimeSpec(pair=pair, draft=drafter_name))
    drafter = extra_drafter(rt, drafter_name)
    engine = rt.engine
    session = ChatSession(engine, rt.tokenizer)
    out = []
    for p in bench.load_prompts(categories, quick=not all_prompts):
        ids = session.encode(p["messages"])
        engine.reset()
        gen = engine.run(ids, max_new_tokens=max_new, policy=FixedK(0)).token_ids
        m = []
        for i in range(len(gen)):
            drafter.begin(ids + gen[:i])
            prop = drafter.propose(k_max, SamplingParams(), torch.Generator()).tokens
            n = 0
            while n < len(prop) and i + n < len(gen) and prop[n] == gen[i + n]:
                n += 1
            m.append(n)
        out.append({"id": p["id"], "category": p["category"], "prompt_len": len(ids), "m": m})
        print(f"{p['id']}: {len(gen)} tokens, mean match {statistics.mean(m):.2f}", file=sys.stderr)
    return out


def replay(policy, m: list[int], lat, prompt_len: int = 0, catch_up_s: float = 0.0) -> float:
    """Seconds to produce the trace's tokens under `policy` (the policy sees the rounds as they happen).
    A draft model's lazy prefill is charged as in the engine: the first drafted round feeds every token the
    drafter has not seen (`prompt_len`, then one per round decoded without drafting) at `catch_up_s` each."""
    i, t, n = 0, 0.0, len(m)
    lag = prompt_len
    policy.begin_request()
    while i < n:
        k = max(0, min(policy.next_k(remaining=n - i, lag=lag), n - i - 1, lat.k_max))
        a = min(k, m[i])
        d, v = lat.draft[k], lat.verify[k + 1]
        c, fed = 0.0, 0
        if k > 0 and lag > 2:
            c, fed = lag * catch_up_s, lag
        t += c + d + v
        policy.observe(k, k, a, d, v, catch_up_s=c, catch_up_tokens=fed)
        lag = 1 if k > 0 else lag + 1
        i += a + 1
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--drafter", default="int8")
    ap.add_argument("--profile", default=None, help="profile TOML for latencies and the prior (default: this machine's)")
    ap.add_argument("--all-prompts", action="store_true", help="every bench prompt (default: one per category)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--categories", default=None, help="comma-separated categories to record (default: all)")
    ap.add_argument("--traces", default=None, help="JSON file: read traces from it if it exists, else record and write")
    ap.add_argument("--temperature", type=float, default=0.0, help="band of the profile's prior (traces are greedy)")
    ap.add_argument("--catch-up-ms", type=float, default=0.0,
                    help="draft model prefill per unseen token, ms (charged once per request; 0 = free)")
    args = ap.parse_args()

    from edgespec.costmodel import Latencies
    from edgespec.policy import FixedK
    from edgespec.profiling import policy_from_profile, read_profile
    from edgespec.runtime import RuntimeSpec, select_profile

    k_max = 8
    path = Path(args.traces) if args.traces else None
    if path is not None and path.exists():
        traces = json.loads(path.read_text())
    else:
        traces = record_traces(args.pair, args.drafter, args.max_new_tokens, args.all_prompts, k_max,
                               args.categories.split(",") if args.categories else None)
        if path is not None:
            path.write_text(json.dumps(traces))
    if args.profile:
        profile = read_profile(Path(args.profile))
    else:
        profile = select_profile(RuntimeSpec(pair=args.pair, draft=args.drafter), None, args.temperature,
                                 choose_drafter=False)
    raw = profile.latencies(args.drafter)
    # Charge drafting as a least-squares line through the measured proposal times: a proposal of k tokens is
    # k single-token steps, and the raw medians are jagged on a noisy machine (fixed K would be ranked by noise).
    ks = list(range(1, len(raw.draft)))
    mk, md = statistics.mean(ks), statistics.mean(raw.draft[1:])
    slope = sum((k - mk) * (raw.draft[k] - md) for k in ks) / sum((k - mk) ** 2 for k in ks)
    base_cost = md - slope * mk
    lat = Latencies([0.0] + [max(base_cost + slope * k, 0.0) for k in ks], list(raw.verify))
    print(f"draft charged as {base_cost * 1000:.2f} + {slope * 1000:.2f} ms x k; verify ms "
          + " ".join(f"{v * 1000:.1f}" for v in lat.verify[1:]))
    policies = {f"K={k}": (lambda k=k: FixedK(k)) for k in range(k_max + 1)}
    # as in the bench and the chat: one auto policy kept across prompts
    shared = policy_from_profile(profile, args.drafter, args.temperature)
    policies["auto"] = lambda: shared
    policies["auto (fresh per prompt)"] = lambda: policy_from_profile(profile, args.drafter, args.temperature)
    cats = sorted({t["category"] for t in traces})
    speed = {name: {} for name in policies}
    for name, make in policies.items():
        for c in cats:
            tokens = sum(len(t["m"]) for t in traces if t["category"] == c)
            secs = sum(replay(make(), t["m"], lat, t["prompt_len"], args.catch_up_ms / 1000)
                       for t in traces if t["category"] == c)
            speed[name][c] = tokens / secs
    base = speed["K=0"]
    print(f"profile {profile.path}; drafter {args.drafter}; {len(traces)} prompts; speed-up over K=0 per category")
    print("| policy | " + " | ".join(cats) + " |")
    print("|---|" + "---:|" * len(cats))
    for name in policies:
        print(f"| {name} | " + " | ".join(f"{speed[name][c] / base[c]:.3f}" for c in cats) + " |")
    best = {c: max(speed[f"K={k}"][c] for k in range(k_max + 1)) for c in cats}
    print("| auto / best fixed | " + " | ".join(f"{speed['auto'][c] / best[c]:.3f}" for c in cats) + " |")
    probe = policy_from_profile(profile, args.drafter, args.temperature)
    for t in traces:
        replay(probe, t["m"], lat, t["prompt_len"], args.catch_up_ms / 1000)
    counts = {k: probe.history.count(k) for k in sorted(set(probe.history))}
    print(f"K chosen by the shared auto policy over all prompts (K: rounds): {counts}")


if __name__ == "__main__":
    main()

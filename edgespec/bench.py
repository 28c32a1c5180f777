"""`edgespec bench`: measured speed-ups on a Spec-Bench-like prompt set, against the baselines people pick.

On one set of loaded models it runs target-only decoding, each drafter at each K (and `auto`), and, when the
target runs under torch, transformers' own assisted generation and prompt lookup as anchors. Warm-up first;
configurations interleaved (rotated each repeat) so drift hits all alike; the median of repeats per prompt.
Every greedy output is checked against target-only's, and a mismatch is reported with its first differing
position. Speed-ups are ratios measured in the same run. The report maths lives in pure functions
(`summarise`, `first_difference`, `median`) tested on synthetic records.

It does not choose K for a device (that is `edgespec profile`) and does not print anything but the report
and a progress bar.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from .errors import EdgespecError
from .policy import check_k

CATEGORIES = ("multi_turn", "translation", "summarization", "qa", "math", "rag", "code", "rewrite")
TARGET_ONLY = "target-only"
# With --exact: the target alone with the exact target's numerics (short steps padded to its `min_rows`). It is
# the reference of the greedy check; plain target-only (the fastest plain decoding) stays the speed baseline.
TARGET_ONLY_EXACT = "target-only-exact"
LLAMA_CPP = "llama.cpp"  # anchor: llama.cpp's own decoding loop and sampler on the same GGUF, same threads


# ------------------------------------------------------------------------------------------- prompt set

def load_prompts(categories: Sequence[str] | None = None, *, quick: bool = False, per_category: int | None = None,
                 path: Path | None = None) -> list[dict]:
    """The bench prompts (chats), filtered by category; `quick` keeps the first quick prompt per category,
    `per_category` the first N prompts of each category (in file order)."""
    if per_category is not None and per_category < 1:
        raise EdgespecError(f"--per-category must be at least 1, got {per_category}")
    if categories:
        unknown = [c for c in categories if c not in CATEGORIES]
        if unknown:
            raise EdgespecError(f"unknown bench category {unknown[0]!r}; use some of {', '.join(CATEGORIES)}")
    text = path.read_text() if path else resources.files("edgespec").joinpath("data/bench_prompts.jsonl").read_text()
    prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    if categories:
        prompts = [p for p in prompts if p["category"] in categories]
    if quick:  # the first quick prompt of each category
        prompts = [p for p in prompts if p.get("quick")]
        per_category = 1
    if per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for p in prompts:
            counts[p["category"]] = counts.get(p["category"], 0) + 1
            if counts[p["category"]] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts


def parse_ks(text: str) -> list[int | str]:
    out: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        if part == "auto":
            out.append("auto")
            continue
        try:
            out.append(check_k(int(part)))
        except ValueError:
            raise EdgespecError(f"--k {part!r} is not a number; use integers 0..16 and/or 'auto', e.g. --k 0,2,4,auto") from None
    return out


# ------------------------------------------------------------------------------------------ records & maths

@dataclass
class RunRecord:
    config: str
    prompt_id: str
    category: str
    repeat: int
    token_ids: list[int]
    wall_s: float
    prefill_s: float = 0.0
    metrics: dict | None = None  # SpecMetrics.to_dict() for our engine; None for anchors


def median(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("median of nothing")
    return float(statistics.median(xs))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the sequences differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarise(records: Sequence[RunRecord], *, greedy: bool) -> dict:
    """Per config and category (and overall): tokens/s, speed-up over target-only, tau, acceptance,
    per-position acceptance, draft share of time, and greedy mismatches.

    Per prompt the median over repeats is taken (time and counters); a category's tokens/s is its total tokens
    over its total median time (as Spec-Bench does), so long answers weigh more than short ones.
    """
    by_key: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        by_key.setdefault((r.config, r.prompt_id), []).append(r)
    per_prompt = {}
    for (config, pid), runs in by_key.items():
        ms = [r.metrics for r in runs if r.metrics]
        per_prompt[(config, pid)] = {
            "category": runs[0].category,
            "tokens": median([len(r.token_ids) for r in runs]),
            "wall_s": median([r.wall_s for r in runs]),
            "decode_s": median([r.wall_s - r.prefill_s for r in runs]),
            # the draft model's lazy prefill, paid in decode; None for records written before it was kept
            "catch_up_s": (median([m["catch_up_ms"] / 1000 for m in ms])
                           if ms and all("catch_up_ms" in m for m in ms) else None),
            "token_ids": runs[0].token_ids,
            "metrics": ms,
        }
    configs = list(dict.fromkeys(r.config for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    out: dict = {"configs": {}, "mismatches": []}
    reference = TARGET_ONLY_EXACT if TARGET_ONLY_EXACT in configs else TARGET_ONLY
    out["reference"] = reference
    if greedy and reference in configs:
        for (config, pid), p in per_prompt.items():
            ref = per_prompt.get((reference, pid))
            if config in (TARGET_ONLY, TARGET_ONLY_EXACT, LLAMA_CPP) or ref is None:
                continue  # (the llama.cpp anchor may run other numerics than the target: not ours to check)
            pos = first_difference(ref["token_ids"], p["token_ids"])
            if pos is not None:
                out["mismatches"].append({"config": config, "prompt_id": pid, "first_difference": pos})
    for config in configs:
        rows = {}
        for cat in [*categories, "overall"]:
            items = [p for (c, _), p in per_prompt.items() if c == config and (cat == "overall" or p["category"] == cat)]
            if not items:
                continue
            tokens = sum(p["tokens"] for p in items)
            wall = sum(p["wall_s"] for p in items)
            decode = sum(p["decode_s"] for p in items)
            ms = [m for p in items for m in p["metrics"]]
            drafted = sum(m["num_draft_tokens"] for m in ms)
            accepted = sum(m["num_accepted_tokens"] for m in ms)
            forwards = sum(m["num_target_forwards"] for m in ms)
            emitted = sum(m["num_emitted_tokens"] for m in ms)
            draft_ms = sum(m["draft_ms"] for m in ms)
            verify_ms = sum(m["verify_ms"] for m in ms)
            pos_d = _position_sums(ms, "drafted_per_position")
            width = len(pos_d)
            pos_a = _position_sums(ms, "accepted_per_position", width)
            pos_k = _position_sums(ms, "asked_per_position")  # absent from records written before it was kept
            catch_up = [p["catch_up_s"] for p in items]
            steady = decode - sum(catch_up) if ms and None not in catch_up else None
            rows[cat] = {
                "prompts": len(items),
                "tokens": tokens,
                "tokens_per_s": tokens / wall if wall > 0 else 0.0,
                # after prefill; anchors (transformers' generate) do not report their prefill: None
                "decode_tokens_per_s": (tokens / decode if decode > 0 else 0.0) if ms else None,
                "tau": emitted / forwards if forwards else None,
                "acceptance_rate": accepted / drafted if drafted else None,
                "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(pos_a, pos_d)],
                "draft_share": draft_ms / (draft_ms + verify_ms) if draft_ms + verify_ms > 0 else None,
                # decode without the draft model's catch-up on the prompt: the steady rounds the cost model prices
                "steady_tokens_per_s": tokens / steady if steady else None,
                # per position i, over the rounds whose K reached it: P(accepted through i) and P(a proposal there)
                "survival": [(pos_a[i] if i < width else 0) / n for i, n in enumerate(pos_k) if n],
                "reach": [(pos_d[i] if i < width else 0) / n for i, n in enumerate(pos_k) if n],
                "mismatches": sum(1 for m in out["mismatches"] if m["config"] == config
                                  and (cat == "overall" or per_prompt[(config, m["prompt_id"])]["category"] == cat)),
            }
        out["configs"][config] = rows
    base = out["configs"].get(TARGET_ONLY, {})
    for rows in out["configs"].values():
        for cat, row in rows.items():
            ref = base.get(cat)
            row["speedup"] = row["tokens_per_s"] / ref["tokens_per_s"] if ref and ref["tokens_per_s"] > 0 else None
            ok = ref and row["decode_tokens_per_s"] and ref["decode_tokens_per_s"]
            row["decode_speedup"] = row["decode_tokens_per_s"] / ref["decode_tokens_per_s"] if ok else None
            ok = ref and row["steady_tokens_per_s"] and ref["decode_tokens_per_s"]
            row["steady_speedup"] = row["steady_tokens_per_s"] / ref["decode_tokens_per_s"] if ok else None
    return out


def _position_sums(ms: Sequence[dict], key: str, width: int | None = None) -> list[int]:
    """Per draft position, the sum of the metrics' `key` lists (shorter lists count 0 there); `width`
    positions, or as many as the longest list has."""
    lists = [m.get(key, []) for m in ms]
    if width is None:
        width = max(map(len, lists), default=0)
    return [sum(xs[i] for xs in lists if i < len(xs)) for i in range(width)]


# ------------------------------------------------------------------------------------------------ runs

@dataclass
class Config:
    name: str
    run: Callable[[list[int], int, object], tuple[list[int], float, dict | None]]  # ids, max_new, params -> ids, prefill_s, metrics


def engine_config(name, engine, policy_factory, *, setup: Callable[[], None] | None = None) -> Config:
    """`setup` runs before every request (the bench's exact configs set the target's row count with it)."""
    def run(prompt_ids, max_new_tokens, params):
        if setup is not None:
            setup()
        engine.reset()
        result = engine.run(prompt_ids, params=params, max_new_tokens=max_new_tokens, policy=policy_factory())
        return result.token_ids, result.metrics.prefill_ms / 1000, result.metrics.to_dict()
    return Config(name, run)


def llamacpp_config(name, target, eos_token_ids) -> Config:
    """Plain llama.cpp (`LlamaCppLM.plain_generate`: its own loop and sampler chain in C) on `target`'s model,
    timed as our engine is (prefill, then one step a token). The target's cache is emptied before and after,
    so the engine's rows find it as they left it: empty."""
    from .metrics import SpecMetrics

    def run(prompt_ids, max_new_tokens, params):
        target.reset()
        try:
            tokens, prefill_s, decode_s = target.lm.plain_generate(
                prompt_ids, max_new_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                seed=params.seed, stop_ids=eos_token_ids)
        finally:
            target.reset()
        metrics = SpecMetrics(num_target_forwards=len(tokens), num_emitted_tokens=len(tokens),
                              prefill_ms=prefill_s * 1000, verify_ms=decode_s * 1000, wall_s=prefill_s + decode_s,
                              k_per_round=[0] * len(tokens))
        return tokens, prefill_s, metrics.to_dict()
    return Config(name, run)


def hf_config(name, model, tokenizer, **generate_kwargs) -> Config:
    """transformers' own generate (assisted generation / prompt lookup) on the same torch target."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(prompt_ids, max_new_tokens, params):
        x = torch.tensor([prompt_ids], device=model.device)
        sample = {"do_sample": False} if params.greedy else {
            "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or None}
        if params.seed is not None:
            torch.manual_seed(params.seed)
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, **sample, **generate_kwargs)
        return out[0, len(prompt_ids):].tolist(), 0.0, None
    return Config(name, run)


@dataclass
class BenchResult:
    command: str
    machine: dict
    settings: dict
    records: list[RunRecord]
    summary: dict
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    peak_rss_mb: float
    wall_s: float
    notes: list[str] = field(default_factory=list)
    # from the profile the run used (`profile_latencies`): the cost model's inputs for the report's predictions
    latencies: dict = field(default_factory=dict)


def run_bench(configs: Sequence[Config], prompts: Sequence[dict], encode: Callable[[list[dict]], list[int]], *,
              params, max_new_tokens: int, repeats: int, progress: bool = True, command: str = "",
              machine: dict | None = None, settings: dict | None = None) -> BenchResult:
    from tqdm import tqdm

    start = time.perf_counter()
    load_before = os.getloadavg()
    encoded = [(p, encode(p["messages"])) for p in prompts]
    # Warm-up: every configuration once on a short generation, so first-call costs are not measured.
    for c in configs:
        c.run(encoded[0][1], min(16, max_new_tokens), params)
    records: list[RunRecord] = []
    bar = tqdm(total=repeats * len(encoded) * len(configs), desc="bench", unit="run", file=sys.stderr,
               disable=not progress)
    for rep in range(repeats):
        for i, (prompt, ids) in enumerate(encoded):
            shift = (rep + i) % len(configs)
            for c in [*configs[shift:], *configs[:shift]]:  # rotate: no configuration always runs first
                # Sampling: the same seed for every configuration on a given prompt and repeat.
                p = params if params.greedy else replace(params, seed=(params.seed or 0) + 1000 * rep + i)
                t0 = time.perf_counter()
                out, prefill_s, metrics = c.run(ids, max_new_tokens, p)
                wall = time.perf_counter() - t0
                records.append(RunRecord(c.name, prompt["id"], prompt["category"], rep, out, wall, prefill_s, metrics))
                bar.update(1)
    bar.close()
    summary = summarise(records, greedy=params.greedy)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return BenchResult(command, machine or {}, settings or {}, records, summary, load_before, os.getloadavg(),
                       peak, time.perf_counter() - start)


MODEL_DRAFTERS = ("int4", "int8", "torch", "llamacpp")


def run_bench_for(spec, *, ks: Sequence[int | str], params, prompts: Sequence[dict] | None = None,
                  categories: Sequence[str] | None = None, quick: bool = False, per_category: int | None = None,
                  drafters: Sequence[str] | None = None, repeats: int | None = None,
                  max_new_tokens: int | None = None, anchor_k: int = 4, anchors: bool = True,
                  p_mins: Sequence[float] | None = None, profile_path: str | None = None,
                  out_dir: str | Path = "bench-results", command: str | None = None,
                  progress: bool = True) -> tuple[BenchResult, dict[str, Path]]:
    """The whole `edgespec bench` run for the models of `spec` (`edgespec.runtime.RuntimeSpec`): load them,
    run target-only, each drafter (`drafters`, default: the pair's model drafter and n-gram) at each K of `ks`
    (0 and "auto" included; parse text with `parse_ks`) and, on a torch target, transformers' anchors, then write
    the JSON, markdown and PNG under `out_dir`. Returns the result and the paths written.

    `prompts`: the prompt set (default: `load_prompts(categories, quick=, per_category=)`); `quick` and
    `per_category` also name the files and set the defaults of `max_new_tokens` (48 quick, 128) and `repeats`
    (1 quick, 3). `p_mins`: the --p-min values, a run per value for each K (None: the default's for auto, 0 for a
    fixed K). `profile_path`: the profile for --k auto and the report's predictions (default: the one matching
    this machine). `spec.overlap` true also runs each drafter that can draft ahead overlapped."""
    from . import llamacpp_lm
    from .engine import SpeculativeEngine
    from .loading import load_causal_lm
    from .policy import DEFAULT_P_MIN, FixedK
    from .profiling import read_profile
    from .runtime import build_runtime, extra_drafter, make_policy, matching_profile, select_profile
    from .session import ChatSession
    from .target import ModelTarget

    ks = list(ks)
    check_k(anchor_k)
    p_min_values = list(p_mins) if p_mins else [None]
    if prompts is None:
        prompts = load_prompts(categories, quick=quick, per_category=per_category)
    max_new = max_new_tokens or (48 if quick else 128)
    repeats = repeats or (1 if quick else 3)
    wanted = list(drafters) if drafters else None
    for name in wanted or []:
        if name not in (*MODEL_DRAFTERS, "ngram"):
            raise EdgespecError(f"unknown drafter {name!r} in --drafters; use some of {', '.join(MODEL_DRAFTERS)}, ngram")
    spec = replace(spec)  # the caller's spec stays as given
    if wanted and spec.draft in (None, *MODEL_DRAFTERS, "ngram", "none"):
        # load the first model drafter asked for; the n-gram drafter needs no model
        spec.draft = next((d for d in wanted if d != "ngram"), "none")
    if "auto" in ks:
        profile = select_profile(spec, profile_path, params.temperature, choose_drafter=False)
    else:  # only for the report's predictions: no notice when there is none
        profile = read_profile(profile_path) if profile_path else matching_profile(spec)
    rt = build_runtime(spec, progress=None)
    wanted = wanted or ([rt.drafter_name] if rt.drafter_name not in ("none", "ngram") else []) + ["ngram"]
    target = rt.engine.target
    loaded = {}
    for name in wanted:
        drafter = extra_drafter(rt, name)
        if drafter is None:
            raise EdgespecError(f"drafter {name!r} needs a draft model; give --pair or --draft DIR")
        loaded[name] = drafter
    eos = rt.engine.eos_token_ids
    plain = SpeculativeEngine(target, None, eos_token_ids=eos)
    rows = target.min_rows  # more than 1 with --exact (`edgespec.lm.exact_rows`)

    def set_rows(n):
        def setup():
            target.lm.min_rows = n
        return setup

    exact_setup = set_rows(rows) if rows > 1 else None
    # With --exact the speed baseline is still the fastest plain decoding (one row a step); the greedy reference
    # is the target alone with the exact numerics every speculative configuration runs with.
    configs = [engine_config(TARGET_ONLY, plain, lambda: FixedK(0), setup=set_rows(1) if rows > 1 else None)]
    if rows > 1:
        configs.append(engine_config(TARGET_ONLY_EXACT, plain, lambda: FixedK(0), setup=exact_setup))
    for name, drafter in loaded.items():
        modes = [False, True] if spec.overlap and drafter.can_draft_ahead else [False]
        for overlap in modes:
            engine = SpeculativeEngine(target, drafter, eos_token_ids=eos, overlap=overlap)
            tag = "+overlap" if overlap else ""
            for k in ks:
                if k == 0:
                    continue
                if k == "auto":
                    # one per configuration: it keeps what it learnt across prompts. Each --p-min value is a run of
                    # its own (named +pP unless it is the default's value).
                    for p_min in p_min_values:
                        policy = make_policy("auto", profile, name, params.temperature, overlap=overlap, p_min=p_min)
                        ptag = "" if p_min is None or p_min == DEFAULT_P_MIN else f"+p{p_min:g}"
                        configs.append(engine_config(f"{name}@auto{tag}{ptag}", engine, lambda p=policy: p,
                                                     setup=exact_setup))
                else:  # a fixed K drafts K (p_min 0) unless --p-min names values: then one run per value
                    for p_min in p_min_values if p_mins else [0.0]:
                        ptag = f"+p{p_min:g}" if p_min else ""
                        configs.append(engine_config(f"{name}@{k}{tag}{ptag}", engine,
                                                     lambda k=k, p=p_min: FixedK(k, p_min=p), setup=exact_setup))
    notes = []
    if anchors:
        if rt.target_backend == "torch":
            model = target.lm.model
            draft_dir = rt.draft_weights() or rt.target_weights()  # (a GGUF draft's converted here if it was not)
            assistant = load_causal_lm(draft_dir, dtype=spec.dtype) if draft_dir != rt.target_weights() else model
            configs.append(hf_config("hf-assisted", model, rt.tokenizer, assistant_model=assistant))
            configs.append(hf_config(f"hf-assisted@{anchor_k}", model, rt.tokenizer, assistant_model=assistant,
                                     num_assistant_tokens=anchor_k, num_assistant_tokens_schedule="constant",
                                     assistant_confidence_threshold=0.0))
            configs.append(hf_config(f"hf-prompt-lookup@{anchor_k}", model, rt.tokenizer,
                                     prompt_lookup_num_tokens=anchor_k))
        else:
            notes.append("transformers anchors need the torch target backend (--target-backend torch); skipped")
        if rt.target_gguf is not None and llamacpp_lm.available():
            # What users run otherwise: plain llama.cpp decoding of the same GGUF on the same threads, through the
            # same library: llama.cpp's own loop and sampler, not our engine at K = 0 (which is target-only), timed
            # the same way. (a llama.cpp target is that model already: no second copy loaded)
            anchor = target if rt.target_backend == "llamacpp" else ModelTarget(
                llamacpp_lm.LlamaCppLM(rt.target_gguf, threads=spec.threads, name="anchor"))
            configs.append(llamacpp_config(LLAMA_CPP, anchor, frozenset(eos)))
        elif rt.target_gguf is not None:
            notes.append(f"the plain llama.cpp anchor needs the llama.cpp backend ({llamacpp_lm.INSTALL_HINT}); skipped")
    session = ChatSession(rt.engine, rt.tokenizer)
    settings = {"pair": rt.pair or spec.target, "target": rt.target_description, "draft": rt.draft_description,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "greedy": params.greedy, "max_new_tokens": max_new, "repeats": repeats, "prompts": len(prompts),
                "ks": ks, "exact": rows > 1,
                "title": f"{rt.pair or 'custom'} / {rt.target_backend} target / T={params.temperature}"}
    threads = (spec.threads, spec.draft_threads or spec.threads)  # what --threads/--draft-threads or --overlap set
    if threads != (None, None):
        settings["threads"] = {"target": threads[0], "draft": threads[1]}
    result = run_bench(configs, prompts, session.encode, params=params, max_new_tokens=max_new, repeats=repeats,
                       progress=progress, command=command_line() if command is None else command,
                       machine=machine_description(), settings=settings)
    result.notes.extend(notes)
    if profile is not None:
        result.latencies = profile_latencies(profile, list(loaded), threads)
    if rows > 1 and params.greedy:
        outs = {(r.config, r.prompt_id): r.token_ids for r in result.records if r.repeat == 0}
        differ = sum(outs[(TARGET_ONLY, p["id"])] != outs[(TARGET_ONLY_EXACT, p["id"])] for p in prompts)
        result.notes.append(f"--exact: the greedy reference is {TARGET_ONLY_EXACT} (steps run as {rows} rows at least"
                            f"{', over a fixed-length cache' if rt.target_backend == 'torch' else ''}); "
                            f"plain {TARGET_ONLY} (one row a step, the speed baseline) gives different output on "
                            f"{differ} of {len(prompts)} prompts: the kernels' rounding, not speculation")
    stem = f"{rt.pair or 'custom'}-{rt.target_backend}-t{params.temperature:g}" + ("-quick" if quick else "")
    stem += f"-n{per_category}" if per_category and not quick else ""
    return result, write_outputs(result, Path(out_dir), stem)


# ---------------------------------------------------------------------------------------------- report

# The profile issue's targets for --k auto against a fixed-K sweep.
AUTO_WITHIN_BEST = 0.95  # auto at least 95% of the best fixed K (K = 0 included) in each category
AUTO_VS_K0 = 0.97  # and never more than 3% below K = 0 (target-only)


def config_parts(name: str) -> tuple[str, str, str]:
    """A configuration's name in parts: "int4@3+overlap" -> ("int4", "3", "+overlap"), "ngram@auto" ->
    ("ngram", "auto", ""), "target-only" -> ("target-only", "", "")."""
    drafter, _, rest = name.partition("@")
    k, plus, tag = rest.partition("+")
    return drafter, k, plus + tag


def _rate(row: dict) -> float:
    """The rate sweeps compare: decode tokens/s; anchors (transformers' generate) have none: the whole request's."""
    return row["decode_tokens_per_s"] or row["tokens_per_s"]


def auto_vs_fixed(summary: dict) -> dict[str, dict[str, dict]]:
    """Per drafter with an `@auto` run and at least one fixed-K run (same overlap tag), per category and overall:
    the best fixed K (target-only counts as K = 0), auto's speed-up over it and over K = 0, and whether auto meets
    AUTO_WITHIN_BEST and AUTO_VS_K0. Empty when the run has no such sweep.

    Rates are decode tokens/s (after the target's prefill, which is the same work at every K, so it adds only
    noise: the same prompt's prefill varied 2x between configurations on a busy VM; and with sampling each
    configuration draws answers of other lengths, so a whole-request rate would also weigh prefill differently);
    the draft model's own prefill is paid in decode, so it still counts against drafting."""
    configs = summary["configs"]
    base = configs.get(TARGET_ONLY, {})
    out: dict[str, dict[str, dict]] = {}
    for name in configs:
        drafter, k_text, tag = config_parts(name)
        if k_text != "auto":
            continue
        fixed = {}
        for other in configs:  # "int8@3", or "int8@3+overlap" for "int8@auto+overlap"
            d, k, t = config_parts(other)
            if d == drafter and t == tag and k.isdigit():
                fixed[int(k)] = configs[other]
        if not fixed:
            continue
        fixed[0] = base
        rows = {}
        for cat, auto_row in configs[name].items():
            speeds = {k: _rate(r[cat]) for k, r in fixed.items() if cat in r}
            if 0 not in speeds or not speeds[0]:
                continue
            best_k = max(speeds, key=lambda k: speeds[k])
            auto = _rate(auto_row)
            rows[cat] = {"best_k": best_k, "best_speedup": speeds[best_k] / speeds[0],
                         "auto_speedup": auto / speeds[0], "auto_over_best": auto / speeds[best_k],
                         "within_best": auto >= AUTO_WITHIN_BEST * speeds[best_k],
                         "not_below_k0": auto >= AUTO_VS_K0 * speeds[0]}
        out[name] = rows
    return out


def per_repeat(records: Sequence[RunRecord], *, greedy: bool) -> list[dict]:
    """`summarise` of each repeat on its own (empty with one repeat): how far a number moves from one run of the
    same configurations to the next, which says how large a difference between them means anything."""
    reps = sorted({r.repeat for r in records})
    if len(reps) < 2:
        return []
    return [summarise([r for r in records if r.repeat == i], greedy=greedy) for i in reps]


def repeat_spread(runs: Sequence[dict]) -> dict[str, float]:
    """Per category (and overall), over the configurations with a decode rate: the median of (the faster run's
    decode rate / the slower one's - 1) across `per_repeat`'s runs. With sampling each run draws other answers,
    so this is mostly the text's doing, not the clock's."""
    if len(runs) < 2:
        return {}
    spreads: dict[str, list[float]] = {}
    for config, rows in runs[0]["configs"].items():
        for cat in rows:
            cells = [run["configs"].get(config, {}).get(cat) for run in runs]
            rates = [_rate(c) if c else None for c in cells]
            if all(rates):
                spreads.setdefault(cat, []).append(max(rates) / min(rates) - 1.0)
    return {cat: statistics.median(v) for cat, v in spreads.items()}


# Issue 7's bar for the cost model: its predicted speed-up within 15% of the measured one.
PREDICTION_TOLERANCE = 0.15


def profile_latencies(profile, drafters: Sequence[str], threads: tuple[int | None, int | None] = (None, None)) -> dict:
    """What the report's predictions need from a profile (`edgespec.profiling.Profile`): its path and, per
    drafter it measured, the cost model's latencies in seconds. Kept in the result, so a re-render needs no
    profile file. `threads`: the run's (target, draft) threads; where they are the split the profile measured
    for overlap (`[overlap]`), those latencies, as the run's target-only baseline ran on the same split."""
    measured = profile.data.get("drafters", {})
    path = profile.path
    if path is not None:  # the shipped profiles by their path in the package, not this install's absolute one
        from .profiling import PROFILES_DIR

        root, resolved = PROFILES_DIR.parents[2], Path(path).resolve()
        path = resolved.relative_to(root) if resolved.is_relative_to(root) else path
    out = {"profile": str(path) if path else None, "drafters": {}}
    split = threads != (None, None) and profile.split() == tuple(threads)
    if split:
        target = "on the GPU" if threads[0] is None else f"{threads[0]} thread(s)"
        out["split"] = f"the target {target}, the draft {threads[1]} thread(s)"
    for name in drafters:
        if name in measured:
            lat = profile.latencies(name, overlap=split)
            out["drafters"][name] = {"draft_s": list(lat.draft), "verify_s": list(lat.verify)}
    return out


def predictions(summary: dict, latencies: dict) -> dict[str, dict[str, dict]]:
    """Per fixed-K configuration ("int4@3", "int4@3+overlap", "int4@3+p0.75") whose drafter the profile measured,
    per category and overall: the cost model's speed-up over plain decoding from the profile's latencies and this
    run's own acceptance per position and reach (so only the timing model is tested), beside the measured speed-up
    of the steady rounds (decode without the draft model's catch-up on the prompt) and their ratio."""
    from .costmodel import Latencies, speedup

    out: dict[str, dict[str, dict]] = {}
    for name, rows in summary["configs"].items():
        drafter, k_text, tag = config_parts(name)
        # "+p0.75": drafts that stop after an unsure token; the run's reach per position says how far they went
        tag = re.sub(r"\+p[0-9.]+$", "", tag)
        lat_data = latencies.get("drafters", {}).get(drafter)
        if not lat_data or not k_text.isdigit() or tag not in ("", "+overlap"):
            continue
        k = int(k_text)
        lat = Latencies(lat_data["draft_s"], lat_data["verify_s"])
        if not 0 < k <= lat.k_max:
            continue
        cells = {}
        for cat, row in rows.items():
            survival, reach = row.get("survival") or [], row.get("reach") or []
            measured = row.get("steady_speedup")
            if len(survival) < k or measured is None:
                continue
            predicted = speedup(survival[:k], lat.expected(reach), k, overlap=tag == "+overlap")
            cells[cat] = {"predicted": predicted, "measured": measured, "ratio": measured / predicted,
                          "within": abs(measured / predicted - 1) <= PREDICTION_TOLERANCE}
        if cells:
            out[name] = cells
    return out


def markdown(result: BenchResult) -> str:
    s = result.summary
    configs = list(s["configs"])
    cats = [c for c in CATEGORIES if any(c in rows for rows in s["configs"].values())]
    lines = ["# edgespec bench", "", f"`{result.command}`", ""]
    m = result.machine
    if m:
        lines.append(f"Machine: {m.get('cpu_model', '?')}, {m.get('cores_logical', '?')} cores, "
                     f"{(m.get('memory_total') or 0) / 2**30:.0f} GiB, GPU: {', '.join(d['name'] for d in m.get('cuda_devices', [])) or 'none'}; "
                     f"torch {m.get('torch')}, onnxruntime {m.get('onnxruntime')}")
    st = result.settings
    lines.append(f"Settings: {', '.join(f'{k}={v}' for k, v in st.items())}")
    lines.append(f"Load average before/after: {result.load_before[0]:.2f} / {result.load_after[0]:.2f}; "
                 f"peak RSS {result.peak_rss_mb:.0f} MiB; bench wall time {result.wall_s:.0f} s")
    lines += ["", "## Overall", "",
              "tok/s and speed-up count the whole request (prefill included, as a user waits for it); decode counts "
              "the time after the target's prefill (the draft model's prefill is done at its first drafted round, so it "
              "counts in decode).", "",
              "| config | tok/s | speed-up | decode tok/s | decode speed-up | tau | acceptance | acceptance per position | draft share | greedy mismatches |",
              "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for c in configs:
        r = s["configs"][c].get("overall")
        if not r:
            continue
        lines.append(f"| {c} | {r['tokens_per_s']:.2f} | {_x(r['speedup'])} | {_f(r['decode_tokens_per_s'])} | {_x(r['decode_speedup'])} | "
                     f"{_f(r['tau'])} | {_f(r['acceptance_rate'])} | "
                     f"{' '.join(f'{a:.2f}' for a in r['acceptance_per_position']) or '-'} | {_f(r['draft_share'])} | {r['mismatches']} |")
    lines += ["", "## Speed-up over target-only per category", "",
              "| config | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for c in configs:
        rows = s["configs"][c]
        lines.append(f"| {c} | " + " | ".join(_x(rows[k]["speedup"]) if k in rows else "-" for k in cats) + " |")
    lines += ["", "## Decode speed-up (after prefill) per category", "",
              "| config | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for c in configs:
        rows = s["configs"][c]
        lines.append(f"| {c} | " + " | ".join(_x(rows[k]["decode_speedup"]) if k in rows else "-" for k in cats) + " |")
    lines += ["", "## Tokens/s per category", "", "| config | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for c in configs:
        rows = s["configs"][c]
        lines.append(f"| {c} | " + " | ".join(f"{rows[k]['tokens_per_s']:.2f}" if k in rows else "-" for k in cats) + " |")
    sweep = auto_vs_fixed(s)
    if sweep:
        runs = per_repeat(result.records, greedy=bool(result.settings.get("greedy")))
        spread = repeat_spread(runs)
        lines += ["", "## Auto against the fixed-K sweep", "",
                  (f"Per category, in decode tokens/s (after the target's prefill, the same work at every K): the best "
                   f"fixed K of the same drafter (K = 0 is target-only) and its speed-up, then auto's rate over the best "
                   f"fixed K's (target: >= {AUTO_WITHIN_BEST:.2f}) and over K = 0's (target: >= {AUTO_VS_K0:.2f}); a "
                   f"cell missing a target is marked **!**.")
                  + (f" With {len(runs)} runs: auto over the best fixed K of each run on its own, and the run-to-run "
                     f"spread (per category, the median over configurations of the faster run's decode rate over the "
                     f"slower one's, minus 1): a difference well inside it is noise." if runs else ""), ""]
        for name, rows in sweep.items():
            cols = [c for c in [*cats, "overall"] if c in rows]
            lines += [f"**{name}**", "", "| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols),
                      "| best fixed K | " + " | ".join(f"{rows[c]['best_k']} ({_x(rows[c]['best_speedup'])})" for c in cols) + " |",
                      "| auto / best fixed | " + " | ".join(f"{rows[c]['auto_over_best']:.2f}" + ("" if rows[c]["within_best"] else " **!**")
                                                          for c in cols) + " |",
                      "| auto / K = 0 | " + " | ".join(f"{rows[c]['auto_speedup']:.2f}" + ("" if rows[c]["not_below_k0"] else " **!**")
                                                      for c in cols) + " |"]
            if runs:
                each = [auto_vs_fixed(run).get(name, {}) for run in runs]
                lines += ["| auto / best fixed, each run | " + " | ".join(
                              ", ".join(f"{e[c]['auto_over_best']:.2f}" if c in e else "-" for e in each) for c in cols) + " |",
                          "| run-to-run spread | " + " | ".join(f"{spread[c]:.0%}" if c in spread else "-" for c in cols) + " |"]
            lines.append("")
            per_cat = [c for c in cols if c != "overall"]
            missed = [c for c in per_cat if not (rows[c]["within_best"] and rows[c]["not_below_k0"])]
            lines.append(f"{name}: {len(per_cat) - len(missed)} of {len(per_cat)} categories meet both targets"
                         + (f"; missed: {', '.join(missed)}" if missed else "") + ".")
            lines.append("")
    predicted = predictions(s, result.latencies) if result.latencies else {}
    if predicted:
        cols = [c for c in [*cats, "overall"] if any(c in rows for rows in predicted.values())]
        lines += ["", "## Cost model against measured", "",
                  (f"Predicted: the cost model's speed-up over plain decoding (`edgespec.costmodel.speedup`, the "
                   f"overlapped form for +overlap) from the latencies of the profile "
                   f"`{result.latencies.get('profile') or '?'}`"
                   + (f" measured with the cores split as this run split them ({result.latencies['split']})"
                      if result.latencies.get("split") else "")
                   + f" and this run's own acceptance per position and reach; "
                   f"measured: the decode speed-up of the steady rounds (after the target's prefill, without the draft "
                   f"model's catch-up on the prompt). Overall: predicted, measured, measured / predicted; per category: "
                   f"measured / predicted. Off by more than {PREDICTION_TOLERANCE:.0%}: **!**."), "",
                  "| config | predicted | measured | measured / predicted | " + " | ".join(c for c in cols if c != "overall") + " |",
                  "|---|---:|---:|---:|" + "---:|" * (len(cols) - 1)]
        for name, cells in predicted.items():
            o = cells.get("overall")
            head = (f"| {name} | {o['predicted']:.2f}x | {o['measured']:.2f}x | {o['ratio']:.2f}" + ("" if o["within"] else " **!**")
                    if o else f"| {name} | - | - | -")
            lines.append(head + " | " + " | ".join(
                (f"{cells[c]['ratio']:.2f}" + ("" if cells[c]["within"] else " **!**")) if c in cells else "-"
                for c in cols if c != "overall") + " |")
        overall = [c["overall"] for c in predicted.values() if "overall" in c]
        lines += ["", f"Overall within {PREDICTION_TOLERANCE:.0%}: {sum(c['within'] for c in overall)} of {len(overall)} configurations."]
    if result.settings.get("greedy"):
        lines += [""]
        ref = s.get("reference", TARGET_ONLY)
        if s["mismatches"]:
            lines.append(f"**GREEDY MISMATCHES: {len(s['mismatches'])}** (output differs from {ref}):")
            for mm in s["mismatches"]:
                lines.append(f"- {mm['config']} on {mm['prompt_id']}: first difference at generated token {mm['first_difference']}")
        else:
            lines.append(f"Greedy check: every output equals {ref}'s, token for token.")
    for n in result.notes:
        lines.append(f"- note: {n}")
    return "\n".join(lines) + "\n"


def _x(v):
    return f"{v:.2f}x" if v is not None else "-"


def _f(v):
    return f"{v:.2f}" if v is not None else "-"


def chart(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.summary
    configs = [c for c in s["configs"] if c != TARGET_ONLY]
    cats = [c for c in CATEGORIES if any(c in rows for rows in s["configs"].values())] + ["overall"]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(cats)), 4.5))
    width = 0.8 / max(len(configs), 1)
    for i, c in enumerate(configs):
        vals = [s["configs"][c].get(k, {}).get("speedup") or 0 for k in cats]
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=c)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=20)
    ax.set_ylabel("speed-up over target-only")
    ax.set_title(result.settings.get("title", "edgespec bench"))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: BenchResult, out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    data = asdict(result)
    paths["json"].write_text(json.dumps(data, indent=1))
    paths["md"].write_text(markdown(result))
    chart(result, paths["png"])
    return paths


def load_result(path: Path) -> BenchResult:
    """A BenchResult back from its JSON, re-summarised (so a report can be re-rendered without re-running)."""
    try:
        data = json.loads(Path(path).read_text())
        data["records"] = [RunRecord(**r) for r in data["records"]]
        data["load_before"], data["load_after"] = tuple(data["load_before"]), tuple(data["load_after"])
        result = BenchResult(**data)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise EdgespecError(f"cannot read the bench result {path} ({type(err).__name__}: {err}); give the .json "
                            "file an `edgespec bench` run wrote") from None
    result.summary = summarise(result.records, greedy=result.settings.get("greedy", False))
    return result


def rerender(path: str | Path, profile_path: str | Path | None = None) -> tuple[BenchResult, dict[str, Path]]:
    """`edgespec bench --report`: an earlier run's JSON re-rendered, with nothing run, as its JSON, markdown
    and PNG beside it (the same stem). With `profile_path` the report's predictions come from that profile's
    latencies (for the drafters the run used, on the run's threads); without, from the ones the JSON kept."""
    from .profiling import read_profile

    result = load_result(Path(path))
    if profile_path:
        drafters = {config_parts(c)[0] for c in result.summary["configs"] if "@" in c}
        threads = result.settings.get("threads") or {}
        result.latencies = profile_latencies(read_profile(profile_path), sorted(drafters),
                                             (threads.get("target"), threads.get("draft")))
    return result, write_outputs(result, Path(path).parent, Path(path).stem)


def command_line() -> str:
    return "edgespec " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def machine_description() -> dict:
    from .hardware import describe

    d = describe().to_dict()
    d["platform"] = platform.platform()
    return d

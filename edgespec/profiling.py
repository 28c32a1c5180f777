"""`edgespec profile`: measure this machine and pair, choose K, and read/write profiles (TOML files).

A measured profile goes to the user's data dir (`user_profiles_dir`); the profiles shipped with edgespec are
package data (`PROFILES_DIR`, `edgespec/data/profiles/`). Lookups read the user's first, then the shipped ones.

It measures, with warm-up and medians: the target's time to verify n tokens (n = 1..K_max+1) at a few context
lengths, each drafter's time to propose n tokens, and each drafter's per-position acceptance on a calibration
subset of the bench prompts at temperature 0 and 0.7. Latencies belong to the device and the models' sizes;
acceptance to the pair and the task: they are stored apart, and K comes from both through `edgespec.costmodel`.
A profile names the machine it was measured on; `find_profile` only returns one whose machine matches.

Where a pair has a draft model and the machine more than one core, it also measures the target and the draft
with the cores split as `--overlap` runs them (`[overlap]`), predicts the overlapped speed-up over plain decoding
on every core, and chooses overlap for a temperature band only where that beats drafting one after the other.

It does not run generation for users; `policy_from_profile` turns a profile into the adaptive K policy.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import EdgespecError

SCHEMA = 1
PROFILES_DIR = Path(__file__).resolve().parent / "data" / "profiles"  # shipped: package data, found in a wheel too
BANDS = {"greedy": 0.0, "sampling": 0.7}  # temperature bands: the measured temperature of each
# Every bench category: acceptance varies several-fold between them (n-gram drafting on rewrites vs on
# open questions), and a subset of four over-estimated n-gram acceptance by 3x in the first profile.
CALIBRATION_CATEGORIES = ("multi_turn", "translation", "summarization", "qa", "math", "rag", "code", "rewrite")


# The CPU features that decide which kernels run, in rising order. Virtual machines often report only a family
# name ("AMD EPYC"): two machines with that name measured here, one with AVX-512 VNNI/BF16 and one with AVX2
# only, ran the Qwen 1.5B INT4 target 5x apart, and verifying 3 tokens cost 1.2x one token on the first but
# 2x on the second, so a profile from one chose K badly on the other.
KEY_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16",
             "asimddp", "i8mm", "bf16", "sve")


def isa_tag(hw: dict) -> str:
    """The KEY_FLAGS this CPU has, joined by '+' ("isa-unknown" where /proc/cpuinfo says nothing)."""
    flags = hw.get("cpu_flags") or {}
    return "+".join(f for f in KEY_FLAGS if flags.get(f)) or "isa-unknown"


def machine_key(hw: dict) -> str:
    """What must be equal for a profile to apply: CPU model, usable cores, GPU names, CPU features."""
    gpus = "+".join(d["name"] for d in hw.get("cuda_devices", [])) or "cpu"
    return f"{hw.get('cpu_model', '?')}|{hw.get('cores_usable') or hw.get('cores_logical')}c|{gpus}|{isa_tag(hw)}"


def band_for(temperature: float) -> str:
    return "greedy" if temperature == 0 else "sampling"


# ------------------------------------------------------------------------------------------ measuring

def _median_ms(fn, repeats: int) -> tuple[float, float]:
    """Median and spread (max - min of the middle half) in ms of `fn()` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    q = len(times) // 4
    mid = times[q: len(times) - q] or times
    return statistics.median(times), mid[-1] - mid[0]


def measure_verify(target, context_ids: list[int], ns: range, repeats: int) -> tuple[list[float], list[float]]:
    """ms for the target to process n new tokens on a cache holding `context_ids` (then rolled back)."""
    target.prefill(context_ids)
    base = len(context_ids)
    med, spread = [0.0], [0.0]
    for n in ns:
        block = context_ids[-n:] if n <= len(context_ids) else (context_ids * n)[:n]

        def step():
            target.verify(block)
            target.rollback(base)
            target.synchronize()  # a GPU's time, not its launches'

        m, s = _median_ms(step, repeats)
        med.append(round(m, 3))
        spread.append(round(s, 3))
    return med, spread


def _draft_in_full(drafter) -> None:
    """Timing k drafted tokens: a model drafter an engine told its end-of-answer ids would stop at one and time
    fewer (each engine request sets them again)."""
    drafter.stop_ids = frozenset()


def measure_propose(drafter, context_ids: list[int], k_max: int, repeats: int) -> list[float]:
    """ms for the drafter to propose k tokens (k = 0..k_max) from a context, greedily."""
    import torch

    from .sampling import SamplingParams

    _draft_in_full(drafter)
    params, gen = SamplingParams(), torch.Generator().manual_seed(0)
    out = [0.0]
    for k in range(1, k_max + 1):
        def step():
            drafter.begin(context_ids)
            drafter.propose(k, params, gen)

        drafter.begin(context_ids)  # the first begin pays the prefill; measure proposals on a warm cache
        t_begin, _ = _median_ms(lambda: drafter.begin(context_ids), max(3, repeats // 2))
        m, _ = _median_ms(step, repeats)
        out.append(round(max(m - t_begin, 0.0), 3))
    return out


def measure_catch_up(drafter, context_ids: list[int], repeats: int) -> float:
    """ms per prompt token for the drafter to take in a prompt it has not seen: a model drafter's lazy
    prefill, paid at its first proposal of each request (an n-gram lookup pays nothing)."""
    import torch

    from .sampling import SamplingParams

    params, gen = SamplingParams(), torch.Generator().manual_seed(0)

    def warm():
        drafter.begin(context_ids)
        drafter.propose(1, params, gen)

    def cold():
        drafter.reset()
        warm()

    w, _ = _median_ms(warm, repeats)
    c, _ = _median_ms(cold, max(3, repeats // 3))
    return round(max(c - w, 0.0) / max(len(context_ids) - 1, 1), 5)


@contextmanager
def running_beside(work):
    """Run `work()` over and over on another thread while the body runs: a model's latency with the other model
    busy beside it, as overlapped drafting runs them. Measured one at a time, the split latencies left out the
    contention for memory bandwidth, caches and the interpreter, and predicted the SmolLM2 pair's overlapped
    speed-up 16-19% above what it measured at T = 0.7 (docs/bench/amx/overlap-default)."""
    import threading

    stop = threading.Event()
    failed: list[BaseException] = []

    def loop():
        try:
            while not stop.is_set():
                work()
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
            failed.append(err)

    thread = threading.Thread(target=loop, name="edgespec-profile-beside", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    if failed:
        raise failed[0]


def drafting(drafter, context_ids: list[int], k: int = 3):
    """One overlapped drafter's round of work, for `running_beside`: K + 1 tokens ahead of a warm context."""
    import torch

    from .sampling import SamplingParams

    _draft_in_full(drafter)
    params, gen = SamplingParams(), torch.Generator().manual_seed(0)

    def work():
        drafter.begin(context_ids)
        drafter.propose(k + 1, params, gen)

    return work


def verifying(target, context_ids: list[int], n: int = 4):
    """One overlapped target's round of work, for `running_beside`: verify n tokens after `context_ids`."""
    target.prefill(context_ids)
    base, block = len(context_ids), context_ids[-n:]

    def work():
        target.verify(block)
        target.rollback(base)
        target.synchronize()

    return work


def measure_prefill(target, prompt_ids: list[int], repeats: int, drafter=None) -> float:
    """ms for the target to take in a prompt from an empty cache (all but its last token, as a request does).
    With `drafter`: the draft model takes in the same prompt on its own thread meanwhile and the time runs until
    both are done, as an overlapped request starts."""
    import threading

    def step():
        target.reset()
        if drafter is None:
            target.prefill(prompt_ids[:-1])
            target.synchronize()
            return
        drafter.reset()
        drafter.begin(prompt_ids)
        thread = threading.Thread(target=drafter.prefill)
        thread.start()
        target.prefill(prompt_ids[:-1])
        target.synchronize()
        thread.join()

    m, _ = _median_ms(step, max(3, repeats // 2))
    return round(m, 3)


def measure_acceptance(engine, prompts: list[list[int]], k_max: int, temperature: float,
                       max_new: int, p_min: float = 0.0) -> tuple[list[float], list[float]]:
    """With K = k_max on the calibration prompts, per draft position: survival (P(the first i+1 drafts were
    proposed and accepted)) and reach (P(the proposal had more than i tokens)), both over the rounds that
    asked for position i. A model drafter reaches but at an end of answer, or (`p_min` > 0) after a token it
    was unsure of; an n-gram lookup proposes only where it matches."""
    from .policy import FixedK
    from .sampling import SamplingParams

    asked, drafted, accepted = [0] * k_max, [0] * k_max, [0] * k_max
    for i, ids in enumerate(prompts):
        engine.reset()
        params = SamplingParams(temperature=temperature, seed=1234 + i)
        m = engine.run(ids, params=params, max_new_tokens=max_new, policy=FixedK(k_max, p_min=p_min)).metrics
        for counts, per in ((asked, m.asked_per_position), (drafted, m.drafted_per_position),
                            (accepted, m.accepted_per_position)):
            for j, c in enumerate(per[:k_max]):
                counts[j] += c
    survival = [round(a / n, 4) if n else 0.0 for a, n in zip(accepted, asked)]
    reach = [round(d / n, 4) if n else 0.0 for d, n in zip(drafted, asked)]
    return survival, reach


# ---------------------------------------------------------------------------------------- the profile

@dataclass
class Profile:
    data: dict
    path: Path | None = None

    @property
    def pair(self) -> str:
        return self.data["pair"]["name"]

    def latencies(self, drafter: str, *, overlap: bool = False):
        """Latencies at the middle measured context length (the cost model's inputs), in seconds. `overlap`:
        those measured with the cores split between the draft and the target (`[overlap]`), where measured."""
        from .costmodel import Latencies

        split = self.overlap_latencies(drafter) if overlap else None
        if split is not None:
            return split
        ctx = self._mid_context()
        verify = [t / 1000 for t in self.data["latency"]["verify"][ctx]]
        draft = [t / 1000 for t in self.data["drafters"][drafter]["propose"][ctx]]
        return Latencies(draft, verify)

    def overlap_latencies(self, drafter: str):
        """Latencies in seconds with the target on `overlap.threads` and the draft on `overlap.draft_threads`
        (the split `--overlap` runs with); None where the profile did not measure them for this drafter."""
        from .costmodel import Latencies

        ov = self.data.get("overlap") or {}
        verify = [t / 1000 for t in ov.get("verify", [])]
        if drafter in ov.get("drafters", {}):
            return Latencies([t / 1000 for t in ov["drafters"][drafter]["propose"]], verify)
        if drafter == "ngram" and verify and drafter in self.data["drafters"]:
            # A lookup in Python uses no ONNX Runtime threads: its proposals cost the same on any split.
            return Latencies(self.latencies(drafter).draft, verify)
        return None

    def split(self) -> tuple[int | None, int] | None:
        """(target threads, draft threads) the `[overlap]` latencies were measured with (target None: on the GPU)."""
        ov = self.data.get("overlap")
        return (ov.get("threads"), ov["draft_threads"]) if ov else None

    def survival(self, drafter: str, band: str) -> list[float]:
        return list(self.data["drafters"][drafter]["acceptance"][band])

    def reach(self, drafter: str, band: str) -> list[float] | None:
        """P(a proposal reaches position i); None for profiles written before it was measured (= always)."""
        reach = self.data["drafters"][drafter].get("reach")
        return list(reach[band]) if reach else None

    def p_min(self, drafter: str, band: str) -> float:
        """The p_min the profile chose for this drafter and band (0: drafts are never stopped early)."""
        return float((self.data["drafters"][drafter].get("p_min") or {}).get(band, 0.0))

    def catch_up_ms(self, drafter: str) -> float:
        """ms per prompt token the drafter spends taking in a new prompt (0 where not measured)."""
        per_ctx = self.data["drafters"][drafter].get("catch_up_ms_per_token") or {}
        return float(per_ctx[max(per_ctx, key=int)]) if per_ctx else 0.0

    def choice(self, band: str) -> dict:
        return self.data["choice"][band]

    def _mid_context(self) -> str:
        ctxs = sorted(self.data["latency"]["verify"], key=int)
        return ctxs[len(ctxs) // 2]


# The answer length the drafter choice assumes (the bench's default): a model drafter's prefill of the prompt
# is paid once per request, so it must be repaid by the rounds of one answer.
REQUEST_TOKENS = 128


def request_speedup(speedup: float, catch_up_s: float, t_plain: float, tokens: int = REQUEST_TOKENS) -> float:
    """Speed-up over a whole answer of `tokens` when each round runs `speedup` times faster than plain decoding
    (`t_plain` seconds a token) but the drafter first spends `catch_up_s` taking in the prompt."""
    if speedup <= 0 or t_plain <= 0:
        return speedup
    return tokens * t_plain / (tokens * t_plain / speedup + catch_up_s)


def predict(data: dict, k_max: int) -> None:
    """Fill `predicted` (speed-up per K) per drafter and band and `choice` per band, from the measurements.

    K comes from the per-round speed-up; the drafter from the speed-up over a whole typical request, which
    also pays the drafter's prefill of the prompt. On an AVX2-only EPYC the SmolLM2 pair's INT8 drafter (the
    target model itself, quantised) was predicted 1.19x per round against n-gram's 1.16x, and measured 0.97x
    against 1.23x over all 56 bench prompts: its prefill of each prompt costs about what the target's does."""
    from .costmodel import speedups

    prof = Profile(data)
    settings = data.get("settings", {})
    prompt_tokens = settings.get("typical_prompt_tokens", 0)
    answer_tokens = settings.get("request_tokens", REQUEST_TOKENS)
    data["choice"] = {}
    for band in BANDS:
        best = {"drafter": "none", "k": 0, "speedup": 1.0, "request_speedup": 1.0}
        best_score = 1.0
        for name, d in data["drafters"].items():
            _choose_p_min(d, band, prof, name, prompt_tokens, answer_tokens)
            surv, reach = prof.survival(name, band), prof.reach(name, band)
            lat = prof.latencies(name).expected(reach)
            d.setdefault("predicted", {})[band] = [round(x, 4) for x in speedups(surv, lat)]
            k, s, whole = _best_over_answer(prof, name, surv, reach, prompt_tokens, answer_tokens)
            # A model drafter must beat the others (and plain decoding) by MODEL_DRAFTER_MARGIN; a free one (an
            # n-gram lookup: microseconds for K tokens, under 1% of one target step) need not.
            free = max(lat.draft[1:], default=0.0) < 0.01 * lat.verify[1]
            score = whole if free else whole / (1.0 + MODEL_DRAFTER_MARGIN)
            if k > 0 and score > best_score:
                best = {"drafter": name, "k": k, "speedup": round(s, 4), "request_speedup": round(whole, 4)}
                best_score = score
        data["choice"][band] = _with_overlap(data, prof, band, best)


# A model drafter is chosen only where its predicted whole-answer speed-up beats the best other choice by this
# much. On this project's AMX machine the profile predicted model drafters 5-7% above what the bench measured
# over the prompt set (SmolLM2 INT8 1.39x predicted against 1.30x, all 56 prompts at T = 0.7; Qwen's INT4 with
# p_min 0.75 1.14x against 1.07x at its best fixed K, 16 prompts at T = 0, where n-gram drafting measured 1.12x
# and had been predicted 1.11x): an n-gram lookup's prediction holds (no prefill to pay, nothing that turns
# K on and off), a model drafter's carries its prefill and its on/off rounds (docs/bench/amx/p-min).
MODEL_DRAFTER_MARGIN = 0.05


# The p_min values `edgespec profile` measures acceptance at for a model drafter, besides 0 (llama.cpp's default
# --draft-p-min). Whether stopping a draft after an unsure token pays depends on the pair: on this project's
# AMX machine it cost SmolLM2's INT8 drafter (a quantised copy of its target, which agrees with it even where
# both are unsure) 1.36x -> 1.29x-1.16x at 0.5-0.9, and made Qwen's 0.5B INT4 drafter win (K=6: 0.85x -> 1.10x
# at 0.75; docs/bench/amx/p-min). So the profile measures both and keeps the faster, per drafter and band.
P_MIN_CANDIDATES = (0.75,)


def _best_over_answer(prof: Profile, name: str, surv: list[float], reach: list[float] | None, prompt_tokens: int,
                      answer_tokens: int) -> tuple[int, float, float]:
    """The drafter's best K from its acceptance and reach, that K's speed-up a round, and over a whole typical
    answer (which also pays the drafter's prefill of the prompt)."""
    from .costmodel import best_k

    lat = prof.latencies(name).expected(reach)
    k, s = best_k(surv, lat, margin=0.02)
    return k, s, request_speedup(s, prompt_tokens * prof.catch_up_ms(name) / 1000, lat.verify[1], answer_tokens)


def _choose_p_min(d: dict, band: str, prof: Profile, name: str, prompt_tokens: int, answer_tokens: int) -> None:
    """Where the drafter's acceptance was measured at several p_min (`by_p_min`), set its `acceptance`, `reach`
    and `p_min` for `band` to the variant predicted fastest over a whole typical answer."""
    variants = d.get("by_p_min")
    if not variants:
        return
    top = None
    for key, v in variants.items():
        if band not in v.get("acceptance", {}):
            continue
        surv, reach = list(v["acceptance"][band]), list(v["reach"][band])
        k, _, whole = _best_over_answer(prof, name, surv, reach, prompt_tokens, answer_tokens)
        whole = whole if k else 1.0
        # p_min 0 first: another value must predict strictly faster to be chosen
        if top is None or whole > top[0]:
            top = (whole, float(key), surv, reach)
    if top is None:
        return
    d.setdefault("acceptance", {})[band] = top[2]
    d.setdefault("reach", {})[band] = top[3]
    d.setdefault("p_min", {})[band] = top[1]


# Overlap must beat the best sequential choice by this much to be chosen. Fed with latencies measured one model
# at a time, the cost model predicted the overlapped speed-up 3-9% above what the Qwen pair measured with both
# running at once on this project's 2-core machines (docs/bench/amx/overlap/steady), and 16-19% above for the
# SmolLM2 pair (docs/bench/amx/overlap-default); the split latencies are now measured with the other model
# working beside (`running_beside`), and the margin stays as a guard against the noise of a 2-core machine.
OVERLAP_MARGIN = 0.05


def overlap_speedups(prof: Profile, drafter: str, band: str) -> list[float] | None:
    """Predicted speed-up by K of overlapped drafting with the cores split as `[overlap]` measured, over plain
    decoding with the target on every core (what runs without overlap): the cost model's overlapped speed-up
    over plain decoding on the split, rescaled by how much slower the target's share runs, so K = 0 is plain
    decoding on that share alone (below 1 on a CPU). None where the split was not measured for this drafter."""
    from .costmodel import speedups

    split = prof.overlap_latencies(drafter)
    if split is None:
        return None
    lat = split.expected(prof.reach(drafter, band))
    slower = prof.latencies(drafter).verify[1] / lat.verify[1]
    return [s * slower for s in speedups(prof.survival(drafter, band), lat, overlap=True)]


def overlap_prefill_s(prof: Profile, drafter: str) -> float:
    """Seconds an overlapped request's start costs more than a sequential one's: the target's prefill of a
    typical prompt on its share of the cores, with the draft model taking in the prompt beside it, over the
    target's prefill on every core (0 where the profile did not measure them)."""
    full = prof.data["latency"].get("prefill_ms")
    split = ((prof.data.get("overlap") or {}).get("drafters", {}).get(drafter) or {}).get("prefill_ms")
    if full is None or split is None:
        return 0.0
    return max(split - full, 0.0) / 1000


def _with_overlap(data: dict, prof: Profile, band: str, best: dict) -> dict:
    """The band's choice, switched to overlapped drafting where `[overlap]` predicts it beats the sequential
    choice over a whole typical request by OVERLAP_MARGIN. The drafter takes in the prompt beside the target's
    prefill there, so no catch-up is charged; what the target's prefill on fewer cores costs more is."""
    ov = data.get("overlap")
    if not ov:
        return best
    answer_tokens = data.get("settings", {}).get("request_tokens", REQUEST_TOKENS)
    top = None
    for name in ov.get("drafters", {}):
        table = overlap_speedups(prof, name, band)
        ov.setdefault("predicted", {}).setdefault(name, {})[band] = [round(x, 4) for x in table]
        k = max(range(1, len(table)), key=lambda i: table[i], default=0)
        if not k:
            continue
        whole = request_speedup(table[k], overlap_prefill_s(prof, name), prof.latencies(name).verify[1], answer_tokens)
        if top is None or whole > top[3]:
            top = (name, k, table[k], whole)
    if top is None:
        return best
    best = dict(best, overlap_speedup=round(top[2], 4), overlap_request_speedup=round(top[3], 4))
    if top[3] > 1.0 + OVERLAP_MARGIN and top[3] > best["request_speedup"] * (1.0 + OVERLAP_MARGIN):
        split = {"threads": ov["threads"]} if "threads" in ov else {}
        best = {"drafter": top[0], "k": top[1], "speedup": round(top[2], 4), "request_speedup": round(top[3], 4),
                "overlap": True, **split, "draft_threads": ov["draft_threads"],
                "sequential_speedup": best["request_speedup"]}
    return best


def write_profile(data: dict, path: Path) -> Path:
    import tomli_w

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(tomli_w.dumps(data))
    os.replace(tmp, path)
    return path


def read_profile(path: Path) -> Profile:
    """A profile file, checked field by field (`check_profile`); a one-line EdgespecError naming the file and
    the field when it is unreadable or malformed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0][:120]
        raise EdgespecError(f"profile {path} cannot be read ({reason}); run `edgespec profile` again") from err
    try:
        check_profile(data)
    except BadField as err:
        raise EdgespecError(f"profile {path} is malformed: {err}; run `edgespec profile` again") from None
    return Profile(data, Path(path))


class BadField(Exception):
    """A profile field that is missing or out of range: its dotted name, and what is wrong with it."""


def check_profile(data) -> None:
    """Raise BadField for the first field of a profile that the runtime would misread: the schema, the tables it
    looks up (machine, pair, latency, drafters, choice, and overlap where present), every temperature band
    (`BANDS`) in acceptance, reach and choice, latencies that are finite and not negative (a target's time for
    one token above 0) with enough entries for K = 1, acceptance and reach in [0, 1], and a choice of a
    drafter the profile measured with K in range. A NaN latency used to load and yield K = 4."""
    from .policy import MAX_K

    if not isinstance(data, dict):
        raise BadField("the file is not a table")
    if data.get("schema") != SCHEMA:
        raise BadField(f"schema is {data.get('schema')!r}, but this edgespec reads schema {SCHEMA}")
    machine, pair = _table(data, "machine"), _table(data, "pair")
    for key in ("key", "cpu_model", "gpu"):
        _text(machine, key, "machine")
    for key in ("name", "target_backend", "target"):
        _text(pair, key, "pair")
    verify = _table(_table(data, "latency"), "verify", "latency")
    if not verify:
        raise BadField("latency.verify has no context lengths")
    for ctx, row in verify.items():
        _context(ctx, "latency.verify")
        _latencies(row, f"latency.verify.{ctx}", "latency", 3, positive_from=1)
    _optional_number(data["latency"], "prefill_ms", "latency", "latency")
    drafters = _table(data, "drafters")
    for name, d in drafters.items():
        where = f"drafters.{name}"
        if not isinstance(d, dict):
            raise BadField(f"{where} must be a table")
        propose = _table(d, "propose", where)
        for ctx in verify:
            if ctx not in propose:
                raise BadField(f"{where}.propose.{ctx} is missing (latency.verify has that context length)")
        for ctx, row in propose.items():
            _context(ctx, f"{where}.propose")
            _latencies(row, f"{where}.propose.{ctx}", "latency", 2)
        for what in ("acceptance", "reach"):
            if what == "reach" and "reach" not in d:
                continue  # profiles written before reach was measured: always reaches
            bands = _table(d, what, where)
            for band in BANDS:
                _probabilities(bands, band, f"{where}.{what}", what)
        for band, value in (_table(d, "p_min", where) if "p_min" in d else {}).items():
            _number(value, f"{where}.p_min.{band}", "p_min", high=1.0)
        for ctx, value in (_table(d, "catch_up_ms_per_token", where) if "catch_up_ms_per_token" in d else {}).items():
            _context(ctx, f"{where}.catch_up_ms_per_token")
            _number(value, f"{where}.catch_up_ms_per_token.{ctx}", "latency")
        if "predicted" in d:
            predicted = _table(d, "predicted", where)
            for band in BANDS:
                _latencies(predicted.get(band), f"{where}.predicted.{band}", "speed-up", 1)
    choice = _table(data, "choice")
    for band in BANDS:
        c = _table(choice, band, "choice")
        where = f"choice.{band}"
        name = _text(c, "drafter", where)
        if name != "none" and name not in drafters:
            raise BadField(f"{where}.drafter is {name!r}, which the profile did not measure")
        k = c.get("k")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K:
            raise BadField(f"{where}.k is {k!r}; it must be an integer from 0 to {MAX_K}")
        _number(c.get("speedup"), f"{where}.speedup", "speed-up")
        for key in ("request_speedup", "overlap_speedup", "overlap_request_speedup", "sequential_speedup"):
            _optional_number(c, key, where, "speed-up")
        if "overlap" in c and not isinstance(c["overlap"], bool):
            raise BadField(f"{where}.overlap is {c['overlap']!r}; it must be true or false")
        if c.get("overlap") and "request_speedup" not in c:
            raise BadField(f"{where}.request_speedup is missing (the choice is overlapped)")
        for key in ("threads", "draft_threads"):
            _optional_threads(c, key, where)
    if "overlap" in data:
        ov = _table(data, "overlap")
        _optional_threads(ov, "threads", "overlap")
        if "draft_threads" not in ov:
            raise BadField("overlap.draft_threads is missing")
        _optional_threads(ov, "draft_threads", "overlap")
        _latencies(ov.get("verify"), "overlap.verify", "overlap latency", 3, positive_from=1)
        for name, d in (_table(ov, "drafters", "overlap") if "drafters" in ov else {}).items():
            if not isinstance(d, dict):
                raise BadField(f"overlap.drafters.{name} must be a table")
            _latencies(d.get("propose"), f"overlap.drafters.{name}.propose", "overlap latency", 2)
            _optional_number(d, "prefill_ms", f"overlap.drafters.{name}", "overlap latency")


def _table(parent: dict, key: str, where: str = "") -> dict:
    name = f"{where}.{key}" if where else key
    if key not in parent:
        raise BadField(f"[{name}] is missing")
    if not isinstance(parent[key], dict):
        raise BadField(f"{name} must be a table, not {type(parent[key]).__name__}")
    return parent[key]


def _text(parent: dict, key: str, where: str) -> str:
    value = parent.get(key)
    if not isinstance(value, str) or not value:
        raise BadField(f"{where}.{key} is {'missing' if value is None else repr(value)}; it must be a non-empty string")
    return value


def _context(ctx, where: str) -> None:
    if not (isinstance(ctx, str) and ctx.isdigit()):
        raise BadField(f"{where} has the key {ctx!r}; context lengths must be whole numbers of tokens")


def _number(value, where: str, what: str, *, high: float | None = None, positive: bool = False) -> float:
    """A finite number from 0 (above 0 with `positive`) up to `high`."""
    bound = f"from 0 to {high:g}" if high is not None else ("above 0" if positive else "0 or more")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        got = "missing" if value is None else f"{value!r} ({type(value).__name__})"
        raise BadField(f"{where} is {got}; a {what} must be a finite number {bound}")
    if value != value or value in (float("inf"), float("-inf")) or value < 0 or (positive and value == 0) \
            or (high is not None and value > high):
        raise BadField(f"{where} is {value!r}; a {what} must be a finite number {bound}")
    return value


def _optional_number(parent: dict, key: str, where: str, what: str) -> None:
    if key in parent:
        _number(parent[key], f"{where}.{key}", what)


def _latencies(row, where: str, what: str, min_len: int, *, positive_from: int | None = None) -> None:
    """A list of at least `min_len` finite numbers, 0 or more (above 0 from index `positive_from` on)."""
    if not isinstance(row, list):
        got = "missing" if row is None else f"a {type(row).__name__}"
        raise BadField(f"{where} is {got}; it must be a list of numbers")
    if len(row) < min_len:
        raise BadField(f"{where} has {len(row)} entries; it needs at least {min_len}")
    for i, t in enumerate(row):
        _number(t, f"{where}[{i}]", what, positive=positive_from is not None and i == positive_from)


def _probabilities(bands: dict, band: str, where: str, what: str) -> None:
    row = bands.get(band)
    if row is None:
        raise BadField(f"{where}.{band} is missing (every temperature band must be measured: {', '.join(BANDS)})")
    if not isinstance(row, list) or not row:
        raise BadField(f"{where}.{band} must be a non-empty list of probabilities")
    for i, a in enumerate(row):
        _number(a, f"{where}.{band}[{i}]", what, high=1.0)


def _optional_threads(parent: dict, key: str, where: str) -> None:
    value = parent.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise BadField(f"{where}.{key} is {value!r}; a thread count must be a whole number, 1 or more")


def user_profiles_dir() -> Path:
    """Where `edgespec profile` writes: the user's data dir (`EDGESPEC_DATA` moves it), never the package."""
    from .paths import data_dir

    return data_dir() / "profiles"


def profile_dirs() -> list[Path]:
    """Where profiles are looked up, in order: the user's own measurements first, then the shipped ones."""
    return [user_profiles_dir(), PROFILES_DIR]


def list_profiles() -> list[tuple[Path, Profile | None, str | None]]:
    out = []
    for d in profile_dirs():
        for p in sorted(d.glob("*.toml")) if d.is_dir() else []:
            try:
                out.append((p, read_profile(p), None))
            except EdgespecError as err:
                out.append((p, None, str(err)))
    return out


def find_profile(pair: str, target_backend: str, hw: dict, *, target_detail: str | None = None,
                 warn=None) -> Profile | None:
    """The profile measured on this machine for this pair and target backend, if one exists. `target_detail`
    (e.g. "torch cpu bfloat16") must also end the profile's target description when given: a torch target's
    latencies depend on its dtype (bf16 runs ~2.6x faster than float32 on an avx512_bf16 CPU), so a float32
    profile would mislead K for a bf16 target."""
    key = machine_key(hw)
    for path, prof, err in list_profiles():
        if prof is None:
            if warn:
                warn(f"ignoring {err}")
            continue
        if prof.pair != pair or prof.data["pair"]["target_backend"] != target_backend:
            continue
        their = prof.data["machine"]["key"]
        if their != key:
            if warn and their.count("|") == 2 and key.startswith(their + "|"):
                warn(f"ignoring {path}: it was measured on {prof.data['machine']['cpu_model']} but does not "
                     f"record which CPU features that one had (this one: {isa_tag(hw)}), and they decide the "
                     f"latencies; run `edgespec profile` to measure this machine")
            continue
        if target_detail and not prof.data["pair"].get("target", "").endswith(target_detail):
            continue
        return prof
    return None


def policy_from_profile(profile: Profile | None, drafter: str, temperature: float, *, k_max: int = 8,
                        overlap: bool = False, p_min: float | None = None):
    """The adaptive K policy, seeded with the profile's latencies and acceptance when there is a profile for
    this drafter; otherwise it calibrates during the first rounds. `p_min`: None = the profile's choice for
    this drafter and band (DEFAULT_P_MIN without one)."""
    from .policy import DEFAULT_P_MIN, AdaptiveK

    if profile is None or drafter not in profile.data["drafters"]:
        return AdaptiveK(k_max=k_max, overlap=overlap, p_min=DEFAULT_P_MIN if p_min is None else p_min)
    if p_min is None:
        p_min = profile.p_min(drafter, band_for(temperature))
    surv = profile.survival(drafter, band_for(temperature))
    cond, prev = [], 1.0
    for s in surv:
        cond.append(min(max(s / prev, 0.0), 1.0) if prev > 0 else 0.0)
        prev = s
    lat = profile.latencies(drafter, overlap=overlap)
    # A measured profile is worth a few rounds of evidence (prior_weight), which age away like real rounds.
    return AdaptiveK(latencies=lat, prior_acceptance=cond or 0.6, k_max=min(k_max, lat.k_max), prior_weight=16.0,
                     overlap=overlap, prior_reach=profile.reach(drafter, band_for(temperature)), p_min=p_min)


# ------------------------------------------------------------------------------------------- output

def table(data: dict) -> str:
    prof = Profile(data)
    lines = []
    for band in BANDS:
        c = data["choice"][band]
        whole = f", {c['request_speedup']:.2f}x over a whole answer" if "request_speedup" in c else ""
        p_min = prof.p_min(c["drafter"], band) if c["drafter"] in data["drafters"] else 0.0
        lines.append(f"{band} (T={BANDS[band]}): choose {c['drafter']} K={c['k']}"
                     + (f" p_min {p_min:g}" if p_min else "") + " "
                     f"(predicted {c['speedup']:.2f}x a round{whole})")
        for name, d in data["drafters"].items():
            pred = d["predicted"][band]
            acc = " ".join(f"{a:.2f}" for a in d["acceptance"][band])
            p_min = prof.p_min(name, band)
            lines.append(f"  {name:6} survival {acc}" + (f"   (drafts stop below p_min {p_min:g})" if p_min else ""))
            for key, v in (d.get("by_p_min") or {}).items():
                if float(key) != p_min and band in v.get("acceptance", {}):
                    lines.append(f"  {name:6} at p_min {key}: survival " + " ".join(f"{a:.2f}" for a in v["acceptance"][band])
                                 + "  reach " + " ".join(f"{r:.2f}" for r in v["reach"][band]) + "  (predicted slower)")
            if d.get("reach") and any(r < 1 for r in d["reach"][band]):
                lines.append(f"  {name:6} reach    " + " ".join(f"{r:.2f}" for r in d["reach"][band]))
            lines.append(f"  {name:6} speed-up by K: " + " ".join(f"{k}:{s:.2f}" for k, s in enumerate(pred)))
    ov = data.get("overlap")
    if ov:
        where = f"target {ov['threads']} thread(s)" if "threads" in ov else "target on the GPU"
        lines.append(f"overlapped ({where}, draft {ov['draft_threads']} thread(s); speed-up over plain decoding "
                     f"on every core):")
        for name, bands in ov.get("predicted", {}).items():
            for band, pred in bands.items():
                lines.append(f"  {name:6} {band:8} by K: " + " ".join(f"{k}:{x:.2f}" for k, x in enumerate(pred)))
        for band in BANDS:
            c = data["choice"][band]
            verdict = ("on" if c.get("overlap") else "off") + f" for {band}"
            if "overlap_speedup" in c or c.get("overlap"):
                seq = c.get("sequential_speedup", c["request_speedup"])
                whole = c.get("overlap_request_speedup", c["request_speedup"] if c.get("overlap") else None)
                lines.append(f"  overlap {verdict}: best overlapped {c.get('overlap_speedup', c['speedup']):.2f}x a round"
                             + (f", {whole:.2f}x a whole answer" if whole is not None else "")
                             + f", against {seq:.2f}x one after the other")
        lines.append("  split verify ms (n=1..): " + " ".join(f"{t:.1f}" for t in ov["verify"][1:]))
        for name, d in ov.get("drafters", {}).items():
            lines.append(f"  split {name} propose ms (k=1..): " + " ".join(f"{t:.1f}" for t in d["propose"][1:]))
            if "prefill_ms" in d and "prefill_ms" in data["latency"]:
                lines.append(f"  prefill of a {data['latency'].get('prefill_tokens', '?')}-token prompt: "
                             f"{d['prefill_ms']:.1f} ms split with {name} beside, {data['latency']['prefill_ms']:.1f} ms "
                             "on every core")
    ctx = prof._mid_context()
    lines.append(f"target verify ms (n=1..) at context {ctx}: " + " ".join(f"{t:.1f}" for t in data["latency"]["verify"][ctx][1:]))
    for name, d in data["drafters"].items():
        lines.append(f"{name} propose ms (k=1..) at context {ctx}: " + " ".join(f"{t:.1f}" for t in d["propose"][ctx][1:]))
    settings = data.get("settings", {})
    if "typical_prompt_tokens" in settings:
        lines.append(f"drafters' prefill of a {settings['typical_prompt_tokens']}-token prompt, paid once per answer "
                     f"(the drafter is chosen over a {settings.get('request_tokens', REQUEST_TOKENS)}-token answer): "
                     + ", ".join(f"{name} {prof.catch_up_ms(name) * settings['typical_prompt_tokens']:.0f} ms"
                                 for name in data["drafters"]))
    return "\n".join(lines)


def terminal_plot(values: list[float], width: int = 40) -> str:
    top = max(values + [1.0])
    return "\n".join(f"K={k:<2} {'#' * int(width * v / top):<{width}} {v:.2f}x" for k, v in enumerate(values))


def chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, d in data["drafters"].items():
        for band, style in (("greedy", "-o"), ("sampling", "--s")):
            ax.plot(range(len(d["predicted"][band])), d["predicted"][band], style, label=f"{name} {band}")
    ov = data.get("overlap") or {}
    for name, bands in ov.get("predicted", {}).items():
        for band, style in (("greedy", ":o"), ("sampling", ":s")):
            if band in bands:
                ax.plot(range(len(bands[band])), bands[band], style, label=f"{name} {band} overlapped")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("predicted speed-up over plain decoding")
    ax.set_title(f"{data['pair']['name']} on {data['machine']['cpu_model']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def slug(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def default_path(data: dict) -> Path:
    m = data["machine"]
    gpu = m["gpu"] if m["gpu"] != "none" else f"{m['cores_logical']}c"
    backend = data["pair"]["target_backend"]
    if backend == "torch":  # one profile per dtype: their latencies differ several-fold
        backend += "-" + data["pair"]["target"].rsplit(" ", 1)[-1]
    fields = m.get("key", "").split("|")
    isa = fields[3].split("+")[-1] if len(fields) > 3 else ""  # the CPU's most advanced KEY_FLAGS feature
    parts = [slug(m["cpu_model"]), slug(gpu), slug(isa), data["pair"]["name"], slug(backend)]
    return user_profiles_dir() / ("-".join(p for p in parts if p) + ".toml")


def progress_bar(total: int, *, enabled: bool = True):
    from tqdm import tqdm

    return tqdm(total=total, desc="profile", unit="step", file=sys.stderr, disable=not enabled)


# ---------------------------------------------------------------------------------------------- the procedure


def profile_listing(hw: dict) -> str:
    """`edgespec profile --show`: each profile found (`list_profiles`), whether it applies to the machine `hw`
    (`edgespec.hardware.describe().to_dict()`) and what it chose, then this machine's key."""
    here = machine_key(hw)
    found = list_profiles()
    lines = [] if found else ["no profiles yet; run `edgespec profile --pair PAIR`"]
    for path, prof, err in found:
        if prof is None:
            lines.append(f"{path}: {err}")
            continue
        d = prof.data
        mark = "applies here" if d["machine"]["key"] == here else "other machine"
        choice = ", ".join(f"{b}: {c['drafter']} K={c['k']} ({c['speedup']:.2f}x{', overlapped' * bool(c.get('overlap'))})"
                           for b, c in d["choice"].items())
        lines.append(f"{path}  [{mark}]  pair {d['pair']['name']}, target {d['pair']['target']} on "
                     f"{d['machine']['cpu_model']} / {d['machine']['gpu']}; {choice}")
    lines.append(f"this machine: {here}")
    lines.append(f"`edgespec profile` writes to {user_profiles_dir()}; those are read before the shipped ones in "
                 f"{PROFILES_DIR}")
    return "\n".join(lines)


def run_profile(spec, *, k_max: int = 8, quick: bool = False, p_min_candidates: Sequence[float] | None = None,
                out: str | Path | None = None, hw: dict | None = None, command: str | None = None,
                progress: bool = True, notice: Callable[[str], None] | None = None) -> tuple[dict, Path]:
    """The whole `edgespec profile` for the models of `spec` (`edgespec.runtime.RuntimeSpec`): the target's verify
    latencies at a few context lengths, each drafter's (the pair's model drafters and n-gram) propose and catch-up
    latencies and acceptance per temperature band (a model drafter also at each of `p_min_candidates`, default
    P_MIN_CANDIDATES), and, unless `spec.overlap` is False, the same models with the cores split as --overlap
    runs them; then the predictions and choices (`predict`). Writes the profile to `out` (default `default_path`)
    and its chart beside it; returns the profile's data and path.

    `quick`: fewer repeats, one context length, three calibration prompts. `hw`: this machine as
    `edgespec.hardware.describe().to_dict()` (default: described now). `command`: the command line recorded
    (default: this process's arguments). `progress`: the loading lines and progress bar on stderr. `notice`: where
    a one-line remark goes (default stderr)."""
    import dataclasses
    import gc

    from .bench import load_prompts
    from .engine import SpeculativeEngine
    from .policy import check_k
    from .runtime import DRAFTERS, build_runtime, extra_drafter, overlap_threads
    from .session import ChatSession

    if hw is None:
        from .hardware import describe

        hw = describe().to_dict()
    if notice is None:
        def notice(msg: str) -> None:
            print(msg, file=sys.stderr)
    k_max = check_k(k_max)
    # p_min_candidates: the values to measure a model drafter's acceptance at besides 0 (the profile keeps the fastest)
    p_min_candidates = list(p_min_candidates) if p_min_candidates else list(P_MIN_CANDIDATES)
    if spec.exact:
        raise EdgespecError("edgespec profile measures the target's plain one-row steps, which --k auto compares "
                            "against also under --exact; drop --exact")
    measure_split = spec.overlap is not False
    # the pair's model drafters are measured; n-gram needs no model and is always measured.
    # Sequential latencies with every core; --overlap/--no-overlap: whether to measure the split.
    spec = dataclasses.replace(spec, draft=None if spec.draft == "ngram" else spec.draft, overlap=False)
    rt = build_runtime(spec, progress=None if progress else (lambda _msg: None))
    session = ChatSession(rt.engine, rt.tokenizer)
    prompts = load_prompts(list(CALIBRATION_CATEGORIES), quick=True)  # one prompt per category
    if quick:
        prompts = prompts[:3]
    calib = [session.encode(p["messages"]) for p in prompts]
    filler = [t for ids in calib for t in ids]
    contexts = [256] if quick else [128, 512]
    contexts = [c for c in contexts if c + k_max + 2 < rt.engine.target.max_context]
    repeats = 5 if quick else 9
    max_new = 32 if quick else 64
    names = [rt.drafter_name] if rt.drafter_name not in ("ngram", "none") else []
    if rt.pair:
        from .models import load_manifest

        names += [d for d in load_manifest(rt.pair).default_drafters if d not in names and d != "ngram"]
    drafters = {n: d for n in [*names, "ngram"] if (d := extra_drafter(rt, n)) is not None}
    model_drafters = [n for n, d in drafters.items() if d.can_draft_ahead]  # those that can overlap
    split = None
    if measure_split and model_drafters:
        from .runtime import planned_target_device

        split = overlap_threads(planned_target_device(spec))  # the split --overlap runs with
        if split is None:
            notice("one usable core: overlapped drafting is not measured (there is nothing to split)")
    # a model drafter also at each p_min candidate (an n-gram lookup has no confidence to stop on)
    p_mins = {n: [0.0, *(p for p in p_min_candidates if p > 0)] if d.uses_p_min else [0.0]
              for n, d in drafters.items()}
    bar = progress_bar(len(contexts) * (1 + len(drafters)) + sum(map(len, p_mins.values())) * len(BANDS)
                       + (1 + len(model_drafters) if split else 0), enabled=progress)
    target = rt.engine.target
    verify, spread = {}, {}
    propose = {name: {} for name in drafters}
    catch_up = {name: {} for name in drafters}
    for ctx in contexts:
        ids = (filler * (ctx // max(len(filler), 1) + 1))[:ctx]
        verify[str(ctx)], spread[str(ctx)] = measure_verify(target, ids, range(1, k_max + 2), repeats)
        bar.update(1)
        for name, drafter in drafters.items():
            propose[name][str(ctx)] = measure_propose(drafter, ids, k_max, repeats)
            if ctx == contexts[-1]:  # the prefill is priced from the longest context only (Profile.catch_up_ms)
                catch_up[name][str(ctx)] = measure_catch_up(drafter, ids, repeats)
            bar.update(1)
    # The target's prefill of a typical prompt on every core: what an overlapped request, with the target on
    # fewer cores, pays more before its first token.
    typical = round(sum(map(len, calib)) / len(calib))
    prompt_ids = (filler * (typical // max(len(filler), 1) + 1))[:max(typical, 2)]
    prefill_ms = measure_prefill(target, prompt_ids, repeats) if split else None
    acceptance = {name: {} for name in drafters}
    reach = {name: {} for name in drafters}
    by_p_min = {name: {} for name in drafters}
    for name, drafter in drafters.items():
        engine = SpeculativeEngine(target, drafter, eos_token_ids=rt.engine.eos_token_ids)
        for p_min in p_mins[name]:
            variant = by_p_min[name].setdefault(f"{p_min:g}", {"acceptance": {}, "reach": {}})
            for band, temperature in BANDS.items():
                variant["acceptance"][band], variant["reach"][band] = measure_acceptance(
                    engine, calib, k_max, temperature, max_new, p_min=p_min)
                bar.update(1)
        acceptance[name], reach[name] = dict(by_p_min[name]["0"]["acceptance"]), dict(by_p_min[name]["0"]["reach"])
    descriptions = {name: d.description for name, d in drafters.items()}
    pair = {"name": rt.pair or Path(spec.target or "custom").name, "target": rt.target_description,
            "target_backend": rt.target_backend, "draft": rt.draft_description or "none"}
    overlap = None
    if split:
        # The same models again with the cores split as --overlap runs them, at the middle context length (the
        # one the cost model reads). The first runtime goes first, so a small board never holds both.
        mid = sorted(contexts)[len(contexts) // 2]
        ids = (filler * (mid // max(len(filler), 1) + 1))[:mid]
        del rt, session, target, drafters, drafter, engine
        gc.collect()
        draft = spec.draft if spec.draft not in (None, *DRAFTERS) else model_drafters[0]  # a path stays
        split_spec = dataclasses.replace(spec, threads=split[0], draft_threads=split[1], overlap=True, draft=draft)
        rt = build_runtime(split_spec, progress=lambda _msg: None)
        # Each model is timed while the other works beside it, as overlapped rounds run them.
        with running_beside(drafting(rt.engine.drafter, ids)):
            split_verify, split_spread = measure_verify(rt.engine.target, ids, range(1, k_max + 2), repeats)
        bar.update(1)
        overlap = {"threads": split[0], "draft_threads": split[1], "context": mid, "verify": split_verify,
                   "verify_spread": split_spread, "concurrent": True, "drafters": {}}
        if split[0] is None:
            del overlap["threads"]  # the target on the GPU: torch's own threads
        for name in model_drafters:
            drafter = extra_drafter(rt, name)
            with running_beside(verifying(rt.engine.target, ids)):
                propose_split = measure_propose(drafter, ids, k_max, repeats)
            overlap["drafters"][name] = {
                "propose": propose_split,
                "prefill_ms": measure_prefill(rt.engine.target, prompt_ids, repeats, drafter=drafter)}
            bar.update(1)
    bar.close()
    gpus = [d["name"] for d in hw.get("cuda_devices", [])]
    data = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "edgespec " + " ".join(sys.argv[1:]) if command is None else command,
        "machine": {"key": machine_key(hw), "cpu_model": hw.get("cpu_model"),
                    "cpu_flags": [f for f, on in (hw.get("cpu_flags") or {}).items() if on],
                    "cores_logical": hw.get("cores_logical"), "cores_usable": hw.get("cores_usable"),
                    "memory_gib": round((hw.get("memory_total") or 0) / 2**30, 1), "gpu": ", ".join(gpus) or "none",
                    "torch": hw.get("torch"), "onnxruntime": hw.get("onnxruntime"), "transformers": hw.get("transformers"),
                    "load_average": list(os.getloadavg())},
        "pair": pair,
        "settings": {"k_max": k_max, "repeats": repeats, "calibration_prompts": [p["id"] for p in prompts],
                     "max_new_tokens": max_new, "bands": BANDS,
                     "typical_prompt_tokens": typical,
                     "request_tokens": REQUEST_TOKENS},
        "latency": {"unit": "ms", "contexts": contexts, "verify": verify, "verify_spread": spread,
                    **({"prefill_ms": prefill_ms, "prefill_tokens": len(prompt_ids)} if prefill_ms is not None else {})},
        "drafters": {name: {"description": descriptions[name], "propose": propose[name],
                            "catch_up_ms_per_token": catch_up[name],
                            "acceptance": acceptance[name], "reach": reach[name],
                            **({"by_p_min": by_p_min[name]} if len(by_p_min[name]) > 1 else {})}
                      for name in descriptions},
    }
    if overlap:
        data["overlap"] = overlap
    predict(data, k_max)
    path = Path(out) if out else default_path(data)
    write_profile(data, path)
    chart(data, path.with_suffix(".png"))
    return data, path


def terminal_report(data: dict) -> str:
    """What `edgespec profile` prints when done: the table, then per temperature band the predicted speed-up by K
    with the drafter it chose (the first measured where it chose none)."""
    parts = [table(data)]
    for band in BANDS:
        c = data["choice"][band]
        name = c["drafter"] if c["drafter"] != "none" else next(iter(data["drafters"]))
        parts.append(f"\n{band}: predicted speed-up by K with {name}\n" + terminal_plot(data["drafters"][name]["predicted"][band]))
    return "\n".join(parts)

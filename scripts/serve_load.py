"""The `edgespec serve` measurements of issue 27: overhead against `edgespec generate`, time to first token,
16 clients at once, memory over many requests.

    python scripts/serve_load.py --out docs/serve-load [--k 3] [--max-tokens 128] [--clients 16] [--rounds 4]
                                 [--requests 1000] [--repeats 3] -- [edgespec model options: --pair ..., --target ...]

Everything after `--` goes to both `edgespec generate` and `edgespec serve` (the same models, backends and
threads). It starts `edgespec serve` on a free loopback port and measures, with the real `openai` client:

1. overhead: one streaming client's decode tokens/s (tokens after the first over the time from the first to the
   last, as the client sees them) against `edgespec generate --json`'s decode tokens/s on the same raw prompt,
   greedy, same K and budget; the median of --repeats runs each (goal: >= 0.95x). The engine's own rate inside
   the server (`timings.predicted_per_second`) is reported beside it;
2. time to first token for a 100-token prompt (token ids from the server's /tokenize, a different window of a
   long text each time, so no request reuses the last one's prefix), streaming, the median of --repeats;
3. load: --clients streaming clients at once, --rounds times: p50/p99 time to first token (from sending) and the
   total throughput (completion tokens over the rounds' wall time);
4. memory: the server's RSS after a warm-up and after --requests short chat requests (4 clients at a time,
   varied prompts from the bench set), sampled every 10% (goal: flat within 5%);
5. intervals (only when asked: `--parts intervals --intervals 0,50`): one server per `--stream-interval`, all
   started at once (an idle server takes no CPU), and generate and each server in turn --repeats times, with the
   CPU seconds the server process and this client spent per token.

Writes serve_load.json and serve_load.md to --out. A measurement: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
# A raw completion prompt that runs to the budget: an instruction without the chat template ends at once on the
# embedded default's llama.cpp target (its first token is EOS), which left nothing to time.
PROMPT = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper named"
LONG_TEXT = (ROOT / "README.md").read_text(encoding="utf-8")


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    model_opts = []
    if "--" in argv:
        i = argv.index("--")
        argv, model_opts = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for serve_load.json and serve_load.md")
    p.add_argument("--k", default="3", help="K for both (a fixed K keeps the two comparable; auto adapts online)")
    p.add_argument("--max-tokens", type=int, default=128, help="budget of the overhead and load requests")
    p.add_argument("--repeats", type=int, default=3, help="runs of the overhead and TTFT measurements (median)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="rounds of --clients requests at once")
    p.add_argument("--requests", type=int, default=1000, help="requests of the memory measurement")
    p.add_argument("--memory-max-tokens", type=int, default=32)
    p.add_argument("--ttft-prompt-tokens", type=int, default=100)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--stream-interval", type=int, default=None,
                   help="edgespec serve's --stream-interval (ms between streamed events; default: serve's own)")
    p.add_argument("--parts", default="overhead,ttft,load,memory",
                   help="which measurements to run, comma-separated (default: overhead,ttft,load,memory; also "
                        "intervals)")
    p.add_argument("--intervals", default="0,50", help="the --stream-interval values (ms) the intervals part compares")
    args = p.parse_args(argv)
    args.model_opts = model_opts
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`edgespec serve` as a subprocess, with its RSS."""

    def __init__(self, args):
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # one log per server: the intervals part runs several at once
        self.log = Path(args.out) / ("serve.log" if args.stream_interval is None else f"serve-{args.stream_interval}ms.log")
        cmd = [sys.executable, "-m", "edgespec", "serve", *args.model_opts, "--k", args.k, "--port", str(self.port),
               "--max-queue", str(max(args.clients, 4)), "--log-level", "warning"]
        if args.stream_interval is not None:
            cmd += ["--stream-interval", str(args.stream_interval)]
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=ROOT)
        self.command = " ".join(cmd[1:])
        end = time.monotonic() + args.startup_timeout
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"edgespec serve exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    self.model = json.loads(r.read())["model"]
                    break
            except OSError:
                if time.monotonic() > end:
                    self.stop()
                    sys.exit(f"edgespec serve did not answer in {args.startup_timeout:.0f} s; see {self.log}")
                time.sleep(0.2)

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600)

    def post(self, path: str, body: dict) -> dict:
        import urllib.request

        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def stream_once(client, model: str, prompt, max_tokens: int, k: str) -> dict:
    """One streaming completion: client-side times, and the server's timings and usage."""
    sent = time.perf_counter()
    first = last = None
    tokens, text, final = 0, [], {}
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body=_ext(k))
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            last = now
            text.append(chunk.choices[0].text)
        extra = chunk.model_extra or {}
        if "timings" in extra:
            final = {"timings": extra["timings"], "edgespec": extra["edgespec"]}
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            final["cached_tokens"] = chunk.usage.prompt_tokens_details.cached_tokens
    decode = (tokens - 1) / (last - first) if first and last and last > first and tokens > 1 else None
    return {"ttft_s": (first - sent) if first else None, "tokens": tokens, "decode_tokens_per_s": decode,
            "wall_s": (last or time.perf_counter()) - sent, "text": "".join(text), **final}


def _ext(k: str) -> dict:
    return {"edgespec": {"k": k if k == "auto" else int(k)}}


def generate_once(args) -> dict:
    cmd = [sys.executable, "-m", "edgespec", "generate", *args.model_opts, "--k", args.k, "--prompt", PROMPT,
           "--max-new-tokens", str(args.max_tokens), "--temperature", "0", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    result = json.loads(out)
    return {"tokens": len(result["token_ids"]), "decode_tokens_per_s": result["metrics"]["decode_tokens_per_s"],
            "text": result["text"]}


def overhead(args, served: Served) -> dict:
    client = served.client()
    stream_once(client, served.model, PROMPT, 16, args.k)  # warm-up
    server_runs, gen_runs = [], []
    for _ in range(args.repeats):  # interleaved, so a drift in the machine's speed falls on both sides alike
        server_runs.append(stream_once(client, served.model, PROMPT, args.max_tokens, args.k))
        gen_runs.append(generate_once(args))
    if any(r["decode_tokens_per_s"] is None for r in [*server_runs, *gen_runs]):
        sys.exit(f"serve_load: the overhead prompt gave fewer than 2 tokens ({[r['tokens'] for r in server_runs]}); "
                 "nothing to time with these models")
    server_tps = statistics.median(r["decode_tokens_per_s"] for r in server_runs)
    engine_tps = statistics.median(r["timings"]["predicted_per_second"] for r in server_runs)
    gen_tps = statistics.median(r["decode_tokens_per_s"] for r in gen_runs)
    return {"server_client_decode_tokens_per_s": server_tps, "server_engine_decode_tokens_per_s": engine_tps,
            "generate_decode_tokens_per_s": gen_tps, "ratio": server_tps / gen_tps,
            "same_text": all(r["text"] == gen_runs[0]["text"] for r in [*server_runs, *gen_runs]),
            "tokens": server_runs[0]["tokens"], "server_runs": _strip(server_runs), "generate_runs": _strip(gen_runs)}


def intervals(args, _served: Served) -> dict:
    """generate, then a streaming client of each server (one per --intervals value), in turn, --repeats times."""
    servers = {}
    try:
        for ms in (int(v) for v in args.intervals.split(",")):
            servers[ms] = Served(argparse.Namespace(**{**vars(args), "stream_interval": ms}))
        clients = {ms: sv.client() for ms, sv in servers.items()}
        for ms, sv in servers.items():
            stream_once(clients[ms], sv.model, PROMPT, 16, args.k)  # warm-up
        me = psutil.Process()
        runs: dict = {"generate": [], **{f"serve {ms} ms": [] for ms in servers}}
        for _ in range(args.repeats):
            runs["generate"].append(generate_once(args))
            for ms, sv in servers.items():
                proc = psutil.Process(sv.proc.pid)
                server0, mine0 = _cpu_s(proc), _cpu_s(me)
                r = stream_once(clients[ms], sv.model, PROMPT, args.max_tokens, args.k)
                r["server_cpu_ms_per_token"] = (_cpu_s(proc) - server0) * 1000 / r["tokens"]
                r["client_cpu_ms_per_token"] = (_cpu_s(me) - mine0) * 1000 / r["tokens"]
                runs[f"serve {ms} ms"].append(r)
    finally:
        for sv in servers.values():
            sv.stop()
    gen = [r["decode_tokens_per_s"] for r in runs["generate"]]
    out = {"intervals_ms": list(servers), "repeats": args.repeats, "generate_median": statistics.median(gen)}
    for name, rs in runs.items():
        if name == "generate":
            continue
        tps = [r["decode_tokens_per_s"] for r in rs]
        out[name] = {"decode_tokens_per_s_median": statistics.median(tps),
                     "ratio_of_medians": statistics.median(tps) / statistics.median(gen),
                     "median_paired_ratio": statistics.median(a / b for a, b in zip(tps, gen)),
                     "server_cpu_ms_per_token_median": statistics.median(r["server_cpu_ms_per_token"] for r in rs),
                     "client_cpu_ms_per_token_median": statistics.median(r["client_cpu_ms_per_token"] for r in rs),
                     "same_text_as_generate": all(r["text"] == runs["generate"][0]["text"] for r in rs)}
    out["runs"] = {name: [round(r["decode_tokens_per_s"], 2) for r in rs] for name, rs in runs.items()}
    return out


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def ttft(args, served: Served) -> dict:
    ids = served.post("/tokenize", {"prompt": LONG_TEXT})["tokens"]
    n = args.ttft_prompt_tokens
    if len(ids) < n + 10 * args.repeats:
        sys.exit(f"the text for the TTFT prompt has {len(ids)} tokens; need {n + 10 * args.repeats}")
    client = served.client()
    runs = []
    for i in range(args.repeats + 1):  # the first is a warm-up
        prompt = ids[(i + 1) * 10: (i + 1) * 10 + n]  # another window each time: nothing to reuse
        runs.append(stream_once(client, served.model, prompt, 8, args.k))
    runs = runs[1:]
    return {"prompt_tokens": n, "ttft_s_median": statistics.median(r["ttft_s"] for r in runs),
            "cached_tokens": [r.get("cached_tokens") for r in runs], "runs": _strip(runs)}


def load(args, served: Served) -> dict:
    client = served.client()
    prompts = [f"{PROMPT} Call the keeper {name}." for name in _names(args.clients * args.rounds)]
    ttfts, tokens, walls = [], 0, 0.0
    with ThreadPoolExecutor(args.clients) as pool:
        for r in range(args.rounds):
            batch = prompts[r * args.clients:(r + 1) * args.clients]
            start = time.perf_counter()
            results = list(pool.map(lambda p: stream_once(client, served.model, p, args.max_tokens, args.k), batch))
            walls += time.perf_counter() - start
            ttfts += [x["ttft_s"] for x in results if x["ttft_s"] is not None]
            tokens += sum(x["tokens"] for x in results)
    ttfts.sort()
    return {"clients": args.clients, "rounds": args.rounds, "requests": len(prompts), "completion_tokens": tokens,
            "wall_s": walls, "throughput_tokens_per_s": tokens / walls, "ttft_s_p50": _pct(ttfts, 50),
            "ttft_s_p99": _pct(ttfts, 99), "ttft_s_max": ttfts[-1]}


def memory(args, served: Served) -> dict:
    client = served.client()
    messages = _bench_messages()
    samples = []

    def one(i):
        m = messages[i % len(messages)]
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": m}],
                                       max_tokens=args.memory_max_tokens, temperature=0, extra_body=_ext(args.k))

    warmup = min(50, max(args.requests // 10, 1))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(warmup)))
        before = served.rss_mb()
        samples.append({"requests": 0, "rss_mb": before})
        step = max(args.requests // 10, 1)
        done = 0
        while done < args.requests:
            n = min(step, args.requests - done)
            list(pool.map(one, range(warmup + done, warmup + done + n)))
            done += n
            samples.append({"requests": done, "rss_mb": served.rss_mb()})
    after = samples[-1]["rss_mb"]
    return {"requests": args.requests, "warmup_requests": warmup, "rss_mb_before": before, "rss_mb_after": after,
            "growth_pct": (after - before) / before * 100, "samples": samples}


def _bench_messages() -> list[str]:
    out = []
    for line in (ROOT / "edgespec" / "data" / "bench_prompts.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            msgs = item.get("messages") or [{"role": "user", "content": item.get("prompt", "")}]
            user = [m["content"] for m in msgs if m.get("role") == "user"]
            if user and user[-1]:
                out.append(user[-1])
    return out or [PROMPT]


def _names(n: int) -> list[str]:
    base = ["Ada", "Bo", "Cyd", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kit", "Lu", "Max", "Ned", "Oz", "Pia"]
    return [f"{base[i % len(base)]} {i}" for i in range(n)]


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    i = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[i]


def _strip(runs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "text"} for r in runs]


def markdown(result: dict) -> str:
    head = ["# edgespec serve: load measurements", "",
            f"`{result['command']}` (K {result['k']}, greedy), {result['machine']}.", "",
            "| measurement | value | goal |", "|---|---|---|"]
    if not all(p in result for p in ("overhead", "ttft", "load", "memory")):  # --parts: the raw numbers only
        return "\n".join(head[:4] + ["```json", json.dumps({k: v for k, v in result.items() if k in (
            "overhead", "ttft", "load", "memory", "intervals")}, indent=2)[:4000], "```", ""])
    o, t, lo, m = result["overhead"], result["ttft"], result["load"], result["memory"]
    return "\n".join([
        *head,
        f"| one streaming client, decode tok/s (client-side) | {o['server_client_decode_tokens_per_s']:.1f} | |",
        f"| the same inside the server (engine) | {o['server_engine_decode_tokens_per_s']:.1f} | |",
        f"| `edgespec generate`, decode tok/s | {o['generate_decode_tokens_per_s']:.1f} | |",
        f"| server / generate | {o['ratio']:.3f}x | >= 0.95x |",
        f"| same text both ways | {o['same_text']} | True |",
        f"| time to first token, {t['prompt_tokens']}-token prompt | {t['ttft_s_median'] * 1000:.0f} ms | |",
        f"| {lo['clients']} clients x {lo['rounds']} rounds: TTFT p50 / p99 | "
        f"{lo['ttft_s_p50'] * 1000:.0f} / {lo['ttft_s_p99'] * 1000:.0f} ms | |",
        f"| {lo['clients']} clients: total throughput | {lo['throughput_tokens_per_s']:.1f} tok/s | |",
        f"| RSS after warm-up -> after {m['requests']} requests | {m['rss_mb_before']:.0f} -> {m['rss_mb_after']:.0f} MB "
        f"({m['growth_pct']:+.1f}%) | within 5% |",
        "",
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the intervals part starts its own servers
    served = Served(args) if set(args.parts.split(",")) - {"intervals"} else None
    try:
        result = {"command": served.command if served else "serve (one per --intervals value)", "k": args.k, "max_tokens": args.max_tokens,
                  "machine": f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB"}
        parts = {"overhead": overhead, "ttft": ttft, "load": load, "memory": memory, "intervals": intervals}
        unknown = set(args.parts.split(",")) - set(parts)
        if unknown:
            sys.exit(f"serve_load: unknown --parts {', '.join(sorted(unknown))}: use {', '.join(parts)}")
        for name, fn in ((n, f) for n, f in parts.items() if n in args.parts.split(",")):
            print(f"serve_load: {name} ...", file=sys.stderr, flush=True)
            result[name] = fn(args, served)
    finally:
        if served:
            served.stop()
    (out / "serve_load.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "serve_load.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / 'serve_load.json'} and {out / 'serve_load.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `edgespec` command line: generate (and, as they land, prepare, devices, bench, profile, chat).

Every user-fixable problem is an `EdgespecError`, printed as one line `edgespec: error: ...` with exit
status 2; nothing here prints a traceback for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import EdgespecError


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed and a fixed --k give the same answer (with --k auto the K of "
                        "each round follows measured timings, so a seed gives another sample of the same distribution)")
    p.add_argument("--max-new-tokens", type=int, default=256)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Which models, where: shared by generate, chat, bench and profile."""
    p.add_argument("--pair", default=None, help="a known model pair (`edgespec models` lists them; default: smollm2-135m, the embedded one) or a pair manifest .toml")
    p.add_argument("--target", default=None, help="target instead of a pair: a Hugging Face hub id (org/name, or "
                   "org/name/file.gguf), a checkpoint dir, a .gguf file or an ONNX dir")
    p.add_argument("--draft", default=None,
                   help="int4 / int8 (draft model under ONNX Runtime), torch, llamacpp (the draft GGUF on llama.cpp), ngram (prompt lookup), none, or a draft model: a hub id, checkpoint dir or .gguf file")
    p.add_argument("--draft-backend", default="int4", choices=["int4", "int8", "torch", "llamacpp"], help="how a draft given as a path runs (llamacpp: a GGUF on llama.cpp)")
    p.add_argument("--target-backend", default="auto", help="auto (torch on CUDA; on the CPU a GGUF runs on llama.cpp when the llamacpp extra is installed, anything else on ONNX Runtime), torch, onnx, or llamacpp")
    p.add_argument("--target-device", "--device", dest="target_device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--draft-device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="torch target dtype: auto (bf16 on CUDA GPUs of compute capability 8.0+, fp16 on older ones, fp32 on CPU), float32, bfloat16, float16")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads per model (default: all cores)")
    p.add_argument("--draft-threads", type=int, default=None, help="ONNX Runtime threads for the draft (default: --threads)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="draft the next round on its own thread while the target verifies, the cores split between "
                        "them (`edgespec devices`; --threads/--draft-threads set others). Default: on where this "
                        "machine's profile measured it to win, with --k auto")
    p.add_argument("--p-min", default=None, metavar="P",
                   help="stop a model draft after a token the draft model gave less than probability P (llama.cpp's "
                        "--draft-p-min; output unchanged, only fewer drafts). Default: 0 (off) for a fixed K, "
                        "edgespec.policy.DEFAULT_P_MIN for --k auto. bench takes a comma list: a run per value for each K")
    p.add_argument("--profile", default=None, help="use this profile file for --k auto instead of the one matching this machine")
    p.add_argument("--exact", action="store_true",
                   help="run the target's short steps through the same kernels as verification (padded rows; torch: "
                        "a fixed-length cache), so greedy output is bitwise the same at every K (plain decoding slower)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch target: run its steps under torch.compile (a static cache of "
                        "edgespec.compiled_lm.COMPILE_CONTEXT tokens, each step padded to one of a few widths, each "
                        "compiled once at start: minutes on a CPU; CUDA graphs on CUDA). Default: off "
                        "(edgespec.compiled_lm.COMPILE_ON_CUDA_DEFAULT turns it on for CUDA)")


def parse_k(text) -> int | str:
    from .policy import check_k

    if text == "auto":
        return "auto"
    try:
        return check_k(int(text))
    except ValueError:
        raise EdgespecError(f"K={text!r} is not a number; use auto or an integer from 0 to 16") from None


MAX_SEED = 2**63 - 2  # the engine seeds two torch generators, seed and seed + 1 (signed 64-bit)
POSITIVE = ("max_new_tokens", "threads", "draft_threads", "repeats", "per_category")


def check_args(args: argparse.Namespace) -> None:
    """Ranges argparse's types leave open, checked before anything loads: a one-line error instead of a
    traceback from deep inside a run (or a value quietly replaced by its default, as `--repeats 0` was)."""
    import math

    if args.command != "chat":  # the chat checks these itself, as its settings dialog does (tui.settings)
        t = getattr(args, "temperature", None)
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise EdgespecError(f"--temperature {t:g} is out of range; use 0 (greedy) or a positive number like 0.7")
        top_p = getattr(args, "top_p", None)
        if top_p is not None and not 0 < top_p <= 1:
            raise EdgespecError(f"--top-p {top_p:g} is outside (0, 1]; use 1 to turn it off")
        top_k = getattr(args, "top_k", None)
        if top_k is not None and top_k < 0:
            raise EdgespecError(f"--top-k {top_k} is negative; use 0 to turn it off or a positive count")
    for name in POSITIVE:
        if args.command == "chat" and name == "max_new_tokens":
            continue
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise EdgespecError(f"--{name.replace('_', '-')} {value} must be at least 1")
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise EdgespecError(f"--seed {seed} is out of range; use a whole number from 0 to {MAX_SEED}")


def runtime_spec(args: argparse.Namespace):
    from .runtime import RuntimeSpec

    return RuntimeSpec.from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec", description="Lossless speculative decoding on the machine you have.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    add_model_options(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--k", default="auto", help="tokens drafted per round: auto (default: from the profile, adapted online) or 0..16")
    _add_sampling(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system prompt (with --chat)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-spec", action="store_true", help="run the target alone through the same loop")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="measure speed-ups on the bench prompt set against target-only and transformers")
    add_model_options(b)
    b.add_argument("--drafters", default=None, help="comma list of int4, int8, torch, ngram (default: the pair's drafters)")
    b.add_argument("--k", default="0,2,4,6,8,auto", help="comma list of K values and/or auto")
    b.add_argument("--categories", default=None, help="comma list of categories (default: all)")
    b.add_argument("--quick", action="store_true", help="one prompt per category, 48 tokens, K 3 and auto (about 2 min)")
    b.add_argument("--per-category", type=int, default=None, metavar="N",
                   help="the first N prompts of each category (default: all 7; a fixed-K sweep on a slow machine)")
    b.add_argument("--repeats", type=int, default=None, help="repeats per prompt (median taken; default 3, quick 1)")
    b.add_argument("--anchor-k", type=int, default=4, help="fixed K for transformers' assisted generation anchor")
    b.add_argument("--no-anchors", action="store_true", help="skip the anchors: transformers' assisted generation / prompt lookup (torch targets), plain llama.cpp of the same GGUF")
    b.add_argument("--out", default="bench-results", help="directory for the JSON, markdown and PNG")
    b.add_argument("--report", default=None, metavar="RESULT.json",
                   help="run nothing: re-render the markdown and PNG of an earlier run's JSON (with --profile: "
                        "its predictions from that profile's latencies)")
    _add_sampling(b)
    b.set_defaults(func=cmd_bench, max_new_tokens=None)

    pf = sub.add_parser("profile", help="measure draft/verify latencies and acceptance here; choose K; write a profile to your data dir")
    add_model_options(pf)
    pf.add_argument("--out", default=None, help="profile path (default: <your data dir>/profiles/<machine>-<pair>-<backend>.toml; `--show` prints the dir)")
    pf.add_argument("--quick", action="store_true", help="fewer repeats, one context length, three calibration prompts (one per category otherwise)")
    pf.add_argument("--k-max", type=int, default=8)
    pf.add_argument("--show", action="store_true", help="list the profiles and which one applies here")
    pf.set_defaults(func=cmd_profile)

    pr = sub.add_parser("prepare", help="download, verify and convert a model pair once (cached)")
    pr.add_argument("pair", nargs="?", default=None, help="a known pair (default: smollm2-135m)")
    pr.add_argument("--target", default=None,
                    help="your own target instead of a pair: a Hugging Face hub id (org/name, org/name/file.gguf), a "
                         "checkpoint dir or a .gguf file")
    pr.add_argument("--draft", default=None, help="with --target: the draft model, given the same ways")
    pr.add_argument("--drafters", default=None,
                    help="comma list of model drafters to prepare (default: the pair's; int4 for --draft)")
    pr.add_argument("--target-backend", default="auto", metavar="BACKEND",
                    help="what to convert the target for: auto (the backend a start on this machine uses: llama.cpp "
                         "for a GGUF when installed, else ONNX Runtime; torch on CUDA), llamacpp, onnx, torch, or all "
                         "(a cache to copy to other machines)")
    pr.set_defaults(func=cmd_prepare)

    mo = sub.add_parser("models", help="the known pairs, what is downloaded and converted (with sizes); free the cache")
    mo.add_argument("--remove", action="append", default=[], metavar="NAME",
                    help="free a pair's downloads and conversions, or one entry by the name listed (repeatable)")
    mo.add_argument("--clean", action="store_true", help="free everything edgespec wrote in its cache")
    mo.set_defaults(func=cmd_models)

    d = sub.add_parser("devices", help="what this machine has: CPU, memory, CUDA GPUs, ONNX Runtime providers")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_devices)
    add_chat_parser(sub)
    add_serve_parser(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    """One prompt through the Python API (`edgespec.api`), as any program would call it."""
    from .api import load_spec
    from .policy import parse_p_min

    k = 0 if args.no_spec else parse_k(args.k)
    if args.no_spec:
        args.draft = "none"
    model = load_spec(runtime_spec(args), k=k, temperature=args.temperature, p_min=parse_p_min(args.p_min),
                      profile=args.profile, progress=None if not args.json else (lambda _: None))
    if args.chat:
        prompt_ids = model.encode_chat([{"role": "user", "content": args.prompt}], args.system,
                                       missing="drop --chat and pass the raw prompt")
    else:
        prompt_ids = model.encode(args.prompt)
    stream = model.stream(prompt_ids, max_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    shown = 0
    try:
        for chunk in stream:
            if chunk.notice and not args.json:
                print(f"\nedgespec: {chunk.notice}", file=sys.stderr, flush=True)
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                shown += len(chunk.text)
    except KeyboardInterrupt:
        stream.close()
    stop_reason, ids, metrics = stream.stop_reason, stream.token_ids, stream.metrics
    if args.json:
        print(json.dumps({"text": stream.text, "token_ids": ids, "stop_reason": stop_reason,
                          "prompt_tokens": len(prompt_ids), "notices": metrics.notices,
                          "metrics": metrics.to_dict()}))
    else:
        sys.stdout.write(stream.text[shown:] + "\n")
        m = metrics
        print(f"[{m.num_emitted_tokens} tokens, {m.decode_tokens_per_s:.1f} tok/s, acceptance {m.acceptance_rate:.2f}, "
              f"tau {m.tau:.2f}, stop: {stop_reason}]", file=sys.stderr)
    return 130 if stop_reason == "cancelled" else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench
    from .policy import check_k, parse_p_min
    from .sampling import SamplingParams

    if args.report:
        return rerender_bench(args.report, args.profile)
    ks = bench.parse_ks("3,auto" if args.quick and args.k == "0,2,4,6,8,auto" else args.k)
    check_k(args.anchor_k)
    p_mins = parse_p_min(args.p_min, many=True)
    categories = args.categories.split(",") if args.categories else None
    prompts = bench.load_prompts(categories, quick=args.quick, per_category=args.per_category)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    result, paths = bench.run_bench_for(
        runtime_spec(args), ks=ks, params=params, prompts=prompts, quick=args.quick, per_category=args.per_category,
        drafters=args.drafters.split(",") if args.drafters else None, repeats=args.repeats,
        max_new_tokens=args.max_new_tokens, anchor_k=args.anchor_k, anchors=not args.no_anchors, p_mins=p_mins,
        profile_path=args.profile, out_dir=args.out, command=bench.command_line())
    print(bench.markdown(result))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 1 if result.summary["mismatches"] else 0


def rerender_bench(path: str, profile_path: str | None) -> int:
    from . import bench

    result, paths = bench.rerender(path, profile_path)
    print(bench.markdown(result))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from . import profiling
    from .hardware import describe
    from .policy import check_k, parse_p_min

    hw = describe().to_dict()
    if args.show:
        print(profiling.profile_listing(hw))
        return 0
    k_max = check_k(args.k_max)
    # --p-min here: the values to measure a model drafter's acceptance at besides 0 (the profile keeps the fastest)
    p_min_candidates = parse_p_min(args.p_min, many=True)
    data, path = profiling.run_profile(runtime_spec(args), k_max=k_max, quick=args.quick,
                                       p_min_candidates=p_min_candidates, out=args.out, hw=hw,
                                       command="edgespec " + " ".join(sys.argv[1:]))
    print(profiling.terminal_report(data))
    print(f"\nwrote {path} and {path.with_suffix('.png')}", file=sys.stderr)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from .runtime import DEFAULT_PAIR, prepare_models, prepare_pair

    drafters = tuple(args.drafters.split(",")) if args.drafters else None
    if args.target is not None:
        if args.pair is not None:
            raise EdgespecError("give either a pair or --target, not both")
        prepared = prepare_models(args.target, args.draft, drafters=drafters, backend=args.target_backend)
    elif args.draft is not None:
        raise EdgespecError("--draft needs --target (a pair names its own draft)")
    else:
        prepared = prepare_pair(args.pair or DEFAULT_PAIR, drafters=drafters, backend=args.target_backend)
    for what, path in prepared.items():
        print(f"{what:24} {path}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from . import cache

    found = cache.entries()
    if not args.remove and not args.clean:
        print(cache.listing(found))
        return 0
    chosen = found if args.clean else [e for name in args.remove for e in cache.select(name, found)]
    freed, kept = 0, []
    for entry in {id(e): e for e in chosen}.values():
        if not entry.files:
            kept.append(f"{entry.path} ({entry.note})")
            continue
        size, left = cache.remove(entry)
        freed += size
        kept += [f"{p} (not written by edgespec)" for p in left]
        print(f"removed {entry.name} ({cache.human(size)})")
    if args.clean:
        for path in cache.leftovers():
            freed += cache.remove_path(path)
    for line in kept:
        print(f"left alone: {line}")
    print(f"freed {cache.human(freed)}")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from .hardware import describe, format_devices

    hw = describe()
    print(json.dumps(hw.to_dict(), indent=2) if args.json else format_devices(hw))
    return 0


def add_chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat in the terminal, with the speculation shown as it happens")
    add_model_options(c)
    c.add_argument("--k", default="auto", help="tokens drafted per round: auto (default) or 0..16 (0 = no speculation)")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--max-new-tokens", type=int, default=512)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--resume", nargs="?", const="", default=None, metavar="ID",
                   help="continue a saved chat (no ID: the latest); see --list")
    c.add_argument("--list", action="store_true", help="list saved chats (id, date, first message) and exit")
    c.add_argument("--no-color-origin", action="store_true",
                   help="start with answers rendered as Markdown instead of coloured by origin (F2 toggles)")
    c.add_argument("--server", default=None, metavar="URL",
                   help="chat with a running `edgespec serve` (http://HOST:PORT) instead of loading a model here; "
                        "the model options then belong to the server")
    c.add_argument("--api-key", default=None, help="with --server: the server's API key (default: $EDGESPEC_API_KEY)")
    c.set_defaults(func=cmd_chat)


def check_server_args(args: argparse.Namespace) -> None:
    """`edgespec chat --server URL`: no model options beside it (the server's model answers), a well-formed URL,
    and the API key from $EDGESPEC_API_KEY (as `edgespec serve` reads it) unless --api-key gives one."""
    import os

    from .remote import parse_server_url

    if args.server is None:
        if args.api_key is not None:
            raise EdgespecError("--api-key goes with --server URL (the key of a running edgespec serve)")
        return
    model_options = argparse.ArgumentParser(add_help=False)
    add_model_options(model_options)
    given = [f"--{name.replace('_', '-')}" for name, default in vars(model_options.parse_args([])).items()
             if getattr(args, name) != default]
    if given:
        raise EdgespecError(f"--server chats with the model that server runs; drop {', '.join(given)} (give model "
                            "options to `edgespec serve` instead)")
    parse_server_url(args.server)
    args.api_key = args.api_key or os.environ.get("EDGESPEC_API_KEY") or None


def chat_settings(args: argparse.Namespace) -> dict:
    """The chat's turn settings from its command line, validated as the settings dialog validates them (a bad
    value is the dialog's one-line message)."""
    from tui.settings import parse_settings

    try:
        return parse_settings({"temperature": str(args.temperature), "top_p": str(args.top_p),
                               "max_new_tokens": str(args.max_new_tokens), "k": str(args.k)})
    except ValueError as err:
        raise EdgespecError(str(err)) from None


def cmd_chat(args: argparse.Namespace) -> int:
    # tui imports edgespec, never the reverse: only the chat's functions (this one, chat_settings) know it exists.
    from tui.history import (
        CorruptChat,
        format_chat_list,
        latest_chat_id,
        list_chats,
        load_chat,
    )

    if args.list:
        print(format_chat_list(list_chats()))
        return 0
    check_server_args(args)
    settings = chat_settings(args)
    record, warning = None, None
    if args.resume is not None:
        chat_id = args.resume or latest_chat_id()
        if chat_id is None:
            warning = "there is no saved chat to resume yet; this is a new chat"
        else:
            try:
                record = load_chat(chat_id)
            except CorruptChat as err:
                warning = (f"the saved chat {chat_id} cannot be read ({err.reason}); "
                           "the file is left untouched and this is a new chat")

    from tui.app import ChatApp

    # ui_nice: the UI draws in the gaps of generation instead of preempting it (see tui.app).
    app = ChatApp(lambda progress: load_chat_model(args, progress), settings=settings, system=args.system,
                  record=record, warning=warning, colour_origin=not args.no_color_origin, ui_nice=10)
    app.run()
    return app.return_code or 0


def load_chat_model(args: argparse.Namespace, progress):
    """The `edgespec.api.Model` `edgespec chat` talks to (the chat app's factory, run on its model thread): loaded
    with `load_spec` as `edgespec generate` loads one, but always with K = auto's profile, so the chat's settings
    can switch between auto and a fixed K from one turn to the next (each turn passes its own K). With --server,
    a `RemoteModel` instead: the same surface over a running `edgespec serve`."""
    if args.server is not None:
        from .remote import RemoteModel

        progress(f"connecting to {args.server}")
        model = RemoteModel(args.server, api_key=args.api_key)
    else:
        from .api import load_spec
        from .policy import parse_p_min

        model = load_spec(runtime_spec(args), k="auto", temperature=args.temperature, p_min=parse_p_min(args.p_min),
                          profile=args.profile, progress=progress)
    if not model.has_chat_template:
        raise EdgespecError(f"{model.name}'s tokenizer has no chat template; edgespec chat needs an instruct/chat "
                            "model (or use edgespec generate with a raw prompt)")
    return model


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (chat, completions, /metrics) over one pair")
    add_model_options(s)
    s.add_argument("--k", default="auto", help="requests' default K: auto (default) or 0..16 (a request's edgespec.k overrides)")
    s.add_argument("--temperature", type=float, default=1.0,
                   help="for requests that send none (default 1, as OpenAI's API; 0 = greedy)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only; another needs --api-key or --insecure)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (default: $EDGESPEC_API_KEY)")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    s.add_argument("--max-queue", type=int, default=16, help="requests that may wait for the device; past it 429 (default 16)")
    s.add_argument("--max-body", type=int, default=4 * 2**20, help="largest request body in bytes; past it 413 (default 4 MiB)")
    s.add_argument("--stream-interval", type=float, default=None, metavar="MS",
                   help="send a stream's rounds together, at most one event per MS milliseconds after the first "
                        "text (default 50; 0: an event per round)")
    s.add_argument("--model-name", default=None, help="the model id clients send and /v1/models lists (default: the pair or target's name)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import serve_from_args

    return serve_from_args(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        return args.func(args)
    except EdgespecError as err:
        print(f"edgespec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading (generate ends its answer early itself): no traceback
        print("edgespec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

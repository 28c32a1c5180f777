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
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec", description="Lossless speculative decoding on the machine you have.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout")
    g.add_argument("--target", required=True, help="transformers checkpoint dir of the target model")
    g.add_argument("--draft", default="ngram", help="draft checkpoint dir, 'ngram' (prompt lookup, default) or 'none'")
    g.add_argument("--prompt", required=True)
    g.add_argument("--k", type=int, default=4, help="tokens drafted per round (0 = no speculation)")
    _add_sampling(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system prompt (with --chat)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-spec", action="store_true", help="run the target alone through the same loop")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--target-device", "--device", dest="device", default="cpu", help="target device: cpu, cuda or cuda:N")
    g.add_argument("--draft-device", default="cpu", help="draft model device: cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (fp16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("devices", help="what this machine has: CPU, memory, CUDA GPUs, ONNX Runtime providers")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_devices)
    return parser


def encode_prompt(tokenizer, prompt: str, *, chat: bool, system: str | None = None) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise EdgespecError("this model's tokenizer has no chat template; drop --chat and pass the raw prompt")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return list(ids)


def cmd_generate(args: argparse.Namespace) -> int:
    from .drafters import NgramDrafter, TorchDrafter
    from .engine import SpeculativeEngine
    from .loading import check_same_tokenizer, eos_token_ids, load_causal_lm, load_tokenizer
    from .metrics import SpecMetrics
    from .policy import FixedK
    from .sampling import SamplingParams
    from .target import TorchTarget
    from .text import TextStream

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    policy = FixedK(0 if args.no_spec else args.k)
    model = load_causal_lm(args.target, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(args.target)
    drafter = None
    if not args.no_spec and args.draft != "none":
        if args.draft == "ngram":
            drafter = NgramDrafter()
        else:
            check_same_tokenizer(tokenizer, load_tokenizer(args.draft))
            drafter = TorchDrafter(load_causal_lm(args.draft, device=args.draft_device, dtype=args.dtype, device_flag="--draft-device"))
    engine = SpeculativeEngine(TorchTarget(model), drafter, eos_token_ids=eos_token_ids(model, tokenizer))
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat, system=args.system)

    stream = TextStream(tokenizer, args.stop)
    metrics = SpecMetrics()
    ids: list[int] = []
    stop_reason = None
    try:
        for step in engine.generate(prompt_ids, params=params, max_new_tokens=args.max_new_tokens,
                                    policy=policy, stop=stream.stop if args.stop else None):
            ids.extend(step.tokens)
            metrics.add(step)
            stop_reason = step.stop_reason
            if not args.json:
                sys.stdout.write(stream.update(ids))
                sys.stdout.flush()
    except KeyboardInterrupt:
        stop_reason = "cancelled"
    stream.update(ids)
    if args.json:
        print(json.dumps({"text": stream.text, "token_ids": ids, "stop_reason": stop_reason,
                          "prompt_tokens": len(prompt_ids), "metrics": metrics.to_dict()}))
    else:
        sys.stdout.write(stream.flush() + "\n")
        m = metrics
        print(f"[{m.num_emitted_tokens} tokens, {m.decode_tokens_per_s:.1f} tok/s, acceptance {m.acceptance_rate:.2f}, "
              f"tau {m.tau:.2f}, stop: {stop_reason}]", file=sys.stderr)
    return 130 if stop_reason == "cancelled" else 0


def cmd_devices(args: argparse.Namespace) -> int:
    from .hardware import describe, format_devices

    hw = describe()
    print(json.dumps(hw.to_dict(), indent=2) if args.json else format_devices(hw))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgespecError as err:
        print(f"edgespec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

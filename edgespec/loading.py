"""Loading transformers models and tokenizers for the torch backend, with the checks that fail early.

Turns a user's path, device and dtype into a model in eval mode, or a one-line `EdgespecError`: a path that
does not exist, a model that is not a decoder-only causal LM, unreadable weights, CUDA asked for where there
is none, draft and target tokenizers that differ. It does not download anything (see `edgespec.models`) and
does not convert GGUF files (see `edgespec.convert`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import EdgespecError
from .hardware import check_device
from .paths import user_path

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a CUDA GPU that computes it natively (compute capability 8.0 and up: A100, H100,
    RTX 30xx/40xx, Jetson Orin), float16 on older GPUs, and float32 on the CPU (exact greedy equivalence; bf16 is
    faster on CPUs with avx512_bf16 but may flip near-tie argmaxes between batched and one-by-one passes, see
    README). bfloat16 costs what float16 does on those GPUs and has float32's range: Qwen2.5-class models have
    activation outliers that overflow float16 (`ModelTarget` stops with an error naming --dtype when logits are
    not finite)."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    if dtype not in DTYPES:
        raise EdgespecError(f"unknown dtype {dtype!r}; use one of auto, float32, bfloat16, float16")
    return DTYPES[dtype]


def checkpoint_dir(path: str | Path) -> Path:
    """A local transformers checkpoint dir, checked to exist and to hold a config."""
    p = user_path(path, "model path")
    if not p.exists():
        raise EdgespecError(
            f"model path {str(p)!r} does not exist; pass a transformers checkpoint directory, a .gguf file, or --pair NAME"
        )
    if p.is_dir() and not (p / "config.json").is_file():
        raise EdgespecError(f"{str(p)!r} has no config.json, so it is not a transformers checkpoint; pass the directory that holds config.json")
    return p


def load_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise EdgespecError(f"cannot read the model config in {str(path)!r} ({_first_line(err)}); check or re-download the model") from err


def check_decoder_only(config, path: Path) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False) or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise EdgespecError(
            f"{str(path)!r} is a {config.model_type!r} model, not a decoder-only causal LM; "
            "edgespec needs a decoder-only model such as Llama, Qwen2 or SmolLM2"
        )


def load_causal_lm(path: str | Path, *, device: str = "cpu", dtype: str = "auto", device_flag: str = "--target-device"):
    """A transformers causal LM from a checkpoint dir, on `device` in `dtype`, in eval mode."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    p = checkpoint_dir(path)
    dev = torch.device(check_device(device, flag=device_flag))
    config = load_config(p)
    check_decoder_only(config, p)
    # On a GPU the weights go straight to it (device_map), in the dtype they will run in: loading them on the CPU
    # first and moving them doubled the peak, and on a Jetson's unified memory both copies live in the same RAM.
    placement = {"device_map": {"": str(dev)}} if dev.type == "cuda" else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=pick_dtype(dtype, dev), **placement)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise EdgespecError(f"cannot load the weights in {str(p)!r} ({_first_line(err)}); the files may be incomplete or corrupt: re-download them") from err
    return model.eval() if placement else model.to(dev).eval()


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    p = checkpoint_dir(path)
    try:
        return AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError) as err:
        raise EdgespecError(f"cannot load a tokenizer from {str(p)!r} ({_first_line(err)}); the checkpoint needs its tokenizer files") from err


def check_same_tokenizer(target_tok, draft_tok) -> None:
    """Draft and target must be one tokenizer: every token string mapped to the same id (or the target verifies
    nonsense), and the same special tokens. Compared on content, not on the models' embedding sizes, which two
    sizes of one family pad differently (`engine.check_vocab_sizes`)."""
    fix = "use a draft model with the target's tokenizer (same family), or --draft ngram"
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        raise EdgespecError(f"draft and target tokenizers differ (draft {len(d_vocab)} tokens, target "
                            f"{len(t_vocab)}; {_first_difference(t_vocab, d_vocab)}); {fix}")
    t_special, d_special = _special_tokens(target_tok), _special_tokens(draft_tok)
    if t_special != d_special:
        only_t, only_d = sorted(t_special - d_special), sorted(d_special - t_special)
        raise EdgespecError(f"draft and target tokenizers differ in their special tokens (target only: "
                            f"{only_t[:3]}, draft only: {only_d[:3]}); {fix}")


def _first_difference(t_vocab: dict[str, int], d_vocab: dict[str, int]) -> str:
    for token in sorted(t_vocab.keys() | d_vocab.keys(), key=lambda t: t_vocab.get(t, d_vocab.get(t))):
        t, d = t_vocab.get(token), d_vocab.get(token)
        if t != d:
            return f"{token!r} is {'id ' + str(t) if t is not None else 'missing'} in the target, " \
                   f"{'id ' + str(d) if d is not None else 'missing'} in the draft"
    return "the same tokens"


def _special_tokens(tokenizer) -> set[tuple[str, int]]:
    """(token, id) of every special token: the named ones (bos, eos, pad, ...) and added tokens marked special."""
    named = {(t, tokenizer.convert_tokens_to_ids(t)) for t in tokenizer.all_special_tokens}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return named | {(tok.content, i) for i, tok in added.items() if getattr(tok, "special", False)}


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """Every id that ends generation: the generation config's (it may list several) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    return sorted(ids)


def quiet_transformers() -> None:
    """transformers' per-load progress bars and advisory warnings would bury our one-line messages."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__

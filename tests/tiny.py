"""Tiny random-weight models and a character tokenizer for tests: built from configs, no downloads."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CHARS = " abcdefghijklmnopqrstuvwxyz.,!?'\n0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def tiny_llama(vocab_size: int = 32, seed: int = 0, *, hidden: int = 32, layers: int = 2,
               init: float = 0.3, max_pos: int = 128, eos: int = 2) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights. A large init range makes the distributions peaked, so greedy
    decisions are far from ties and sampling tests see distributions that really differ."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
        initializer_range=init, tie_word_embeddings=False, bos_token_id=1, eos_token_id=eos, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A copy of `model` with noise added to every weight: a draft that agrees often but not always."""
    torch.manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * scale * p.std())
    return other


def save_tiny_checkpoint(path: Path, model: LlamaForCausalLM,
                         special: tuple[str, ...] = ("<|user|>", "<|assistant|>")) -> Path:
    """Save `model` with a character-level tokenizer (ids 0..4 special, then CHARS) and a chat template;
    `special`: which of the role tokens are marked special (the ids stay the same)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    assert len(vocab) <= model.config.vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=list(special),
    )
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path

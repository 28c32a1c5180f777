"""Drafters propose tokens for the target to verify. See `base.Drafter` for the protocol."""

from .base import Draft, Drafter, DrafterBase
from .model import ModelDrafter, TorchDrafter
from .ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "DrafterBase", "ModelDrafter", "NgramDrafter", "TorchDrafter"]

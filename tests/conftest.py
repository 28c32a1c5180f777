import os
import sys
import tempfile
from pathlib import Path

import pytest

# Tests never write chat history into the user's data dir. The model cache is shared on purpose (the real
# SmolLM2 download and conversions are reused across runs); point EDGESPEC_CACHE elsewhere to isolate it.
os.environ["EDGESPEC_DATA"] = tempfile.mkdtemp(prefix="edgespec-test-data-")

sys.path.insert(0, str(Path(__file__).parent))

from tiny import perturbed, save_tiny_checkpoint, tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama(vocab_size=32, seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """A target checkpoint dir, a close draft, a foreign draft with a different vocabulary, on disk."""
    root = tmp_path_factory.mktemp("ckpt")
    target = tiny_llama(vocab_size=96, seed=0, max_pos=2048)  # room for the bench prompts (one token a char)
    return {
        "target": save_tiny_checkpoint(root / "target", target),
        "draft": save_tiny_checkpoint(root / "draft", perturbed(target, 0.3)),
        "other_vocab": save_tiny_checkpoint(root / "other", tiny_llama(vocab_size=128, seed=5, max_pos=2048)),
    }

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


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A llama.cpp runtime keeps torch at one thread (edgespec.runtime.torch_threads): not for the next test."""
    yield
    from edgespec import runtime

    runtime.torch_threads(True)


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


@pytest.fixture
def untemplated_target(tiny_checkpoints, tmp_path) -> Path:
    """The tiny target's checkpoint without a chat template (a base model, which only takes raw prompts)."""
    import json
    import shutil

    plain = tmp_path / "no-template"
    shutil.copytree(tiny_checkpoints["target"], plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in plain.glob("chat_template.*"):
        extra.unlink()
    return plain

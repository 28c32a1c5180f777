"""edgespec: lossless speculative decoding for local LLMs. `edgespec.load()` is the Python API (`edgespec.api`).

The API is imported on first use, so `edgespec --help` and the CLI's one-line errors stay quick (no torch)."""

__all__ = ["Completion", "Model", "RequestError", "Stream", "load"]


def __getattr__(name: str):
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'edgespec' has no attribute {name!r}")

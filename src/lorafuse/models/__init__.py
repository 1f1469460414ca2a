"""Model loading: local HF dirs, GGUF files (converted once, cached), the built-in SmolLM2
default, NF4 4-bit base weights, gradient checkpointing, and the ``FastLanguageModel`` API."""

from __future__ import annotations

from lorafuse.models.source import DEFAULT_MODEL, ModelSourceError, resolve_model_source

__all__ = ["DEFAULT_MODEL", "FastLanguageModel", "ModelSourceError", "resolve_model_source"]


def __getattr__(name: str):
    if name == "FastLanguageModel":
        from lorafuse.models.fast_model import FastLanguageModel

        return FastLanguageModel
    raise AttributeError(f"module 'lorafuse.models' has no attribute {name!r}")

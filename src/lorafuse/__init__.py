"""lorafuse: fast, exact, memory-lean LoRA / QLoRA fine-tuning."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["FastLanguageModel", "patch_peft_model", "unpatch_peft_model", "__version__"]


def __getattr__(name: str):
    # Lazy so `import lorafuse` stays cheap and works without transformers/peft importing.
    if name == "FastLanguageModel":
        from lorafuse.models.fast_model import FastLanguageModel

        return FastLanguageModel
    if name in ("patch_peft_model", "unpatch_peft_model"):
        from lorafuse import patching

        return getattr(patching, name)
    raise AttributeError(f"module 'lorafuse' has no attribute {name!r}")

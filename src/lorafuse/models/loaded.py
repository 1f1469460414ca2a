"""What loading a model built: :class:`LoadedModel` ``(model, tokenizer, processor)``.

Every loader returns one (``load_language_model``, ``load_vision_model``, the commands'
``models.resolve.load_resolved``, training's ``train.model.load_for_training``); the processor travels in it,
never as an attribute on the model.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class LoadedModel(NamedTuple):
    """A loaded model with its tokenizer, and its processor where it is a vision-language model
    (None for a text-only one; a VLM's ``tokenizer`` is ``processor.tokenizer``)."""

    model: Any
    tokenizer: Any
    processor: Any = None

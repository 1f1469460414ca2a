"""Processors of vision-language models, torchvision-free.

Without torchvision (CPU torch wheels it does not match), transformers' Qwen2-VL processors cannot
be built: ``ProcessorMixin`` checks every sub-processor's class, the video processor's base class
``VideoProcessorMixin`` is only importable with torchvision, and the check runs even for
``video_processor=None``. :func:`images_only_processor` then builds the stock processor class from
its (PIL) image processor and tokenizer alone: images and text work, videos raise.
"""

from __future__ import annotations

import json
from pathlib import Path

from lorafuse import files
from lorafuse.models import preflight
from lorafuse.models.source import ModelSourceError, say


class VisionModelError(ModelSourceError):
    """A vision-language model or its processor cannot be loaded or used as asked."""


def images_only_processor(processor_cls, image_processor, tokenizer, chat_template=None):
    """``processor_cls`` (a Qwen2-VL-style processor) built from its image processor and
    tokenizer only, for machines without torchvision. ``.stock_class`` names the original class
    (saved files name it, so a machine with torchvision loads the stock processor)."""
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(processor_cls):
        stock_class = processor_cls

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def __call__(self, images=None, text=None, videos=None, **kwargs):
            if videos is not None:
                raise VisionModelError(
                    f"{processor_cls.__name__} was built without its video processor "
                    "(torchvision does not load here): videos are not supported"
                )
            return super().__call__(images=images, text=text, **kwargs)

        def save_pretrained(self, save_directory, **kwargs):
            """The stock files, naming the stock class (a machine with torchvision loads it)."""
            out = super().save_pretrained(save_directory, **kwargs)
            cfg = Path(save_directory) / "processor_config.json"
            data = json.loads(cfg.read_text())
            data["processor_class"] = processor_cls.__name__
            files.write_text(cfg, json.dumps(data, indent=2))
            return out

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"{processor_cls.__name__}ImagesOnly"
    template = chat_template or getattr(tokenizer, "chat_template", None)
    return ImagesOnly(image_processor, tokenizer, chat_template=template)


def is_vision_model_dir(model_dir) -> bool:
    """Whether ``model_dir``'s config.json describes a vision-language model."""
    cfg = Path(model_dir) / "config.json"
    try:
        return "vision_config" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def load_processor(model_dir: Path, max_seq_length: int = 2048):
    """The model's processor: ``AutoProcessor`` where it loads; for Qwen2-VL-style processors
    without torchvision, the stock class built from its PIL image processor (said out loud)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(model_dir))
    except Exception as err:
        first = err
    cfg = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (model_dir / name).is_file():
            data = json.loads((model_dir / name).read_text())
            cfg = {**data, **data.get("image_processor", {}), **cfg}  # nested in transformers 5
    cls_name = cfg.get("processor_class", "")
    import transformers

    cls = getattr(transformers, cls_name, None)
    if cls is None or "video_processor" not in cls.get_attributes():
        raise VisionModelError(
            f"cannot load the processor in {model_dir}: {type(first).__name__}: {first}"
        ) from first
    image_cls = _pil_image_processor(cfg.get("image_processor_type", ""))
    images = image_cls.from_pretrained(str(model_dir))
    tokenizer = preflight.load_tokenizer(model_dir, max_seq_length)
    say(
        f"{cls_name}: built from {image_cls.__name__} and the tokenizer without its video "
        f"processor (AutoProcessor failed: {type(first).__name__}); images work, videos do not"
    )
    return images_only_processor(cls, images, tokenizer)


def _pil_image_processor(name: str):
    import transformers

    base = name.removesuffix("Fast").removesuffix("Pil")
    cls = getattr(transformers, base + "Pil", None)
    if cls is None:
        raise VisionModelError(f"no PIL image processor for {name!r} in transformers")
    return cls

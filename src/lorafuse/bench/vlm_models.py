"""Random vision-language models built offline from configs, for the VLM bench and the tests
(:mod:`lorafuse.testing.vlm`): an Idefics3 (SmolVLM layout: SigLIP vision, pixel-shuffle
connector, Llama text) and a Qwen2-VL / Qwen2.5-VL (ViT with 2x2 patch merger, multimodal rope,
Qwen2 text), each with a PIL image processor (torchvision-free) and the given tokenizer plus the
family's vision special tokens and chat template; and generated shape images.
"""

from __future__ import annotations

import torch

from lorafuse.models.vision_processor import images_only_processor

FAMILIES = ("idefics3", "qwen2_vl", "qwen2_5_vl")

# SmolVLM's template: "User:<image>text<end_of_utterance>\nAssistant: ...".
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Qwen2-VL's template (ChatML; an image part becomes <|vision_start|><|image_pad|><|vision_end|>).
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_IDEFICS3_SPECIALS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
_IDEFICS3_SPECIALS += [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
_QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
             tie_word_embeddings=False)  # fmt: skip


def vlm_tokenizer(family: str, tok):
    """``tok`` (a fast tokenizer with a pad token) with ``family``'s vision special tokens and
    chat template, in place; returns it."""
    specials = _IDEFICS3_SPECIALS if family == "idefics3" else _QWEN_SPECIALS
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = IDEFICS3_TEMPLATE if family == "idefics3" else QWEN2_VL_TEMPLATE
    if family == "idefics3":
        tok.eos_token = "<end_of_utterance>"
    return tok


# ``size="small"``: a shape with real proportions (2048-wide-class ratios at 512) for the bench
_SMALL_TEXT = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)  # fmt: skip


def _idefics3(tok, small: bool = False):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    text = dict(_TEXT, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    if small:
        text.update(_SMALL_TEXT)
        vision.update(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4)  # fmt: skip
    config = Idefics3Config(
        vision_config=vision, text_config=text, scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
    )  # fmt: skip
    model = Idefics3ForConditionalGeneration(config)
    # 64-pixel longest edge, 32-pixel tiles: up to 2x2 tiles + the global image, 4 tokens each
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    )
    processor = Idefics3Processor(images, tok, image_seq_len=4, chat_template=tok.chat_template)
    return model, processor


def _qwen(tok, family: str, small: bool = False):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model
        from transformers import Qwen2VLProcessor as Processor

        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                      patch_size=8, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    else:
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model
        from transformers import Qwen2_5_VLProcessor as Processor

        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, num_heads=2,
                      intermediate_size=48, patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1])  # fmt: skip
    ids = {t: tok.convert_tokens_to_ids(t) for t in _QWEN_SPECIALS}
    # head_dim 16: the multimodal rope splits its 8 frequencies 2 (time) / 3 (height) / 3 (width)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(_TEXT, vocab_size=len(tok), rope_parameters=rope, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    if small:  # head_dim 64: 32 rope frequencies split 8 / 12 / 12 as Qwen2-VL's 16 / 24 / 24
        text.update(_SMALL_TEXT, rope_parameters={**rope, "mrope_section": [8, 12, 12]})
        width = "embed_dim" if family == "qwen2_vl" else "hidden_size"
        vision.update({width: 256, "depth": 4, "num_heads": 4})
        vision.update({"hidden_size": 512} if family == "qwen2_vl" else {"out_hidden_size": 512})
        if family == "qwen2_5_vl":
            vision.update(intermediate_size=1024, fullatt_block_indexes=[3])
    config = Config(
        vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip
    model = Model(config)
    images = Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=64 * 64, patch_size=8, merge_size=2, temporal_patch_size=2
    )
    return model, images_only_processor(Processor, images, tok)


def build_vlm(family: str, tok, seed: int = 0, scale: float = 1.0, size: str = "tiny"):
    """``(model, processor)``: a random ``family`` VLM in fp32 eval mode over tokenizer ``tok``;
    ``size`` "tiny" (tests) or "small" (512-wide, 4+4 layers: the bench's)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown VLM family {family!r}; one of {FAMILIES}")
    tok = vlm_tokenizer(family, tok)
    torch.manual_seed(seed)
    small = size == "small"
    model, processor = _idefics3(tok, small) if family == "idefics3" else _qwen(tok, family, small)
    model = model.float().eval()
    if scale != 1.0:  # decisive greedy choices for argmax comparisons (as testing.llm does)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(scale)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, processor


COLOURS = ("red", "green", "blue", "yellow")


def shape_image(colour: str = "red", size: tuple[int, int] = (48, 40), shape: str = "square"):
    """A PIL image: one ``colour`` square or circle on white (deterministic)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    w, h = size
    box = (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
    draw = ImageDraw.Draw(img)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=colour)
    return img

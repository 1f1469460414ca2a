"""Tiny random Stable Diffusion 1.5- and SDXL-shaped pipelines (in memory, as a diffusers dir and as an original single-file checkpoint) and a CLIP tokenizer built without files."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

_SD_SCHEDULE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                    num_train_timesteps=1000)  # fmt: skip


def tiny_clip_tokenizer(model_max_length: int = 77):
    """A CLIP BPE tokenizer built in memory (no files): every byte char with and without ``</w>``.

    No merges, so words split into characters (514 tokens); ids, padding to 77 and
    ``<|startoftext|>``/``<|endoftext|>`` behave like the real CLIP tokenizer's.
    """
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {tok: i for i, tok in enumerate(chars + [c + "</w>" for c in chars])}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def _tiny_clip(tok, *, hidden: int, projection: bool, projection_dim: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=len(tok), max_position_embeddings=77,
        projection_dim=projection_dim, hidden_act="gelu" if projection else "quick_gelu",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg).eval()


def _tiny_unet(family: str):
    """SD1.5 shape: 1x1-conv proj_in/out, 2 levels; SDXL shape: linear proj, text_time, 3 levels.

    Both have ResNet blocks (with conv_shortcut where channels change), a Downsample and an
    Upsample, cross-attention transformer blocks in the down, mid and up blocks. Channels are
    multiples of 32 (GroupNorm's 32 groups). A forward at 8x8 latents takes milliseconds.
    """
    from diffusers import UNet2DConditionModel

    if family == "sd15":
        return UNet2DConditionModel(
            sample_size=8, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, use_linear_projection=False,
        )  # fmt: skip
    # SDXL: like the real one, level 0 has no attention, layers_per_block=2 (the SGM numbering
    # kohya writes depends on it), several transformer layers in the last level, cross-attention
    # on te1 + te2 hidden states (32 + 64), and the micro-conditioning input: te2's pooled
    # projection (32) + 6 size/crop values x 8 = 80.
    return UNet2DConditionModel(
        sample_size=8, block_out_channels=(32, 64, 64), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2), cross_attention_dim=96,
        attention_head_dim=(2, 4, 8), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=80,
    )  # fmt: skip


def build_tiny_sd(family: str = "sd15", prediction_type: str = "epsilon", seed: int = 0):
    """The tiny random pipeline of :func:`save_tiny_sd` in memory (fp32, eval mode)."""
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        PNDMScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
    )

    if family not in ("sd15", "sdxl"):
        raise ValueError(f"family must be 'sd15' or 'sdxl', got {family!r}")
    torch.manual_seed(seed)
    unet = _tiny_unet(family).eval()
    vae = AutoencoderKL(
        block_out_channels=(32, 64), latent_channels=4, sample_size=64,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        scaling_factor=0.13025 if family == "sdxl" else 0.18215,
    ).eval()  # fmt: skip
    tok = tiny_clip_tokenizer()
    if family == "sd15":
        sched = PNDMScheduler(
            **_SD_SCHEDULE, skip_prk_steps=True, prediction_type=prediction_type, steps_offset=1
        )
        return StableDiffusionPipeline(
            vae=vae, text_encoder=_tiny_clip(tok, hidden=32, projection=False), tokenizer=tok,
            unet=unet, scheduler=sched, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )  # fmt: skip
    sched = EulerDiscreteScheduler(**_SD_SCHEDULE, prediction_type=prediction_type, steps_offset=1)
    return StableDiffusionXLPipeline(
        vae=vae, text_encoder=_tiny_clip(tok, hidden=32, projection=False), tokenizer=tok,
        # te2 wider than te1, as on SDXL (768 / 1280): diffusers' single-file loader tells the
        # two apart by their position-embedding width
        text_encoder_2=_tiny_clip(tok, hidden=64, projection=True),
        tokenizer_2=tiny_clip_tokenizer(), unet=unet, scheduler=sched,
    )  # fmt: skip


def _vae_to_ldm(sd: dict) -> dict:
    """Diffusers AutoencoderKL state dict -> the LDM ``first_stage_model`` layout (attention
    q/k/v/proj_out as 1x1 convs, decoder levels numbered from the bottom)."""
    n_up = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("decoder.up_blocks."))
    out = {}
    for key, v in sd.items():
        k = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        k = re.sub(r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", k)
        k = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", k)
        k = re.sub(r"up_blocks\.(\d+)\.resnets\.",
                   lambda m: f"up.{n_up - 1 - int(m[1])}.block.", k)  # fmt: skip
        k = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0\.",
                   lambda m: f"up.{n_up - 1 - int(m[1])}.upsample.", k)  # fmt: skip
        k = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", k)
        if ".mid_block.attentions.0." in k:
            k = k.replace("mid_block.attentions.0.", "mid.attn_1.").replace("group_norm", "norm")
            for a, b in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
                k = k.replace(f".{a}.", f".{b}.")
            if v.dim() == 2:
                v = v[:, :, None, None]  # (out, in) -> (out, in, 1, 1) conv
        out["first_stage_model." + k] = v
    return out


def _open_clip_to_ldm(sd: dict, prefix: str) -> dict:
    """transformers CLIPTextModelWithProjection -> OpenCLIP layout (SDXL's second encoder):
    fused ``in_proj`` q/k/v, ``text_projection`` stored transposed (width, proj)."""
    out = {prefix + "text_projection": sd["text_projection.weight"].T.contiguous()}
    names = {"embeddings.token_embedding.weight": "token_embedding.weight",
             "embeddings.position_embedding.weight": "positional_embedding",
             "final_layer_norm.weight": "ln_final.weight", "final_layer_norm.bias": "ln_final.bias"}  # fmt: skip
    layers = {}
    for key, v in sd.items():
        k = key.removeprefix("text_model.")
        if k in names:
            out[prefix + names[k]] = v
        elif k.startswith("encoder.layers."):
            n, rest = k[len("encoder.layers.") :].split(".", 1)
            layers.setdefault(int(n), {})[rest] = v
    for n, p in layers.items():
        base = f"{prefix}transformer.resblocks.{n}."
        for part in ("weight", "bias"):
            qkv = [p[f"self_attn.{x}_proj.{part}"] for x in "qkv"]
            out[f"{base}attn.in_proj_{part}"] = torch.cat(qkv)  # (3*width, width) / (3*width,)
            for ours, theirs in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                                 ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"),
                                 ("mlp.fc2", "mlp.c_proj")):  # fmt: skip
                out[f"{base}{theirs}.{part}"] = p[f"{ours}.{part}"]
    return out


_UNET_TOP = {"time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
             "add_embedding.linear_1.": "label_emb.0.0.", "add_embedding.linear_2.": "label_emb.0.2.",
             "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2."}  # fmt: skip
_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0",
                "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                "conv_shortcut": "skip_connection"}  # fmt: skip


def _unet_to_ldm(sd: dict, config) -> dict:
    """Diffusers UNet state dict -> the original LDM/SGM ``model.diffusion_model`` layout (the
    inverse of diffusers' ``convert_ldm_unet_checkpoint``; L = layers per block): down block b,
    layer i -> ``input_blocks.{1 + b(L+1) + i}.0|1``, its Downsample ``.{1 + b(L+1) + L}.0.op``;
    mid -> ``middle_block.0|1|2``; up -> ``output_blocks.{b(L+1) + i}.0|1``, Upsample at
    ``.{b(L+1) + L}.2`` (``.1`` in a block without attention). Written independently of
    :mod:`lorafuse.image.kohya`, whose LoRA names tests check against it."""
    L = config["layers_per_block"]
    up_attn = ["CrossAttn" in t for t in config["up_block_types"]]
    subs = [
        (r"^(.*resnets\.\d+\.)(norm1|conv1|norm2|conv2|time_emb_proj|conv_shortcut)\.",
         lambda m: f"{m[1]}{_UNET_RESNET[m[2]]}."),
        (r"^down_blocks\.(\d+)\.resnets\.(\d+)\.",
         lambda m: f"input_blocks.{1 + int(m[1]) * (L + 1) + int(m[2])}.0."),
        (r"^down_blocks\.(\d+)\.attentions\.(\d+)\.",
         lambda m: f"input_blocks.{1 + int(m[1]) * (L + 1) + int(m[2])}.1."),
        (r"^down_blocks\.(\d+)\.downsamplers\.0\.conv\.",
         lambda m: f"input_blocks.{1 + int(m[1]) * (L + 1) + L}.0.op."),
        (r"^mid_block\.resnets\.(\d+)\.", lambda m: f"middle_block.{2 * int(m[1])}."),
        (r"^mid_block\.attentions\.0\.", lambda m: "middle_block.1."),
        (r"^up_blocks\.(\d+)\.resnets\.(\d+)\.",
         lambda m: f"output_blocks.{int(m[1]) * (L + 1) + int(m[2])}.0."),
        (r"^up_blocks\.(\d+)\.attentions\.(\d+)\.",
         lambda m: f"output_blocks.{int(m[1]) * (L + 1) + int(m[2])}.1."),
        (r"^up_blocks\.(\d+)\.upsamplers\.0\.",
         lambda m: f"output_blocks.{int(m[1]) * (L + 1) + L}.{2 if up_attn[int(m[1])] else 1}."),
    ]  # fmt: skip
    out = {}
    for key, v in sd.items():
        k = next(
            (new + key[len(old) :] for old, new in _UNET_TOP.items() if key.startswith(old)), key
        )
        for pattern, repl in subs:
            k = re.sub(pattern, repl, k)
        out["model.diffusion_model." + k] = v
    return out


def sd_single_file_state_dict(pipe, family: str) -> dict:
    """A diffusers SD1.5/SDXL pipeline as an original single-file checkpoint (LDM for SD1.x,
    SGM for SDXL): the layout ``from_single_file`` converts back."""
    out = _unet_to_ldm(pipe.unet.state_dict(), pipe.unet.config)
    out.update(_vae_to_ldm(pipe.vae.state_dict()))
    te1 = pipe.text_encoder.state_dict()
    prefix = "conditioner.embedders.0." if family == "sdxl" else "cond_stage_model."
    for key, v in te1.items():
        out[f"{prefix}transformer.text_model.{key.removeprefix('text_model.')}"] = v
    if family == "sdxl":
        out.update(
            _open_clip_to_ldm(pipe.text_encoder_2.state_dict(), "conditioner.embedders.1.model.")
        )
    return {k: v.detach().contiguous() for k, v in out.items()}


def save_tiny_sd(
    path: str | os.PathLike,
    family: str = "sd15",
    prediction_type: str = "epsilon",
    single_file: bool = False,
    seed: int = 0,
) -> str:
    """Write a tiny random SD1.5- or SDXL-shaped pipeline as a diffusers dir; returns its path.

    ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline.from_pretrained(path)`` load it
    offline. Deterministic from ``seed``. ``prediction_type="v_prediction"`` gives an SD2-v-like
    scheduler config. ``single_file=True`` also writes the same weights as an original
    single-file checkpoint ``<path>.safetensors`` and returns that file's path (``path`` is then
    its config dir: ``from_single_file(file, config=path)``).
    """
    from safetensors.torch import save_file

    pipe = build_tiny_sd(family, prediction_type, seed)
    pipe.save_pretrained(Path(path), safe_serialization=True)
    if not single_file:
        return str(path)
    file = Path(path).with_name(Path(path).name + ".safetensors")
    save_file(sd_single_file_state_dict(pipe, family), str(file))
    return str(file)

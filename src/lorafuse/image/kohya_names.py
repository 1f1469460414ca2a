"""kohya LoRA names: our network's keys (``"<component>:<dotted module path>"``) to and from the
names sd-scripts writes (``lora_unet_...``, ``lora_te_...``), including SDXL's SGM block layout
(see :mod:`lorafuse.image.kohya` for the naming rules, and its file, tensors and metadata)."""

from __future__ import annotations

from dataclasses import dataclass

from lorafuse.errors import LorafuseError

FAMILIES = ("sd1", "sd2", "sdxl")
TE_PREFIXES = {"sd1": {"te1": "lora_te_"}, "sd2": {"te1": "lora_te_"},
               "sdxl": {"te1": "lora_te1_", "te2": "lora_te2_"}}  # fmt: skip
# Identifiers that contain '_' (to read kohya names back without a model): longest match first
_WORDS = {
    tuple(w.split("_"))
    for w in (
        "down_blocks up_blocks mid_block transformer_blocks proj_in proj_out to_q to_k to_v "
        "to_out conv_shortcut time_emb_proj conv_in conv_out conv_norm_out time_embedding "
        "linear_1 linear_2 add_embedding input_blocks middle_block output_blocks in_layers "
        "out_layers emb_layers skip_connection time_embed label_emb text_model self_attn q_proj "
        "k_proj v_proj out_proj final_layer_norm layer_norm1 layer_norm2 text_projection"
    ).split()
}
_RESNET_TO_SGM = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0",
                  "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                  "conv_shortcut": "skip_connection"}  # fmt: skip
_RESNET_FROM_SGM = {v: k for k, v in _RESNET_TO_SGM.items()}
_TOP_TO_SGM = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_TOP_FROM_SGM = {v: k for k, v in _TOP_TO_SGM.items()}


class LoRAFileError(LorafuseError, ValueError):
    """A LoRA file or state dict that is not a kohya LoRA we can read (names the key/file)."""


@dataclass(frozen=True)
class UNetLayout:
    """What the SGM numbering depends on: ResNets per down block, and which up blocks have
    attention (their Upsample sits at index 2, else 1). Defaults: SDXL base."""

    layers_per_block: int = 2
    up_attention: tuple[bool, ...] = (True, True, False)

    @classmethod
    def from_config(cls, config) -> UNetLayout:
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
        return cls(
            int(get("layers_per_block")),
            tuple("CrossAttn" in t for t in get("up_block_types")),
        )


DEFAULT_LAYOUT = UNetLayout()  # SDXL base's; SD1.x / 2.x name no SGM paths


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise LoRAFileError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")


# ---- UNet paths: diffusers <-> SGM (SDXL) ---------------------------------------------------


def unet_to_sgm(path: str, layout: UNetLayout = UNetLayout()) -> str:
    """Diffusers UNet module path -> kohya's SDXL (SGM) path (a path outside the blocks and the
    embeddings raises)."""
    L = layout.layers_per_block
    p = path.split(".")
    if path in _TOP_TO_SGM:
        return _TOP_TO_SGM[path]
    if p[0] == "down_blocks" and len(p) >= 4:
        b, kind, i, rest = int(p[1]), p[2], int(p[3]), p[4:]
        if kind == "downsamplers":  # Downsample2D.conv -> op
            return ".".join([f"input_blocks.{1 + b * (L + 1) + L}.0.op"] + rest[1:])
        n = 1 + b * (L + 1) + i
        return _sgm_inner(f"input_blocks.{n}", kind, rest, path)
    if p[0] == "mid_block" and len(p) >= 3:
        kind, i, rest = p[1], int(p[2]), p[3:]
        n = {("resnets", 0): 0, ("attentions", 0): 1, ("resnets", 1): 2}.get((kind, i))
        if n is None:
            raise LoRAFileError(f"UNet path {path!r}: no SGM name for mid_block.{kind}.{i}")
        return _sgm_inner(f"middle_block.{n}", kind, rest, path, sub=False)
    if p[0] == "up_blocks" and len(p) >= 4:
        b, kind, i, rest = int(p[1]), p[2], int(p[3]), p[4:]
        if kind == "upsamplers":
            has_attn = b < len(layout.up_attention) and layout.up_attention[b]
            return ".".join([f"output_blocks.{b * (L + 1) + L}.{2 if has_attn else 1}"] + rest)
        return _sgm_inner(f"output_blocks.{b * (L + 1) + i}", kind, rest, path)
    raise LoRAFileError(f"UNet path {path!r} has no SGM (SDXL) name")


def _sgm_inner(block: str, kind: str, rest: list[str], path: str, sub: bool = True) -> str:
    """ResNet -> ``<block>.0`` with SGM layer names, transformer -> ``<block>.1`` (the middle
    block's entries have no sub-index)."""
    if kind == "resnets":
        inner, rest = "0", [_RESNET_TO_SGM.get(rest[0], rest[0]), *rest[1:]] if rest else rest
    elif kind == "attentions":
        inner = "1"
    else:
        raise LoRAFileError(f"UNet path {path!r}: no SGM name for {kind!r}")
    return ".".join([f"{block}.{inner}" if sub else block, *rest])


def sgm_to_unet(path: str, layout: UNetLayout = UNetLayout()) -> str:
    """Inverse of :func:`unet_to_sgm` (kohya's SDXL path -> diffusers path)."""
    L = layout.layers_per_block
    if path in _TOP_FROM_SGM:
        return _TOP_FROM_SGM[path]
    p = path.split(".")
    bad = LoRAFileError(f"SDXL UNet path {path!r} is not in kohya's SGM layout")
    if len(p) < 3 or not p[1].isdigit():
        raise bad
    n = int(p[1])
    if p[0] == "input_blocks" and n >= 1 and p[2].isdigit():
        b, i = divmod(n - 1, L + 1)
        if p[2] == "0" and len(p) > 3 and p[3] == "op":
            return ".".join([f"down_blocks.{b}.downsamplers.0.conv"] + p[4:])
        return _diffusers_inner(f"down_blocks.{b}", i, p[2], p[3:], bad)
    if p[0] == "middle_block" and n in (0, 1, 2):
        kind = "attentions.0" if n == 1 else f"resnets.{n // 2}"
        rest = p[2:]
        if kind.startswith("resnets") and rest:
            rest = _resnet_from_sgm(rest)
        return ".".join([f"mid_block.{kind}"] + rest)
    if p[0] == "output_blocks" and p[2].isdigit():
        b, i = divmod(n, L + 1)
        if p[2] in ("1", "2") and len(p) > 3 and p[3] == "conv":  # Upsample2D (.1 without attn)
            return ".".join([f"up_blocks.{b}.upsamplers.0"] + p[3:])
        return _diffusers_inner(f"up_blocks.{b}", i, p[2], p[3:], bad)
    raise bad


def _resnet_from_sgm(rest: list[str]) -> list[str]:
    two = ".".join(rest[:2])
    if two in _RESNET_FROM_SGM:
        return [_RESNET_FROM_SGM[two]] + rest[2:]
    if rest[0] in _RESNET_FROM_SGM:  # skip_connection
        return [_RESNET_FROM_SGM[rest[0]]] + rest[1:]
    return rest


def _diffusers_inner(block: str, i: int, inner: str, rest: list[str], bad: Exception) -> str:
    if inner == "0":
        return ".".join([f"{block}.resnets.{i}"] + _resnet_from_sgm(rest))
    if inner == "1":
        return ".".join([f"{block}.attentions.{i}"] + rest)
    raise bad


# ---- names ----------------------------------------------------------------------------------


def kohya_name(key: str, family: str, layout: UNetLayout = UNetLayout()) -> str:
    """``"<component>:<dotted path>"`` -> kohya LoRA name (no suffix)."""
    check_family(family)
    component, _, path = key.partition(":")
    if component == "unet":
        if family == "sdxl":
            path = unet_to_sgm(path, layout)
        return "lora_unet_" + path.replace(".", "_")
    prefix = TE_PREFIXES[family].get(component)
    if prefix is None or not path:
        raise LoRAFileError(
            f"LoRA key {key!r}: no kohya name for component {component!r} "
            f"on {family} (components: unet, {', '.join(TE_PREFIXES[family])})"
        )
    path = path.removeprefix("text_model.")  # CLIPTextModelWithProjection still nests it
    return prefix + "text_model_" + path.replace(".", "_")


def _dotted(underscored: str) -> str:
    """``down_blocks_0_attentions_0_proj_in`` -> ``down_blocks.0.attentions.0.proj_in``."""
    toks, out, i = underscored.split("_"), [], 0
    while i < len(toks):
        for n in (3, 2, 1):
            if n == 1 or tuple(toks[i : i + n]) in _WORDS:
                out.append("_".join(toks[i : i + n]))
                i += n
                break
    return ".".join(out)


def module_key(name: str, family: str, layout: UNetLayout = UNetLayout()) -> str:
    """kohya LoRA name -> ``"<component>:<dotted path>"`` (inverse of :func:`kohya_name`).

    Reads SDXL UNet names in the SGM layout (kohya's) or the diffusers one, and ``lora_te_`` as
    the first text encoder in every family (as diffusers does). The path of a CLIPTextModel has
    no ``text_model.`` (transformers 5); that of SDXL's CLIPTextModelWithProjection keeps it.
    """
    check_family(family)
    if name.startswith("lora_unet_"):
        path = _dotted(name[len("lora_unet_") :])
        if family == "sdxl" and path.split(".")[0] in ("input_blocks", "middle_block",
                                                       "output_blocks", "time_embed",
                                                       "label_emb", "out"):  # fmt: skip
            path = sgm_to_unet(path, layout)
        return f"unet:{path}"
    for component, prefix in [("te1", "lora_te_"), *TE_PREFIXES[family].items()]:
        if name.startswith(prefix + "text_model_"):
            path = _dotted(name[len(prefix + "text_model_") :])
            return f"{component}:{'text_model.' if component == 'te2' else ''}{path}"
    raise LoRAFileError(
        f"LoRA name {name!r} is not a kohya {family} name (lora_unet_..., "
        f"{', '.join(p + 'text_model_...' for p in TE_PREFIXES[family].values())})"
    )


# ---- state dicts ----------------------------------------------------------------------------

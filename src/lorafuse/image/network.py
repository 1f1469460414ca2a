"""kohya-style LoRA network for a diffusers UNet and transformers CLIP text encoders.

Targets as sd-scripts' ``networks/lora.py`` chooses them; one :class:`LoRAModule` per adapted
layer: ``lora_down`` (Linear (r, in) or Conv2d (r, Cin, kh, kw)), ``lora_up`` (Linear (out, r) or
1x1 Conv2d), ``scale = alpha / dim``, kohya's init. The forward is installed per instance
(revertible): ``fused=True`` runs one fused op, ``fused=False`` kohya's math (the baseline).
Network dropout runs training forwards unfused (it warns). Details: docs/image.md.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from lorafuse.errors import LorafuseError
from lorafuse.ops.lora_conv import lora_conv2d
from lorafuse.ops.lora_linear import lora_linear
from lorafuse.patching.peft_lora import (
    install_forward,
    is_installed,
    original_forward,
    restore_forward,
)

UNET_TARGETS = ("Transformer2DModel",)
UNET_CONV_TARGETS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_TARGETS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")
COMPONENTS = ("unet", "te1", "te2")


class NetworkError(LorafuseError):
    """A LoRA network cannot be built, applied or loaded as asked (names the module/key/shape)."""


def _fuse_reason(org: nn.Module) -> str | None:
    """Why ``org`` cannot take a fused op (None: it can)."""
    if type(org) is nn.Linear:
        return None
    if type(org) is not nn.Conv2d:
        return f"{type(org).__module__}.{type(org).__name__} is not a plain nn.Linear/nn.Conv2d"
    if org.padding_mode != "zeros":
        return f"Conv2d padding_mode={org.padding_mode!r} (the fused op pads with zeros)"
    if org.dilation != (1, 1):
        return f"Conv2d dilation={org.dilation} (kohya's lora_down conv is not dilated)"
    if isinstance(org.padding, str):
        return f"Conv2d padding={org.padding!r} (string padding)"
    return None


class LoRAModule(nn.Module):
    """One adapted ``nn.Linear`` or ``nn.Conv2d``, kohya style (docs/image.md)."""

    def __init__(
        self,
        org: nn.Module,
        dim: int,
        alpha: float | None,
        *,
        dropout: float = 0.0,
        fused: bool = True,
        backend: str | None = None,
    ):
        super().__init__()
        if dim < 1:
            raise NetworkError(f"LoRA dim must be >= 1, got {dim}")
        if not 0.0 <= dropout < 1.0:
            raise NetworkError(f"LoRA dropout must be in [0, 1), got {dropout}")
        dev = org.weight.device
        if isinstance(org, nn.Conv2d):
            # Same kernel/stride/padding as the layer, so the branch output has its spatial shape.
            self.lora_down = nn.Conv2d(org.in_channels, dim, org.kernel_size, org.stride,
                                       org.padding, bias=False, device=dev)  # fmt: skip
            self.lora_up = nn.Conv2d(dim, org.out_channels, (1, 1), (1, 1), bias=False, device=dev)
        else:
            self.lora_down = nn.Linear(org.in_features, dim, bias=False, device=dev)
            self.lora_up = nn.Linear(dim, org.out_features, bias=False, device=dev)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        self.dim = dim
        self.register_buffer("alpha", torch.tensor(0.0, device=dev))
        self.set_alpha(alpha)
        self.dropout = float(dropout)
        self.backend = backend
        # Not a registered submodule: the network's parameters and state_dict are LoRA only.
        self._org = [org]
        reason = None if fused else "fused=False (kohya's unfused math)"
        self.unfused_reason = reason or _fuse_reason(org)

    @property
    def org_module(self) -> nn.Module:
        return self._org[0]

    def set_alpha(self, alpha: float | None) -> None:
        """Set ``alpha`` (0/None -> dim, i.e. scale 1) and the cached python ``scale``.

        Cached as python floats (``alpha_value``, ``scale``) so a forward never reads the buffer
        (a device sync on CUDA) and a bf16 cast of the network does not round them.
        """
        alpha = float(self.dim) if alpha is None or float(alpha) == 0.0 else float(alpha)
        self.alpha.fill_(alpha)
        self.alpha_value = alpha
        self.scale = alpha / self.dim

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "alpha" in state_dict:  # a resumed network: the cached scale follows
            self.set_alpha(float(state_dict[prefix + "alpha"]))

    def uses_fused(self) -> bool:
        """Whether the next forward runs the fused op (training with dropout runs unfused)."""
        if self.unfused_reason is not None:
            return False
        return not (self.training and self.dropout > 0.0)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not self.uses_fused():
            return self.forward_unfused(x, *args, **kwargs)
        org = self.org_module
        if isinstance(org, nn.Conv2d):
            return lora_conv2d(x, org.weight, org.bias, self.lora_down.weight,
                               self.lora_up.weight, self.scale, stride=org.stride,
                               padding=org.padding, dilation=org.dilation, groups=org.groups,
                               backend=self.backend)  # fmt: skip
        return lora_linear(x, org.weight, org.bias, self.lora_down.weight,
                           self.lora_up.weight, self.scale, backend=self.backend)  # fmt: skip

    def forward_unfused(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """kohya: ``org_forward(x) + lora_up(dropout(lora_down(x))) * scale``."""
        org = self.org_module
        out = original_forward(org, x, *args, **kwargs)
        lx = self.lora_down(x.to(self.lora_down.weight.dtype))
        if self.dropout > 0.0 and self.training:
            lx = F.dropout(lx, p=self.dropout)
        return out + (self.lora_up(lx) * self.scale).to(out.dtype)


def find_targets(root: nn.Module, classes: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """``(dotted path, layer)`` of every Linear/Conv2d inside a module whose class is in
    ``classes``, in ``named_modules`` order, each once (kohya matches on class names too)."""
    found: dict[str, nn.Module] = {}
    for name, module in root.named_modules():
        if type(module).__name__ not in classes:
            continue
        for child_name, child in module.named_modules():
            if child_name and type(child).__name__ in ("Linear", "Conv2d"):
                found.setdefault(f"{name}.{child_name}" if name else child_name, child)
    return list(found.items())


def _slot(key: str) -> str:
    """ModuleDict name for a key: ``nn.Module`` names may not contain '.'."""
    return key.replace(".", "/")


class LoRANetwork(nn.Module):
    """kohya-style LoRA modules over a UNet and (optionally) its text encoders.

    ``lora_modules`` is an ``nn.ModuleDict`` of :class:`LoRAModule`, one per adapted layer, named
    by key with '.' -> '/'; :meth:`keys` gives the keys, ``"<component>:<dotted module path>"``
    with component ``unet``, ``te1`` or ``te2``. (Not ``modules``: that would shadow
    ``nn.Module.modules()``.) Nothing runs until :meth:`apply_to`.
    """

    def __init__(self, loras: dict[str, LoRAModule]):
        super().__init__()
        self._keys = list(loras)
        self.lora_modules = nn.ModuleDict({_slot(k): m for k, m in loras.items()})
        self._frozen: dict[str, tuple[bool, ...]] = {}

    @classmethod
    def create(
        cls,
        unet: nn.Module,
        text_encoders: list,
        *,
        dim: int,
        alpha: float | None,
        conv_dim: int | None = None,
        conv_alpha: float | None = None,
        train_text_encoder: bool = False,
        fused: bool = True,
        backend: str | None = None,
        dropout: float = 0.0,
    ) -> LoRANetwork:
        """Build the modules (not yet applied: call :meth:`apply_to`).

        ``alpha``/``conv_alpha`` 0 or None mean "= the rank" (scale 1); ``conv_dim`` None or 0
        leaves the ResNet/Down/Upsample layers alone. SD1.x/2.x pass one text encoder, SDXL two.
        """
        if len(text_encoders) > 2:
            raise NetworkError(f"at most two text encoders (SDXL), got {len(text_encoders)}")
        if dropout > 0.0 and fused:
            warnings.warn(
                f"lorafuse: LoRA network dropout {dropout} acts on the rank-r activations "
                "(kohya); the fused ops do not expose them, so training forwards run the unfused "
                "math (eval forwards stay fused)",
                RuntimeWarning,
                stacklevel=2,
            )
        kw = {"dropout": dropout, "fused": fused, "backend": backend}
        loras: dict[str, LoRAModule] = {}
        classes = UNET_TARGETS + (UNET_CONV_TARGETS if conv_dim else ())
        for path, layer in find_targets(unet, classes):
            is_3x3 = isinstance(layer, nn.Conv2d) and layer.kernel_size != (1, 1)
            if is_3x3 and not conv_dim:
                continue  # kohya: a 3x3 conv needs conv_dim
            r, a = (conv_dim, conv_alpha) if is_3x3 else (dim, alpha)
            loras[f"unet:{path}"] = LoRAModule(layer, r, a, **kw)
        if train_text_encoder:
            for i, te in enumerate(text_encoders):
                for path, layer in find_targets(te, TEXT_ENCODER_TARGETS):
                    loras[f"te{i + 1}:{path}"] = LoRAModule(layer, dim, alpha, **kw)
        if not loras:
            raise NetworkError(
                f"no LoRA targets found: the UNet ({type(unet).__name__}) has no "
                f"{'/'.join(classes)} with Linear/Conv2d layers"
            )
        return cls(loras)

    # ---- structure -------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._keys)

    def module_for(self, key: str) -> LoRAModule:
        return self.lora_modules[_slot(key)]

    def items(self):
        return [(k, self.lora_modules[_slot(k)]) for k in self._keys]

    def component_keys(self, component: str) -> list[str]:
        return [k for k in self._keys if k.split(":", 1)[0] == component]

    # ---- install / remove ------------------------------------------------------------------

    def apply_to(self) -> LoRANetwork:
        """Install each module's forward on its layer and freeze the layer's own parameters."""
        for key, lora in self.items():
            org = lora.org_module
            if is_installed(org) and key not in self._frozen:
                raise NetworkError(f"{key}: the layer already has a lorafuse forward installed")
            if key in self._frozen:
                continue  # idempotent
            self._frozen[key] = tuple(p.requires_grad for p in org.parameters(recurse=False))
            for p in org.parameters(recurse=False):
                p.requires_grad_(False)
            install_forward(org, _lora_forward(lora), lora.backend)
        return self

    def restore(self) -> None:
        """Give every layer its own forward and its parameters' ``requires_grad`` back."""
        for key, lora in self.items():
            prev = self._frozen.pop(key, None)
            if prev is None:
                continue
            restore_forward(lora.org_module)
            for p, flag in zip(lora.org_module.parameters(recurse=False), prev):
                p.requires_grad_(flag)

    def report(self) -> str:
        """How many modules run fused, and why each of the others does not."""
        fused = sum(m.unfused_reason is None for _, m in self.items())
        lines = [f"LoRA network: {len(self._keys)} modules, {fused} fused"]
        why: dict[str, int] = {}
        for _, m in self.items():
            if m.unfused_reason is not None:
                why[m.unfused_reason] = why.get(m.unfused_reason, 0) + 1
        lines += [f"  unfused ({n}): {reason}" for reason, n in why.items()]
        drop = {m.dropout for _, m in self.items() if m.dropout > 0 and m.unfused_reason is None}
        if drop:
            lines.append(f"  dropout {max(drop)}: training forwards unfused, eval fused")
        return "\n".join(lines)

    # ---- tensors ---------------------------------------------------------------------------

    def lora_tensors(self) -> dict[str, dict]:
        """key -> {"down": (r, in[, kh, kw]), "up": (out, r[, 1, 1]), "alpha": float} (detached)."""
        return {
            k: {
                "down": m.lora_down.weight.detach(),
                "up": m.lora_up.weight.detach(),
                "alpha": m.alpha_value,
            }  # fmt: skip
            for k, m in self.items()
        }

    def load_lora_tensors(self, tensors: dict[str, dict], strict: bool = True) -> None:
        """Copy weights and alphas in (cast to each module's dtype/device).

        ``strict``: the key sets must be equal. Shapes must always match (named in the error).
        """
        ours = set(self._keys)
        extra = sorted(set(tensors) - ours)
        missing = sorted(ours - set(tensors))
        if strict and (extra or missing):
            raise NetworkError(
                f"LoRA tensors do not match the network: {len(extra)} unexpected "
                f"({', '.join(extra[:3])}{'...' if len(extra) > 3 else ''}), {len(missing)} "
                f"missing ({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''})"
            )
        for key in tensors:
            if key not in ours:
                continue
            m, t = self.module_for(key), tensors[key]
            for part, param in (("down", m.lora_down.weight), ("up", m.lora_up.weight)):
                if tuple(t[part].shape) != tuple(param.shape):
                    raise NetworkError(
                        f"{key}.{part}: shape {tuple(t[part].shape)} does not match the "
                        f"network's {tuple(param.shape)}"
                    )
            with torch.no_grad():
                m.lora_down.weight.copy_(t["down"])
                m.lora_up.weight.copy_(t["up"])
            m.set_alpha(float(t["alpha"]))

    def param_groups(self, unet_lr: float, text_encoder_lr: float | None) -> list[dict]:
        """Optimizer groups, text encoders first (kohya's order): ``text_encoder_lr`` None ->
        ``unet_lr``; a group whose lr is 0 is left out (those modules do not train), as kohya."""
        te_lr = unet_lr if text_encoder_lr is None else text_encoder_lr
        groups = []
        for name, comps, lr in (
            ("text_encoder", ("te1", "te2"), te_lr),
            ("unet", ("unet",), unet_lr),
        ):
            params = [p for k, m in self.items() if k.split(":", 1)[0] in comps
                      for p in m.parameters()]  # fmt: skip
            if params and lr:
                groups.append({"params": params, "lr": float(lr), "name": name})
        return groups


def _lora_forward(lora: LoRAModule):
    """The instance forward for the adapted layer: the LoRA module computes base + branch."""

    def forward(org_self, x, *args, **kwargs):
        return lora(x, *args, **kwargs)

    return forward

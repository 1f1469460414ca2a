"""What :func:`lorafuse.patching.patch_peft_model` did, module by module.

A :class:`PatchReport` is attached to the model as ``model.lorafuse_report``. It says how many LoRA
modules take the fused path, why every other one stays on PEFT's own forward, which
per-architecture fast paths (fused attention, MLP, RMSNorm, loss) were applied, and anything
the patcher wants the user to know. Nothing falls back silently: every stock-path module is
listed with its reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lorafuse import backends


@dataclass
class PatchReport:
    """The outcome of one ``patch_peft_model`` call.

    Attributes:
        backend: the kernel request (``auto``/``torch``/``cpp``/``triton``) and what it resolves to
            on the model's device, e.g. ``"auto -> cpp (cpu)"``.
        patched: qualified names of LoRA modules routed through the fused LoRA linear op.
        skipped: qualified name -> reason, for every LoRA module left on PEFT's stock forward.
        fast_paths: per-architecture fast path name -> number of modules it was applied to
            (``"llama.attention[lora_qkv]"``, ``"llama.mlp[lora_mlp]"``, ``"llama.rms_norm"``, ...).
        architecture: the model type seen (``config.model_type``) or None.
        notes: free-form lines (missing ops, unsupported architectures, semantics to know about).
    """

    backend: str = "auto"
    patched: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    fast_paths: dict[str, int] = field(default_factory=dict)
    architecture: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def n_patched(self) -> int:
        return len(self.patched)

    @property
    def n_lora(self) -> int:
        """All LoRA modules seen (patched + skipped)."""
        return len(self.patched) + len(self.skipped)

    @property
    def kernels(self) -> dict[str, str]:
        """Every kernel choice made so far in this process (``backends.choices()``): op (device)
        -> implementation and why. Read live: RMSNorm's dtype check, the attention self-test and
        the NF4 dequantiser choose at the first forward pass, after patching."""
        return backends.choices()

    def add_fast_path(self, name: str, count: int = 1) -> None:
        self.fast_paths[name] = self.fast_paths.get(name, 0) + count

    def summary(self) -> str:
        return f"patched {self.n_patched} of {self.n_lora} LoRA modules"

    def __str__(self) -> str:
        lines = [f"lorafuse: {self.summary()} (backend {self.backend})"]
        if self.architecture is not None:
            lines.append(f"  architecture: {self.architecture}")
        if self.fast_paths:
            lines.append("  fast paths applied:")
            lines += [f"    {name}: {n} module(s)" for name, n in sorted(self.fast_paths.items())]
        if self.skipped:
            lines.append("  left on the stock PEFT path:")
            by_reason = Counter(self.skipped.values())
            for reason, n in by_reason.most_common():
                names = [k for k, v in self.skipped.items() if v == reason]
                shown = ", ".join(names[:3]) + (
                    f", ... (+{len(names) - 3})" if len(names) > 3 else ""
                )
                lines.append(f"    {n} x {reason}: {shown}")
        lines += [f"  note: {note}" for note in self.notes]
        if variant := backends.cpp_variant():
            lines.append(f"  C++ kernels: {variant}")
        if kernels := self.kernels:
            lines.append("  kernels chosen so far:")
            lines += [f"    {op}: {choice}" for op, choice in kernels.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {
            "summary": self.summary(),
            "backend": self.backend,
            "patched": list(self.patched),
            "skipped": dict(self.skipped),
            "fast_paths": dict(self.fast_paths),
            "architecture": self.architecture,
            "notes": list(self.notes),
            "kernels": self.kernels,
            "cpp_variant": backends.cpp_variant(),
        }

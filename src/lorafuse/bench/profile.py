"""One profiled training step (``lorafuse bench --profile``): torch.profiler's table, and the step's
time split by the kind of work.

Every C++ kernel's entry point is a range named ``lorafuse::<kernel>`` (``LORAFUSE_PROFILE_RANGE``,
csrc/common.h), so its self time is that kernel's own work, and an autograd Function's self time
is what runs in Python around its kernels. MKL's bf16 GEMM is a range named by its caller
(``lora_rank_mkl_bf16_gemm``, ``attention_mkl_bf16_gemm``), so it counts with that kind. Self
times add up to the step's time on the calling thread: work a kernel hands to other threads
counts once, inside the range that waits for it.
"""

from __future__ import annotations

# Operators whose self time is a matrix product torch runs (oneDNN / MKL): the frozen weights'
# products, the lm_head's, a UNet's convolutions.
TORCH_PRODUCTS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_convolution",
    "aten::convolution_backward", "aten::_convolution", "aten::_slow_conv2d_forward",
    "aten::_slow_conv2d_backward",
})  # fmt: skip

# (kind, does an event of this name belong to it); the first match wins.
KINDS = (
    ("matrix products (torch)", lambda name: name in TORCH_PRODUCTS),
    ("LoRA rank-r products", lambda name: name.startswith("lorafuse::lora_rank_")),
    ("attention", lambda name: name.startswith(("lorafuse::attention", "aten::_scaled_dot_product"))),
    ("other lorafuse kernels", lambda name: name.startswith("lorafuse::")),
    ("optimizer", lambda name: name.startswith("Optimizer.") or "adam" in name.lower()),
    ("other torch ops", lambda name: name.startswith("aten::")),
    ("Python, autograd, the rest", lambda name: True),
)  # fmt: skip


def kind_of(name: str) -> str:
    return next(kind for kind, belongs in KINDS if belongs(name))


def seconds_by_kind(averages) -> dict[str, float]:
    """Self seconds per kind, in :data:`KINDS` order, from ``prof.key_averages()`` rows."""
    out = {kind: 0.0 for kind, _ in KINDS}
    for row in averages:
        out[kind_of(row.key)] += row.self_cpu_time_total / 1e6
    return out


def format_kinds(seconds: dict[str, float]) -> str:
    total = sum(seconds.values()) or 1.0
    parts = [f"{kind} {s:.3f} s ({s / total:.0%})" for kind, s in seconds.items() if s > 0]
    return f"where the step's {total:.3f} s go (self time by kind): " + "; ".join(parts)


def profiled(step) -> str:
    """Run ``step()`` once under torch.profiler; its table by self time, then :func:`format_kinds`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=40)
    return f"{table}\n{format_kinds(seconds_by_kind(averages))}"

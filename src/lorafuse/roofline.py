"""The matrix products a LoRA training step cannot avoid, and how long they take alone.

``lorafuse bench`` divides this time by each side's step time: efficiency = unavoidable product
seconds / step seconds. Each product is ``(M, K) @ (K, N)``, ``count`` times, 2*M*K*N FLOPs;
what is counted (frozen projections, LoRA products, lm_head, causal attention at half the
T x T work, no gradient nobody needs) is listed in docs/benchmarks.md (Roofline).
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_PRODUCTS = ("lora_xA", "lora_xAB", "lora_dB", "lora_gB", "lora_dA", "lora_dx")
ATTENTION_PRODUCTS = ("attn_QK", "attn_PV", "attn_dP", "attn_dV", "attn_dQ", "attn_dK")
# Largest operand the timer allocates for one batched product; bigger batches are timed on a
# slice and scaled (at 1 x 8192 one full score tensor is 9 x 8192^2 floats = 2.4 GB).
_MAX_TIMED_BYTES = 256 * 2**20
# Side of the square product that stands for the machine's peak: (n, n) @ (n, n). 2048^3 is 17
# GFLOP, ~0.1 s in fp32 on 2 cores, and on those cores already at the rate of 4096^3 (each thread
# works on 1024 x 2048 blocks, far past the kernels' blocking); GPUs get 8192.
PEAK_SIZE = {"cpu": 2048, "cuda": 8192}


class Product(NamedTuple):
    """``count`` matrix products ``(m, k) @ (k, n)``; ``group`` of them are issued as one batched
    call (attention: one per (sequence, head)); ``fraction`` of the work is needed (causal: 0.5)."""

    name: str
    m: int
    k: int
    n: int
    count: int
    group: int = 1
    fraction: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count * self.fraction


def _shapes(config) -> tuple[int, int, int, int, dict[str, tuple[int, int]]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = kv_heads * head_dim
    io = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
          "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter),
          "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # fmt: skip
    return hidden, heads, head_dim, config.vocab_size, io


def _first_layer_needs(targets: set[str]) -> dict[str, bool]:
    """In layer 0, whether the gradient of each projection's *input* is needed: only where a
    trainable adapter sits before it in that layer (the layer's input comes from the frozen
    embedding)."""
    qkv = bool(targets & {"q_proj", "k_proj", "v_proj"})  # before the attention output
    attn = qkv or "o_proj" in targets  # before the MLP input
    mlp_mid = attn or bool(targets & {"gate_proj", "up_proj"})  # before down_proj's input
    return {"q_proj": False, "k_proj": False, "v_proj": False, "o_proj": qkv,
            "gate_proj": attn, "up_proj": attn, "down_proj": mlp_mid}  # fmt: skip


def training_products(config, batch: int, seq: int, rank: int, targets) -> list[Product]:
    """The matrix products one LoRA training step cannot avoid (docs/benchmarks.md, Roofline).

    ``config`` is a transformers Llama-family config (hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size). One entry
    per product kind, its ``count`` summed over layers.
    """
    targets = set(targets)
    unknown = targets - set(PROJECTIONS)
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty subset of {PROJECTIONS}, got {targets}")
    if min(batch, seq, rank) < 1:
        raise ValueError(f"batch, seq and rank must be >= 1, got {batch}, {seq}, {rank}")
    hidden, heads, d, vocab, io = _shapes(config)
    layers, m = config.num_hidden_layers, batch * seq
    first = _first_layer_needs(targets)
    out: list[Product] = []
    for name in PROJECTIONS:
        fan_in, fan_out = io[name]
        dx_layers = layers - (0 if first[name] else 1)  # layers that need the input gradient
        out.append(Product(f"{name}.fwd", m, fan_in, fan_out, layers))
        if dx_layers:
            out.append(Product(f"{name}.dx", m, fan_out, fan_in, dx_layers))
        if name in targets:
            shapes = {"lora_xA": (m, fan_in, rank), "lora_xAB": (m, rank, fan_out),
                      "lora_dB": (fan_out, m, rank), "lora_gB": (m, fan_out, rank),
                      "lora_dA": (rank, m, fan_in), "lora_dx": (m, rank, fan_in)}  # fmt: skip
            for kind in LORA_PRODUCTS:
                n_layers = dx_layers if kind == "lora_dx" else layers
                if n_layers:
                    out.append(Product(f"{name}.{kind}", *shapes[kind], n_layers))
    out += _attention_products(targets, layers, batch * heads, seq, d)
    out.append(Product("lm_head.fwd", m, hidden, vocab, 1))
    out.append(Product("lm_head.dx", m, vocab, hidden, 1))
    return out


def _attention_products(targets: set[str], layers: int, group: int, t: int, d: int):
    """Causal score/value products per (sequence, head); layer 0 needs each backward product only
    where a gradient flows to a LoRA adapter through it."""
    q, k, v = ("q_proj" in targets), ("k_proj" in targets), ("v_proj" in targets)
    needed_in_first = {"attn_QK": True, "attn_PV": True, "attn_dP": q or k, "attn_dV": v,
                       "attn_dQ": q, "attn_dK": k}  # fmt: skip
    shapes = {"attn_QK": (t, d, t), "attn_PV": (t, t, d), "attn_dP": (t, d, t),
              "attn_dV": (t, t, d), "attn_dQ": (t, t, d), "attn_dK": (t, t, d)}  # fmt: skip
    out = []
    for kind in ATTENTION_PRODUCTS:
        n_layers = layers - (0 if needed_in_first[kind] else 1)
        if n_layers:
            out.append(Product(kind, *shapes[kind], n_layers * group, group=group, fraction=0.5))
    return out


def total_flops(products) -> float:
    return sum(p.flops for p in products)


# --------------------------------------------------------------------------------------------
# Timing.


def _time_call(fn, sync, reps: int, warmup: int) -> float:
    """Median seconds of ``fn()``; tiny calls are repeated inside one timing to ~2 ms."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    inner = max(1, min(1000, int(2e-3 / max(time.perf_counter() - t0, 1e-7))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def time_products(products, device="cpu", dtype=None, reps: int = 5, warmup: int = 2) -> dict:
    """Time each distinct shape of ``products`` alone; return the unavoidable seconds per step.

    ``dtype`` is the *model* dtype; products run in ``hardware.matmul_dtype(device, dtype)``
    (docs/benchmarks.md, Roofline). Returns ``{"seconds", "flops", "matmul_dtype", "products":
    [...]}`` where each product row has its per-step seconds. Set ``torch.set_num_threads`` before calling.
    """
    import torch

    from lorafuse.hardware import matmul_dtype

    device = torch.device(device)
    mm_dtype = matmul_dtype(device, dtype or torch.float32)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seen: dict[tuple[int, int, int, int], float] = {}  # (m, k, n, group) -> seconds per product
    rows, total = [], 0.0
    for p in products:
        key = (p.m, p.k, p.n, p.group)
        if key not in seen:
            seen[key] = _time_one(p, device, mm_dtype, sync, reps, warmup)
        seconds = seen[key] * p.count * p.fraction
        total += seconds
        rows.append({**p._asdict(), "flops": p.flops, "seconds": seconds})
    return {"seconds": total, "flops": total_flops(products), "matmul_dtype": str(mm_dtype),
            "products": rows}  # fmt: skip


def _time_one(p: Product, device, dtype, sync, reps: int, warmup: int) -> float:
    """Seconds for one (m, k) @ (k, n) product of ``p``'s shape, at ``p.group`` per call."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    itemsize = torch.empty((), dtype=dtype).element_size()
    biggest = max(p.m * p.k, p.k * p.n, p.m * p.n) * itemsize
    group = max(1, min(p.group, _MAX_TIMED_BYTES // max(biggest, 1)))  # a slice of the batch

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    if p.group == 1:
        a, b = rand(p.m, p.k), rand(p.k, p.n)
        out = torch.empty(p.m, p.n, device=device, dtype=dtype)
        return _time_call(lambda: torch.mm(a, b, out=out), sync, reps, warmup)
    a, b = rand(group, p.m, p.k), rand(group, p.k, p.n)
    out = torch.empty(group, p.m, p.n, device=device, dtype=dtype)
    return _time_call(lambda: torch.bmm(a, b, out=out), sync, reps, warmup) / group


def peak_product(device="cpu", dtype=None, reps: int = 5, warmup: int = 2) -> dict:
    """The machine's peak product rate: one ``(n, n) @ (n, n)`` product (``PEAK_SIZE``) in the
    roofline's dtype, timed alone. Returns ``{"gflops_per_s", "seconds", "size", "matmul_dtype"}``.
    Set ``torch.set_num_threads`` before calling."""
    import torch

    from lorafuse.hardware import matmul_dtype

    device = torch.device(device)
    mm_dtype = matmul_dtype(device, dtype or torch.float32)
    n = PEAK_SIZE.get(device.type, PEAK_SIZE["cpu"])
    p = Product("peak", n, n, n, 1)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds = _time_one(p, device, mm_dtype, sync, reps, warmup)
    return {"gflops_per_s": p.flops / seconds / 1e9, "seconds": seconds, "size": n,
            "matmul_dtype": str(mm_dtype)}  # fmt: skip

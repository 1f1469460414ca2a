"""Compile every Triton kernel launch of lorafuse for Hopper (sm_90) on a machine with no GPU.

The interpreter tests check the arithmetic; they cannot see what only the GPU compiler rejects
(types, layouts, constexpr misuse) or whether the GEMM gets wgmma and a pipelined K-loop. This
script runs the Python wrappers with every kernel's launch recorded instead of executed (CPU
tensors, device checks bypassed, GPU tile configs forced), derives each launch's signature the way
Triton's JIT specializes it (pointer and integer alignment to 16, integers equal to 1 as
constants), and compiles it with the ptxas that ships in the triton wheel.

    python tests/triton/compile_sm90.py      # must run WITHOUT TRITON_INTERPRET; exit 1 on failure
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_sm90.py: unset TRITON_INTERPRET (it compiles, it does not interpret)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lorafuse.ops import moe_lora_groups  # noqa: E402
from lorafuse.ops.moe_lora import Activation, ExpertStack  # noqa: E402
from lorafuse.triton import (  # noqa: E402
    cross_entropy,
    lora_linear,
    moe_lora,
    moe_lora_kernels,
    rms_norm,
    rope,
    swiglu,
)

MODULES = (lora_linear, rms_norm, rope, swiglu, cross_entropy, moe_lora, moe_lora_kernels)
TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}  # fmt: skip
LAUNCHES: list[tuple] = []


class _Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kw)`` records the launch."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kw: LAUNCHES.append((self.kernel, args, kw))


def _patch():
    for mod in MODULES:
        mod.check_device = lambda op, *ts: ts[0].device
        if hasattr(mod, "interpreted"):
            mod.interpreted = lambda device: False  # the GPU tile configs
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(mod, name, _Recorder(obj))


def _signature(kernel, args, kw):
    """(signature, constexprs, attrs, options) as the JIT would specialize this launch."""
    names = kernel.arg_names
    values = dict(zip(names, args))
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    values.update(kw)
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + DTYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # fresh allocations are 16-byte aligned
        elif kernel.params[i].is_constexpr or isinstance(v, (bool, str)):
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, int):
            if v == 1:
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name}={v!r} has no signature type")
    return sig, consts, attrs, options


def _run_wrappers(N, d, k, r, inter, V, dtype, adapter):
    """Every wrapper, forward and backward, with and without dropout/bias. Shapes as given."""
    x = torch.empty(N, d, dtype=dtype)
    W, b = torch.empty(k, d, dtype=dtype), torch.empty(k, dtype=dtype)
    A, B = torch.empty(r, d, dtype=adapter), torch.empty(k, r, dtype=adapter)
    mask, g = torch.ones(N, d, dtype=torch.bool), torch.empty(N, k, dtype=dtype)
    xa = torch.empty(N, r, dtype=adapter)
    for bias, m in ((None, None), (b, mask)):
        lora_linear.forward(x, W, bias, A, B, 2.0, m, 0.9)
        lora_linear.backward(g, x, W, A, B, xa, 2.0, m, 0.9, (True, True, True, True))
    w = torch.empty(d, dtype=dtype)
    rms_norm.forward(x, w, 1e-6)
    rms_norm.backward(x, x, w, torch.empty(N, dtype=torch.float32), (True, True))
    h = torch.empty(N, inter, dtype=dtype)
    swiglu.forward(h, h)
    swiglu.backward(h, h, h)
    q, kk = (
        torch.empty(2, 32, N // 2, 128, dtype=dtype),
        torch.empty(2, 8, N // 2, 128, dtype=dtype),
    )
    cs = torch.empty(2, N // 2, 128, dtype=torch.float32)
    rope.forward(q, kk, cs, cs)
    rope.backward(q, kk, cs, cs)
    cross_entropy.chunk_forward_backward(
        torch.empty(64, V, dtype=torch.float32), torch.zeros(64, dtype=torch.int64), -100, 1.0
    )


def _run_moe(T, H, inner, E, K, r, dtype, gpt_oss):
    """The expert-LoRA forward and backward (saved and recomputed), Qwen3-MoE's SwiGLU or
    gpt-oss's clamped, interleaved, transposed experts with biases; a real routing (the tile
    table is built from it), every other value left unset."""

    def stack(out_dim, in_dim):
        shape = (E, in_dim, out_dim) if gpt_oss else (E, out_dim, in_dim)
        b = torch.empty(E, out_dim, dtype=dtype) if gpt_oss else None
        lora_b = torch.empty(out_dim, r, E).permute(2, 0, 1)  # PEFT's (out, r·E) view
        return ExpertStack(torch.empty(shape, dtype=dtype), b, torch.empty(E, r, in_dim), lora_b,
                           2.0, gpt_oss)  # fmt: skip

    act = Activation("clamped_swiglu", interleaved=True) if gpt_oss else Activation("swiglu")
    order, counts = moe_lora_groups.route(torch.randn(T, E).topk(K, dim=-1).indices, E)
    tok = torch.div(order, K, rounding_mode="floor")
    args = (torch.empty(T, H, dtype=dtype), tok, torch.empty(T * K, dtype=dtype), counts,
            stack(2 * inner, H), stack(H, inner), act)  # fmt: skip
    _, saved = moe_lora.forward(*args, save=True)
    g = torch.empty(T, H, dtype=dtype)
    moe_lora.backward(g, *args, True, True, True, saved)
    moe_lora.backward(g, *args, True, True, True)


def main() -> int:
    _patch()
    _run_moe(512, 2048, 768, 16, 8, 16, torch.bfloat16, False)  # Qwen3-30B-A3B's geometry
    _run_moe(256, 2880, 2880, 8, 4, 16, torch.bfloat16, True)  # gpt-oss-20b's
    _run_moe(64, 64, 48, 4, 2, 8, torch.float32, False)
    _run_wrappers(2048, 4096, 4096, 16, 11008, 32000, torch.bfloat16, torch.bfloat16)
    _run_wrappers(2048, 4096, 11008, 16, 64, 1000, torch.bfloat16, torch.float32)
    _run_wrappers(32, 64, 48, 8, 64, 1000, torch.float32, torch.float32)
    seen, failures = set(), 0
    for kernel, args, kw in LAUNCHES:
        sig, consts, attrs, options = _signature(kernel, args, dict(kw))
        key = (kernel.__name__, tuple(sorted(sig.items())), tuple(sorted(map(str, consts.items()))))
        if key in seen:
            continue
        seen.add(key)
        label = f"{kernel.__name__} {consts}"
        t0 = time.time()
        try:
            out = triton.compile(
                ASTSource(kernel, sig, consts, attrs), target=TARGET, options=options
            )
        except Exception as err:  # report every failing launch, not only the first
            failures += 1
            print(f"FAIL {label}\n     {type(err).__name__}: {str(err)[:2000]}", flush=True)
            continue
        ttgir = out.asm["ttgir"]
        extra = ""
        if "dot" in ttgir:
            extra = (f" wgmma={ttgir.count('warp_group_dot ')}"
                     f" async_copies={ttgir.count('async_copy_global_to_local')}")  # fmt: skip
        print(
            f"ok   {label} shared={out.metadata.shared}B{extra} ({time.time() - t0:.1f}s)",
            flush=True,
        )
    print(f"{len(seen)} distinct launches compiled for sm_90, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Parity of every C++ op against its torch reference, small shapes, fp32 and bf16: a check for a
build run where pytest and transformers are not (emulators, foreign architectures, a wheel).

Imports only torch and lorafuse's ops (the references are the ops' own ``*_reference`` functions);
each op runs forward and backward where it has one. fp32: the same math in another order, 1e-5
(STYLE.md). bf16: the kernel on bf16 inputs against the fp32 reference on the same values upcast;
the kernels sum in fp32 and round once, so a few bf16 half-ulps: 2**-7 relative (2 ulps), with an
absolute 2**-7 times the term scale for gradients (sums of O(1) terms), as tests/ops do.

Usage: python scripts/cpp_parity.py [--prebuilt DIR]
  --prebuilt DIR: load the module from DIR (``lorafuse_cpp_<variant><EXT_SUFFIX>`` next to a
  ``TORCH_VERSION`` stamp), as an installed wheel does, instead of building it; fails if it
  is not used.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

BF16 = torch.bfloat16
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=2**-7, rtol=2**-7)}
results: list[str] = []


def check(name: str, got, want, dtype) -> None:
    """Each of ``got`` close to ``want``: rtol as TOL, atol TOL's times the output's largest
    magnitude (at least 1), the scale of the terms summed into it."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        tol = dict(TOL[dtype])
        tol["atol"] *= max(1.0, w.abs().max().item())
        torch.testing.assert_close(
            g.float(), w.float(), **tol, msg=lambda m, i=i: f"{name}[{i}]: {m}"
        )
    results.append(f"{name} {str(dtype).removeprefix('torch.')}")


def grads(fn, *inputs, frozen=()):
    """fn(*inputs) and d(sum(out * fixed weights))/d(inputs), one backward; inputs at the
    ``frozen`` positions get no gradient (a LoRA layer's base weight and bias). The weights (the
    upstream gradient) are rounded to the output's dtype, so a bf16 run and its fp32 reference
    start the backward from the same values."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point() and i not in frozen)
              for i, t in enumerate(inputs)]  # fmt: skip
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.dtype).float()).sum()
               for o in outs)  # fmt: skip
    loss.backward()
    return (*outs, *(t.grad for t in leaves if t.requires_grad))


def upcast(*ts):
    return [t.float() if t is not None and t.is_floating_point() else t for t in ts]


def randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def lora_linear(dtype, gen):
    from lorafuse.ops.lora_linear import lora_linear, lora_linear_reference

    x, w, b = randn(37, 129, dtype=dtype, gen=gen), randn(65, 129, dtype=dtype, gen=gen, scale=0.1), randn(65, dtype=dtype, gen=gen)  # fmt: skip
    A, B = randn(8, 129, dtype=dtype, gen=gen, scale=0.1), randn(65, 8, dtype=dtype, gen=gen)
    fast = grads(lambda *t: lora_linear(*t, 2.0, backend="cpp"), x, w, b, A, B, frozen=(1, 2))
    ref = grads(lambda *t: lora_linear_reference(*t, 2.0), *upcast(x, w, b, A, B), frozen=(1, 2))
    check("lora_linear", fast, ref, dtype)


def rms_norm(dtype, gen):
    from lorafuse.ops.rms_norm import rms_norm, rms_norm_reference

    x, w = randn(37, 129, dtype=dtype, gen=gen), randn(129, dtype=dtype, gen=gen)
    fast = grads(lambda *t: rms_norm(*t, 1e-6, backend="cpp"), x, w)
    ref = grads(lambda *t: rms_norm_reference(*t, 1e-6), *upcast(x, w))
    check("rms_norm", fast, ref, dtype)


def swiglu(dtype, gen):
    from lorafuse.ops.swiglu import swiglu, swiglu_reference

    g, u = randn(37, 129, dtype=dtype, gen=gen), randn(37, 129, dtype=dtype, gen=gen)
    fast = grads(lambda *t: swiglu(*t, backend="cpp"), g, u)
    check("swiglu", fast, grads(swiglu_reference, *upcast(g, u)), dtype)


def rope(dtype, gen):
    from lorafuse.ops.rope import apply_rope, rope_reference

    q, k = randn(2, 4, 7, 18, dtype=dtype, gen=gen), randn(2, 2, 7, 18, dtype=dtype, gen=gen)
    angle = torch.randn(1, 7, 18, generator=gen)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    fast = grads(lambda q, k: apply_rope(q, k, cos, sin, backend="cpp"), q, k)
    ref = grads(lambda q, k: rope_reference(q, k, *upcast(cos, sin)), *upcast(q, k))
    check("rope", fast, ref, dtype)


def attention(dtype, gen):
    from lorafuse.ops.attention import causal_attention, causal_attention_reference

    q, k, v = (randn(1, 3, 9, 16, dtype=dtype, gen=gen) for _ in range(3))
    fast = grads(lambda *t: causal_attention(*t, 0.25, backend="cpp"), q, k, v)
    ref = grads(lambda *t: causal_attention_reference(*t, 0.25), *upcast(q, k, v))
    check("attention", fast, ref, dtype)


def cross_entropy(dtype, gen):
    from lorafuse.ops.cross_entropy import (
        fused_linear_cross_entropy,
        linear_cross_entropy_reference,
    )

    h, w = randn(23, 64, dtype=dtype, gen=gen), randn(257, 64, dtype=dtype, gen=gen, scale=0.1)
    t = torch.randint(0, 257, (23,), generator=gen)
    t[3] = -100  # an ignored row
    fast = grads(lambda h, w: fused_linear_cross_entropy(h, w, t, backend="cpp"), h, w)
    ref = grads(lambda h, w: linear_cross_entropy_reference(h, w, t), *upcast(h, w))
    check("cross_entropy", fast, ref, dtype)


def lora_conv2d(dtype, gen):
    from lorafuse.ops.lora_conv import lora_conv2d, lora_conv2d_reference

    x, w = randn(2, 6, 9, 9, dtype=dtype, gen=gen), randn(10, 6, 3, 3, dtype=dtype, gen=gen, scale=0.2)  # fmt: skip
    b = randn(10, dtype=dtype, gen=gen)
    down, up = randn(4, 6, 3, 3, dtype=dtype, gen=gen, scale=0.2), randn(10, 4, 1, 1, dtype=dtype, gen=gen)  # fmt: skip
    conv = dict(padding=1, backend="cpp")
    fast = grads(lambda *t: lora_conv2d(*t, 0.5, **conv), x, w, b, down, up, frozen=(1, 2))
    ref = grads(lambda *t: lora_conv2d_reference(*t, 0.5, padding=1), *upcast(x, w, b, down, up),
                frozen=(1, 2))  # fmt: skip
    check("lora_conv2d", fast, ref, dtype)


def decode_linear(dtype, gen):
    if dtype != BF16:  # the decode kernel multiplies bf16/fp16 rows only
        return
    from lorafuse.ops.decode_linear import decode_linear

    x, w = randn(3, 200, dtype=dtype, gen=gen), randn(70, 200, dtype=dtype, gen=gen, scale=0.1)
    b = randn(70, dtype=dtype, gen=gen)
    want = torch.nn.functional.linear(*upcast(x, w, b))
    check("decode_linear", decode_linear(x, w, b), want, dtype)


def nf4(dtype, gen):
    """The C++ dequantiser (plain and SIMD bodies) and NF4 decode, bit-identical to torch's."""
    from lorafuse import _ext
    from lorafuse.ops import nf4 as fmt

    ext = _ext.load_cpp()
    q = fmt.quantize_nf4(torch.randn(48, 256, generator=gen))
    bufs = (q["codes"], q["absmax_q"], q["absmax_scale"], q["absmax_offset"])
    want = fmt.dequantize_nf4(*bufs, (48, 256), dtype)
    for simd in (False, True):
        out = torch.empty(48, 256, dtype=dtype)
        ext.nf4_dequantize_forward(*bufs, out, simd=simd)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    if dtype == BF16:
        x = randn(2, 256, dtype=dtype, gen=gen)
        got = ext.nf4_decode_linear(x, *bufs, 48)
        check("nf4_decode_linear", got, x.float() @ want.float().T, dtype)
    results.append(f"nf4_dequantize {str(dtype).removeprefix('torch.')} (bit-identical)")


CHECKS = (lora_linear, rms_norm, swiglu, rope, attention, cross_entropy, lora_conv2d,
          decode_linear, nf4)  # fmt: skip


def count_calls(ext) -> list[int]:
    """Wraps every function of the loaded module to count its calls (the ops look them up on
    first use, after this), so that a check through an op that never reached C++ fails."""
    calls = [0]

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in dir(ext):
        if not name.startswith("_") and callable(getattr(ext, name)):
            setattr(ext, name, counted(getattr(ext, name)))
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prebuilt", type=Path, help="load the module from this directory")
    args = parser.parse_args()
    from lorafuse import _ext, backends

    if args.prebuilt:
        _ext.PREBUILT = args.prebuilt.resolve()
    start = time.perf_counter()
    calls = count_calls(_ext.load_cpp())
    origin = backends.cpp_variant()
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), C++ kernels: "
          f"{origin}, loaded in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    if args.prebuilt and not origin.endswith("(prebuilt)"):
        print(f"FAIL: the module in {args.prebuilt} was not used", file=sys.stderr)
        return 1
    for dtype in (torch.float32, BF16):
        for fn in CHECKS:
            before = calls[0]
            fn(dtype, torch.Generator().manual_seed(0))
            if calls[0] == before and (fn is not decode_linear or dtype == BF16):
                print(f"FAIL: {fn.__name__} {dtype} ran no C++ function", file=sys.stderr)
                return 1
    print(f"parity OK ({len(results)} checks): {', '.join(results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

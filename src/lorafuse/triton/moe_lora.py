"""Triton fused mixture-of-experts LoRA: grouped GEMMs over (expert, row-tile) programs.

Contract: :func:`lorafuse.ops.moe_lora_groups.forward` / ``backward`` (same arguments, same
results). Shapes: x (T, H); the S = T·K routed pairs sorted by expert (``tok`` (S,) their token
rows, ``ws`` (S,) their router weights, ``counts`` (E,) pairs per expert, on the CPU); a stack
(:class:`~lorafuse.ops.moe_lora_groups.ExpertStack`) W (E, out, in) or (E, in, out)
(``transposed``), bias (E, out), A (E, r, in), B (E, out, r), any strides.

The tile table (:func:`_plan`) lists one (expert, first row, end row) per BLOCK_M rows of each
expert's contiguous slice: experts with no pair get no program. Every grouped kernel
(:mod:`.moe_lora_kernels`) runs one program per (tile, column tile) and reads its expert's
weights through strides (no copy, no dense ``W + s·B·A``). Forward:

* ``xa = x[tok]·A_guᵀ`` (S, r) fp32 (``rank_kernel``);
* ``gate_up_kernel``: gate and up tiles of ``x[tok]·W_guᵀ + b + s·xa·B_guᵀ`` side by side (one K
  loop, two accumulators), rounded to x's dtype (``z``, stored only for backward), then the
  activation (SwiGLU or gpt-oss's clamped, halves or interleaved) in fp32: ``h`` (S, I);
* ``ha = h·A_dᵀ``; ``grouped_kernel``: ``ws·(h·W_dᵀ + b + s·ha·B_dᵀ)`` (S, H) fp32;
  ``combine_kernel`` sums each token's K rows in fp32 (no atomics: deterministic).

Saved (by the op): ``z`` (S, 2I) in x's dtype and ``xa``; recomputed here when none is passed
(the custom op under ``torch.compile``). Backward: ``gb = g[tok]·B_d``; ``down_bwd_kernel``:
``u = g[tok]·W_d + s·gb·A_d``, and in its epilogue ``h`` again from ``z``, the router-weight
partial sums ``Σ h·u`` per column tile, and the activation's backward of ``ws·u``: ``dz``
(S, 2I) fp32; ``gbz = s·dz·B_gu``; ``grouped_kernel``: ``dz·W_gu + gbz·A_gu`` per pair, then
``combine_kernel``: dx. Each LoRA gradient is a per-expert sum over the expert's rows
(``outer_kernel``: one program per expert and output tile; an expert without rows reads and
writes nothing). fp32 buffers of (S, H) and (S, 2I) hold per-pair rows between launches.
NF4 expert stacks are not taken (the op runs torch for them, with a warning).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from lorafuse.triton import moe_lora_kernels as kern
from lorafuse.triton._common import (
    check_contiguous,
    check_device,
    dot_precision,
    interpreted,
    pow2_at_least,
)

F32 = torch.float32
CLAMPED = "clamped_swiglu"


class _Plan(NamedTuple):
    tiles: torch.Tensor  # (3, n_tiles) int32: expert, first row, end row
    n_tiles: int
    offsets: torch.Tensor  # (E + 1,) int32 on the device
    pos: torch.Tensor  # (S,) each token's K sorted pair rows, token by token
    cfg: dict  # BLOCK_M/N/K, num_warps, num_stages
    prec: str  # tl.dot precision of the base products


def _blocks(device, dtype) -> dict:
    """Tile sizes. Not tuned on a GPU yet (benchmarks/ops/gpu_all.py times them); the
    interpreter gets 16s so small test shapes still run several row, column and K tiles."""
    if interpreted(device):
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
    if dtype in (torch.bfloat16, torch.float16):
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)  # IEEE fp32


def _plan(tok, counts, x) -> _Plan:
    """The tile table from the per-expert counts (host side: they are on the CPU already)."""
    cfg = _blocks(x.device, x.dtype)
    bm = cfg["BLOCK_M"]
    counts = counts.to(torch.int64).cpu()  # (E,)
    ends = counts.cumsum(0)
    per = (counts + bm - 1) // bm  # (E,) tiles per expert; 0 for an expert without pairs
    expert = torch.repeat_interleave(torch.arange(counts.numel()), per)  # (n_tiles,)
    first = (per.cumsum(0) - per)[expert]
    start = (ends - counts)[expert] + (torch.arange(expert.numel()) - first) * bm
    tiles = torch.stack([expert, start, ends[expert]]).to(torch.int32).to(x.device)
    offsets = torch.cat([ends.new_zeros(1), ends]).to(torch.int32).to(x.device)
    pos = torch.argsort(tok, stable=True)  # (S,) token-major; within a token, expert order
    return _Plan(tiles, int(expert.numel()), offsets, pos, cfg, dot_precision(x.dtype))


def _strides(p) -> tuple[int, int, int]:
    """``(expert, in, out)`` element strides of the base weight W."""
    w = p.weight
    return (w.stride(0), w.stride(1), w.stride(2)) if p.transposed else (
        w.stride(0), w.stride(2), w.stride(1))  # fmt: skip


def _launch_cfg(plan) -> dict:
    return dict(BLOCK_M=plan.cfg["BLOCK_M"], num_warps=plan.cfg["num_warps"])


def _rank(plan, src, tok, m, m_strides, k, scale, gather) -> torch.Tensor:
    """``(S, r)`` fp32: ``scale·src[rows]·M_eᵀ``, ``m`` (E, r, K) given by ``m_strides``."""
    r = m_strides[3]
    out = torch.empty((tok.numel(), r), dtype=F32, device=src.device)
    kern.rank_kernel[(plan.n_tiles,)](
        src, src.stride(0), tok, plan.tiles, plan.n_tiles, m, *m_strides[:3], out, k, r,
        float(scale), GATHER=gather, BLOCK_K=min(64, plan.cfg["BLOCK_K"]),
        BLOCK_R=pow2_at_least(r), PREC=dot_precision(F32), **_launch_cfg(plan),
    )  # fmt: skip
    return out


def _a_view(p):  # A (E, r, in) as an (E, r, K=in) matrix: (expert, r, k) strides and r
    a = p.lora_A
    return (a.stride(0), a.stride(1), a.stride(2), a.shape[1])


def _bt_view(p):  # B (E, out, r) read as Bᵀ (E, r, K=out)
    b = p.lora_B
    return (b.stride(0), b.stride(2), b.stride(1), b.shape[2])


def _gate_up(plan, x, tok, gu, act, width, save):
    """``(z (S, 2I) or None, xa (S, r) or None, h (S, I))``."""
    S, H = tok.numel(), x.shape[1]
    lora = gu.lora_A is not None
    xa = _rank(plan, x, tok, gu.lora_A, _a_view(gu), H, 1.0, True) if lora else None
    h = torch.empty((S, width // 2), dtype=x.dtype, device=x.device)
    z = torch.empty((S, width), dtype=x.dtype, device=x.device) if save else h
    se, s_in, s_out = _strides(gu)
    b = gu.lora_B if lora else h
    r = b.shape[2] if lora else 0
    b_strides = (b.stride(0), b.stride(2), b.stride(1)) if lora else (0, 0, 0)  # Bᵀ (r, 2I)
    bn = plan.cfg["BLOCK_N"]
    cs, up0 = (2, 1) if act.interleaved else (1, width // 2)
    kern.gate_up_kernel[(plan.n_tiles, triton.cdiv(width // 2, bn))](
        x, x.stride(0), tok, plan.tiles, plan.n_tiles, gu.weight, se, s_in, s_out,
        gu.bias if gu.bias is not None else h, 0 if gu.bias is None else gu.bias.stride(0),
        xa if lora else h, r, b, *b_strides, float(gu.scaling),
        z, h, width // 2, H, cs, up0, float(act.alpha), float(act.limit),
        HAS_BIAS=gu.bias is not None, HAS_LORA=lora, SAVE=save, CLAMPED=act.kind == CLAMPED,
        BLOCK_N=bn, BLOCK_K=plan.cfg["BLOCK_K"], BLOCK_R=pow2_at_least(r),
        PREC=plan.prec, PREC_R=dot_precision(F32), num_stages=plan.cfg["num_stages"],
        **_launch_cfg(plan),
    )  # fmt: skip
    return (z if save else None), xa, h


def _grouped(plan, src, tok, w, w_strides, k, n, bias, z, lora_mat, l_strides, scale, ws, gather):
    """``(S, n)`` fp32: ``ws·(src[rows]·W_e + b_e + scale·z·L_e)``, W_e (k, n) and L_e (r, n)
    given by ``(expert, k, n)`` / ``(expert, r, n)`` strides."""
    out = torch.empty((tok.numel(), n), dtype=F32, device=src.device)
    lora = z is not None
    bn = plan.cfg["BLOCK_N"]
    kern.grouped_kernel[(plan.n_tiles, triton.cdiv(n, bn))](
        src, src.stride(0), tok, plan.tiles, plan.n_tiles, w, *w_strides,
        bias if bias is not None else out, 0 if bias is None else bias.stride(0),
        z if lora else out, z.shape[1] if lora else 0, lora_mat if lora else out,
        *(l_strides if lora else (0, 0, 0)), float(scale), ws if ws is not None else out, out,
        k, n, GATHER=gather, HAS_BIAS=bias is not None, HAS_LORA=lora, HAS_WS=ws is not None,
        BLOCK_N=bn, BLOCK_K=plan.cfg["BLOCK_K"], BLOCK_R=pow2_at_least(z.shape[1] if lora else 1),
        PREC=plan.prec, PREC_R=dot_precision(F32), num_stages=plan.cfg["num_stages"],
        **_launch_cfg(plan),
    )  # fmt: skip
    return out


def _combine(plan, rows, n_tokens, dtype):
    """``(T, N)`` in ``dtype``: each token's K per-pair rows of ``rows`` (S, N) summed in fp32."""
    S, N = rows.shape
    out = torch.empty((n_tokens, N), dtype=dtype, device=rows.device)
    bt, bn = 16, min(128, pow2_at_least(N))
    kern.combine_kernel[(triton.cdiv(n_tokens, bt), triton.cdiv(N, bn))](
        rows, plan.pos, out, n_tokens, N, S // n_tokens, BLOCK_T=bt, BLOCK_N=bn, num_warps=4
    )
    return out


def _check(x, tok, ws, gu, down, *more):
    tensors = [x, tok, ws, *more]
    for p in (gu, down):
        if not isinstance(p.weight, torch.Tensor):
            raise ValueError("lorafuse.triton.moe_lora: NF4 expert stacks are not supported")
        tensors += [p.weight, p.bias, p.lora_A, p.lora_B]
    check_device("moe_lora", *tensors)
    check_contiguous("moe_lora", x=x, tok=tok, ws=ws)
    for p, name in ((gu, "gate_up"), (down, "down")):
        check_contiguous("moe_lora", **{f"{name} bias": p.bias})


def forward(x, tok, ws, counts, gu, down, act, save=False):
    """``(out (T, H) in x's dtype, (z, xa))``: see :func:`lorafuse.ops.moe_lora_groups.forward`."""
    _check(x, tok, ws, gu, down)
    T, H = x.shape
    width = gu.weight.shape[2] if gu.transposed else gu.weight.shape[1]  # 2I
    if tok.numel() == 0:
        return torch.zeros_like(x), (None, None)
    plan = _plan(tok, counts, x)
    z, xa, h = _gate_up(plan, x, tok, gu, act, width, save)
    se, s_in, s_out = _strides(down)
    ha, lb = None, None
    if down.lora_A is not None:
        ha = _rank(plan, h, tok, down.lora_A, _a_view(down), width // 2, 1.0, False)  # (S, r)
        lb = down.lora_B
    l_strides = None if lb is None else (lb.stride(0), lb.stride(2), lb.stride(1))  # Bᵀ (r, H)
    y = _grouped(plan, h, tok, down.weight, (se, s_in, s_out), width // 2, H, down.bias, ha, lb,
                 l_strides, down.scaling, ws, False)  # (S, H) fp32, router weights applied  # fmt: skip
    return _combine(plan, y, T, x.dtype), (z, xa)


def _outer(plan, left, ltok, right, rtok, ws, out, scale):
    """``out[e]`` (P, Q) = scale·Σ over expert e's rows of (ws·)left[row]ᵀ·right[row]; ``ltok`` /
    ``rtok``: read that side's rows through the token index (x, g). ``out`` is zeroed."""
    E, P, Q = out.shape
    cap = plan.cfg["BLOCK_N"]
    bp, bq = min(cap, pow2_at_least(P)), min(cap, pow2_at_least(Q))
    kern.outer_kernel[(E, triton.cdiv(P, bp), triton.cdiv(Q, bq))](
        left, left.stride(0), ltok if ltok is not None else plan.offsets, right, right.stride(0),
        rtok if rtok is not None else plan.offsets, ws if ws is not None else left, plan.offsets,
        out, *out.stride(), P, Q, float(scale), L_GATHER=ltok is not None,
        R_GATHER=rtok is not None, HAS_WS=ws is not None, BLOCK_P=bp, BLOCK_Q=bq,
        PREC=dot_precision(F32), **_launch_cfg(plan),
    )  # fmt: skip
    return out


def _zeros(t, need):
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device) if need and t is not None else None


def _down_backward(plan, g, tok, ws, z, down, act, width):
    """``(h (S, I), dz (S, 2I) fp32, Σ h·u per pair (S,) fp32, gb (S, r) or None)``."""
    S, H, inner = tok.numel(), g.shape[1], width // 2
    lora = down.lora_A is not None
    gb = _rank(plan, g, tok, down.lora_B, _bt_view(down), H, 1.0, True) if lora else None
    bn = plan.cfg["BLOCK_N"]
    n_col = triton.cdiv(inner, bn)
    h = torch.empty((S, inner), dtype=g.dtype, device=g.device)
    dz = torch.empty((S, width), dtype=F32, device=g.device)
    hu = torch.empty((S, n_col), dtype=F32, device=g.device)  # partial Σ h·u per column tile
    se, s_in, s_out = _strides(down)
    a = down.lora_A if lora else dz
    r = a.shape[1] if lora else 0
    cs, up0 = (2, 1) if act.interleaved else (1, inner)
    kern.down_bwd_kernel[(plan.n_tiles, n_col)](
        g, g.stride(0), tok, plan.tiles, plan.n_tiles, down.weight, se, s_out, s_in,
        gb if lora else dz, r, a, *(a.stride() if lora else (0, 0, 0)), float(down.scaling),
        z, ws, h, dz, hu, n_col, inner, H, cs, up0, float(act.alpha), float(act.limit),
        HAS_LORA=lora, CLAMPED=act.kind == CLAMPED, BLOCK_N=bn, BLOCK_K=plan.cfg["BLOCK_K"],
        BLOCK_R=pow2_at_least(r), PREC=plan.prec, PREC_R=dot_precision(F32),
        num_stages=plan.cfg["num_stages"], **_launch_cfg(plan),
    )  # fmt: skip
    return h, dz, hu.sum(1), gb


def backward(g, x, tok, ws, counts, gu, down, act, need_x, need_ws, need_lora,
             saved=(None, None)):  # fmt: skip
    """``(dx (T, H), dws (S,) fp32, dA_gu, dB_gu, dA_d, dB_d)``, None where not needed; see
    :func:`lorafuse.ops.moe_lora_groups.backward`."""
    _check(x, tok, ws, gu, down, g)
    check_contiguous("moe_lora", g=g)
    T, H = x.shape
    width = gu.weight.shape[2] if gu.transposed else gu.weight.shape[1]  # 2I
    dA_gu, dB_gu = _zeros(gu.lora_A, need_lora), _zeros(gu.lora_B, need_lora)
    dA_d, dB_d = _zeros(down.lora_A, need_lora), _zeros(down.lora_B, need_lora)
    if tok.numel() == 0:
        dws = torch.zeros(0, dtype=F32, device=x.device) if need_ws else None
        return (torch.zeros_like(x) if need_x else None), dws, dA_gu, dB_gu, dA_d, dB_d
    plan = _plan(tok, counts, x)
    z, xa = saved
    if z is None or (gu.lora_A is not None and xa is None):  # not saved: recompute from x
        z, xa, _ = _gate_up(plan, x, tok, gu, act, width, True)
    h, dz, dws, gb = _down_backward(plan, g, tok, ws, z, down, act, width)
    if need_ws and down.bias is not None:  # + g·b_d per pair
        expert = torch.repeat_interleave(torch.arange(len(counts)), counts.cpu()).to(x.device)
        dws = dws + (g.index_select(0, tok).to(F32) * down.bias.to(F32)[expert]).sum(1)
    if dA_d is not None:
        ha = _rank(plan, h, tok, down.lora_A, _a_view(down), width // 2, 1.0, False)  # (S, r)
        _outer(plan, g, tok, ha, None, ws, dB_d, down.scaling)  # (E, H, r)
        _outer(plan, gb, None, h, None, ws, dA_d, down.scaling)  # (E, r, I)
    gbz = None
    if gu.lora_A is not None and (need_x or need_lora):
        gbz = _rank(plan, dz, tok, gu.lora_B, _bt_view(gu), width, gu.scaling, False)  # (S, r)
    if dA_gu is not None:
        _outer(plan, dz, None, xa, None, None, dB_gu, gu.scaling)  # (E, 2I, r)
        _outer(plan, gbz, None, x, tok, None, dA_gu, 1.0)  # (E, r, H)
    dx = None
    if need_x:
        se, s_in, s_out = _strides(gu)
        a = gu.lora_A
        rows = _grouped(plan, dz, tok, gu.weight, (se, s_out, s_in), width, H, None, gbz, a,
                        None if a is None else a.stride(), 1.0, None, False)  # (S, H) fp32  # fmt: skip
        dx = _combine(plan, rows, T, x.dtype)
    return dx, (dws if need_ws else None), dA_gu, dB_gu, dA_d, dB_d

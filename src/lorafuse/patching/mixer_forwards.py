"""The forwards of the hybrids' stateful token mixers on lorafuse's ops, with example boundaries.

Bound per instance by :mod:`lorafuse.patching.mixers` in place of transformers' forward:

* :func:`gated_delta_net_forward`: Qwen3.5 / Qwen3.5-MoE / Qwen3-Next Gated DeltaNet (projections
  -> causal conv1d + SiLU over q, k, v -> gated delta rule with L2-normalised q/k -> gated RMSNorm
  -> out_proj);
* :func:`short_conv_forward`: LFM2 / LFM2-MoE short convolution (in_proj to B, C, x -> conv1d over
  B * x -> C * conv -> out_proj);
* :func:`mamba2_forward`: Granite 4's Mamba2 layer (in_proj to gate, xBC, dt -> conv1d + SiLU over
  xBC -> SSD scan with D skip -> gated RMSNorm -> out_proj).

Each reads the :class:`~lorafuse.patching.segments.Segments` the decoder model found for this
forward (keyword :data:`SEGMENTS`; absent: from the 2D padding mask alone) and runs the ops over the
batch flattened to one row with those boundaries, so no state crosses a packed example or comes
from padding. The projections, norms and out_proj are the module's own submodules (PEFT LoRA layers
and other fast paths apply to them unchanged). Decode-time states live in transformers' cache
(:class:`~lorafuse.patching.mixer_cache.MixerCache`). With one example per row and no padding the
math is transformers' own, op for op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorafuse.ops.causal_conv1d import causal_conv1d
from lorafuse.ops.gated_delta import gated_delta_rule
from lorafuse.ops.mamba2_scan import mamba2_scan
from lorafuse.patching import segments as seg_mod
from lorafuse.patching.mixer_cache import MixerCache

SEGMENTS = "lorafuse_segments"  # the keyword the decoder model hands every mixer


def _segments(kwargs, attention_mask, batch: int, length: int):
    if SEGMENTS in kwargs:
        return kwargs[SEGMENTS]
    return seg_mod.find(None, attention_mask, batch, length)


def _flat(x: torch.Tensor, seg) -> torch.Tensor:
    """(B, T, ...) -> (1, B*T, ...) when the batch runs as one row of examples."""
    return x if seg is None else x.reshape(1, -1, *x.shape[2:])


def _conv(conv: torch.nn.Conv1d, x, activation, state: MixerCache, seg):
    """Causal depthwise conv over ``x`` (B, D, T) with the segments and the cached inputs:
    ``(y (B, D, T), final (B, D, K - 1) or None)``."""
    b, d, t = x.shape
    weight = conv.weight[:, 0]  # (D, K)
    if seg is None:
        return causal_conv1d(x, weight, conv.bias, activation=activation,
                             initial_state=state.conv, output_final_state=state.keeps)  # fmt: skip
    flat = x.transpose(0, 1).reshape(1, d, b * t)  # (1, D, B*T): row b's tokens at b*T + t
    y, final = causal_conv1d(
        flat, weight, conv.bias, activation=activation, initial_state=seg.initial(state.conv),
        output_final_state=state.keeps, cu_seqlens=seg.cu_seqlens,
    )  # fmt: skip
    return y.view(d, b, t).transpose(0, 1), seg.final(final)


def _rows(y: torch.Tensor, seg, batch: int) -> torch.Tensor:
    """(1, B*T, ...) -> (B, T, ...) after a flattened op."""
    return y if seg is None else y.reshape(batch, -1, *y.shape[2:])


# --------------------------------------------------------------------------------------------
# Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).


def _qwen3_5_projections(self, h):
    """(mixed q/k/v (B, T, conv_dim), z (B, T, Hv, Dv), b, a (B, T, Hv))."""
    b, t, _ = h.shape
    z = self.in_proj_z(h).reshape(b, t, -1, self.head_v_dim)
    return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)


def _qwen3_next_projections(self, h):
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba, reordered by the module's own helper."""
    b, t, _ = h.shape
    q, k, v, z, beta_in, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(h),
                                                               self.in_proj_ba(h))  # fmt: skip
    return torch.cat([x.reshape(b, t, -1) for x in (q, k, v)], -1), z, beta_in, a


def gated_delta_net_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward`` (and its MoE / Next twins) on lorafuse's ops."""
    b, t, _ = hidden_states.shape
    seg = _segments(kwargs, attention_mask, b, t)
    state = MixerCache(cache, self.layer_idx)
    project = _qwen3_next_projections if hasattr(self, "in_proj_qkvz") else _qwen3_5_projections
    mixed, z, beta_in, a = project(self, hidden_states)
    conv_in = mixed.transpose(1, 2)  # (B, conv_dim, T)
    mixed, conv_final = _conv(self.conv1d, conv_in, self.activation, state, seg)
    q, k, v = torch.split(mixed.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], -1)
    q, k = (x.reshape(b, t, -1, self.head_k_dim) for x in (q, k))  # (B, T, Hk, Dk)
    v = v.reshape(b, t, -1, self.head_v_dim)  # (B, T, Hv, Dv)
    beta = beta_in.sigmoid()  # (B, T, Hv)
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, T, Hv) log decay
    init = state.recurrent if seg is None else seg.initial(state.recurrent)
    out, final = gated_delta_rule(
        *(_flat(x, seg) for x in (q, k, v, g, beta)), initial_state=init,
        output_final_state=state.keeps, use_qk_l2norm=True,
        cu_seqlens=None if seg is None else seg.cu_seqlens,
    )  # fmt: skip
    state.store(conv_in, conv_final, final if seg is None else seg.final(final))
    out = self.norm(_rows(out, seg, b).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(b, t, -1))


# --------------------------------------------------------------------------------------------
# LFM2 short convolution.


def short_conv_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """``Lfm2ShortConv.forward`` (and LFM2-MoE's) on lorafuse's conv op."""
    b, t, _ = hidden_states.shape
    seg = _segments(kwargs, attention_mask, b, t)
    state = MixerCache(cache, self.layer_idx)
    gate_b, gate_c, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
    conv_in = gate_b * x  # (B, D, T)
    y, final = _conv(self.conv, conv_in, None, state, seg)
    state.store(conv_in, final)
    return self.out_proj((gate_c * y).transpose(-1, -2).contiguous())


# --------------------------------------------------------------------------------------------
# Mamba2 (Granite 4).


def mamba2_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """``GraniteMoeHybridMambaLayer.forward`` on lorafuse's conv and SSD scan ops."""
    b, t, _ = hidden_states.shape
    dtype = hidden_states.dtype
    seg = _segments(kwargs, attention_mask, b, t)
    state = MixerCache(cache, self.layer_idx)
    gate, xbc, dt = self.in_proj(hidden_states).split(
        [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
    )
    conv_in = xbc.transpose(1, 2)  # (B, conv_dim, T)
    xbc, conv_final = _conv(self.conv1d, conv_in, self.activation, state, seg)
    groups = self.n_groups * self.ssm_state_size
    x, B, C = torch.split(xbc.transpose(1, 2), [self.intermediate_size, groups, groups], dim=-1)
    init = state.recurrent if seg is None else seg.initial(state.recurrent)
    y, final = mamba2_scan(
        _flat(x.reshape(b, t, self.num_heads, self.head_dim), seg), _flat(dt, seg),
        -torch.exp(self.A_log.float()),
        *(_flat(v.reshape(b, t, self.n_groups, self.ssm_state_size), seg) for v in (B, C)),
        D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=tuple(self.time_step_limit),
        chunk_size=self.chunk_size, initial_state=init, output_final_state=state.keeps,
        cu_seqlens=None if seg is None else seg.cu_seqlens,
    )  # fmt: skip
    state.store(conv_in, conv_final, final if seg is None else seg.final(final))
    y = self.norm(_rows(y, seg, b).reshape(b, t, -1), gate)  # fp32 scan output, as stock
    return self.out_proj(y.to(dtype))

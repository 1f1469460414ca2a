"""The fused attention forward of the registry's architectures (:mod:`lorafuse.patching.registry`),
bound per instance of ``<Arch>Attention`` by :func:`lorafuse.patching.fast_paths.apply_fast_paths`.

Line for line transformers 5.x's attention, with the spec's flags: Q/K/V through
:func:`lorafuse.ops.lora_qkv.lora_qkv`, q/k norms, partial rope, shared KV, and
:func:`lorafuse.ops.attention.causal_attention` where :func:`lorafuse.ops.attention.kernel` picks
a fast kernel for the plain causal case; everything else through the model's own attention
interface, as stock. Every projection re-checks PEFT's state per call. Per family:
docs/kernels.md.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from lorafuse.ops.attention import causal_attention
from lorafuse.ops.attention import kernel as attention_kernel
from lorafuse.ops.attention import supported as attention_supported
from lorafuse.ops.lora_params import LoRAParams
from lorafuse.ops.lora_qkv import lora_qkv
from lorafuse.ops.rope import apply_rope
from lorafuse.ops.weights import is_quantized
from lorafuse.patching import peft_lora
from lorafuse.patching.fused_forwards import proj_params
from lorafuse.patching.registry import ArchSpec


def _backend(module: nn.Module) -> str | None:
    return peft_lora.installed_backend(module)


# --------------------------------------------------------------------------------------------
# Projections.


def _row_blocks(p: LoRAParams, sizes: list[int]) -> list[LoRAParams]:
    """A stacked projection (Phi-3's qkv_proj) as one LoRAParams per block of output rows (views):
    weight, bias and lora_B split by rows, the one lora_A shared, so autograd sums its gradients
    from every block as PEFT's single product does."""
    blocks, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        bias = None if p.bias is None else p.bias[rows]
        b = None if p.lora_B is None else p.lora_B[rows]  # (n, r)
        blocks.append(LoRAParams(p.weight[rows], bias, p.lora_A, b, p.scaling))
        start += n
    return blocks


def _project_fused_qkv(self, x):
    """Phi-3's qkv_proj as q, k, v (..., H*D): lora_qkv on its row blocks when it can be exact."""
    d = self.head_dim
    sizes = [self.config.num_attention_heads * d, self.num_key_value_heads * d]
    sizes.append(self.qkv_proj.out_features - sum(sizes))
    p = proj_params(self.qkv_proj, x)
    if p is None or is_quantized(p.weight) or p.dropout_p:  # one PEFT dropout mask for q, k, v
        return self.qkv_proj(x).split(sizes, dim=-1)
    return lora_qkv(x, *_row_blocks(p, sizes), training=self.training, backend=_backend(self))


def _project_qkv(self, x):
    """q, k, v as (..., out) tensors (v None on a Gemma 4 shared-KV layer, where k is None too):
    one fused op when possible, else each module's forward."""
    if self._lorafuse_spec.fused_qkv:
        return _project_fused_qkv(self, x)
    if getattr(self, "is_kv_shared_layer", False):  # Gemma 4: k/v come from an earlier layer
        return self.q_proj(x), None, None
    if getattr(self, "v_proj", True) is None:  # Gemma 4 attention_k_eq_v: v is k's projection
        k = self.k_proj(x)
        return self.q_proj(x), k, k
    ps = [proj_params(m, x) for m in (self.q_proj, self.k_proj, self.v_proj)]
    if all(p is not None for p in ps):
        return lora_qkv(x, *ps, training=self.training, backend=_backend(self))
    return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _heads(self, spec: ArchSpec, x, input_shape):
    """q, k, v as (B, H, T, D) after the family's norms, and the output gate (B, T, Hq*D) or
    None; k and v are None on a Gemma 4 shared-KV layer."""
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = _project_qkv(self, x)
    gate = None
    if spec.q_gate:  # (B, T, H, 2D) per head: the query, then its gate
        q, gate = torch.chunk(q.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
    q_norm, k_norm = (getattr(self, n, None) for n in spec.qk_names)
    if spec.qk_norm == "whole":  # OLMo 3: over all heads at once, before the split
        q, k = q_norm(q), k_norm(k)
    q = q.view(hidden_shape)
    if spec.qk_norm is True:
        q = q_norm(q)
    if k is not None:
        k, v = k.view(hidden_shape), v.view(hidden_shape)  # (B, T, H, D)
        if spec.qk_norm is True:
            k = k_norm(k)
        if spec.v_norm:
            v = self.v_norm(v)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    return q.transpose(1, 2), k, v, gate


# --------------------------------------------------------------------------------------------
# The forward.


def attention_forward(
    self,
    hidden_states,
    position_embeddings=None,
    attention_mask=None,
    cache=None,
    past_key_values=None,
    shared_kv_states=None,
    **kwargs,
):
    """The model's attention with fused ops; returns ``(output, attention weights or None)``."""
    spec: ArchSpec = self._lorafuse_spec
    cache = cache if cache is not None else past_key_values
    input_shape = hidden_states.shape[:-1]
    q, k, v, gate = _heads(self, spec, hidden_states, input_shape)
    use_rope = position_embeddings is not None and (not spec.rope_attr or self.use_rope)
    if k is None:  # Gemma 4 shared-KV layer: q alone rotated, k/v those stored before
        if use_rope:
            q = sys.modules[spec.module].apply_rotary_pos_emb(q, *position_embeddings)
        k, v = shared_kv_states[self.layer_type]
    else:
        if use_rope:
            q, k = _rope(self, spec, q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    if getattr(self, "store_full_length_kv", False):
        shared_kv_states[self.layer_type] = k, v
    out, weights = _attend(self, spec, q, k, v, attention_mask, kwargs)
    out = out.reshape(*input_shape, -1)  # (B, T, Hq*D)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return getattr(self, spec.o_proj)(out), weights


def _attend(self, spec: ArchSpec, q, k, v, attention_mask, kwargs):
    """``(out (B, T, Hq, D), weights or None)``: the causal kernel where it applies, else the
    model's own attention interface with the module's scaling, window, softcap and sinks."""
    extra = {}
    if spec.sliding == "config":
        extra["sliding_window"] = getattr(self.config, "sliding_window", None)
    elif spec.sliding == "attr":
        extra["sliding_window"] = self.sliding_window
    if spec.attn_softcap:  # Gemma 2: no fast kernel soft-caps attention logits
        extra["softcap"] = self.attn_logit_softcapping
    if spec.sinks:  # gpt-oss: no fast kernel has the per-head sink logits
        extra["s_aux"] = self.sinks
    dropout = getattr(self, "attention_dropout", 0.0) if self.training else 0.0
    own = not extra.get("softcap") and not spec.sinks
    if own and _own_attention(
        self, q, k, attention_mask, dropout, extra.get("sliding_window"), kwargs
    ):
        return causal_attention(q, k, v, self.scaling, backend=_backend(self)), None
    mod = sys.modules[spec.module]  # imported when patching; import_module breaks a compiled graph
    interface = mod.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, mod.eager_attention_forward
    )
    out, weights = interface(
        self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **extra, **kwargs
    )
    return out.contiguous(), weights


def _rope(self, spec: ArchSpec, q, k, cos, sin):
    """RoPE on the first ``cos.shape[-1]`` features of each head (all of them, except with a
    partial rotary factor, whose other features pass through as in transformers); gpt-oss's
    half-width tables rotate the two halves of every head."""
    if spec.half_rope:  # (B, T, D/2): first*cos - second*sin, second*cos + first*sin
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    rotary = cos.shape[-1]  # cos, sin: (B, T, rotary)
    if rotary == q.shape[-1]:
        return apply_rope(q, k, cos, sin, backend=_backend(self))
    q_rot, k_rot = apply_rope(q[..., :rotary], k[..., :rotary], cos, sin, backend=_backend(self))
    return torch.cat([q_rot, q[..., rotary:]], dim=-1), torch.cat([k_rot, k[..., rotary:]], dim=-1)


def _own_attention(self, q, k, attention_mask, dropout, sliding_window, kwargs) -> bool:
    """Whether :func:`causal_attention` computes this call: sdpa semantics (no mask = causal),
    the plain training case, and a fast kernel for this device and length (else the model's own
    interface, which is exactly stock's path: past the measured crossover length too)."""
    return (
        self.config._attn_implementation == "sdpa"
        and getattr(self, "is_causal", True)
        and not kwargs.get("output_attentions")
        and attention_supported(q, k, attention_mask, dropout, sliding_window)
        and attention_kernel(q, _backend(self)) != "torch"  # the op's one choice, asked
    )

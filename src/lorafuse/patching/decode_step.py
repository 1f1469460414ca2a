"""One decoding step of a registry model (Llama, Mistral, Qwen2, Qwen3) in fewer Python calls.

A bf16 SmolLM2-135M token spent ~45% of its time outside its products (py-spy, 1 thread): 30
layers of transformers modules, each call through ``nn.Module.__call__`` and its decorators, ~900
small ops. For the plain decoding step, :func:`model_forward` runs the layers itself:

* the same math op for op as transformers' ``<Arch>Model`` / ``DecoderLayer`` / ``Attention`` /
  ``MLP`` forwards (the MLP's ``act_fn``, ``scaled_dot_product_attention`` as transformers' sdpa
  interface calls it for one query row, RoPE as ``apply_rotary_pos_emb`` rounds it, in one C++
  call), so it generates the same tokens as the model's own forward;
* plain ``nn.Linear`` projections straight into the decode kernel where it applies
  (:func:`lorafuse.ops.decode_linear.applies`), norms and every other projection (PEFT's LoRA
  layers, 4-bit layers) through their own forward.

"Plain" is: no gradient, ``input_ids`` of one new token per sequence over a non-empty KV cache,
no attention mask (generate passes none for an unpadded batch), sdpa attention, no sliding window
within reach, no output flags; the model had no forward hooks when it was routed (the step does
not call submodules through ``__call__``). Everything else runs the model's own forward.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
from torch import nn

from lorafuse.ops import decode_linear as op
from lorafuse.ops.rope import rope_stepwise_cpp
from lorafuse.patching.peft_lora import original_forward

# What a decoding step's call may carry (generate passes the first six); anything else set
# (output_attentions=True, a custom kwarg...) takes the model's own forward.
_KNOWN = frozenset(
    ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache")
    + ("past_key_values", "cache_position", "return_dict")
)


def has_hooks(model: nn.Module) -> bool:
    """Whether any module of ``model`` has forward hooks (or an accelerate hook): the step would
    skip them."""
    return any(
        m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules()
    )


def _plain_step(self: nn.Module, args, kwargs) -> bool:
    from transformers import DynamicCache  # loaded with the model; not at lorafuse's import

    ids, cache = kwargs.get("input_ids"), _cache(kwargs)
    # A DynamicCache only: a static cache holds empty slots that need the model's mask.
    if args or torch.is_grad_enabled() or ids is None or type(cache) is not DynamicCache:
        return False
    if ids.dim() != 2 or ids.shape[1] != 1 or not ids.is_cpu:
        return False
    if kwargs.get("attention_mask") is not None or kwargs.get("inputs_embeds") is not None:
        return False
    if any(kwargs[k] is not None and kwargs[k] is not False for k in kwargs.keys() - _KNOWN):
        return False
    if kwargs.get("return_dict") is False or self.config._attn_implementation != "sdpa":
        return False
    past = cache.get_seq_length()
    window = getattr(self.config, "sliding_window", None)
    return past > 0 and (window is None or past + 1 <= window)


def _cache(kwargs):
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def _project(limits, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    if type(m) is nn.Linear and op.applies(x, m.weight, m.bias, limits.get(x.dtype, 0)):
        return op.decode_linear(x, m.weight, m.bias)
    return m.forward(x)


def _stepwise_rope(q, k, cos, sin, rope):
    """``rope(q, k, cos, sin)`` (the modeling module's ``apply_rotary_pos_emb``) in one C++ call
    with its roundings (``csrc/rope.cpp``: ``rope_stepwise``, bit for bit) where q, k, cos and
    sin share a bf16 / fp16 dtype; its ten small ops were ~6% of a bf16 SmolLM2 token."""
    if q.dtype in op.LOW_PRECISION and q.dtype == k.dtype == cos.dtype == sin.dtype:
        return rope_stepwise_cpp(q, k, cos, sin)
    return rope(q, k, cos, sin)


def _attention(limits, attn, x, cos, sin, cache, rope):
    """transformers' ``<Arch>Attention.forward`` for one query row per sequence, no mask."""
    B, T, _ = x.shape
    shape = (B, T, -1, attn.head_dim)
    q, k, v = (_project(limits, x, m).view(shape) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm on each head before RoPE
        q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    q, k = _stepwise_rope(q, k, cos, sin, rope)
    k, v = cache.update(k, v, attn.layer_idx)
    # transformers' sdpa interface for one query row and no mask: not causal, GQA in the kernel
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.0, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
    )
    return _project(limits, out.transpose(1, 2).reshape(B, T, -1), attn.o_proj)


def _mlp(limits, mlp, x):
    gate = _project(limits, x, mlp.gate_proj)
    return _project(limits, mlp.act_fn(gate) * _project(limits, x, mlp.up_proj), mlp.down_proj)


def model_forward(limits, self: nn.Module, *args, **kwargs):
    """``<Arch>Model.forward`` (bound by :func:`lorafuse.patching.decoding.install` with the
    decode row ``limits``): the plain decoding step here, every other call the model's own."""
    if not _plain_step(self, args, kwargs):
        return original_forward(self, *args, **kwargs)
    ids, cache = kwargs["input_ids"], _cache(kwargs)
    rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
    h = self.embed_tokens.forward(ids)  # (B, 1, hidden)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.full((1, 1), cache.get_seq_length(), dtype=torch.long)
    cos, sin = self.rotary_emb(h, position_ids=positions)
    # islice: slicing the ModuleList builds a new one, ~160 µs a token for 30 layers
    for layer in itertools.islice(self.layers, self.config.num_hidden_layers):
        x = layer.input_layernorm.forward(h)
        h = h + _attention(limits, layer.self_attn, x, cos, sin, cache, rope)
        h = h + _mlp(limits, layer.mlp, layer.post_attention_layernorm.forward(h))
    out = self.norm.forward(h)
    return sys.modules[type(self).__module__].BaseModelOutputWithPast(
        last_hidden_state=out, cache=cache
    )

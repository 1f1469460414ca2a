"""The fused forwards of the registry's architectures (:mod:`lorafuse.patching.registry`), bound
per instance with ``peft_lora.install_forward`` by :func:`lorafuse.patching.llama.apply_fast_paths`:

* ``<Arch>RMSNorm``   -> :func:`lorafuse.ops.rms_norm.rms_norm` (weight gradient when trainable);
* ``<Arch>Attention`` -> Q/K/V through :func:`lorafuse.ops.lora_qkv.lora_qkv` (input read and
  saved once; per projection when one of them is not fusable right now), Qwen3's q/k norms,
  :func:`lorafuse.ops.rope.apply_rope`, then attention and ``o_proj`` through its (fused) LoRA
  Linear. Attention is :func:`lorafuse.ops.attention.causal_attention` where it has a fast
  kernel (CPU) and the call is the plain causal case under ``sdpa`` (no mask tensor, no KV-cache
  offset, no dropout, window wider than the sequence); everything else goes through
  transformers' own interface (``ALL_ATTENTION_FUNCTIONS``: sdpa / eager / flash), so masks,
  padding, sliding windows and the KV cache behave exactly as stock;
* ``<Arch>MLP``       -> :func:`lorafuse.ops.lora_mlp.lora_mlp` (SwiGLU recomputed in backward;
  Gemma's GeGLU with the tanh GELU);
* ``<Arch>ForCausalLM`` with ``labels`` under autograd -> the loss from
  :func:`lorafuse.ops.cross_entropy.fused_linear_cross_entropy` on the final hidden states,
  chunked over tokens, so the (tokens, vocab) logits are never materialised. **The returned
  ``logits`` is None on that path.** Without labels, or under ``torch.no_grad()``, the stock
  forward runs and returns logits (generation, evaluation metrics). TRL's ``SFTTrainer`` (1.x)
  computes its loss and metrics with its own fused LM head (``fused_lm_head=True``) on top of
  our backbone: that call is always left to TRL, whichever of the two wrapped the forward first.

Every fused forward re-checks PEFT's state per call (disabled / merged adapters, several
active adapters...) and then uses the modules' own forwards, which is PEFT's behaviour.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn

from lorafuse import backends
from lorafuse.ops import custom_ops
from lorafuse.ops.attention import auto_prefers_torch as attention_auto_prefers_torch
from lorafuse.ops.attention import causal_attention
from lorafuse.ops.attention import supported as attention_supported
from lorafuse.ops.cross_entropy import fused_linear_cross_entropy
from lorafuse.ops.lora_mlp import lora_mlp
from lorafuse.ops.lora_qkv import lora_qkv
from lorafuse.ops.projection import LoRAParams
from lorafuse.ops.rms_norm import rms_norm
from lorafuse.ops.rope import apply_rope
from lorafuse.ops.weights import is_quantized
from lorafuse.patching import peft_lora
from lorafuse.patching.registry import ArchSpec


def _backend(module: nn.Module) -> str | None:
    return peft_lora.installed_backend(module)


# --------------------------------------------------------------------------------------------
# Projections as LoRAParams.


def proj_params(module: nn.Module, x: torch.Tensor) -> LoRAParams | None:
    """``module`` (a LoRA Linear or a plain frozen Linear) as LoRAParams for input ``x``.

    None means "call the module itself": a LoRA layer whose current PEFT state the fused ops
    cannot express (disabled, merged, several adapters...), or a layer of unknown type.
    """
    if peft_lora.is_lora_layer(module):
        if not peft_lora.is_fused_lora(module):
            return None
        st = peft_lora.fused_state(module, x)
        if st is None or st.magnitude is not None:  # DoRA: its own fused op (module forward)
            return None
        p = st.dropout_p if st.training else 0.0
        return LoRAParams(st.weight, st.bias, st.lora_A, st.lora_B, st.scaling, p)
    weight = getattr(module, "weight", None)
    if type(module) is nn.Linear and not (weight.requires_grad and torch.is_grad_enabled()):
        return LoRAParams(weight, module.bias)
    if weight is not None and is_quantized(weight) and hasattr(weight, "dequantize"):
        return LoRAParams(weight, getattr(module, "bias", None))
    return None


# --------------------------------------------------------------------------------------------
# Fused forwards (bound per instance with peft_lora.install_forward).


def rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, _backend(self))


def gemma_norm_forward(self, x):
    """Gemma's RMSNorm, ``(norm(x.float()) * (1 + w.float())).type_as(x)``: the fused norm with
    weight ``1 + w`` computes exactly that for fp32 ``x`` and ``w`` (patched only with fp32 ``w``;
    in bf16 Gemma rounds once after the weight, the fused norm before it)."""
    if x.dtype != torch.float32:
        peft_lora.warn_once(self, f"{x.dtype} input to Gemma's fp32 norm: fused norm not used")
        return peft_lora.original_forward(self, x)
    return rms_norm(x, 1.0 + self.weight, self.eps, _backend(self))


def mlp_forward(self, x):
    ps = [proj_params(m, x) for m in (self.gate_proj, self.up_proj, self.down_proj)]
    if any(p is None for p in ps):
        return peft_lora.original_forward(self, x)
    return lora_mlp(x, *ps, training=self.training, backend=_backend(self))


def geglu_mlp_forward(self, x):
    """Gemma's MLP, ``down(gelu_tanh(gate(x)) * up(x))``, as lora_mlp's GeGLU (eager only)."""
    ps = [proj_params(m, x) for m in (self.gate_proj, self.up_proj, self.down_proj)]
    if any(p is None for p in ps):
        return peft_lora.original_forward(self, x)
    if custom_ops.active():
        peft_lora.warn_once(self, "GeGLU MLP under torch.compile: fused MLP not used")
        return peft_lora.original_forward(self, x)
    return lora_mlp(x, *ps, training=self.training, backend=_backend(self), activation="gelu_tanh")


def gate_up_mlp_forward(self, x):
    """Phi-3's MLP as lora_mlp: gate_up_proj's weight, bias and lora_B split by rows into gate
    and up (views); its one lora_A goes to both, so autograd sums its two gradients, as PEFT's
    single product does. Exact only without dropout: PEFT draws one mask for gate and up."""
    gu, down = proj_params(self.gate_up_proj, x), proj_params(self.down_proj, x)
    if gu is None or down is None or is_quantized(gu.weight):
        return peft_lora.original_forward(self, x)
    if gu.dropout_p:
        peft_lora.warn_once(self, "gate_up_proj has lora_dropout > 0: fused MLP not used")
        return peft_lora.original_forward(self, x)
    i = gu.out_features // 2  # gate rows first (transformers: gate, up = chunk(2, dim=-1))

    def half(sl):
        bias = None if gu.bias is None else gu.bias[sl]
        b = None if gu.lora_B is None else gu.lora_B[sl]  # (i, r)
        return LoRAParams(gu.weight[sl], bias, gu.lora_A, b, gu.scaling)

    gate, up = half(slice(0, i)), half(slice(i, None))
    return lora_mlp(x, gate, up, down, training=self.training, backend=_backend(self))


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
    """q, k, v as (..., H*D) tensors: one fused op when possible, else each module's forward."""
    if self._lorafuse_spec.fused_qkv:
        return _project_fused_qkv(self, x)
    ps = [proj_params(m, x) for m in (self.q_proj, self.k_proj, self.v_proj)]
    if all(p is not None for p in ps):
        return lora_qkv(x, *ps, training=self.training, backend=_backend(self))
    return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def attention_forward(
    self,
    hidden_states,
    position_embeddings=None,
    attention_mask=None,
    cache=None,
    past_key_values=None,
    **kwargs,
):
    """Line for line the transformers 5.x Llama/Mistral/Qwen2/Qwen3/Phi-3/Gemma 2/Gemma 3 attention,
    with fused ops (the q/k norms are per head, so before or after the transpose is the same)."""
    spec: ArchSpec = self._lorafuse_spec
    cache = cache if cache is not None else past_key_values
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = _project_qkv(self, hidden_states)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)  # (B, T, H, D)
    if spec.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    if not spec.rope_attr or self.use_rope:
        q, k = _rope(self, q, k, *position_embeddings)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    extra = {}
    if spec.sliding == "config":
        extra["sliding_window"] = getattr(self.config, "sliding_window", None)
    elif spec.sliding == "attr":
        extra["sliding_window"] = self.sliding_window
    if spec.attn_softcap:  # Gemma 2: no fast kernel soft-caps attention logits
        extra["softcap"] = self.attn_logit_softcapping
    dropout = 0.0 if not self.training else self.attention_dropout
    own = not extra.get("softcap")
    if own and _own_attention(
        self, q, k, attention_mask, dropout, extra.get("sliding_window"), kwargs
    ):
        out = causal_attention(q, k, v, self.scaling, backend=_attention_backend(self))
        return self.o_proj(out.reshape(*input_shape, -1)), None
    mod = sys.modules[spec.module]  # imported when patching; import_module breaks a compiled graph
    interface = mod.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, mod.eager_attention_forward
    )
    out, weights = interface(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=dropout,
        scaling=self.scaling,
        **extra,
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()  # (B, T, H*D)
    return self.o_proj(out), weights


def _rope(self, q, k, cos, sin):
    """RoPE on the first ``cos.shape[-1]`` features of each head (all of them, except with Phi-3's
    partial_rotary_factor, whose other features pass through as in transformers)."""
    rotary = cos.shape[-1]  # cos, sin: (B, T, rotary)
    if rotary == q.shape[-1]:
        return apply_rope(q, k, cos, sin, backend=_backend(self))
    q_rot, k_rot = apply_rope(q[..., :rotary], k[..., :rotary], cos, sin, backend=_backend(self))
    return torch.cat([q_rot, q[..., rotary:]], dim=-1), torch.cat([k_rot, k[..., rotary:]], dim=-1)


def attention_request(backend: str | None) -> str | None:
    # No Triton attention: on CUDA torch's SDPA is FlashAttention already, so a Triton request
    # means "auto" here (which keeps SDPA on CUDA).
    return None if backend == "triton" else backend


def _attention_backend(module: nn.Module) -> str | None:
    return attention_request(_backend(module))


def _own_attention(self, q, k, attention_mask, dropout, sliding_window, kwargs) -> bool:
    """Whether :func:`causal_attention` computes this call: sdpa semantics (no mask = causal),
    the plain training case, and a fast kernel for this device and length (else the model's own
    interface, which is exactly stock's path: past the measured crossover length too)."""
    backend = _attention_backend(self)
    return (
        self.config._attn_implementation == "sdpa"
        and getattr(self, "is_causal", True)
        and not kwargs.get("output_attentions")
        and attention_supported(q, k, attention_mask, dropout, sliding_window)
        and not attention_auto_prefers_torch(q, backend)
        and backends.select("attention", q.device, backend) != "torch"
    )


@functools.cache
def _signature(cls) -> inspect.Signature:
    return inspect.signature(cls.forward)


# TRL >= 1.x (``trl.trainer.utils.add_fused_lm_head``) wraps the model's forward: called with
# ``fused_lm_head=True`` it runs the backbone itself and scores the labels with its own chunked
# LM head (log-probs plus the entropy / token-accuracy metrics), never reading ``logits``.
FUSED_LM_HEAD = "fused_lm_head"


def causal_lm_forward(self, *args, **kwargs):
    """Fused linear cross-entropy when labels are given under autograd; stock forward otherwise."""
    bound = _signature(type(self)).bind(self, *args, **kwargs)
    a = dict(bound.arguments)
    a.pop("self")
    extra = a.pop("kwargs", {})
    labels = a.pop("labels", None)
    keep = a.pop("logits_to_keep", 0)
    why = loss_blocker(self)
    if extra.get(FUSED_LM_HEAD):  # TRL's own chunked head (see the module docstring): its call
        return peft_lora.original_forward(self, *args, **kwargs)
    extra.pop(FUSED_LM_HEAD, None)  # False: our loss; not a kwarg the backbone takes
    if labels is None or not torch.is_grad_enabled() or not (isinstance(keep, int) and keep == 0):
        return peft_lora.original_forward(self, *args, **kwargs)
    if why is not None:
        peft_lora.warn_once(self, f"fused cross-entropy not used: {why}; running the stock loss")
        return peft_lora.original_forward(self, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # As transformers' @can_return_tuple: return_dict is consumed here, not passed down.
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    outputs = self.model(**a, **extra)
    hidden = outputs.last_hidden_state  # (B, T, H)
    out = CausalLMOutputWithPast(
        loss=_shifted_loss(self, hidden, labels, extra),
        logits=None,  # never materialised: the point of the fused loss
        cache=getattr(outputs, "cache", None),
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    return out if return_dict else out.to_tuple()


def _shifted_loss(self, hidden, labels, extra):
    """HF ``ForCausalLMLoss`` semantics: shift labels, ignore -100, honour num_items_in_batch."""
    ignore = -100
    shift = extra.get("shift_labels")
    if shift is None:
        shift = nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]  # (B, T)
    n_items = extra.get("num_items_in_batch")
    head = self.lm_head
    softcap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 2, as HF: logits
    return fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),  # (B*T, H)
        head.weight,
        shift.reshape(-1).to(hidden.device),  # (B*T,)
        bias=head.bias,
        ignore_index=ignore,
        reduction="sum" if n_items is not None else "mean",
        num_items_in_batch=n_items,
        backend=_backend(self),
        softcap=softcap or None,
    )


def loss_blocker(causal_lm: nn.Module) -> str | None:
    """Why the fused loss cannot replace the stock one for this model (None: it can)."""
    head = causal_lm.lm_head
    if peft_lora.is_lora_layer(head):
        return "lm_head carries LoRA (the fused loss takes a plain weight; stock loss trains it)"
    plain = type(head) is nn.Linear or (isinstance(head, nn.Linear) and is_quantized(head.weight))
    if not plain:  # a quantized Linear subclass (Linear4bit) is walked in blocks by the loss
        return f"lm_head is {type(head).__name__} (e.g. modules_to_save), not a plain nn.Linear"
    if getattr(causal_lm.config, "final_logit_softcapping", None) and custom_ops.active():
        return "final_logit_softcapping under torch.compile (the soft-capped loss is eager only)"
    return None

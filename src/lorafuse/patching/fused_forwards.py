"""The fused norm, MLP and loss forwards of the registry's architectures
(:mod:`lorafuse.patching.registry`; the attention forward is :mod:`lorafuse.patching.attention`),
bound per instance with ``peft_lora.install_forward`` by
:func:`lorafuse.patching.fast_paths.apply_fast_paths`:

* ``<Arch>RMSNorm``   -> :func:`lorafuse.ops.rms_norm.rms_norm` (weight gradient when trainable):
  Llama's rounding (``w * round(norm(x))``), or rounded once after an fp32 weight multiply
  (``round(norm(x) * (1 + w))``: Gemma 2/3, Qwen3.5, Qwen3-Next; ``round(norm(x) * w)``:
  Gemma 4, OLMo 3, gpt-oss), as each model computes it;
* ``<Arch>MLP``       -> :func:`lorafuse.ops.lora_mlp.lora_mlp` (SwiGLU recomputed in backward;
  Gemma's GeGLU with the tanh GELU) on the spec's projection names (LFM2's w1 / w3 / w2), or on
  the two halves of one stacked gate/up projection (Phi-3, Granite 4's shared MLP);
* ``<Arch>ForCausalLM`` with ``labels`` under autograd -> the loss from
  :func:`lorafuse.ops.cross_entropy.fused_linear_cross_entropy` on the final hidden states,
  chunked over tokens, so the (tokens, vocab) logits are never materialised (final-logit
  soft-capping, Granite's ``logits_scaling`` and the MoE router's auxiliary loss as the model adds
  them). **The returned ``logits`` is None on that path.** Without labels, or under
  ``torch.no_grad()``, the stock forward runs and returns logits (generation, evaluation
  metrics). TRL's ``SFTTrainer`` (1.x) computes its loss and metrics with its own fused LM head
  (``fused_lm_head=True``) on top of our backbone: that call is always left to TRL, whichever of
  the two wrapped the forward first.

Every fused forward re-checks PEFT's state per call (disabled / merged adapters, several
active adapters...) and then uses the modules' own forwards, which is PEFT's behaviour.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn

from lorafuse.ops import custom_ops
from lorafuse.ops.cross_entropy import fused_linear_cross_entropy
from lorafuse.ops.lora_mlp import lora_mlp
from lorafuse.ops.lora_params import LoRAParams
from lorafuse.ops.rms_norm import rms_norm
from lorafuse.ops.weights import is_quantized
from lorafuse.patching import peft_lora


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


def _eps(norm: nn.Module) -> float:
    return norm.eps if hasattr(norm, "eps") else norm.variance_epsilon


def offset_norm_forward(self, x):
    """Gemma 2/3, Qwen3.5, Qwen3-Next: ``(norm(x.float()) * (1 + w.float())).type_as(x)``, the
    weight multiply in fp32 and one rounding (the ``round_once`` norm with weight ``1 + w``)."""
    return rms_norm(x, 1.0 + self.weight.float(), _eps(self), _backend(self), round_once=True)


def fp32_norm_forward(self, x):
    """Gemma 4, OLMo 3, gpt-oss: ``(norm(x.float()) * w.float()).to(x.dtype)`` (Gemma 4's
    unscaled norms: weight 1), the weight multiply in fp32 and one rounding."""
    w = getattr(self, "weight", None)
    w = x.new_ones(x.shape[-1], dtype=torch.float32) if w is None else w.float()
    return rms_norm(x, w, _eps(self), _backend(self), round_once=True)


def _mlp_params(self, x):
    names = self._lorafuse_spec.mlp_names if hasattr(self, "_lorafuse_spec") else ()
    names = names or ("gate_proj", "up_proj", "down_proj")
    return [proj_params(getattr(self, n), x) for n in names]


def mlp_forward(self, x):
    """``down(silu(gate(x)) * up(x))`` as lora_mlp, on the spec's projection names."""
    ps = _mlp_params(self, x)
    if any(p is None for p in ps):
        return peft_lora.original_forward(self, x)
    return lora_mlp(x, *ps, training=self.training, backend=_backend(self))


def geglu_mlp_forward(self, x):
    """Gemma's MLP, ``down(gelu_tanh(gate(x)) * up(x))``, as lora_mlp's GeGLU (eager only)."""
    ps = _mlp_params(self, x)
    if any(p is None for p in ps):
        return peft_lora.original_forward(self, x)
    if custom_ops.active():
        peft_lora.warn_once(self, "GeGLU MLP under torch.compile: fused MLP not used")
        return peft_lora.original_forward(self, x)
    return lora_mlp(x, *ps, training=self.training, backend=_backend(self), activation="gelu_tanh")


def gate_up_mlp_forward(self, x):
    """A stacked gate/up MLP (Phi-3's gate_up_proj, Granite 4's input_linear) as lora_mlp: the
    stacked weight, bias and lora_B split by rows into gate and up (views); its one lora_A goes
    to both, so autograd sums its two gradients, as PEFT's single product does. Exact only
    without dropout: PEFT draws one mask for gate and up."""
    gu, down = _mlp_params(self, x)
    if gu is None or down is None or is_quantized(gu.weight):
        return peft_lora.original_forward(self, x)
    if gu.dropout_p:
        name = self._lorafuse_spec.mlp_names[0]
        peft_lora.warn_once(self, f"{name} has lora_dropout > 0: fused MLP not used")
        return peft_lora.original_forward(self, x)
    i = gu.out_features // 2  # gate rows first (transformers: gate, up = chunk(2, dim=-1))

    def half(sl):
        bias = None if gu.bias is None else gu.bias[sl]
        b = None if gu.lora_B is None else gu.lora_B[sl]  # (i, r)
        return LoRAParams(gu.weight[sl], bias, gu.lora_A, b, gu.scaling)

    gate, up = half(slice(0, i)), half(slice(i, None))
    return lora_mlp(x, gate, up, down, training=self.training, backend=_backend(self))


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
    # As transformers' @can_return_tuple: return_dict is consumed here, not passed down.
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    # MoE heads: the router's auxiliary loss, as stock adds it (the flag resolved as stock does)
    router = "output_router_logits" in _signature(type(self)).parameters
    if router and a.get("output_router_logits") is None:
        a["output_router_logits"] = getattr(self.config, "output_router_logits", False)
    outputs = self.model(**a, **extra)
    loss = _shifted_loss(self, outputs.last_hidden_state, labels, extra)
    fields = dict(
        logits=None,  # never materialised: the point of the fused loss
        cache=getattr(outputs, "cache", None),
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    if router:
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast as Output

        aux = _router_aux_loss(self, outputs, a) if a["output_router_logits"] else None
        if aux is not None:
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        fields.update(aux_loss=aux, router_logits=getattr(outputs, "router_logits", None))
    else:
        from transformers.modeling_outputs import CausalLMOutputWithPast as Output
    out = Output(loss=loss, **fields)
    return out if return_dict else out.to_tuple()


def _router_aux_loss(self, outputs, a):
    """The load-balancing loss of an MoE model's router logits, by the model's own function."""
    fn = sys.modules[type(self).__module__].load_balancing_loss_func
    return fn(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
              a.get("attention_mask"))  # fmt: skip


def _shifted_loss(self, hidden, labels, extra):
    """HF ``ForCausalLMLoss`` semantics: shift labels, ignore -100, honour num_items_in_batch."""
    ignore = -100
    shift = extra.get("shift_labels")
    if shift is None:
        shift = nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]  # (B, T)
    n_items = extra.get("num_items_in_batch")
    head = self.lm_head
    softcap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 2, as HF: logits
    scale = getattr(self.config, "logits_scaling", None)  # Granite: logits / logits_scaling
    if scale not in (None, 1, 1.0):  # (h / s)·Wᵀ = (h·Wᵀ) / s up to rounding
        hidden = hidden / scale
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

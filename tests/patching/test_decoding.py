"""How models decode through the one-row kernels (patching/decoding.py): which layers install()
routes, that a decoding step takes the kernels with the same logits, and what keeps the stock
forward (prefill, gradients, fp32, PEFT training, torch.compile)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lorafuse import backends
from lorafuse.generation import CACHE_KW
from lorafuse.ops import decode_linear
from lorafuse.patching import decoding
from lorafuse.patching.peft_lora import original_forward

pytestmark = pytest.mark.cpp


@pytest.fixture(autouse=True)
def _needs_cpp():
    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")


def _tiny_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # not all ones: a norm that ignored its weight fails
            nn.init.normal_(p, mean=1.0, std=0.3)
    return model


def _norms(model) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]


def _last_step(model, ids):
    """Prefill all but the last token, then decode the last one over the cache."""
    with torch.inference_mode():
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        return model(ids[:, -1:], **{CACHE_KW: cache}).logits.float()


def test_installed_model_decodes_through_the_kernels_with_the_same_logits(monkeypatch):
    """install() routes every plain nn.Linear (7 per layer and the head) and every RMSNorm (2 per
    layer and the final one); a decoding step runs the decode kernel on each linear, prefill does
    not, and the step's logits match torch's within bf16 rounding."""
    model = _tiny_llama(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 12))
    ref = _last_step(model, ids)
    assert decoding.install(model) == 15 + 5 + 1  # and the model: the lean decoding step
    assert decoding.install(model) == 0  # idempotent
    calls = []
    real = decode_linear.decode_linear
    monkeypatch.setattr(decode_linear, "decode_linear", lambda *a: calls.append(1) or real(*a))
    step = _last_step(model, ids)
    assert len(calls) == 15  # the decoding step's; prefill's 22 rows take torch's product
    assert torch.allclose(step, ref, rtol=0.05, atol=0.05)  # bf16 activations through 2 layers
    assert decoding.uninstall(model) == 21
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(_last_step(model, ids), ref)  # the stock forwards are back


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routed_norm_is_hf_norm_within_one_rounding(dtype):
    """The routed RMSNorm computes LlamaRMSNorm's value (fp32 statistics, normalised value
    rounded to the dtype, then times the weight): each output within one rounding of the stock
    module's, most of them equal; a norm that dropped its weight or eps would be far off."""
    model = _tiny_llama(dtype)
    decoding.install(model)
    torch.manual_seed(1)
    for norm in _norms(model):
        x = torch.randn(3, 1, 128, dtype=dtype) * 4
        with torch.inference_mode():
            ours, stock = norm(x), original_forward(norm, x)
        assert ours.grad_fn is None and ours.shape == stock.shape
        ulp = torch.finfo(dtype).eps  # one unit in the last place, relative
        assert torch.allclose(ours.float(), stock.float(), rtol=ulp, atol=0)
        assert (ours == stock).float().mean() > 0.95


def test_norm_keeps_the_stock_forward_where_a_gradient_is_wanted():
    """With a gradient to carry (training without lorafuse's patch), the stock forward runs and
    the gradient reaches the input and a trainable weight."""
    model = _tiny_llama(torch.bfloat16)
    decoding.install(model)
    norm = _norms(model)[0]
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16, requires_grad=True)
    norm(x).float().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def test_fp32_model_routes_linears_only_and_builds_nothing(monkeypatch):
    """An fp32 model never takes the decode kernels (fp32 one-row products are fine in torch),
    so install() chooses no kernel: no first-use C++ build when an fp32 model loads."""
    model = _tiny_llama(torch.float32)
    chosen = []
    monkeypatch.setattr(backends, "select_cpu", lambda op, *a: chosen.append(op) or "cpp")
    assert decoding.install(model) == 15
    assert chosen == []
    x = torch.randn(1, 1, 128)
    with torch.inference_mode():
        assert torch.equal(_norms(model)[0](x), original_forward(_norms(model)[0], x))


def test_peft_adapters_and_training_keep_working():
    """PEFT wraps the routed base layers: an adapter still changes the decoding output (its
    lora.Linear calls the base layer, then adds its own product), and a training step (rows > 8,
    gradients) takes torch's path with gradients flowing to the adapter."""
    from peft import LoraConfig, get_peft_model

    model = _tiny_llama(torch.bfloat16)
    decoding.install(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)
    ids = torch.randint(0, 256, (1, 6))
    with torch.inference_mode():
        with_adapter = peft_model(ids[:, :1]).logits
        with peft_model.disable_adapter():
            without = peft_model(ids[:, :1]).logits
    assert not torch.equal(with_adapter, without)
    peft_model.train()
    loss = peft_model(torch.randint(0, 256, (2, 16)), labels=torch.randint(0, 256, (2, 16))).loss
    loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_torch_compile_traces_f_linear_without_breaks():
    """Under torch.compile a routed layer is traced as F.linear (the kernel is no custom op)."""
    layers = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).bfloat16()
    decoding.install(layers)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert decode_linear.applies(x, layers[0].weight, layers[0].bias)  # eager: the kernel
        explained = torch._dynamo.explain(layers)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


def test_gemma_norms_keep_their_own_forward_when_decoding():
    """Gemma's RMSNorm scales by (1 + w) and rounds once: the Llama-semantics decoding norm
    would compute another function, so install leaves it (linears still route)."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=96, head_dim=16,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = tf.Gemma3ForCausalLM(cfg).to(torch.bfloat16).eval()
    decoding.install(model)
    norms = [
        m for m in model.modules() if type(m) is tf.models.gemma3.modeling_gemma3.Gemma3RMSNorm
    ]
    assert norms and not any("forward" in m.__dict__ for m in norms)
    decoding.uninstall(model)

"""The fused ops as custom ops under torch.compile: no graph breaks, same numbers as eager.

Inductor compiles are slow on a 2-core box, so the whole-model checks use ``aot_eager`` (Dynamo +
AOTAutograd, the same graphs and custom-op calls Inductor receives, run eagerly) and one small
test runs Inductor itself.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from lorafuse import backends, patch_peft_model
from lorafuse.ops import attention as attn_op
from lorafuse.ops import cross_entropy as ce_op
from lorafuse.ops import custom_ops
from lorafuse.ops import lora_linear as lin_op
from lorafuse.ops import rms_norm as norm_op
from lorafuse.ops import rope as rope_op
from lorafuse.ops import swiglu as act_op
from lorafuse.ops.lora_linear import lora_linear
from lorafuse.ops.rms_norm import rms_norm
from lorafuse.testing import LORA_TARGETS, assert_close, single_thread, tiny_llama_config

# Which backends the ops can run here: torch always, cpp where the extension builds.
HERE = ["torch"] + (["cpp"] if backends.cpp_available() else [])


@pytest.fixture(autouse=True)
def _one_thread():
    yield from single_thread()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _patched(dropout: float = 0.0, backend: str | None = None):
    """A patched tiny PEFT Llama (LoRA on all seven projections, random B), in train mode.

    One decoder layer: Dynamo traces every layer anew, and one shows each op (compile time)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1))
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=LORA_TARGETS)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # PEFT zero-inits B: randomise it so every gradient is non-trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return patch_peft_model(model, backend=backend).train()


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100  # prompt tokens: the fused loss drops these rows inside its op
    return ids, labels


def _lorafuse_ops(graphs) -> set[str]:
    return {
        str(n.target).split(".")[1]
        for g in graphs
        for n in g.graph.nodes
        if str(n.target).startswith("lorafuse.")
    }


@pytest.mark.parametrize("backend", HERE)
def test_no_graph_breaks_in_patched_layer(backend):
    model = _patched(backend=backend)
    inner = model.base_model.model.model
    x = torch.randn(2, 16, 64, requires_grad=True)
    pos = torch.arange(16)[None].expand(2, 16)
    cos, sin = inner.rotary_emb(x, pos)
    exp = torch._dynamo.explain(inner.layers[0])(x, position_embeddings=(cos, sin))
    assert exp.graph_break_count == 0, [b.reason for b in exp.break_reasons]
    want = {"rms_norm", "lora_linear", "rope", "swiglu"}
    if backend == "cpp":  # the torch choice of attention is SDPA itself, traced as such
        want.add("causal_attention")
    assert want <= _lorafuse_ops(exp.graphs)


def test_no_graph_breaks_in_patched_model_forward_with_loss_under_autocast():
    # fp32 whole-model tracing is asserted by fullgraph=True below; autocast adds the casts,
    # the autocast-off regions and the bf16 questions to lorafuse.hardware.
    ids, labels = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exp = torch._dynamo.explain(_patched())(input_ids=ids, labels=labels)
    assert exp.graph_break_count == 0, [b.reason for b in exp.break_reasons]
    assert "linear_cross_entropy" in _lorafuse_ops(exp.graphs)


def test_compiled_matches_eager_loss_and_lora_grads():
    # With dropout: aot_eager draws the masks with eager's RNG in the same order, so they match.
    eager = _patched(dropout=0.1)
    compiled = copy.deepcopy(eager)
    ids, labels = _batch()
    torch.manual_seed(3)
    loss_e = eager(input_ids=ids, labels=labels).loss
    loss_e.backward()
    torch.manual_seed(3)
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)  # fails on any break
    loss_c = step(input_ids=ids, labels=labels).loss
    loss_c.backward()
    assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5, name="loss")
    grads = {n: p.grad for n, p in compiled.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 7  # A and B of seven projections
    for name, p in eager.named_parameters():
        if p.requires_grad:
            assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-5, name=name)


def test_inductor_compiles_the_ops():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(16).requires_grad_()
    W = torch.randn(24, 16)
    A = (torch.randn(4, 16) * 0.1).requires_grad_()
    B = (torch.randn(24, 4) * 0.1).requires_grad_()

    def f(x):  # custom ops and views only: Inductor emits no C++ kernel to build (slow here)
        return lora_linear(rms_norm(x, w), W, None, A, B, 2.0)

    ins = (x, w, A, B)
    g = torch.randn(2, 5, 24)
    y_e = f(x)
    grads_e = torch.autograd.grad(y_e, ins, g)
    y_c = torch.compile(f, backend="inductor", fullgraph=True)(x)
    grads_c = torch.autograd.grad(y_c, ins, g)
    assert_close(y_c, y_e, atol=1e-5, rtol=1e-5, name="y")
    for name, gc, ge in zip(("dx", "dw", "dA", "dB"), grads_c, grads_e):
        assert_close(gc, ge, atol=1e-5, rtol=1e-5, name=name)


def _opcheck_cases(backend):
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=True, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)

    x, W, b = t(6, 8), t(5, 8, grad=False), t(5, grad=False)
    A, B = t(3, 8), t(5, 3)
    mask = torch.rand(6, 8, generator=g) > 0.3
    xa = t(6, 3, grad=False)
    q, k, cos, sin = t(1, 4, 6, 8), t(1, 2, 6, 8), t(1, 6, 8, grad=False), t(1, 6, 8, grad=False)
    v = t(1, 2, 6, 8)
    gate, up = t(6, 8), t(6, 8)
    targets = torch.tensor([1, -100, 3, 0, -100, 4])
    nograd = [a.detach() for a in (x, W, A, B)]
    cases = [
        (lin_op.lora_linear_op, (x, W, b, A, B, 2.0, mask, 0.7, backend)),
        (lin_op.lora_linear_op, (x, W, None, A, B, 0.5, None, 1.0, backend)),
        (lin_op.lora_linear_backward_op,
         (t(6, 5, grad=False), *nograd, xa, 2.0, mask, 0.7, [True, True, True, False], backend)),
        (norm_op.rms_norm_op, (x, t(8), 1e-6, backend)),
        (norm_op.rms_norm_backward_op,
         (t(6, 8, grad=False), x.detach(), t(8, grad=False), t(6, grad=False).abs(),
          [True, False], backend)),
        (norm_op.rms_norm_op, (x, t(8), 1e-6, backend, True)),  # rounded once
        (norm_op.rms_norm_backward_op,
         (t(6, 8, grad=False), x.detach(), t(8, grad=False), t(6, grad=False).abs(),
          [True, True], backend, True)),
        (rope_op.rope_op, (q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin, backend)),
        (rope_op.rope_backward_op, (q.detach(), k.detach(), cos, sin, backend)),
        (act_op.swiglu_op, (gate, up, backend)),
        (act_op.swiglu_backward_op, (t(6, 8, grad=False), gate.detach(), up.detach(), backend)),
        (ce_op.linear_cross_entropy_op,
         (x, W.requires_grad_(False), None, targets, -100, "mean", None, 4, backend,
          [True, False, False])),
        (ce_op.linear_cross_entropy_op,
         (x, t(5, 8), t(5), targets, -100, "sum", torch.tensor(3.0), None, backend,
          [True, True, True])),
    ]  # fmt: skip
    if backend == "cpp":
        out, lse = attn_op.causal_attention_op(q.detach(), k.detach(), v.detach(), 0.3)
        cases += [
            (attn_op.causal_attention_op, (q, k, v, 0.3)),
            (attn_op.causal_attention_backward_op,
             (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.3)),
        ]  # fmt: skip
    return cases


def test_opcheck():
    # One backend (fake shapes, dtypes and layouts do not depend on it): the C++ one where it
    # builds, so attention is checked too. Backward ops skip the (slow) AOT dynamic-shape check:
    # the compiled-vs-eager test runs them inside AOTAutograd's backward graph.
    for op, args in _opcheck_cases(HERE[-1]):
        backward = op._name.endswith("_backward")
        utils = ("test_schema", "test_autograd_registration", "test_faketensor")
        utils += () if backward else ("test_aot_dispatch_dynamic",)
        torch.library.opcheck(op, args, test_utils=utils)


@pytest.mark.parametrize("backend", HERE)
def test_lora_linear_custom_op_gradient_equals_the_function(backend):
    """The custom op's register_autograd is pinned to LoRALinearFunction (the canonical gradient):
    same seed, same mask draw, same kernels, so output and every gradient agree bit for bit."""
    g = torch.Generator().manual_seed(1)
    x, W, b = (torch.randn(*s, generator=g) for s in ((7, 12), (5, 12), (5,)))
    A, B = torch.randn(3, 12, generator=g), torch.randn(5, 3, generator=g)
    dy = torch.randn(7, 5, generator=g)
    results = []
    for run in (lin_op.LoRALinearFunction.apply, lin_op.via_custom_op):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, b, A, B)]
        xi, bi, Ai, Bi = leaves
        torch.manual_seed(0)  # the dropout mask: the same draw on both paths
        y = run(xi, W, bi, Ai, Bi, 2.0, 0.3, backend)
        results.append((y, *torch.autograd.grad(y, leaves, dy)))
    for want, got in zip(*results):
        assert torch.equal(want, got)


def test_eager_keeps_the_autograd_functions():
    # Eager runs each op's autograd.Function (measured faster than the custom ops there:
    # docs/compile.md); the custom ops are for traced code only.
    assert not custom_ops.active()
    x = torch.randn(3, 8, requires_grad=True)
    node = rms_norm(x, torch.ones(8)).grad_fn  # ViewBackward0 of the Function's output
    assert type(node.next_functions[0][0]).__name__ == "RMSNormFunctionBackward"


def test_train_cli_compile_runs_two_steps(tmp_path, monkeypatch, capsys):
    import json

    from lorafuse.commands import main
    from lorafuse.testing import save_tiny_model

    compiled = []
    original = torch.nn.Module.compile

    def compile_eager(self, *args, **kwargs):  # Dynamo only: the numbers are checked above
        compiled.append(type(self).__name__)
        return original(self, *args, **{**kwargs, "backend": "eager"})

    monkeypatch.setattr(torch.nn.Module, "compile", compile_eager)
    save_tiny_model(tmp_path / "model")
    rows = [{"messages": [{"role": "user", "content": f"what is {i} and {i}"},
                          {"role": "assistant", "content": f"the answer is {2 * i}"}]}
            for i in range(8)]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    code = main(["train", "--model", str(tmp_path / "model"), "--data", str(data),
                 "--output-dir", str(tmp_path / "out"), "--max-seq-length", "48",
                 "--batch-size", "2", "--max-steps", "2", "--no-gradient-checkpointing",
                 "--no-progress", "--compile"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert compiled == ["PeftModelForCausalLM"]
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["train_loss"] > 0

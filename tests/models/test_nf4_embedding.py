"""NF4 embeddings and head (quantize_embeddings): row slices, lookups, a tied head stored once,
the fused loss walking a quantized head in blocks, and training through both paths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lorafuse import FastLanguageModel
from lorafuse.models import nf4
from lorafuse.models.nf4_embedding import Embedding4bit, quantize_embeddings_
from lorafuse.ops import weights
from lorafuse.ops.cross_entropy import fused_linear_cross_entropy
from lorafuse.testing import (
    PLAIN,
    assert_as_accurate_as_stock,
    assert_close,
    fp32_oracle,
    save_tiny_model,
    tiny_llama_config,
)


def _nf4(rows: int, cols: int, dtype=torch.float32, seed=0) -> nf4.NF4Weight:
    torch.manual_seed(seed)
    return nf4.Linear4bit(nn.Linear(cols, rows, bias=False), dtype).weight


# (rows, cols): alignment 8 rows at 2048 columns, 256 at 576, 128 at 128; a partial last block
@pytest.mark.parametrize("shape", [(300, 2048), (1000, 576), (77, 128), (5, 192)])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_row_slices_dequantize_to_the_same_rows(shape, kernels, monkeypatch):
    monkeypatch.setenv("LORAFUSE_KERNELS", kernels)
    w = _nf4(*shape)
    full = w.dequantize(torch.bfloat16).clone()
    align = w.row_alignment
    for start in range(0, shape[0], align):
        for stop in {min(shape[0], start + align), min(shape[0], start + 2 * align + 1), shape[0]}:
            got = w.rows(start, stop).dequantize(torch.bfloat16)
            assert torch.equal(got, full[start:stop]), (shape, start, stop)
    with pytest.raises(ValueError, match="multiple of"):
        w.rows(1, 2) if align > 1 else w.rows(2, 1)


def test_row_blocks_cover_the_weight_in_aligned_blocks(monkeypatch):
    monkeypatch.setattr(weights, "ROW_BLOCK_BYTES", 128 * 2 * 100)  # 100 rows -> 128 (aligned)
    w = _nf4(1000, 128)
    spans = [(a, b) for a, b, _ in weights.row_blocks(w, torch.bfloat16)]
    assert spans == [(a, min(1000, a + 128)) for a in range(0, 1000, 128)]


def test_lookup_is_bit_identical_to_indexing_the_dequantized_table():
    torch.manual_seed(1)
    emb = nn.Embedding(300, 192, padding_idx=0)
    q = Embedding4bit(emb, torch.bfloat16)
    table = q.weight.dequantize(torch.bfloat16)
    ids = torch.tensor([[0, 299, 5, 5], [17, 1, 298, 0]])
    out = q(ids)
    assert out.shape == (2, 4, 192) and out.dtype == torch.bfloat16
    assert torch.equal(out, table[ids])
    with pytest.raises(IndexError, match=r"out of range \[0, 300\)"):
        q(torch.tensor([3, 300]))
    with pytest.raises(ValueError, match="multiple of the NF4 block"):
        Embedding4bit(nn.Embedding(10, 100))


def test_tied_head_shares_the_embedding_buffers_and_counts_once():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    nf4.quantize_model_(model, torch.float32, skip=(model.get_output_embeddings(),))
    assert quantize_embeddings_(model, torch.float32) == 1
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, Embedding4bit) and isinstance(head, nf4.Linear4bit)
    assert head.nf4_codes is emb.nf4_codes
    V, H = emb.weight.shape
    mem = nf4.memory_report(model)
    linears = sum(m.in_features * m.out_features for m in model.modules()
                  if isinstance(m, nf4.Linear4bit) and m is not head)  # fmt: skip
    assert mem["linear_bf16"] == 2 * (linears + V * H)  # the shared table once


def _quantized_and_dense_loss(dtype, ignore_some: bool):
    w = _nf4(1000, 128, dtype, seed=3)
    dense = w.dequantize(dtype).clone()
    torch.manual_seed(4)
    h = torch.randn(37, 128, dtype=dtype)
    t = torch.randint(0, 1000, (37,))
    if ignore_some:
        t[::5] = -100
    return w, dense, h, t


def _loss_and_grad(h, weight, t, **kw):
    h = h.detach().clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, t, **kw)
    loss.backward()
    return loss.detach(), h.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ignore_some", [False, True])
def test_fused_loss_over_a_quantized_head_matches_its_dense_copy(dtype, ignore_some, monkeypatch):
    """The head walked in 8 blocks of rows (two dequantizations per token chunk) gives the loss
    and hidden gradient of the same head dequantized whole: fp32 to 1e-5; bf16 as accurate as the
    dense path against an fp32 oracle (block partials are rounded to bf16 before their fp32 sum,
    the dense product rounds once)."""
    monkeypatch.setattr(weights, "ROW_BLOCK_BYTES", 128 * dtype.itemsize * 100)
    w, dense, h, t = _quantized_and_dense_loss(dtype, ignore_some)
    loss, grad = _loss_and_grad(h, w, t, chunk_size=16)
    ref_loss, ref_grad = _loss_and_grad(h, dense, t, chunk_size=16)
    oracle_loss, oracle_grad = _loss_and_grad(h.float(), dense.float(), t)
    assert_as_accurate_as_stock(loss, ref_loss, oracle_loss, name="loss")
    assert_as_accurate_as_stock(grad, ref_grad, oracle_grad, name="grad hidden")


def test_a_quantized_head_takes_chunks_of_half_the_rows(monkeypatch):
    """The automatic loss chunk of a quantized head fits QUANTIZED_HEAD_CHUNK_BYTES of fp32
    logits (half of a dense head's), and the loss is the same as with the dense head."""
    from lorafuse.ops import cross_entropy as ce

    w, dense, h, t = _quantized_and_dense_loss(torch.float32, False)
    n, V = h.shape[0], w.shape[0]
    monkeypatch.setattr(ce, "CHUNK_BYTES", 4 * V * n)  # a dense head: one chunk of all rows
    monkeypatch.setattr(ce, "QUANTIZED_HEAD_CHUNK_BYTES", 4 * V * n // 2)
    chunks = []
    apply = ce.FusedLinearCrossEntropyFunction.apply
    monkeypatch.setattr(ce.FusedLinearCrossEntropyFunction, "apply",
                        lambda *a: chunks.append(a[6]) or apply(*a))  # fmt: skip
    loss, grad = _loss_and_grad(h, w, t)
    ref_loss, ref_grad = _loss_and_grad(h, dense, t)
    assert chunks == [13, n]  # 37 rows, at most 18 per quantized chunk: 3 balanced ones of 13
    assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5, name="loss")
    assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5, name="grad hidden")


@pytest.mark.parametrize("bias", [False, True])
def test_a_large_linear4bit_runs_by_row_blocks_with_the_same_results(bias, monkeypatch):
    """A Linear4bit whose dense copy would exceed WALK_ABOVE_BYTES (a vocabulary head under a plain
    forward: generation, the stock loss) multiplies block by block: fp32 to 1e-5."""
    monkeypatch.setattr(weights, "ROW_BLOCK_BYTES", 128 * 4 * 100)
    monkeypatch.setattr(weights, "WALK_ABOVE_BYTES", 2 * 128 * 4 * 100)
    torch.manual_seed(7)
    q = nf4.Linear4bit(nn.Linear(128, 1000, bias=bias), torch.float32)
    assert nf4._by_row_blocks(q.weight, torch.float32)
    dense = q.weight.dequantize(torch.float32).clone()
    x = torch.randn(2, 5, 128, requires_grad=True)
    y = q(x)
    ref = torch.nn.functional.linear(x, dense, q.bias)
    g = torch.randn_like(y)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0], atol=1e-5, rtol=1e-5
    )


def test_fused_loss_with_a_quantized_head_under_compile_is_refused(monkeypatch):
    from lorafuse.ops import custom_ops

    monkeypatch.setattr(custom_ops, "active", lambda: True)
    w, _, h, t = _quantized_and_dense_loss(torch.float32, False)
    with pytest.raises(NotImplementedError, match="quantized head under torch.compile"):
        fused_linear_cross_entropy(h, w, t)


def test_patched_training_over_quantized_embeddings_matches_the_stock_forward(monkeypatch):
    """A tied tiny Llama, everything NF4 (fp32 compute), its 1024 x 128 head walked in 8 blocks:
    PEFT's own forward (Embedding4bit, the head by blocks, stock loss) and the patched one (fused
    loss over the head by blocks) agree on the loss and every LoRA gradient to 1e-5, and no
    (V, H) tensor is saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lorafuse.patching import patch_peft_model, unpatch_peft_model

    monkeypatch.setattr(weights, "ROW_BLOCK_BYTES", 128 * 4 * 100)
    monkeypatch.setattr(weights, "WALK_ABOVE_BYTES", 2 * 128 * 4 * 100)
    torch.manual_seed(5)
    cfg = tiny_llama_config(tie_word_embeddings=True, vocab_size=1024, hidden_size=128)
    model = LlamaForCausalLM(cfg)
    nf4.quantize_model_(model, torch.float32, skip=(model.get_output_embeddings(),))
    quantize_embeddings_(model, torch.float32)
    V, H = model.get_input_embeddings().weight.shape
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, V, (2, 12))

    def loss_and_grads():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                      lambda t: t):  # fmt: skip
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        assert (V, H) not in saved and (H, V) not in saved
        return loss.detach(), grads

    stock_loss, stock_grads = loss_and_grads()
    patch_peft_model(model)
    assert "causal_lm_loss[fused_linear_cross_entropy]" in str(model.lorafuse_report)
    loss, grads = loss_and_grads()
    unpatch_peft_model(model)
    torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == stock_grads.keys() and len(grads) == 12
    for name in grads:
        torch.testing.assert_close(grads[name], stock_grads[name], atol=1e-5, rtol=1e-5)


def test_from_pretrained_quantize_embeddings(tmp_path):
    save_tiny_model(tmp_path, **PLAIN)
    with pytest.raises(ValueError, match="needs load_in_4bit"):
        FastLanguageModel.from_pretrained(str(tmp_path), quantize_embeddings=True)
    model, _ = FastLanguageModel.from_pretrained(
        str(tmp_path), load_in_4bit=True, quantize_embeddings=True
    )
    assert isinstance(model.get_input_embeddings(), Embedding4bit)
    assert isinstance(model.get_output_embeddings(), nf4.Linear4bit)
    bf16 = fp32_oracle(model)  # deepcopy: the NF4 buffers survive a copy and a dtype cast
    assert torch.equal(
        bf16.get_input_embeddings().nf4_codes, model.get_input_embeddings().nf4_codes
    )

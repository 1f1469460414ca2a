"""NF4 input embeddings and output head: the vocabulary matrices in 4 bit too.

QLoRA (and ``load_in_4bit=True``) keeps the embeddings and the lm_head in the compute dtype. On
models with a large vocabulary they are a big share of the frozen weights: Llama-3.2-1B's tied
128256 x 2048 embedding is 501 MiB in bf16, half of what its NF4 linears plus that embedding
take. :func:`quantize_embeddings_` stores them in the same NF4 format as
:class:`~lorafuse.models.nf4.Linear4bit` (0.258x of bf16):

* :class:`Embedding4bit` looks rows up by dequantizing only the rows asked for (bit-identical to
  dequantizing the whole table and indexing it).
* The head becomes a ``Linear4bit``; a tied head shares the embedding's buffers (stored once).
  The fused loss (:func:`lorafuse.ops.cross_entropy.fused_linear_cross_entropy`) walks it in
  blocks of rows (:func:`lorafuse.ops.weights.row_blocks`), so no dense copy of more than one
  32 MiB block exists. A plain forward of the head (generation, an unpatched loss) walks the
  same blocks (``Linear4bit`` does for any weight that large): per generated token a
  dequantization of the whole head, slower than a bf16 head.
* The quality cost is QLoRA's, now on the vocabulary too: the frozen logits are computed from
  4-bit weights. Off by default (``FastLanguageModel.from_pretrained(quantize_embeddings=True)``).
"""

from __future__ import annotations

import torch
from torch import nn

from lorafuse.models.nf4 import Linear4bit, NF4Buffers, NF4Weight, register_nf4_buffers
from lorafuse.ops.nf4 import BLOCK, BLOCK2, code_values, quantize_nf4

BUFFERS = ("codes", "absmax_q", "absmax_scale", "absmax_offset")


class Embedding4bit(NF4Buffers, nn.Module):
    """An ``nn.Embedding`` (no max_norm, no sparse gradient) whose table is stored as NF4."""

    def __init__(self, embedding: nn.Embedding, compute_dtype: torch.dtype | None = None):
        super().__init__()
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("Embedding4bit: max_norm and sparse embeddings are not supported")
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        if self.embedding_dim % BLOCK:
            raise ValueError(f"Embedding4bit: embedding_dim {self.embedding_dim} is not a "
                             f"multiple of the NF4 block ({BLOCK})")  # fmt: skip
        self.padding_idx = embedding.padding_idx
        self.compute_dtype = compute_dtype or embedding.weight.dtype
        register_nf4_buffers(self, quantize_nf4(embedding.weight))

    @property
    def weight(self) -> NF4Weight:
        return self.nf4_weight((self.num_embeddings, self.embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return lookup(self.weight, ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, nf4"


def lookup(weight: NF4Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of ``weight`` dequantized: ``(*ids.shape, H)`` in its dtype.

    The arithmetic of :func:`~lorafuse.ops.nf4.dequantize_nf4` on the gathered blocks (code
    value times fp32 absmax, one rounding to the output dtype), so the rows are bit-identical.
    """
    V, H = weight.shape
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < V):
        raise IndexError(f"Embedding4bit: token id out of range [0, {V}): "
                         f"min {int(ids.min())}, max {int(ids.max())}")  # fmt: skip
    flat = ids.reshape(-1).to(torch.int64)  # (n,)
    per_row = H // BLOCK
    blocks = flat[:, None] * per_row + torch.arange(per_row, device=flat.device)  # (n, H/64)
    absmax = weight.absmax_q[blocks].float() * weight.absmax_scale[blocks // BLOCK2]
    absmax += weight.absmax_offset  # (n, H/64) fp32, as dequantize_absmax computes it
    codes = weight.codes.view(V, H // 2).index_select(0, flat)  # (n, H/2) uint8
    values = code_values(codes).view(-1, per_row, BLOCK)
    values.mul_(absmax[..., None])
    return values.view(*ids.shape, H).to(weight.dtype)


def quantize_embeddings_(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """NF4 the input embeddings and the output head of ``model`` in place (a tied head shares the
    embedding's buffers); returns the number of matrices replaced (1 tied, 2 untied)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(emb) is not nn.Embedding:
        raise ValueError(f"quantize_embeddings: input embeddings are {type(emb).__name__}, "
                         "not an nn.Embedding")  # fmt: skip
    tied = head is not None and head.weight is emb.weight
    quantized = Embedding4bit(emb, compute_dtype)
    model.set_input_embeddings(quantized)
    if head is None:
        return 1
    if type(head) is not nn.Linear:
        raise ValueError(f"quantize_embeddings: the output head is {type(head).__name__}, not an "
                         "nn.Linear")  # fmt: skip
    if tied:
        new_head = shared_head(quantized, head.bias)
    else:
        new_head = Linear4bit(head, compute_dtype)
    model.set_output_embeddings(new_head)
    return 1 if tied else 2


def shared_head(embedding: Embedding4bit, bias: torch.Tensor | None) -> Linear4bit:
    """A ``Linear4bit`` head over the embedding's own NF4 buffers (a tied head, stored once)."""
    head = Linear4bit.__new__(Linear4bit)
    nn.Module.__init__(head)
    head.out_features, head.in_features = embedding.num_embeddings, embedding.embedding_dim
    head.compute_dtype = embedding.compute_dtype
    register_nf4_buffers(head, {key: getattr(embedding, f"nf4_{key}") for key in BUFFERS})
    head.register_parameter("bias", bias)
    return head

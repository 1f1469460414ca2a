"""The tensors of a GGUF file as computations on the Hugging Face checkpoint's tensors.

An ``Item`` is one GGUF tensor: its name, the HF tensors it is made from, and the function that
makes it (llama.cpp's converter's ``modify_tensors`` for that tensor: a rename, a row permutation,
``-exp(A_log)``, a split of a fused projection, a stack of per-expert matrices). The writer runs
each function twice: on meta tensors of the stored shapes for the header (no data read), then on
the loaded tensors, one item at a time, so peak memory is one item. ``raw`` items hand over ggml
bytes already in a quantized layout (gpt-oss's MXFP4 experts), written as they are.

``tensor_type`` picks each tensor's ggml type the way the converter does: norms, 1-D tensors,
names not ending in ``.weight``, routers and conv kernels stay f32; the rest take the outtype.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import gguf
import torch

from lorafuse.export.gguf_vocab import GGUFExportError

A = gguf.MODEL_ARCH
Q = gguf.GGMLQuantizationType
# GGUF tensor kinds the converter always keeps in f32 (``conversion/base.py``)
_F32_KINDS = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d", "shortconv.conv", "pos_embd",
              "token_types")  # fmt: skip


def _only(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Item:
    name: str  # GGUF tensor name, e.g. blk.0.attn_qkv.weight
    sources: tuple[str, ...]  # HF tensor names (none: computed from the config)
    fn: Callable[..., torch.Tensor] = _only  # (*sources) -> the tensor as llama.cpp reads it
    raw: Q | None = None  # fn returns uint8 ggml blocks of this type (written as they are)
    lora: bool = field(default=True, compare=False)  # llama.cpp applies a LoRA delta to it


@dataclass(frozen=True)
class Family:
    """How one HF architecture is written: llama.cpp's arch, its metadata keys (``keys``), the
    configs it refuses (``check``, before anything is written) and its tensors (``items``)."""

    arch: A
    keys: Callable[[gguf.GGUFWriter, dict], None]
    check: Callable[[dict], None]
    items: Callable[[Family, list[str], dict], list[Item]]
    permute_qk: bool = False  # llama.cpp "norm" rope: HF rotate-half rows -> interleaved
    norm_shift: float = 0.0  # added to every *norm.weight (Gemma's (1 + w) RMSNorm)
    tied_always: bool = False  # the converter drops lm_head: llama.cpp ties output to token_embd
    stored: tuple[str, ...] = ()  # quantization methods of stored tensors it repacks as they are

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]

    def names(self, config: dict) -> gguf.TensorNameMap:
        return gguf.get_tensor_name_map(self.arch, config["num_hidden_layers"])

    def plan(self, keys: list[str], config: dict) -> list[Item]:
        """The GGUF tensors made from the checkpoint tensors ``keys``, in writing order."""
        return self.items(self, keys, config)


# (regex searched in the HF name, handler(key, gguf name) -> the items it becomes)
Rule = tuple[str, Callable[[str, str], list[Item]]]


def mapped_items(fam: Family, keys: Iterable[str], config: dict, rules: Iterable[Rule] = (),
                 rename: Callable[[str], str] = _only) -> list[Item]:  # fmt: skip
    """Every key under its GGUF name (``rename`` first maps the HF name to one gguf's name map
    knows), through the first rule that matches it, else as stored; per-expert matrices stacked
    (``expert_items``); rotary caches, and ``lm_head`` of a tied model, dropped."""
    names, rules = fam.names(config), list(rules)
    keys = [k for k in keys if not k.endswith("rotary_emb.inv_freq")]
    if fam.tied_always or config.get("tie_word_embeddings"):
        keys = [k for k in keys if k != "lm_head.weight"]
    items, used = expert_items(keys, names, fam.name, rename)
    for key in keys:
        if key in used:
            continue
        rule = next((r for r in rules if re.search(r[0], key)), None)
        gname = names.get_name(rename(key), try_suffixes=(".weight", ".bias"))
        if rule is not None:
            items += rule[1](key, gname)
        elif gname is None:
            raise GGUFExportError(f"tensor {key} has no GGUF {fam.name} name")
        else:
            items.append(Item(gname, (key,)))
    return items


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half q/k rows -> GGML interleaved rows; (out, in) -> (out, in)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tn(kind: gguf.MODEL_TENSOR, key: str | None = None, suffix: str = ".weight") -> str:
    """llama.cpp's name of tensor ``kind`` in the layer of HF tensor ``key``
    (``model.layers.3.x`` -> ``blk.3.<kind>``)."""
    name = gguf.TENSOR_NAMES[kind]
    if "{bid}" in name:
        name = name.format(bid=int(re.search(r"\.layers\.(\d+)\.", key)[1]))
    return name + suffix


def gguf_name(names: gguf.TensorNameMap, key: str, arch: str) -> str:
    gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise GGUFExportError(f"tensor {key} has no GGUF {arch} name")
    return gname


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def expert_items(keys: Iterable[str], names: gguf.TensorNameMap, arch: str,
                 rename: Callable[[str], str] = _only) -> tuple[list[Item], set[str]]:  # fmt: skip
    """Per-expert ``...experts.{e}.{proj}.weight`` matrices stacked into one 3-D tensor per
    projection and layer, expert-major ((E, out, in), ggml ne [in, out, E]) as the converter
    stacks them; returns the items and the keys they consume. ``rename`` maps the stacked HF name
    (``...experts.{proj}.weight``) to the one gguf's name map knows."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in keys:
        m = _EXPERT.match(key)
        if m:
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = key
    items, used = [], set()
    for (prefix, proj), by_id in sorted(groups.items()):
        if sorted(by_id) != list(range(len(by_id))):
            raise GGUFExportError(f"{prefix}: experts {sorted(by_id)} are not 0..{len(by_id) - 1}")
        sources = tuple(by_id[i] for i in range(len(by_id)))
        name = gguf_name(names, rename(f"{prefix}.{proj}.weight"), arch)
        items.append(Item(name, sources, lambda *w: torch.stack(w, dim=0)))
        used.update(sources)
    return items, used


def gate_up_items(key: str, _=None) -> list[Item]:
    """transformers' fused (E, 2 x I, hidden) ``experts.gate_up_proj``: gate rows, then up."""
    half = lambda w, i: w.chunk(2, dim=1)[i]  # noqa: E731
    return [Item(tn(gguf.MODEL_TENSOR.FFN_GATE_EXP, key), (key,), lambda w: half(w, 0)),
            Item(tn(gguf.MODEL_TENSOR.FFN_UP_EXP, key), (key,), lambda w: half(w, 1))]  # fmt: skip


def tensor_type(item: Item, ndim: int, qtype: Q, shape: list[int]) -> Q:
    """The ggml type the converter writes ``item`` in for outtype ``qtype``."""
    if item.raw is not None:
        return item.raw
    kind = item.name.split(".", 2)[-1] if item.name.startswith("blk.") else item.name
    if (ndim <= 1 or item.name.endswith("_norm.weight") or not item.name.endswith(".weight")
            or kind.removesuffix(".weight") in _F32_KINDS):  # fmt: skip
        return Q.F32
    if qtype == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        warnings.warn(
            f"{item.name}: row length {shape[-1]} not a multiple of 32; stored as f16", stacklevel=3
        )
        return Q.F16
    return qtype


def gather_of(item: Item, shape: list[int], cache: dict) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """(rows, cols) with ``item.fn(W) == W[rows][:, cols]`` for every (out, in) ``W`` of
    ``shape``, or None where ``fn`` is no such gather (a stack, ``-exp``, a shift): how a LoRA
    delta ``B @ A`` of that weight follows the converter's transform (``B[rows]``, ``A[:, cols]``).
    Found by running ``fn`` on row- and column-index matrices; ``cache`` (one per model: the
    transforms depend on the family and its config) keeps it per tensor kind and shape, since
    every layer's is the same."""
    if len(item.sources) != 1 or item.raw is not None or len(shape) != 2:
        return None
    key = (re.sub(r"^blk\.\d+\.", "blk.N.", item.name), tuple(shape))
    if key not in cache:
        cache[key] = _probe(item.fn, shape)
    return cache[key]


def _probe(fn: Callable, shape: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    out, inn = shape
    # float64 holds every index exactly
    r = fn(torch.arange(out, dtype=torch.float64)[:, None].expand(out, inn).contiguous())
    c = fn(torch.arange(inn, dtype=torch.float64)[None, :].expand(out, inn).contiguous())
    if r.dim() != 2 or not (r == r[:, :1]).all() or not (c == c[:1]).all():
        return None
    rows, cols = r[:, 0].long(), c[0].long()
    if rows.min() < 0 or rows.max() >= out or cols.min() < 0 or cols.max() >= inn:
        return None
    w = torch.randn(out, inn, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return (rows, cols) if torch.equal(fn(w), w[rows][:, cols]) else None


def meta_shape(item: Item, shapes: dict[str, list[int]]) -> list[int]:
    """The shape ``item.fn`` gives on the stored shapes (meta tensors: no data read)."""
    if not item.sources:
        return list(item.fn().shape)
    dtype = torch.uint8 if item.raw is not None else torch.float32
    args = [torch.empty(shapes[s], dtype=dtype, device="meta") for s in item.sources]
    return list(item.fn(*args).shape)

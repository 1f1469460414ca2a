"""The decode engine: sequences over one C++ decoder (``csrc/decode_engine.h``).

A :class:`DecodeEngine` holds a model's (:mod:`lorafuse.decode.families`) frozen weights in a decode format (:data:`WEIGHTS`;
``auto`` = as the model stores them, no copy), its adapters (:mod:`lorafuse.decode.adapters`,
unmerged, any mix per step) and one KV block per open sequence (a slot, reused after
:meth:`~DecodeEngine.close`; grown by doubling, so a sequence opened with ``reserve`` = prompt
+ new tokens never reallocates). Callers drive it:

* :meth:`~DecodeEngine.open` a sequence (its adapter), :meth:`~DecodeEngine.prefill` its prompt
  in chunks of :data:`PREFILL_CHUNK` tokens (logits of the last token, or of every token for
  prompt scoring), :meth:`~DecodeEngine.fork` it (n samples of one prompt share its prefill);
* :meth:`~DecodeEngine.step` any set of open sequences one token each: one C++ call runs every
  layer for the whole batch (continuous batching: sequences join and leave between steps);
* :meth:`~DecodeEngine.close` it.

The step's logits are fp32 ``(rows, vocab)``. With fp32 weights the step is transformers' fp32
forward up to summation order (the same greedy tokens: ``tests/decode/test_engine.py``); bf16,
int8 and q4 weights multiply fp32 activations (their error against fp32 is the weights' alone:
``benchmarks/decode_quality.py``).

:func:`engine_for` builds one engine per (model, weights) and keeps it while the model lives;
where the engine cannot run a model (:func:`lorafuse.decode.families.read` says why) it returns
None and records the reason (``backends.choices()``, op ``decode_engine``), and the caller uses
the model's own forward.
"""

from __future__ import annotations

import threading
import weakref

import torch

from lorafuse import backends
from lorafuse.decode import adapters as lora
from lorafuse.decode import families
from lorafuse.errors import LorafuseError
from lorafuse.ops import quant_linear

WEIGHTS = ("auto", "fp32", "bf16", "fp16", "int8", "q4")
PREFILL_CHUNK = 256  # prompt tokens per step: the step's scratch grows with its rows
ROPE_START = 4096  # positions in the first cos/sin table (doubled when a sequence needs more)
# the family options' defaults: Llama's (csrc/decode_engine.h, DecodeOptions)
_DEFAULT_OPTIONS = {"act": 0, "embed_scale": 1.0, "residual_scale": 1.0, "attn_softcap": 0.0,
                    "logit_divisor": 1.0, "logit_softcap": 0.0}  # fmt: skip


class EngineUnavailable(LorafuseError):
    """The decode engine cannot run this model or setting (the message says why)."""


class Sequence:
    """One open sequence: its KV slot, adapter index (-1: base) and tokens in the cache."""

    __slots__ = ("slot", "adapter", "length")

    def __init__(self, slot: int, adapter: int, length: int = 0) -> None:
        self.slot, self.adapter, self.length = slot, adapter, length


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


class DecodeEngine:
    """See the module docstring. ``weights``: one of :data:`WEIGHTS`."""

    def __init__(self, model, weights: str = "auto") -> None:
        if weights not in WEIGHTS:
            raise EngineUnavailable(f"decode weights {weights!r}: one of {', '.join(WEIGHTS)}")
        decoder = families.read(model)
        if isinstance(decoder, str):
            raise EngineUnavailable(f"the decode engine cannot run this model: {decoder}")
        if backends.select_cpu("decode_engine") != "cpp":
            raise EngineUnavailable(
                "the decode engine needs the C++ extension (lorafuse build-ext)"
            )
        self._lock = threading.RLock()  # one step at a time: the C++ model has one scratch
        dtype = decoder.embed.dtype
        self.weights = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
            dtype] if weights == "auto" else weights  # fmt: skip
        self.decoder = decoder
        self._model = weakref.ref(model)
        cls = quant_linear.decoder_class()
        d = decoder
        self._rope_len = 0
        tables = self._rope_tables(ROPE_START)
        self.cpp = cls(d.hidden, d.heads, d.kv_heads, d.head_dim, d.intermediate, d.vocab,
                       len(d.layers), d.eps, d.attn_scale, *tables[0])  # fmt: skip
        for i, (cos, sin) in enumerate(tables[1:], 1):
            self.cpp.set_rope(cos, sin, i)
        self.cpp.set_options(**{**_DEFAULT_OPTIONS, **d.options})
        if d.moe:
            self.cpp.set_moe(**d.moe)
        self.weight_bytes = self._load_weights()
        self.adapters: list[str] = []
        self._signature = None
        self.sync()
        self._free: list[int] = []
        self._slots = 0

    # ---- building -------------------------------------------------------------------------
    def _rope_tables(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per table, cos, sin (n, rotary dims) fp32 from the model's own rotary embedding (its
        scaling; one table per layer type where the model has several)."""
        pos = torch.arange(n)[None]  # (1, n)
        out = []
        with torch.no_grad():
            for rope in self.decoder.ropes:
                cos, sin = rope(pos)
                out.append((cos[0].float().contiguous(), sin[0].float().contiguous()))
        self._rope_len = n
        return out

    def _pack(self, weight: torch.Tensor) -> quant_linear.PackedWeight:
        return quant_linear.pack(weight, self.weights)

    def _load_weights(self) -> int:
        d, cpp, total = self.decoder, self.cpp, 0
        embed = quant_linear.pack(d.embed, {torch.float32: "fp32", torch.bfloat16: "bf16",
                                            torch.float16: "fp16"}[d.embed.dtype])  # fmt: skip
        cpp.set_weight(-1, "embed", embed.code, embed.data, None)
        # q4 keeps the vocabulary head in int8, as llama.cpp keeps its output matrix at 6-8 bits
        # for its 4-bit types: on SmolLM2-135M a q4 head costs top-1 (benchmarks/decode_quality.py)
        head = quant_linear.pack(d.lm_head.weight, "int8" if self.weights == "q4" else self.weights)
        cpp.set_weight(-1, "lm_head", head.code, head.data, head.scales)
        cpp.set_vector(-1, "norm", d.norm.detach())
        total += head.nbytes()
        for i, layer in enumerate(d.layers):
            if layer.experts is not None:
                total += self._load_experts(i, layer)
            if layer.conv is not None:  # the depthwise kernel (hidden, 1, L) -> (hidden, L)
                cpp.set_conv(i, layer.conv.weight.detach()[:, 0], layer.conv.bias)
            for name in layer.proj:
                base = families.base_linear(layer.proj[name])
                rows = layer.rows.get(name, slice(None))  # Phi-3's fused modules: its rows
                w = self._pack(base.weight[rows])
                cpp.set_weight(i, name, w.code, w.data, w.scales)
                total += w.nbytes()
                if base.bias is not None:
                    cpp.set_vector(i, f"{name}_bias", base.bias.detach()[rows])
            for name, weight in layer.norms.items():
                cpp.set_vector(i, name, weight)
            for name in ("q_norm", "k_norm"):
                if getattr(layer, name) is not None:
                    cpp.set_vector(i, name, getattr(layer, name).detach())
            cpp.set_layer(i, layer.rope, layer.window, layer.rope_table)
        return total

    def _load_experts(self, i: int, layer: families.Layer) -> int:
        """Layer ``i``'s router (fp32: routing is a discrete choice a rounded router can flip,
        and it is E·H weights; llama.cpp keeps it unquantised too) and its experts, the fused
        (E, 2I, H) / (E, H, I) tensors read as (E·2I, H) / (E·H, I) rows in the decode format."""
        router = layer.router.detach().float().contiguous()
        self.cpp.set_weight(i, "router", 0, router, None)
        if layer.expert_bias is not None:
            self.cpp.set_vector(i, "expert_bias", layer.expert_bias.detach())
        total = router.numel() * 4
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(layer.experts, name).detach()
            packed = self._pack(w.reshape(-1, w.shape[2]))  # a view: auto formats copy nothing
            self.cpp.set_weight(i, f"experts_{name[:-5]}", packed.code, packed.data, packed.scales)
            total += packed.nbytes()
        return total

    def sync(self) -> None:
        """Re-read the adapters where they changed since the last call (names, tensors, and
        which projections carry them: PEFT wraps a layer when an adapter first targets it)."""
        model = self._model()
        if model is None:
            raise EngineUnavailable("the engine's model is gone")
        decoder = families.read(model)
        if isinstance(decoder, str):
            raise EngineUnavailable(f"the decode engine cannot run this model now: {decoder}")
        sig = lora.signature(model, decoder)
        if sig == self._signature:
            return
        with self._lock:
            self.cpp.clear_lora()
            self.adapters = lora.adapter_names(model)
            for t in lora.collect(decoder, self.adapters):
                self.cpp.set_lora(t.layer, t.proj, t.adapter, t.A, t.B, t.scale)
            self._signature = sig

    # ---- sequences ------------------------------------------------------------------------
    def adapter_index(self, name: str | None) -> int:
        if name is None:
            return -1
        if name not in self.adapters:
            raise EngineUnavailable(f"adapter {name!r} is not loaded (have: {self.adapters})")
        return self.adapters.index(name)

    def open(self, adapter: str | None = None, reserve: int = 0) -> Sequence:
        """A new empty sequence with ``adapter`` (None: the base), room for ``reserve`` tokens."""
        index = self.adapter_index(adapter)
        with self._lock:
            slot = self._free.pop() if self._free else self._slots
            self._slots = max(self._slots, slot + 1)
            self.cpp.reserve(slot, max(1, reserve))
        return Sequence(slot, index)

    def close(self, seq: Sequence) -> None:
        """Give the sequence's slot back (its KV block is kept for the next sequence)."""
        with self._lock:
            if seq.slot >= 0:
                self._free.append(seq.slot)
                seq.slot = -1

    def fork(self, seq: Sequence, reserve: int = 0) -> Sequence:
        """A new sequence holding a copy of ``seq``'s cache (same adapter)."""
        with self._lock:
            new = Sequence(self._free.pop() if self._free else self._slots, seq.adapter,
                           seq.length)  # fmt: skip
            self._slots = max(self._slots, new.slot + 1)
            self.cpp.reserve(new.slot, max(reserve, seq.length, 1))
            if seq.length:
                self.cpp.copy_slot(seq.slot, new.slot, seq.length)
        return new

    def _ensure_rope(self, position: int) -> None:
        if position >= self._rope_len:
            n = self._rope_len
            while n <= position:
                n *= 2
            for i, (cos, sin) in enumerate(self._rope_tables(n)):
                self.cpp.set_rope(cos, sin, i)

    def prefill(self, seq: Sequence, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Append ``ids`` to ``seq`` in chunks; the next-token logits of its last token (V,) fp32,
        or with ``all_logits`` of every one of them (len(ids), V)."""
        if not ids:
            raise ValueError("prefill needs at least one token")
        with self._lock:
            return self._prefill(seq, ids, all_logits)

    def _prefill(self, seq: Sequence, ids: list[int], all_logits: bool) -> torch.Tensor:
        self._ensure_rope(seq.length + len(ids) - 1)
        self.cpp.reserve(seq.slot, seq.length + len(ids))
        out = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[start : start + PREFILL_CHUNK]
            n = len(chunk)
            rows = list(range(n)) if all_logits else [n - 1]
            if not all_logits and start + n < len(ids):
                rows = []
            pos = _long(range(seq.length, seq.length + n))
            logits = self.cpp.step(_long(chunk), _long([seq.slot] * n), pos,
                                   _long([seq.adapter] * n), _long(rows))  # fmt: skip
            seq.length += n
            out.append(logits)
        logits = torch.cat(out)
        return logits if all_logits else logits[-1]

    def step(self, seqs: list[Sequence], tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens[i]`` to ``seqs[i]`` (one token each): next-token logits (B, V) fp32."""
        with self._lock:
            self._ensure_rope(max(s.length for s in seqs))
            slots, positions = [s.slot for s in seqs], [s.length for s in seqs]
            adapters = [s.adapter for s in seqs]
            logits = self.cpp.step(_long(tokens), _long(slots), _long(positions),
                                   _long(adapters), _long(range(len(seqs))))  # fmt: skip
        for s in seqs:
            s.length += 1
        return logits

    def describe(self) -> str:
        ext = quant_linear.products_isa()
        return (f"decode engine: {self.decoder.model_type}, {len(self.decoder.layers)} layers, "
                f"{self.weights} weights ({self.weight_bytes / 2**20:.0f} MiB, {ext} products), "
                f"{len(self.adapters)} adapter(s) unmerged")  # fmt: skip


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_for(model, weights: str = "auto") -> DecodeEngine | None:
    """The engine of ``model`` with ``weights`` (built once, kept while the model lives, its
    adapters re-read when they changed), or None where the engine cannot run it: the reason is
    recorded (``backends.choices()``, ``decode_engine (cpu)``) and returned by
    :func:`unavailable_reason`."""
    per_model = _ENGINES.setdefault(model, {})
    engine = per_model.get(weights)
    if engine is None:
        try:
            engine = DecodeEngine(model, weights)
        except EngineUnavailable as err:
            backends.record("decode_engine", "cpu", "model forward", str(err))
            per_model[weights] = err
            return None
        per_model[weights] = engine
    if isinstance(engine, EngineUnavailable):
        return None
    active = lora.active_adapters(model)
    if len(active) > 1:
        why = (
            f"PEFT has {len(active)} adapters active at once ({active}); the engine runs one a row"
        )
        backends.record("decode_engine", "cpu", "model forward", why)
        return None
    try:
        engine.sync()
    except EngineUnavailable as err:
        backends.record("decode_engine", "cpu", "model forward", str(err))
        return None
    backends.record("decode_engine", "cpu", "cpp", engine.describe())
    return engine


def unavailable_reason(model, weights: str = "auto") -> str | None:
    """Why :func:`engine_for` returned None for ``model`` (None if it has an engine)."""
    got = _ENGINES.get(model, {}).get(weights)
    return str(got) if isinstance(got, EngineUnavailable) else None

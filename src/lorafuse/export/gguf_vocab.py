"""Tokenizer metadata for GGUF, read from a Hugging Face ``tokenizer.json`` (llama.cpp key names).

Two families are supported, the ones llama.cpp and transformers' GGUF loader both understand:

* byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen2): ``tokenizer.ggml.model = "gpt2"``,
  tokens spelled in the byte alphabet, ``merges``, and a ``pre`` name for the split regex;
* sentencepiece-style BPE with byte fallback (Llama 2, Mistral): ``"llama"``, tokens with ``▁``,
  scores (rank order) and BYTE token types for ``<0xNN>``.

Token types follow gguf.TokenType: NORMAL 1, UNKNOWN 2, CONTROL 3 (special added tokens),
USER_DEFINED 4 (non-special added tokens), UNUSED 5 (padding up to the model's vocab size), BYTE 6.
Anything else raises ``GGUFExportError`` before a file is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

# pre-tokenizer name llama.cpp uses for a known split regex / layout (see convert_hf_to_gguf.py)
_LLAMA3_SPLIT_HEAD = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
_QWEN2_SPLIT_HEAD = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"


class GGUFExportError(ValueError):
    """The model or tokenizer cannot be exported to GGUF (raised before anything is written)."""


@dataclass
class GGUFVocab:
    model: str  # "gpt2" | "llama"
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos/eos/pad/unk -> id
    add_bos: bool = False
    chat_template: str | None = None


def _pre_name(pre: dict | None) -> str | None:
    """Map a tokenizer.json pre_tokenizer onto llama.cpp's pre-tokenizer names."""
    if pre is None:
        return "default"
    kind = pre.get("type")
    if kind == "ByteLevel":
        return "gpt2" if pre.get("use_regex", True) else "default"
    if kind == "Sequence":
        parts = pre.get("pretokenizers", [])
        types = [p.get("type") for p in parts]
        if types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
            return "smollm"
        split = next((p for p in parts if p.get("type") == "Split"), None)
        regex = (split or {}).get("pattern", {}).get("Regex", "")
        if regex.startswith(_LLAMA3_SPLIT_HEAD):
            return "llama-bpe"
        if regex.startswith(_QWEN2_SPLIT_HEAD):
            return "qwen2"
        if types and types[0] == "Metaspace":
            return None
    if kind == "Metaspace":
        return None
    raise GGUFExportError(
        f"tokenizer.json pre_tokenizer {json.dumps(pre)[:200]} has no llama.cpp equivalent"
    )


def _merges(model: dict) -> list[str]:
    merges = model.get("merges") or []
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def _chat_template(tok_dir: Path, tok_cfg: dict) -> str | None:
    jinja = tok_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tmpl = tok_cfg.get("chat_template")
    if isinstance(tmpl, list):  # named templates: llama.cpp wants the default one
        tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
    return tmpl


def read_vocab(tok_dir: str | Path, vocab_size: int) -> GGUFVocab:
    """Build the GGUF tokenizer metadata from ``tok_dir``; pads the vocab to ``vocab_size``."""
    tok_dir = Path(tok_dir)
    tj_path = tok_dir / "tokenizer.json"
    if not tj_path.is_file():
        raise GGUFExportError(
            f"{tok_dir}: no tokenizer.json (only fast tokenizers can be exported to GGUF)"
        )
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    cfg_path = tok_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise GGUFExportError(f"tokenizer model {model.get('type')!r} is not supported (BPE only)")
    byte_fallback = bool(model.get("byte_fallback"))
    kind = "llama" if byte_fallback else "gpt2"
    pre = _pre_name(tj.get("pre_tokenizer")) if kind == "gpt2" else None

    id_to_tok: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types = {i: 1 for i in id_to_tok}
    for added in tj.get("added_tokens", []):
        id_to_tok[added["id"]] = added["content"]
        types[added["id"]] = 3 if added.get("special") else 4
    if kind == "llama":
        for i, t in id_to_tok.items():
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t):
                types[i] = 6
    n = max(vocab_size, max(id_to_tok) + 1)
    if n > vocab_size:
        raise GGUFExportError(
            f"tokenizer has ids up to {max(id_to_tok)} but the model's vocab_size is {vocab_size}"
        )
    tokens = [id_to_tok.get(i, f"[PAD{i}]") for i in range(n)]
    token_types = [types.get(i, 5) for i in range(n)]
    by_text = {t: i for i, t in enumerate(tokens)}
    special_ids = {}
    for key in ("bos", "eos", "pad", "unk"):
        value = tok_cfg.get(f"{key}_token")
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None and value in by_text:
            special_ids[key] = by_text[value]
    return GGUFVocab(
        model=kind, pre=pre, tokens=tokens, token_types=token_types, merges=_merges(model),
        scores=[-float(i) for i in range(n)] if kind == "llama" else None, special_ids=special_ids,
        add_bos=bool(tok_cfg.get("add_bos_token", kind == "llama")), chat_template=_chat_template(tok_dir, tok_cfg),
    )  # fmt: skip


def add_vocab(writer, vocab: GGUFVocab) -> None:
    """Write the vocab keys (tokenizer.ggml.*, tokenizer.chat_template) into a GGUFWriter."""
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
              "pad": writer.add_pad_token_id, "unk": writer.add_unk_token_id}  # fmt: skip
    for key, value in vocab.special_ids.items():
        adders[key](value)
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)

"""Tokenizer metadata for GGUF, read from a Hugging Face ``tokenizer.json`` (llama.cpp key names).

Two families are supported, the ones llama.cpp and transformers' GGUF loader both understand:

* byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen2): ``tokenizer.ggml.model = "gpt2"``,
  tokens spelled in the byte alphabet, ``merges``, and the llama.cpp ``pre`` name of the split
  regex, identified the way llama.cpp's converter does (``gguf_pretokenizer``);
* sentencepiece-style BPE with byte fallback (Llama 2, Mistral): ``"llama"``, tokens with ``▁``,
  scores (rank order), BYTE token types for ``<0xNN>`` and ``pre = "default"``.

Special ids: bos/eos/pad/unk from ``tokenizer_config.json``, and ``eot``, the token the chat
template ends an assistant turn with (``generation.end_of_turn_token``), so llama.cpp and Ollama
stop a reply there even where it is not the EOS (Gemma, Phi-3, Llama 3 base). ``add_bos`` is
decided as llama.cpp's converter does (``_adds_bos``).

Token types follow gguf.TokenType: NORMAL 1, UNKNOWN 2, CONTROL 3 (special added tokens),
USER_DEFINED 4 (non-special added tokens), UNUSED 5 (padding up to the model's vocab size), BYTE 6.
Anything else raises ``GGUFExportError`` before a file is written.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from lorafuse.errors import GGUFExportError  # noqa: F401 - where the GGUF writers import it


@dataclass
class GGUFVocab:
    model: str  # "gpt2" | "llama"
    pre: str  # llama.cpp pre-tokenizer name (see gguf_pretokenizer)
    tokens: list[str]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos/eos/pad/unk -> id
    add_bos: bool = False
    chat_template: str | None = None
    eot_id: int | None = None  # the chat template's end-of-turn token: llama.cpp stops on it


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


def _token_content(value):
    return value.get("content") if isinstance(value, dict) else value


def _adds_bos(tj: dict, tok_cfg: dict, kind: str) -> bool:
    """Whether tokenizing adds BOS, as llama.cpp's converter decides: ``add_bos_token`` if the
    config has it, else a ``TemplateProcessing`` post-processor that starts with the BOS token
    (Llama 3), else llama.cpp's default for the vocab type."""
    if isinstance(tok_cfg.get("add_bos_token"), bool):
        return tok_cfg["add_bos_token"]
    post = tj.get("post_processor") or {}
    for proc in post.get("processors", [post]):
        single = proc.get("single", []) if proc.get("type") == "TemplateProcessing" else []
        if len(single) > 1:
            return single[0].get("SpecialToken", {}).get("id") == _token_content(tok_cfg.get("bos_token"))  # fmt: skip
    return kind == "llama"


def adds_bos(tok_dir: str | Path) -> bool:
    """Whether llama.cpp adds BOS when tokenizing for a GGUF exported from ``tok_dir``."""
    tok_dir = Path(tok_dir)
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    cfg_path = tok_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    kind = "llama" if tj.get("model", {}).get("byte_fallback") else "gpt2"
    return _adds_bos(tj, tok_cfg, kind)


def _eot_id(tok_dir: Path, by_text: dict[str, int]) -> int | None:
    from transformers import AutoTokenizer

    from lorafuse.generation import end_of_turn_token

    token = end_of_turn_token(AutoTokenizer.from_pretrained(str(tok_dir)))
    return by_text.get(token) if token else None


def read_vocab(tok_dir: str | Path, vocab_size: int, pre: str | None = None) -> GGUFVocab:
    """Build the GGUF tokenizer metadata from ``tok_dir``; pads the vocab to ``vocab_size``.

    ``pre`` forces the llama.cpp pre-tokenizer name; by default it is identified
    (``gguf_pretokenizer.pre_tokenizer_name``), and an unidentifiable one raises.
    """
    from lorafuse.export.gguf_pretokenizer import pre_tokenizer_name

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
        value = _token_content(tok_cfg.get(f"{key}_token"))
        if value is not None and value in by_text:
            special_ids[key] = by_text[value]
    pre = pre_tokenizer_name(tok_dir, kind, pre)  # last: it loads the tokenizer to hash it
    return GGUFVocab(
        model=kind, pre=pre, tokens=tokens, token_types=token_types, merges=_merges(model),
        scores=[-float(i) for i in range(n)] if kind == "llama" else None, special_ids=special_ids,
        add_bos=_adds_bos(tj, tok_cfg, kind), chat_template=_chat_template(tok_dir, tok_cfg),
        eot_id=_eot_id(tok_dir, by_text),
    )  # fmt: skip


# llama.cpp sets token attributes by ``general.name``: a name containing "phi-3" / "phi3" makes
# it look up these tokens, and loading aborts ("unordered_map::at") when the vocab lacks one
_PHI3_NAME_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")
_PHI3_NAME = re.compile(r"(?i)(phi)-?3")


def loadable_name(name: str, vocab: GGUFVocab) -> str:
    """``name`` for ``general.name``, with "phi3" / "phi-3" spelled "phi 3" where llama.cpp
    would otherwise abort on this vocab (its Phi-3 rule needs every token above)."""
    if not _PHI3_NAME.search(name) or all(t in vocab.tokens for t in _PHI3_NAME_TOKENS):
        return name
    renamed = _PHI3_NAME.sub(r"\1 3", name)
    warnings.warn(
        f"GGUF general.name {name!r} written as {renamed!r}: llama.cpp treats a name with "
        f"'phi3' as a Phi-3 vocab and fails to load one without {', '.join(_PHI3_NAME_TOKENS)}",
        stacklevel=2,
    )
    return renamed


def add_vocab(writer, vocab: GGUFVocab) -> None:
    """Write the vocab keys (tokenizer.ggml.*, tokenizer.chat_template) into a GGUFWriter."""
    writer.add_tokenizer_model(vocab.model)
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
    if vocab.eot_id is not None:
        writer.add_eot_token_id(vocab.eot_id)
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)

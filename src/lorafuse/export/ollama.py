"""An Ollama ``Modelfile`` next to an exported GGUF file (or a base GGUF + a LoRA adapter GGUF).

Ollama's ``TEMPLATE`` is a Go text/template, not the Jinja template Hugging Face tokenizers
carry, so a Jinja template cannot be copied over. We write a TEMPLATE only where we can prove it
equals the model's own: ``chat_formats.match_renders`` must find a format (ChatML, Llama 2,
Llama 3, Mistral, Gemma, Phi-3, Phi-4) whose rendering equals the Hugging Face template's for
test conversations, a default system prompt becoming ``SYSTEM`` and the format's end-of-turn
tokens the ``PARAMETER stop`` lines. The BOS token the Jinja template writes is left to llama.cpp,
which adds it when the GGUF says so, or written by the Go template where the GGUF does not add
it. For any other template the Modelfile has no TEMPLATE and says why (Ollama then matches the
GGUF's ``tokenizer.chat_template`` against the templates it ships), and stops at the template's
end-of-turn token if it has one.
"""

from __future__ import annotations

import os
from pathlib import Path

from lorafuse import files
from lorafuse.export.chat_formats import PROBE, PROBE_SYSTEM, Match, go_template, match_renders
from lorafuse.export.gguf_vocab import GGUFExportError, adds_bos
from lorafuse.generation import end_of_turn_token


def _render(tok, messages: list[dict]) -> str | None:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - e.g. Gemma 2 and Mistral refuse a system message
        return None


def chat_match(tok_dir: str | os.PathLike) -> tuple[Match | None, str, str | None]:
    """(the format the tokenizer's chat template equals or None, why not, its end-of-turn token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    if not tok.chat_template:
        return None, "the tokenizer has no chat template", None
    eot = end_of_turn_token(tok)
    plain, with_system = _render(tok, PROBE), _render(tok, PROBE_SYSTEM)
    if plain is None:
        return None, "the chat template cannot render a user/assistant conversation", eot
    match, why = match_renders(plain, with_system)
    bos = tok.bos_token or ""
    if match is None and bos and plain.startswith(bos):  # the template writes BOS first
        cut = len(bos)
        match, why = match_renders(plain[cut:], with_system[cut:] if with_system else None)
        if match is not None and not adds_bos(tok_dir):
            match = Match(match.fmt, match.default_system, match.preamble, bos=bos)
    return match, why, eot


def modelfile_text(gguf_name: str, tok_dir: str | os.PathLike, adapter_name: str | None = None) -> str:  # fmt: skip
    """The Modelfile for ``gguf_name`` (a path relative to the Modelfile, or absolute) whose
    tokenizer is in ``tok_dir``; ``adapter_name``: a LoRA adapter GGUF applied to it."""
    lines = [f"FROM {_path(gguf_name)}"]
    if adapter_name is not None:
        lines.append(f"ADAPTER {_path(adapter_name)}")
    match, why, eot = chat_match(tok_dir)
    if match is None:
        lines += [
            f"# No TEMPLATE: {why}. Ollama needs a Go template (a Jinja one is refused); it",
            "# picks one of its own by matching the GGUF's tokenizer.chat_template. If answers",
            "# look wrong, add TEMPLATE and PARAMETER stop lines for this model's chat format.",
        ]
        if eot is not None:
            lines.append(f'PARAMETER stop "{eot}"')
        return "\n".join(lines) + "\n"
    lines.append(
        f"# TEMPLATE: the {match.fmt.name} format, which equals this model's chat template"
    )
    template = go_template(match)
    assert '"""' not in template  # its text is in JSON-escaped Go string constants
    lines.append(f'TEMPLATE """{template}"""')
    if match.default_system is not None and '"""' in match.default_system:
        lines.append("# the default system prompt contains triple quotes: not written as SYSTEM")
    elif match.default_system is not None:
        lines.append(f'SYSTEM """{match.default_system}"""')
    lines += [f'PARAMETER stop "{s}"' for s in match.fmt.stops]
    return "\n".join(lines) + "\n"


def check_base_gguf(base_gguf: str | os.PathLike, base_dir: str | os.PathLike) -> None:
    """Refuse a ``--base-gguf`` that is not a model GGUF of ``base_dir``'s architecture (Ollama
    would apply the adapter to it anyway, with erratic results)."""
    import json

    import gguf

    from lorafuse.export.gguf_families import family

    path = Path(base_gguf)
    if not path.is_file():
        raise GGUFExportError(f"--base-gguf {path}: no such file")
    try:
        fields = gguf.GGUFReader(path).fields
    except (ValueError, OSError) as err:
        raise GGUFExportError(f"--base-gguf {path}: not a GGUF file ({err})") from err

    def text(key: str) -> str | None:
        f = fields.get(key)
        return bytes(f.parts[f.data[0]]).decode() if f is not None else None

    if text("general.type") == "adapter":
        raise GGUFExportError(f"--base-gguf {path} is an adapter GGUF, not the base model's")
    want = family(json.loads((Path(base_dir) / "config.json").read_text())).name
    if text("general.architecture") != want:
        raise GGUFExportError(
            f"--base-gguf {path} is a {text('general.architecture')} model; the adapter is for {want}"
        )


def _path(name: str) -> str:
    return name if os.path.isabs(name) or name.startswith(".") else f"./{name}"


def write_modelfile(gguf_path: str | os.PathLike, tok_dir: str | os.PathLike,
                    base_gguf: str | os.PathLike | None = None) -> Path:  # fmt: skip
    """Write ``Modelfile`` next to ``gguf_path`` (atomically); returns its path. With
    ``base_gguf``, ``gguf_path`` is a LoRA adapter GGUF: ``FROM`` the base, ``ADAPTER`` it."""
    gguf_path = Path(gguf_path)
    out = gguf_path.with_name("Modelfile")
    if base_gguf is None:
        return files.write_text(out, modelfile_text(gguf_path.name, tok_dir))
    base = Path(base_gguf).resolve()
    try:
        base_name = os.path.relpath(base, gguf_path.resolve().parent)
    except ValueError:  # another drive (Windows)
        base_name = str(base)
    return files.write_text(out, modelfile_text(base_name, tok_dir, adapter_name=gguf_path.name))

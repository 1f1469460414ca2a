"""An Ollama ``Modelfile`` next to an exported GGUF file.

Ollama's ``TEMPLATE`` is a Go text/template (``.Messages``, ``.Role``, ``.Content``, ``.System``,
``.Prompt``, ``.Response``), not the Jinja template Hugging Face tokenizers carry, so a Jinja
template cannot be copied over. We write a TEMPLATE only where we can prove it equals the
model's own: the Hugging Face template is rendered for test conversations and must give exactly
ChatML (SmolLM2, Qwen2, many fine-tunes), optionally with a default system prompt that it adds
when the conversation has none (SmolLM2 does: that becomes ``SYSTEM``, which Ollama inserts as
the first message when a request has no system message). For any other template the Modelfile
has no TEMPLATE and says why: Ollama then matches the GGUF's ``tokenizer.chat_template`` against
the templates it ships, and the user can add a TEMPLATE by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

from lorafuse import files

# Ollama's ChatML template (the .Messages form, with the legacy .System/.Prompt form for old
# clients). A final assistant message is left open so a partial answer is continued.
CHATML_TEMPLATE = """{{- if .Messages }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
<|im_start|>{{ .Role }}
{{ .Content }}{{ if not $last }}<|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_end|>
<|im_start|>assistant
{{ end }}
{{- end }}
{{- else }}
{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ end }}{{ .Response }}{{ if .Response }}<|im_end|>{{ end }}"""
CHATML_STOPS = ("<|im_end|>", "<|im_start|>")

# conversations the Hugging Face template must render as ChatML: with a system message, and
# without one (to find a default system prompt); several turns, generation prompt on
_PROBE = [
    {"role": "user", "content": "Hello there."},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]
_PROBE_SYSTEM = [{"role": "system", "content": "Answer briefly."}, *_PROBE]


def _chatml(messages: list[dict]) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def chatml_default_system(tok_dir: str | os.PathLike) -> tuple[bool, str | None]:
    """(is the tokenizer's chat template ChatML, the system prompt it adds when none is given)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        if not tok.chat_template:
            return False, None
        render = [tok.apply_chat_template(ms, tokenize=False, add_generation_prompt=True)
                  for ms in (_PROBE_SYSTEM, _PROBE)]  # fmt: skip
    except Exception:  # noqa: BLE001 - a template we cannot render is simply not ChatML
        return False, None
    if render[0] != _chatml(_PROBE_SYSTEM):
        return False, None
    if render[1] == _chatml(_PROBE):
        return True, None
    head, _, rest = render[1].partition("<|im_end|>\n")
    prefix = "<|im_start|>system\n"
    if head.startswith(prefix) and len(head) > len(prefix) and rest == _chatml(_PROBE):
        return True, head[len(prefix) :]
    return False, None


def modelfile_text(gguf_name: str, tok_dir: str | os.PathLike) -> str:
    """The Modelfile for ``gguf_name`` (in the same folder) whose tokenizer is in ``tok_dir``."""
    lines = [f"FROM ./{gguf_name}"]
    is_chatml, system = chatml_default_system(tok_dir)
    if not is_chatml:
        lines += [
            "# No TEMPLATE: this model's chat template is not ChatML, and Ollama needs a Go",
            "# template (a Jinja one is refused). Ollama picks one of its own templates by matching",
            "# the GGUF's tokenizer.chat_template; if answers look wrong, add TEMPLATE and",
            "# PARAMETER stop lines for this model's chat format.",
        ]
        return "\n".join(lines) + "\n"
    lines.append(f'TEMPLATE """{CHATML_TEMPLATE}"""')
    if system is not None:
        if '"""' in system:
            lines.append(
                "# the default system prompt contains triple quotes: not written as SYSTEM"
            )
        else:
            lines.append(f'SYSTEM """{system}"""')
    lines += [f'PARAMETER stop "{s}"' for s in CHATML_STOPS]
    return "\n".join(lines) + "\n"


def write_modelfile(gguf_path: str | os.PathLike, tok_dir: str | os.PathLike) -> Path:
    """Write ``Modelfile`` next to ``gguf_path`` (atomically); returns its path."""
    gguf_path = Path(gguf_path)
    out = gguf_path.with_name("Modelfile")
    return files.write_text(out, modelfile_text(gguf_path.name, tok_dir))

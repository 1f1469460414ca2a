"""The chat formats of the families we export, as Ollama Go templates that equal their Jinja ones.

A format is a turn shape: ``head`` opens a turn (``{role}`` is the role's name in it: Gemma
calls the assistant ``model``), ``tail`` closes it and starts with the end-of-turn token; the
system prompt is its own turn (``turn``) or is put before the first user message (``prefix``,
Gemma 3). ``match`` renders a tokenizer's Hugging Face template for probe conversations and
accepts a format only when our reference rendering (``render``) gives exactly the same text,
finding two things the Jinja template may add: a default system prompt used when there is
none (SmolLM2, Qwen2/2.5: becomes the Modelfile's ``SYSTEM``, which Ollama inserts as the first
message) and a fixed preamble before every system prompt (Llama 3.1's knowledge date: written
into the Go template). ``go_template`` writes the format for Ollama's ``.Messages`` form and its
legacy ``.System`` / ``.Prompt`` / ``.Response`` form, from text/template builtins only.

What the Go template does not do: Jinja's ``| trim`` of message contents (Llama 3, Gemma), the
templates' tools and Qwen3's ``<think>`` handling, a date the template computes when rendered
(Llama 3.2: refused, the Go template cannot compute it).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChatFormat:
    name: str
    head: str  # "{role}" is replaced by the role's name
    tail: str  # starts with the end-of-turn token
    stops: tuple[str, ...]  # PARAMETER stop lines
    roles: dict[str, str] = field(default_factory=dict)  # HF role -> its name in the head
    system: str = "turn"  # "turn" | "prefix" (prepended to the first user message + "\n\n")

    def open(self, role: str) -> str:
        return self.head.replace("{role}", self.roles.get(role, role))


FORMATS = (
    ChatFormat("chatml", "<|im_start|>{role}\n", "<|im_end|>\n", ("<|im_end|>", "<|im_start|>")),
    ChatFormat("llama3", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>",
               ("<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>")),
    ChatFormat("gemma", "<start_of_turn>{role}\n", "<end_of_turn>\n",
               ("<end_of_turn>", "<start_of_turn>"), roles={"assistant": "model"}, system="prefix"),
    ChatFormat("phi3", "<|{role}|>\n", "<|end|>\n",
               ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")),
    ChatFormat("phi4", "<|im_start|>{role}<|im_sep|>", "<|im_end|>",
               ("<|im_end|>", "<|im_start|>", "<|im_sep|>")),
)  # fmt: skip

# what the Hugging Face template is rendered for: a plain conversation and the same one with a
# system prompt; several turns, the generation prompt on
PROBE = [
    {"role": "user", "content": "Hello there."},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]
PROBE_SYSTEM_TEXT = "Answer briefly."
PROBE_SYSTEM = [{"role": "system", "content": PROBE_SYSTEM_TEXT}, *PROBE]


@dataclass(frozen=True)
class Match:
    fmt: ChatFormat
    default_system: str | None = None  # the Modelfile's SYSTEM
    preamble: str = ""  # before every system prompt (a system turn of its own when none)
    bos: str = ""  # written by the template itself (the GGUF does not add BOS)


def render(fmt: ChatFormat, messages: list[dict], preamble: str = "") -> str:
    """What the Go template renders for ``messages`` (Ollama's ``.Messages``), generation
    prompt included when the last message is not the assistant's."""
    out, msgs = [], list(messages)
    system = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else None
    if fmt.system == "turn" and preamble and system is None:
        out.append(fmt.open("system") + preamble + fmt.tail)
    for i, m in enumerate(msgs):
        if fmt.system == "prefix" and m["role"] == "system":
            continue
        content = m["content"]
        if m["role"] == "system" and i == 0:
            content = preamble + content
        if fmt.system == "prefix" and i == 1 and system is not None:
            content = system + "\n\n" + content
        out.append(fmt.open(m["role"]) + content)
        if i < len(msgs) - 1:
            out.append(fmt.tail)
    if msgs and msgs[-1]["role"] != "assistant":
        if msgs[-1]["role"] != "system" or fmt.system == "turn":
            out.append(fmt.tail)
        out.append(fmt.open("assistant"))
    return "".join(out)


def _system_content(fmt: ChatFormat, text: str) -> str | None:
    """The content of the leading system turn of ``text`` in ``fmt``, or None."""
    head = fmt.open("system")
    if not text.startswith(head) or fmt.tail not in text[len(head) :]:
        return None
    return text[len(head) : text.index(fmt.tail, len(head))]


def _dated(text: str) -> bool:
    today = datetime.date.today()
    return any(today.strftime(f) in text for f in ("%d %b %Y", "%d %B %Y", "%Y-%m-%d"))


def match_renders(plain: str, with_system: str | None) -> tuple[Match | None, str]:
    """The format whose rendering equals the Hugging Face renders of ``PROBE`` (``plain``) and
    ``PROBE_SYSTEM`` (``with_system``; None where the template refuses a system message), BOS
    already removed; or None and why not."""
    for fmt in FORMATS:
        if fmt.system == "prefix":
            if plain == render(fmt, PROBE) and with_system in (None, render(fmt, PROBE_SYSTEM)):
                return Match(fmt), ""
            continue
        default = None
        if plain != render(fmt, PROBE):
            default = _system_content(fmt, plain)
            if default is None or plain != render(fmt, [{"role": "system", "content": default}, *PROBE]):  # fmt: skip
                continue
        preamble = ""
        if with_system is not None:
            content = _system_content(fmt, with_system)
            if content is None or not content.endswith(PROBE_SYSTEM_TEXT):
                continue
            preamble = content[: -len(PROBE_SYSTEM_TEXT)]
            if with_system != render(fmt, PROBE_SYSTEM, preamble):
                continue
        if _dated(preamble) or _dated(default or ""):
            return None, (
                f"the chat template ({fmt.name}) writes today's date into the system prompt, "
                "which a Go template cannot compute"
            )
        if preamble and default not in (None, preamble):
            return None, (
                f"the chat template ({fmt.name}) adds {default!r} without a system prompt but "
                f"{preamble!r} before one"
            )
        if preamble:
            return Match(fmt, preamble=preamble), ""
        return Match(fmt, default_system=default), ""
    return None, f"the chat template is none of the formats we translate ({', '.join(f.name for f in FORMATS)})"  # fmt: skip


def _q(text: str) -> str:
    """``text`` as a Go template string constant (Go and JSON escapes agree on these)."""
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"


def _role(fmt: ChatFormat, var: str = ".Role") -> str:
    renamed = "".join(
        f'{{{{ if eq {var} "{hf}" }}}}{name}{{{{ else }}}}' for hf, name in fmt.roles.items()
    )
    return renamed + f"{{{{ {var} }}}}" + "{{ end }}" * len(fmt.roles)


def _open_role(fmt: ChatFormat) -> str:
    pre, post = fmt.head.split("{role}")
    return _q(pre) + _role(fmt) + _q(post)


def go_template(m: Match) -> str:
    """Ollama's TEMPLATE for ``m``: the ``.Messages`` form (a final assistant message is left
    open, so a partial answer is continued), and the legacy form for old Ollama versions."""
    fmt, pre = m.fmt, m.preamble
    first_system = '(eq (index $.Messages 0).Role "system")'
    lines = ["{{- if .Messages }}"]
    if m.bos:
        lines.append("{{- " + json.dumps(m.bos) + " }}")
    if pre:
        lines.append(f"{{{{- if not {first_system} }}}}"
                     + _q(fmt.open("system") + pre + fmt.tail) + "{{ end }}")  # fmt: skip
    lines += ["{{- range $i, $_ := .Messages }}",
              "{{- $last := eq (len (slice $.Messages $i)) 1 }}"]  # fmt: skip
    if fmt.system == "prefix":
        lines.append('{{- if ne .Role "system" }}')
    lines.append("{{- " + _open_role(fmt)[3:])
    if pre:
        lines.append(f'{{{{- if and (eq $i 0) (eq .Role "system") }}}}{_q(pre)}{{{{ end }}}}')
    if fmt.system == "prefix":
        lines.append(f"{{{{- if and (eq $i 1) {first_system} }}}}"
                     "{{ (index $.Messages 0).Content }}" + _q("\n\n") + "{{ end }}")  # fmt: skip
    lines += ["{{- .Content }}", "{{- if not $last }}" + _q(fmt.tail) + "{{ end }}"]
    gen = _q(fmt.tail + fmt.open("assistant")) + "{{ end }}"
    if fmt.system == "prefix":  # a system message alone opened no turn
        lines.append("{{- end }}")
        gen = _q(fmt.tail) + "{{ end }}" + _q(fmt.open("assistant")) + "{{ end }}"
        gen = '{{ if ne .Role "system" }}' + gen
    lines += ['{{- if and $last (ne .Role "assistant") }}' + gen, "{{- end }}", "{{- else }}"]
    lines += _legacy(m) + ["{{- end }}"]
    return "\n".join(lines)


def _legacy(m: Match) -> list[str]:
    """The ``.System`` / ``.Prompt`` / ``.Response`` form: one round of a conversation."""
    fmt, pre = m.fmt, m.preamble
    lines = ["{{- " + json.dumps(m.bos) + " }}"] if m.bos else []
    if fmt.system == "turn":
        lines.append("{{- if .System }}" + _q(fmt.open("system") + pre)
                     + "{{ .System }}" + _q(fmt.tail) + "{{ end }}")  # fmt: skip
        if pre:
            lines[-1] = lines[-1][: -len("{{ end }}")] + "{{ else }}"
            lines[-1] += _q(fmt.open("system") + pre + fmt.tail) + "{{ end }}"
        lines.append("{{- if .Prompt }}" + _q(fmt.open("user"))
                     + "{{ .Prompt }}" + _q(fmt.tail) + "{{ end }}")  # fmt: skip
    else:
        lines.append("{{- if .Prompt }}" + _q(fmt.open("user")) + "{{ if .System }}{{ .System }}"
                     + _q("\n\n") + "{{ end }}{{ .Prompt }}" + _q(fmt.tail) + "{{ end }}")  # fmt: skip
    lines.append("{{- " + _q(fmt.open("assistant"))[3:] + "{{ .Response }}"
                 + "{{ if .Response }}" + _q(fmt.tail) + "{{ end }}")  # fmt: skip
    return lines

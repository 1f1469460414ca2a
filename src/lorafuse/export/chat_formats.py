"""The chat formats of the families we export, as Ollama Go templates that equal their Jinja ones.

A format is a turn shape (``head`` / ``tail`` / ``turns``, the system prompt as a ``turn`` or a
``prefix``). ``match_renders`` accepts a format only when our ``render`` of probe conversations
equals the tokenizer's Hugging Face render (finding a default system prompt and a fixed
preamble); ``go_template`` writes it for Ollama. What the Go template does not do: docs/deploy.md.
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
    system: str = "turn"  # "turn" | "prefix" (``prefix`` put before the first user message)
    prefix: str = "{system}\n\n"  # "{system}" is replaced by the system prompt
    # role -> (head, tail) where a role's turn has its own shape ([INST]: an assistant turn is
    # its bare answer closed by EOS)
    turns: dict[str, tuple[str, str]] = field(default_factory=dict)
    # what the generation prompt opens the assistant turn with, where not its head (Llama 2:
    # the head's space is the start of the answer's first token)
    gen: str | None = None
    # what the generation prompt writes after the assistant's head: a reasoning block opened
    # (Qwen3.5's "<think>\n") or closed empty (Gemma 4's thought channel, thinking off)
    reply: str = ""

    def open(self, role: str) -> str:
        if role in self.turns:
            return self.turns[role][0]
        return self.head.replace("{role}", self.roles.get(role, role))

    def close(self, role: str) -> str:
        return self.turns[role][1] if role in self.turns else self.tail

    def open_gen(self) -> str:
        return (self.open("assistant") if self.gen is None else self.gen) + self.reply


FORMATS = (
    ChatFormat("chatml", "<|im_start|>{role}\n", "<|im_end|>\n", ("<|im_end|>", "<|im_start|>")),
    # Qwen3.5: ChatML whose generation prompt opens the reasoning block
    ChatFormat("chatml-think", "<|im_start|>{role}\n", "<|im_end|>\n", ("<|im_end|>", "<|im_start|>"),
               reply="<think>\n"),
    ChatFormat("llama3", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>",
               ("<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>")),
    ChatFormat("gemma", "<start_of_turn>{role}\n", "<end_of_turn>\n",
               ("<end_of_turn>", "<start_of_turn>"), roles={"assistant": "model"}, system="prefix"),
    # Gemma 4: its own turn tokens, a system turn, and (thinking off, the template's default) an
    # empty thought channel before the answer
    ChatFormat("gemma4", "<|turn>{role}\n", "<turn|>\n", ("<turn|>", "<|turn>"),
               roles={"assistant": "model"}, reply="<|channel>thought\n<channel|>"),
    ChatFormat("granite", "<|start_of_role|>{role}<|end_of_role|>", "<|end_of_text|>\n",
               ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>")),
    ChatFormat("phi3", "<|{role}|>\n", "<|end|>\n",
               ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")),
    ChatFormat("phi4", "<|im_start|>{role}<|im_sep|>", "<|im_end|>",
               ("<|im_end|>", "<|im_start|>", "<|im_sep|>")),
    # Mistral: [INST] user [/INST]answer</s>; its template refuses a system message (Ollama's
    # own Mistral template puts it before the user message, as here)
    ChatFormat("mistral", "[INST] ", " [/INST]", ("</s>", "[INST]", "[/INST]"), system="prefix",
               turns={"assistant": ("", "</s>")}),
    # Mistral's later template: a space before [INST] and before the answer (the prompt ends at
    # [/INST]: that space starts the answer's first token), a system prompt before the first
    # user message
    ChatFormat("mistral-sys", " [INST] ", " [/INST]", ("</s>", "[INST]", "[/INST]"),
               system="prefix", turns={"assistant": (" ", "</s>")}, gen=""),
    # Llama 2 chat: the system prompt in <<SYS>> inside the first [INST]; every later user turn
    # starts with BOS (the assistant's tail here: the first BOS is llama.cpp's to add)
    ChatFormat("llama2", "[INST] ", " [/INST]",
               ("</s>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"), system="prefix", prefix="<<SYS>>\n{system}\n<</SYS>>\n\n",
               turns={"assistant": (" ", " </s><s>")}, gen=""),
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
        out.append(fmt.open("system") + preamble + fmt.close("system"))
    for i, m in enumerate(msgs):
        if fmt.system == "prefix" and m["role"] == "system":
            continue
        content = m["content"]
        if m["role"] == "system" and i == 0:
            content = preamble + content
        if fmt.system == "prefix" and i == 1 and system is not None:
            content = fmt.prefix.replace("{system}", system) + content
        out.append(fmt.open(m["role"]) + content)
        if i < len(msgs) - 1:
            out.append(fmt.close(m["role"]))
    if msgs and msgs[-1]["role"] != "assistant":
        if msgs[-1]["role"] != "system" or fmt.system == "turn":
            out.append(fmt.close(msgs[-1]["role"]))
        out.append(fmt.open_gen())
    return "".join(out)


def _system_content(fmt: ChatFormat, text: str) -> str | None:
    """The content of the leading system turn of ``text`` in ``fmt``, or None."""
    head, tail = fmt.open("system"), fmt.close("system")
    if not text.startswith(head) or tail not in text[len(head) :]:
        return None
    return text[len(head) : text.index(tail, len(head))]


def _dated(text: str) -> bool:
    today = datetime.date.today()
    return any(today.strftime(f) in text for f in ("%d %b %Y", "%d %B %Y", "%Y-%m-%d"))


def match_renders(plain: str, with_system: str | None) -> tuple[Match | None, str]:
    """The format whose rendering equals the Hugging Face renders of ``PROBE`` (``plain``) and
    ``PROBE_SYSTEM`` (``with_system``; None where the template refuses a system message), BOS
    already removed; or None and why not."""
    if _dated(plain) or _dated(with_system or ""):
        return None, "the chat template writes today's date, which a Go template cannot compute"
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


def _by_role(fmt: ChatFormat, default: str, which: int) -> str:
    """``default`` (Go), or for the roles with a turn of their own their head (``which`` 0) or
    tail (1)."""
    own = [f'{{{{ if eq .Role "{r}" }}}}{_q(t[which])}{{{{ else }}}}' for r, t in fmt.turns.items()]
    return "".join(own) + default + "{{ end }}" * len(own)


def _open_role(fmt: ChatFormat) -> str:
    if "{role}" not in fmt.head:  # [INST]: one head for every role without a turn of its own
        return _by_role(fmt, _q(fmt.head), 0)
    pre, post = fmt.head.split("{role}")
    return _by_role(fmt, _q(pre) + _role(fmt) + _q(post), 0)


def _close_role(fmt: ChatFormat) -> str:
    return _by_role(fmt, _q(fmt.tail), 1)


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
                     + _q(fmt.open("system") + pre + fmt.close("system")) + "{{ end }}")  # fmt: skip
    lines += ["{{- range $i, $_ := .Messages }}",
              "{{- $last := eq (len (slice $.Messages $i)) 1 }}"]  # fmt: skip
    if fmt.system == "prefix":
        lines.append('{{- if ne .Role "system" }}')
    lines.append("{{- " + _open_role(fmt)[3:])
    if pre:
        lines.append(f'{{{{- if and (eq $i 0) (eq .Role "system") }}}}{_q(pre)}{{{{ end }}}}')
    if fmt.system == "prefix":
        before, after = fmt.prefix.split("{system}")
        lines.append(f"{{{{- if and (eq $i 1) {first_system} }}}}" + _q(before)
                     + "{{ (index $.Messages 0).Content }}" + _q(after) + "{{ end }}")  # fmt: skip
    lines += ["{{- .Content }}", "{{- if not $last }}" + _close_role(fmt) + "{{ end }}"]
    gen = _close_role(fmt) + _q(fmt.open_gen()) + "{{ end }}"
    if fmt.system == "prefix":  # a system message alone opened no turn
        lines.append("{{- end }}")
        gen = '{{ if ne .Role "system" }}' + _close_role(fmt) + "{{ end }}"
        gen += _q(fmt.open_gen()) + "{{ end }}"
    lines += ['{{- if and $last (ne .Role "assistant") }}' + gen, "{{- end }}", "{{- else }}"]
    lines += _legacy(m) + ["{{- end }}"]
    return "\n".join(lines)


def _legacy(m: Match) -> list[str]:
    """The ``.System`` / ``.Prompt`` / ``.Response`` form: one round of a conversation."""
    fmt, pre = m.fmt, m.preamble
    lines = ["{{- " + json.dumps(m.bos) + " }}"] if m.bos else []
    if fmt.system == "turn":
        system = fmt.open("system") + pre, fmt.close("system")
        lines.append("{{- if .System }}" + _q(system[0]) + "{{ .System }}" + _q(system[1])
                     + "{{ end }}")  # fmt: skip
        if pre:
            lines[-1] = lines[-1][: -len("{{ end }}")] + "{{ else }}"
            lines[-1] += _q(system[0] + system[1]) + "{{ end }}"
        lines.append("{{- if .Prompt }}" + _q(fmt.open("user"))
                     + "{{ .Prompt }}" + _q(fmt.close("user")) + "{{ end }}")  # fmt: skip
    else:
        before, after = fmt.prefix.split("{system}")
        lines.append("{{- if .Prompt }}" + _q(fmt.open("user")) + "{{ if .System }}" + _q(before)
                     + "{{ .System }}" + _q(after) + "{{ end }}{{ .Prompt }}" + _q(fmt.close("user"))
                     + "{{ end }}")  # fmt: skip
    answer = "{{ .Response }}" + "{{ if .Response }}" + _q(fmt.close("assistant")) + "{{ end }}"
    if fmt.gen is None:
        lines.append("{{- " + _q(fmt.open_gen())[3:] + answer)
    else:  # the assistant's head is written with an answer only: the prompt ends before it
        lines.append("{{- " + _q(fmt.gen)[3:] + "{{ if .Response }}" + _q(fmt.open("assistant"))
                     + "{{ .Response }}" + _q(fmt.close("assistant")) + "{{ end }}")  # fmt: skip
    return lines

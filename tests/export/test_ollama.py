"""The Ollama Modelfile: a TEMPLATE that Go's own text/template renders exactly as the model's
Hugging Face template (or none, with the reason), its stops, and FROM + ADAPTER for an adapter.

Each family's real chat template (``lorafuse.testing.chat_families``) is rendered by transformers
and the Modelfile's TEMPLATE by Go (``go_templates``: Ollama's data, ``collate`` and SYSTEM
insertion included), for conversations with and without a system prompt, one and several turns,
in Ollama's ``.Messages`` form and its legacy one-round ``.System`` / ``.Prompt`` form. The BOS
text the Jinja template writes is llama.cpp's to add when the GGUF says so (``adds_bos``).
"""

from __future__ import annotations

import re

import pytest

from lorafuse.commands import main
from lorafuse.export.chat_formats import FORMATS
from lorafuse.export.gguf_export import write_gguf, write_modelfile
from lorafuse.export.gguf_vocab import adds_bos
from lorafuse.testing.chat_families import CHAT_FAMILIES, save_family_tokenizer

SYSTEM = {"role": "system", "content": "You are terse. Reply in one line."}
TURNS = [
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "And one more, larger?"},
]
CONVERSATIONS = [TURNS, [SYSTEM, *TURNS], TURNS[:1], [SYSTEM, TURNS[0]]]
TRANSLATED = sorted(n for n, f in CHAT_FAMILIES.items() if f.fmt)
NO_SYSTEM = {"gemma2", "mistral"}  # their templates refuse a system message


def _triple(modelfile: str, command: str) -> str | None:
    match = re.search(rf'^{command} """(.*?)"""$', modelfile, re.S | re.M)
    return match.group(1) if match else None


def _stops(modelfile: str) -> list[str]:
    return re.findall(r'^PARAMETER stop "(.*)"$', modelfile, re.M)


def _hf(tok, messages) -> str | None:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - Gemma 2 and Mistral refuse a system message
        return None


def _ollama_messages(modelfile: str, messages: list[dict]) -> list[dict]:
    """What Ollama's server executes the TEMPLATE with: SYSTEM first when no system message."""
    system = _triple(modelfile, "SYSTEM")
    if system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return [{"Role": m["role"], "Content": m["content"]} for m in messages]


@pytest.mark.parametrize("name", TRANSLATED)
def test_family_template_renders_in_go_exactly_as_hugging_face(name, go_templates, tmp_path):
    tok = save_family_tokenizer(name, tmp_path / "tok")
    fam = CHAT_FAMILIES[name]
    text = write_modelfile(tmp_path / "m.gguf", tmp_path / "tok").read_text()
    assert text.startswith("FROM ./m.gguf\n") and f"the {fam.fmt} format" in text
    template = _triple(text, "TEMPLATE")
    assert fam.eot in _stops(text) and not re.search(r"{%|%}|{#", template)  # never Jinja
    bos = tok.bos_token if adds_bos(tmp_path / "tok") else ""
    cases, want = [], []
    for messages in CONVERSATIONS:
        hf = _hf(tok, messages)
        if hf is None:  # the template refuses it: nothing to be equal to
            assert name in NO_SYSTEM and messages[0]["role"] == "system"
            continue
        cases.append({"Template": template, "Messages": _ollama_messages(text, messages)})
        want.append(hf)
        if len(messages) <= 2:  # one round: the legacy form too
            system = messages[0]["content"] if messages[0]["role"] == "system" else None
            system = system if system is not None else _triple(text, "SYSTEM") or ""
            cases.append({"Template": template, "Legacy": True, "System": system,
                          "Prompt": messages[-1]["content"]})  # fmt: skip
            want.append(hf)
    assert len(cases) == (3 if name in NO_SYSTEM else 6)
    for case, got, hf in zip(cases, go_templates.render(cases), want):
        assert hf.startswith(bos)
        form = "legacy" if case.get("Legacy") else f"{len(case['Messages'])} messages"
        assert bos + got == hf, f"{name} ({form}):\n{got!r}\n!=\n{hf[len(bos) :]!r}"


def test_every_format_is_used_by_a_family():
    assert {f.name for f in FORMATS} == {f.fmt for f in CHAT_FAMILIES.values() if f.fmt}


@pytest.mark.parametrize("name", ["llama3.2", "smollm3", "gpt-oss"])
def test_untranslatable_template_gets_no_template_the_reason_and_its_stop(name, tmp_path):
    save_family_tokenizer(name, tmp_path / "tok")
    text = write_modelfile(tmp_path / "m.gguf", tmp_path / "tok").read_text()
    assert "TEMPLATE" not in text.replace("No TEMPLATE", "").replace("add TEMPLATE", "")
    reason = "writes today's date, which a Go template cannot compute"
    assert text.startswith("FROM ./m.gguf\n# No TEMPLATE: the chat template") and reason in text
    assert _stops(text) == [CHAT_FAMILIES[name].eot]


def test_smollm2_gets_chatml_with_its_default_system_prompt(smol_tiny, go_templates, tmp_path):
    text = write_modelfile(tmp_path / "smol.gguf", smol_tiny / "merged").read_text()
    assert text.startswith("FROM ./smol.gguf\n") and "the chatml format" in text
    assert _stops(text) == ["<|im_end|>", "<|im_start|>"]
    # SmolLM2's template adds this system prompt when a conversation has none; Ollama does the
    # same with SYSTEM
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert _triple(text, "SYSTEM") == system
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_tiny / "merged")
    template = _triple(text, "TEMPLATE")
    got = go_templates.render([{"Template": template, "Messages": _ollama_messages(text, TURNS)}])
    assert got == [_hf(tok, TURNS)]
    assert not list(tmp_path.glob(".Modelfile*"))


def test_non_chatml_template_gets_no_template_and_a_reason(smol_tiny, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_tiny / "merged")
    # ChatML-looking tokens, but a space where ChatML has a newline: no format, so no TEMPLATE
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    text = write_modelfile(tmp_path / "m.gguf", tmp_path / "tok").read_text()
    assert [line for line in text.splitlines() if not line.startswith("#")] == [
        "FROM ./m.gguf", 'PARAMETER stop "<|im_end|>"']  # fmt: skip
    assert text.startswith("FROM ./m.gguf\n# No TEMPLATE: the chat template is none of")


def test_adapter_modelfile_is_from_the_base_gguf_with_the_adapter(smol_tiny, tmp_path, capsys):
    base = write_gguf(smol_tiny / "base", tmp_path / "gguf" / "base.gguf", "f32")
    out = tmp_path / "lora" / "adapter.gguf"
    argv = ["export", "--model", str(smol_tiny / "base"), "--adapter", str(smol_tiny / "adapter"),
            "--format", "gguf-lora", "--outtype", "f32", "--ollama", "-o", str(out)]  # fmt: skip
    assert main(argv) == 2 and "needs --base-gguf" in capsys.readouterr().err
    assert main([*argv, "--base-gguf", str(tmp_path / "nope.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not out.exists()
    assert main([*argv, "--base-gguf", str(base)]) == 0
    text = (out.parent / "Modelfile").read_text()
    assert text.startswith("FROM ../gguf/base.gguf\nADAPTER ./adapter.gguf\n")
    assert "the chatml format" in text and _triple(text, "TEMPLATE")
    # an adapter GGUF is no base: refused, and nothing is written
    other = tmp_path / "again" / "adapter.gguf"
    assert main([*argv[:-1], str(other), "--base-gguf", str(out)]) == 2
    assert "is an adapter GGUF" in capsys.readouterr().err and not other.exists()
    assert main(["export", "--model", str(smol_tiny / "base"), "--format", "gguf",
                 "--base-gguf", str(base), "-o", str(tmp_path / "x.gguf")]) == 2  # fmt: skip
    assert "--base-gguf is for --format gguf-lora --ollama" in capsys.readouterr().err

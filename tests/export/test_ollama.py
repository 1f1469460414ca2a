"""The Ollama Modelfile: a Go template Ollama accepts (never Jinja), or none with a reason."""

from __future__ import annotations

import re

from lorafuse.export.gguf_export import write_modelfile
from lorafuse.export.ollama import CHATML_STOPS

GO_ACTION = re.compile(r"{{-?\s*(.*?)\s*-?}}", re.S)
# what Ollama's templates may use: these fields and variables, and text/template's keywords
GO_FIELDS = {".Messages", ".Role", ".Content", ".System", ".Prompt", ".Response", "$.Messages"}
GO_WORDS = {"if", "else", "end", "range", "not", "and", "eq", "ne", "len", "slice", ":=", ",", "$i", "$_", "$last", "1"}  # fmt: skip


def _check_go_template(text: str) -> None:
    """Every action is text/template syntax over Ollama's fields; if/range blocks are closed."""
    assert "{%" not in text and "%}" not in text and "{#" not in text, "Jinja syntax"
    assert text.count("{{") == text.count("}}")
    depth = 0
    for action in GO_ACTION.findall(text):
        bare = re.sub(r'"[^"]*"', " ", action).replace("(", " ").replace(")", " ")  # no literals
        words = re.findall(r"\$?\.?\w+|:=|,", bare)
        unknown = [w for w in words if w not in GO_FIELDS | GO_WORDS]
        assert not unknown, f"{{{{ {action} }}}}: {unknown}"
        depth += words[0] in ("if", "range") if words else 0
        depth -= words[:1] == ["end"]
        assert depth >= 0, f"unbalanced at {{{{ {action} }}}}"
    assert depth == 0, "an if/range block is not closed"


def _template(modelfile: str) -> str:
    match = re.search(r'^TEMPLATE """(.*?)"""$', modelfile, re.S | re.M)
    assert match, modelfile
    return match.group(1)


def test_chatml_model_gets_the_chatml_go_template(smol_tiny, tmp_path):
    gguf = tmp_path / "smol.gguf"  # the Modelfile only names it
    text = write_modelfile(gguf, smol_tiny / "merged").read_text()
    assert text.startswith("FROM ./smol.gguf\n")
    template = _template(text)
    _check_go_template(template)
    assert ".Messages" in template and "<|im_start|>{{ .Role }}" in template
    for stop in CHATML_STOPS:
        assert f'PARAMETER stop "{stop}"' in text
    # SmolLM2's template adds this system prompt when a conversation has none; Ollama does the
    # same with SYSTEM
    assert (
        'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""' in text
    )
    assert not list(tmp_path.glob(".Modelfile*"))


def test_non_chatml_template_gets_no_template_and_a_reason(smol_tiny, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_tiny / "merged")
    # ChatML-looking tokens, but a space where ChatML has a newline: not ChatML, so no TEMPLATE
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    text = write_modelfile(tmp_path / "m.gguf", tmp_path / "tok").read_text()
    assert [line for line in text.splitlines() if not line.startswith("#")] == ["FROM ./m.gguf"]
    assert text.startswith("FROM ./m.gguf\n# No TEMPLATE: this model's chat template is not ChatML")

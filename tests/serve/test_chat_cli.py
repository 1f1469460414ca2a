"""`lorafuse chat`: streamed replies through the chat template, /reset, /system, piped stdin."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from lorafuse.commands.chat import ChatSession
from lorafuse.generation import SamplingParams, encode_messages
from lorafuse.models.resolve import load_resolved, resolve_spec


def _greedy(model, tok, messages, n):
    ids = encode_messages(tok, messages)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    new = out[0, len(ids) :].tolist()
    return tok.decode(new, skip_special_tokens=True)


def test_session_matches_generate_and_commands(tiny_ws, capsys):
    model, tok, _ = load_resolved(resolve_spec(checkpoint=str(tiny_ws["checkpoint"])))
    buf = io.StringIO()
    s = ChatSession(model, tok, SamplingParams(max_new_tokens=8), out=buf)
    s.handle("/system be brief")
    r1 = s.reply("hello")
    assert r1.text == _greedy(
        model,
        tok,
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        8,
    )
    assert buf.getvalue() == r1.text + "\n"  # what was streamed is the answer
    s.reply("again")
    assert [m["role"] for m in s.messages()] == ["system", "user", "assistant", "user", "assistant"]
    s.handle("/reset")
    assert s.messages() == [{"role": "system", "content": "be brief"}]
    assert s.handle("/exit") is False


@pytest.mark.slow
def test_chat_piped_stdin_subprocess(tiny_ws):
    cmd = [sys.executable, "-m", "lorafuse", "chat", "--model", str(tiny_ws["base"]),
           "--adapter", str(tiny_ws["adapter_a"]), "--max-new-tokens", "6",
           "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "1"]  # fmt: skip
    stdin = "hi there\n/reset\n/system you are a bot\nwhat now\n/exit\nnever read\n"
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "system prompt set" in p.stderr and "history cleared" in p.stderr
    # the same session in-process: --seed makes the sampled replies reproducible
    model, tok, _ = load_resolved(
        resolve_spec(model=str(tiny_ws["base"]), adapters=[str(tiny_ws["adapter_a"])])
    )
    buf = io.StringIO()
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=1)
    session = ChatSession(model, tok, params, out=buf)
    for line in stdin.splitlines():
        if not session.handle(line):
            break
    assert p.stdout == buf.getvalue()
    assert p.stdout.count("\n") == 2  # two replies; /exit stopped before "never read"


def test_chat_bad_args(tiny_ws):
    from lorafuse.commands import main

    assert main(["chat", "--model", str(tiny_ws["base"]), "--top-p", "0"]) == 2
    assert main(["chat", "--checkpoint", str(tiny_ws["root"] / "nope")]) == 2

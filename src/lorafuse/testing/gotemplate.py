"""Go's own ``text/template`` rendering Ollama TEMPLATEs the way Ollama executes them.

A few-line Go program (standard library only, built once with the ``go`` toolchain, offline)
reads cases as JSON on stdin and prints the renders. It parses each template as Ollama does
(``missingkey=zero``) and passes Ollama's data: for the ``.Messages`` form, the messages after
Ollama's ``collate`` (consecutive messages of one role merged with a blank line, ``.System`` the
system messages joined) and an empty ``.Response``; for the legacy form one round's
``.System`` / ``.Prompt`` and an empty ``.Response``. Ollama's own template functions (``json``,
``currentDate``...) are not defined, so a template that needs them fails to parse here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

GO_MAIN = r"""package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role    string
	Content string
}

type Case struct {
	Template string
	Messages []Message
	Legacy   bool
	System   string
	Prompt   string
}

func collate(msgs []Message) (string, []*Message) {
	var system []string
	var out []*Message
	for i := range msgs {
		if msgs[i].Role == "system" {
			system = append(system, msgs[i].Content)
		}
		if len(out) > 0 && out[len(out)-1].Role == msgs[i].Role && msgs[i].Role != "tool" {
			out[len(out)-1].Content += "\n\n" + msgs[i].Content
		} else {
			m := msgs[i]
			out = append(out, &m)
		}
	}
	return strings.Join(system, "\n\n"), out
}

func main() {
	var cases []Case
	if err := json.NewDecoder(os.Stdin).Decode(&cases); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	renders := []string{}
	for i, c := range cases {
		t, err := template.New("").Option("missingkey=zero").Parse(c.Template)
		if err != nil {
			fmt.Fprintf(os.Stderr, "case %d: %v\n", i, err)
			os.Exit(1)
		}
		data := map[string]any{"System": c.System, "Prompt": c.Prompt, "Response": ""}
		if !c.Legacy {
			system, msgs := collate(c.Messages)
			data = map[string]any{"System": system, "Messages": msgs, "Response": ""}
		}
		var b strings.Builder
		if err := t.Execute(&b, data); err != nil {
			fmt.Fprintf(os.Stderr, "case %d: %v\n", i, err)
			os.Exit(1)
		}
		renders = append(renders, b.String())
	}
	json.NewEncoder(os.Stdout).Encode(renders)
}
"""


def go_available() -> bool:
    return shutil.which("go") is not None


class GoTemplates:
    """Build the renderer once in ``workdir``; ``render(cases)`` runs it on a list of cases:
    ``{"Template", "Messages": [{"Role", "Content"}]}`` or ``{"Template", "Legacy": True,
    "System", "Prompt"}``."""

    def __init__(self, workdir: str | os.PathLike):
        workdir = Path(workdir)
        (workdir / "main.go").write_text(GO_MAIN)
        env = {**os.environ, "GOFLAGS": "", "GOPROXY": "off", "GO111MODULE": "off",
               "GOCACHE": str(workdir / "cache"), "GOPATH": str(workdir / "gopath")}  # fmt: skip
        self.binary = workdir / "render"
        subprocess.run(["go", "build", "-o", str(self.binary), str(workdir / "main.go")],
                       check=True, env=env, cwd=workdir, capture_output=True, timeout=300)  # fmt: skip

    def render(self, cases: list[dict]) -> list[str]:
        out = subprocess.run([str(self.binary)], input=json.dumps(cases), capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        if out.returncode:
            raise RuntimeError(f"Go text/template failed: {out.stderr.strip()}")
        return json.loads(out.stdout)

"""Checkpoints are verified before they are read: every checkpoint carries a manifest, ``--resume``
takes the newest one that passes it (saying which it skipped and why), the commands that read a
``--checkpoint`` refuse a torn one in one line, older checkpoints (no manifest, a pickled
``trainer_state.pt``) still resume exactly, and a planted pickle never runs. Damage is real:
files truncated or rewritten on disk."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from lorafuse import manifest
from lorafuse.commands import main
from lorafuse.errors import LorafuseError
from lorafuse.testing import one_error_line
from lorafuse.train import checkpoint as ckpt
from lorafuse.train.engine import train

RUN = dict(max_steps=3, save_steps=1, save_total_limit=0, lora_dropout=0.1, num_threads=1,
           max_seq_length=64)  # fmt: skip


@pytest.fixture
def run(make_config, tmp_path):
    """A finished 3-step run with checkpoint-1..3 (LoRA dropout on: the RNG state matters)."""
    threads = torch.get_num_threads()
    try:
        summary = train(make_config(output_dir=str(tmp_path / "out"), **RUN))
    finally:
        torch.set_num_threads(threads)
    return tmp_path / "out", summary


def _truncate(path) -> tuple[int, int]:
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    return size // 2, size


def _resume(out, capsys, *extra) -> dict:
    """``lorafuse train --resume out`` (into ``out`` itself); the summary and the stderr."""
    threads = torch.get_num_threads()
    try:
        rc = main(["train", "--resume", str(out), "--output-dir", str(out), *extra])
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    return {**json.loads(captured.out.strip().splitlines()[-1]), "err": captured.err}


def test_every_checkpoint_and_final_carry_a_verifying_manifest(run):
    out, _ = run
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3", "final"):
        listed = json.loads((out / name / manifest.MANIFEST_NAME).read_text())["files"]
        on_disk = sorted(p.name for p in (out / name).iterdir() if p.name != manifest.MANIFEST_NAME)
        assert sorted(listed) == on_disk and "adapter_model.safetensors" in listed, name
        assert manifest.problem(out / name) is None
    assert {ckpt.STATE_NAME, ckpt.STATE_JSON} <= set(os.listdir(out / "checkpoint-3"))


def test_resume_skips_torn_checkpoints_and_continues_exactly(run, capsys):
    """checkpoint-3's adapter and checkpoint-2's trainer state truncated: --resume <dir> says
    both, resumes checkpoint-1, and ends bit for bit where the unbroken run ended."""
    out, first = run
    a_cut, a_size = _truncate(out / "checkpoint-3" / "adapter_model.safetensors")
    s_cut, s_size = _truncate(out / "checkpoint-2" / ckpt.STATE_NAME)
    resumed = _resume(out, capsys)
    err = resumed["err"]
    assert (f"lorafuse: skipping {out}/checkpoint-3: adapter_model.safetensors is {a_cut} bytes, "
            f"its manifest says {a_size} (truncated?)") in err  # fmt: skip
    assert (f"lorafuse: skipping {out}/checkpoint-2: {ckpt.STATE_NAME} is {s_cut} bytes, "
            f"its manifest says {s_size} (truncated?)") in err  # fmt: skip
    assert f"resuming from {out}/checkpoint-1 (step 1)" in err
    assert resumed["steps"] == 3 and resumed["train_loss"] == first["train_loss"]  # exact
    for name in ("checkpoint-2", "checkpoint-3"):  # rewritten whole by the resumed run
        assert manifest.problem(out / name) is None


def test_no_intact_checkpoint_and_a_named_torn_one_are_one_line(run, capsys):
    out, _ = run
    _truncate(out / "checkpoint-3" / ckpt.STATE_JSON)
    rc = main(["train", "--resume", str(out / "checkpoint-3")])
    line = one_error_line(capsys)
    assert rc == 2 and line.startswith(f"lorafuse train: error: --resume {out}/checkpoint-3: ")
    assert f"{ckpt.STATE_JSON} is " in line
    assert line.endswith(
        f"the newest intact one is {out}/checkpoint-2 (--resume {out}/checkpoint-2)"
    )
    for n in (1, 2):
        (out / f"checkpoint-{n}" / "adapter_config.json").write_text("{}")  # same name, new bytes
    with pytest.raises(LorafuseError, match=r"no intact checkpoint \(") as err:
        ckpt.resolve_resume(str(out))
    assert str(err.value).count("adapter_config.json") == 2


COMMANDS = {
    "export": ["--format", "safetensors", "-o", "{tmp}/exported"],
    "merge": ["-o", "{tmp}/merged"],
    "chat": [],
    "infer": ["--input", "{tmp}/prompts.jsonl", "--output", "{tmp}/answers.jsonl"],
    "serve": [],
    "eval": ["--task", "demo"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_commands_refuse_a_torn_checkpoint_in_one_line(run, command, tmp_path, capsys):
    out, _ = run
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    cut, size = _truncate(out / "final" / "adapter_model.safetensors")
    extra = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    rc = main([command, "--checkpoint", str(out / "final"), *extra])
    line = one_error_line(capsys)
    assert rc == 2
    assert line == (f"lorafuse {command}: error: --checkpoint {out}/final: damaged checkpoint: "
                    f"adapter_model.safetensors is {cut} bytes, its manifest says {size} "
                    "(truncated?)")  # fmt: skip
    assert not (tmp_path / "exported").exists() and not (tmp_path / "merged").exists()


def _to_legacy(path) -> None:
    """Rewrite checkpoint ``path`` as the pickle-era trainer wrote it: trainer_state.pt, no
    manifest."""
    state = ckpt.load_state(str(path))
    for name in (ckpt.STATE_NAME, ckpt.STATE_JSON, manifest.MANIFEST_NAME):
        os.remove(path / name)
    torch.save(state, path / ckpt.LEGACY_STATE)


def test_an_older_checkpoint_resumes_exactly_with_a_warning(run, capsys):
    """trainer_state.pt (numpy RNG state inside) read with weights_only=True: same end."""
    out, first = run
    shutil.rmtree(out / "checkpoint-3")
    _to_legacy(out / "checkpoint-2")
    resumed = _resume(out, capsys)
    assert (f"lorafuse: warning: {out}/checkpoint-2 has no {manifest.MANIFEST_NAME} (written by "
            "an older lorafuse): its files are not verified") in resumed["err"]  # fmt: skip
    assert f"resuming from {out}/checkpoint-2 (step 2)" in resumed["err"]
    assert resumed["train_loss"] == first["train_loss"]


class _Plant:
    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):  # unpickling runs exec: it writes self.path
        return (exec, (f"open({self.path!r}, 'w').write('pwned')",))


def test_resume_refuses_a_planted_pickle_and_it_never_runs(run, tmp_path, capsys):
    out, _ = run
    _to_legacy(out / "checkpoint-3")
    marker = tmp_path / "pwned"
    state = ckpt.load_state(str(out / "checkpoint-3"))
    torch.save({**state, "version": _Plant(marker)}, out / "checkpoint-3" / ckpt.LEGACY_STATE)
    rc = main(["train", "--resume", str(out), "--output-dir", str(out)])
    line = one_error_line(capsys)
    assert rc == 2 and "refusing to load" in line and "builtins.exec" in line
    assert line.startswith(f"lorafuse train: error: {out}/checkpoint-3/{ckpt.LEGACY_STATE}: ")
    assert not marker.exists()

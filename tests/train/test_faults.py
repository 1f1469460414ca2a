"""Faults during training end in one clear line and lose nothing: a disk that fills while a
checkpoint is written (injected ENOSPC everywhere; a real small tmpfs where this machine lets
us mount one) and an out-of-memory step."""

from __future__ import annotations

import os

from lorafuse import files
from lorafuse.commands import main
from lorafuse.testing import filling_open, one_error_line, small_tmpfs
from lorafuse.train import checkpoint as ckpt


def _train_argv(tiny_model_dir, chat_file, out, *extra) -> list[str]:
    return ["train", "--model", tiny_model_dir, "--data", chat_file, "--output-dir", str(out),
            "--max-seq-length", "128", "--no-gradient-checkpointing", "--no-progress",
            "--dtype", "float32", "--device", "cpu", "--lr", "1e-3", "--save-total-limit", "0",
            *extra]  # fmt: skip


def _leftovers(out) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith(".tmp"))


def test_disk_full_mid_checkpoint_names_dir_and_last_good(
    tiny_model_dir, chat_file, tmp_path, monkeypatch, capsys
):
    """checkpoint-3's trainer state hits ENOSPC half-way: one line with the directory, the size
    needed, the last good checkpoint; no partial directory; --resume from it works."""
    out = tmp_path / "out"

    def fails(path, mode):
        return path.endswith(ckpt.STATE_NAME) and "checkpoint-3" in path

    monkeypatch.setattr(ckpt, "open", filling_open(open, fails), raising=False)
    rc = main(_train_argv(tiny_model_dir, chat_file, out, "--max-steps", "4", "--save-steps", "1"))
    assert rc == 2
    line = one_error_line(capsys, "train")
    last = out / "checkpoint-2"
    assert f"disk full writing checkpoint checkpoint-3 to {out}: needs about" in line
    assert f"last good checkpoint: {last} (free space, then --resume {last})" in line
    assert _leftovers(out) == [] and not (out / "checkpoint-3").exists()
    assert ckpt.load_state(str(last))["step"] == 2  # the previous checkpoint is whole
    monkeypatch.undo()
    rc = main(_train_argv(tiny_model_dir, chat_file, out, "--max-steps", "4", "--save-steps", "1",
                          "--resume", str(last)))  # fmt: skip
    assert rc == 0 and (out / "final" / "adapter_model.safetensors").is_file()


def test_disk_full_on_a_real_small_tmpfs(tiny_model_dir, chat_file, tmp_path, capsys):
    """The same on a file system that really fills: room for about one and a half checkpoints."""
    probe = tmp_path / "probe"
    argv = _train_argv(tiny_model_dir, chat_file, probe, "--max-steps", "1")
    assert main(argv) == 0
    size = files.tree_size(probe / "checkpoint-1")
    capsys.readouterr()
    with small_tmpfs(tmp_path / "disk", int(size * 1.5) + 64 * 1024) as disk:
        out = disk / "out"
        rc = main(
            _train_argv(tiny_model_dir, chat_file, out, "--max-steps", "3", "--save-steps", "1")
        )
        assert rc == 2
        line = one_error_line(capsys, "train")
        assert "disk full writing checkpoint checkpoint-" in line and str(out) in line
        assert f"last good checkpoint: {out / 'checkpoint-1'}" in line and "needs about" in line
        assert _leftovers(out) == []
        assert ckpt.load_state(str(out / "checkpoint-1"))["step"] == 1


def test_out_of_memory_step_is_one_line_with_what_to_lower(
    tiny_model_dir, chat_file, tmp_path, monkeypatch, capsys
):
    """An allocation failing in step 3's forward: one line with the step, the batch shape, what
    to lower and the last checkpoint; the traceback only with --debug; nothing half-written."""
    from lorafuse.train.engine import Trainer

    real_step = Trainer.train_step

    def step(self):
        if self.step == 2:  # the third step: its forward runs, then the allocation fails
            real_loss = self.objective.loss

            def loss(model, rows, n_items):
                real_loss(model, rows, n_items)
                raise MemoryError("cannot allocate 1073741824 bytes")

            self.objective.loss = loss
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    out = tmp_path / "out"
    argv = _train_argv(tiny_model_dir, chat_file, out, "--max-steps", "4", "--save-steps", "1",
                       "--batch-size", "2")  # fmt: skip
    assert main(argv) == 2
    line = one_error_line(capsys, "train")
    assert "out of memory at step 3 (micro-batch of shape (2, " in line and "MemoryError" in line
    assert (
        "lower batch_size (now 2; raise grad_accum" in line and "max_seq_length (now 128)" in line
    )
    assert "turn on gradient_checkpointing" in line and "load_in_4bit" in line
    assert line.endswith(f"Last good checkpoint: {out / 'checkpoint-2'}")
    assert sorted(os.listdir(out)) == [
        "checkpoint-1",
        "checkpoint-2",
        "logging.jsonl",
        "status.json",
    ]
    assert main(["--debug", *argv, "--overwrite"]) == 2  # the same run again, old one aside
    err = capsys.readouterr().err
    assert "Traceback" in err and "MemoryError: cannot allocate" in err
    assert err.strip().splitlines()[-1].startswith("lorafuse train: error: out of memory at step 3")

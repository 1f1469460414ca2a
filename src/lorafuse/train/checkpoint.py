"""Checkpoints: the interface-C directory layout, written atomically, rotated, read back.

``<output_dir>/checkpoint-<step>/`` and ``<output_dir>/final/`` each hold

* ``adapter_config.json`` + ``adapter_model.safetensors``: a stock PEFT adapter dir
  (``PeftModel.from_pretrained`` loads it unchanged);
* ``lorafuse_config.json``: the resolved :class:`~lorafuse.train.config.TrainConfig`;
* the tokenizer files;
* ``trainer_state.pt`` (checkpoints only): step, data position, exact trainable weights, optimizer,
  scheduler and RNG states, enough for ``--resume`` to continue bit for bit.

A checkpoint is written into ``<output_dir>/.tmp-<name>-<pid>/`` and renamed into place only when
complete, so a crash (or SIGKILL) mid-write never leaves a half checkpoint under a real name.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
from typing import Any

import torch

from lorafuse import files
from lorafuse.errors import LorafuseError

CONFIG_NAME = "lorafuse_config.json"
STATE_NAME = "trainer_state.pt"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(LorafuseError, RuntimeError):
    """A checkpoint is missing, incomplete or does not match the run."""


def read_checkpoint_config(path: str) -> dict[str, Any]:
    """The resolved training config stored in a checkpoint / final dir."""
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: not a lorafuse checkpoint (no {CONFIG_NAME})")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete ``checkpoint-<step>`` dirs of ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, STATE_NAME)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def resolve_resume(path: str) -> str:
    """A checkpoint dir as given, or the latest checkpoint inside an output dir."""
    if os.path.isfile(os.path.join(path, STATE_NAME)):
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"--resume {path}: no checkpoint with {STATE_NAME} there")
    return found[-1][1]


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _replace_dir(tmp: str, final: str) -> None:
    """Move ``tmp`` to ``final``, replacing an existing ``final`` (e.g. a previous run's final/)."""
    files.replace_dir(tmp, final)


def save(
    output_dir: str,
    name: str,
    model,
    tokenizer,
    config_dict: dict[str, Any],
    trainer_state: dict[str, Any] | None = None,
) -> str:
    """Write checkpoint ``name`` (``checkpoint-<step>`` or ``final``) atomically; return its path.

    A full disk ends in one :class:`~lorafuse.files.DiskFullError` line: the directory, the size
    of the last checkpoint (what this one needs, about), the free space and the checkpoint to
    resume from; the partial directory is removed first."""
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    found = list_checkpoints(output_dir)
    last = found[-1][1] if found else None
    then = f"the partial {os.path.basename(tmp)} was removed; {resume_hint(output_dir)}"
    final = os.path.join(output_dir, name)
    with files.disk_full_as_error(
        f"checkpoint {name}", output_dir, last and files.tree_size(last), then
    ):
        try:
            model.save_pretrained(tmp)  # adapter_config.json + adapter_model.safetensors
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, CONFIG_NAME), "w", encoding="utf-8") as f:
                json.dump(config_dict, f, indent=2, sort_keys=True)
            if trainer_state is not None:
                write_state(os.path.join(tmp, STATE_NAME), trainer_state)
            _replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return final


def resume_hint(output_dir: str) -> str:
    """What a run that failed for lack of disk space resumes from."""
    found = list_checkpoints(output_dir)
    if not found:
        return "no checkpoint was written yet"
    return f"last good checkpoint: {found[-1][1]} (free space, then --resume {found[-1][1]})"


def write_state(path: str, state: dict[str, Any]) -> None:
    """``torch.save`` into memory, then one plain write: a full disk then raises ENOSPC (torch's
    own file writer reports it as "unexpected pos 576 vs 534")."""
    buf = io.BytesIO()
    torch.save(state, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def rotate(output_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (``keep == 0``: keep all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_state(path: str) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint (full pickles: it is our own file)."""
    file = os.path.join(path, STATE_NAME)
    if not os.path.isfile(file):
        raise CheckpointError(
            f"{path}: no {STATE_NAME}; only checkpoints (not final/) can be resumed"
        )
    return torch.load(file, map_location="cpu", weights_only=False)


def trainable_state(model) -> dict[str, torch.Tensor]:
    """Exact copies of the trainable parameters, by name (what resume restores)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model, state: dict[str, torch.Tensor], source: str) -> None:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(state))
    extra = sorted(set(state) - set(params))
    if missing or extra:
        raise CheckpointError(
            f"{source}: adapter does not match the model (missing {missing[:3]}, unexpected {extra[:3]}); "
            "was it trained with another model, lora_r or target_modules?"
        )
    with torch.no_grad():
        for n, p in params.items():
            if p.shape != state[n].shape:
                raise CheckpointError(
                    f"{source}: {n} has shape {tuple(state[n].shape)}, model has {tuple(p.shape)}"
                )
            p.copy_(state[n])


class AdapterSaver:
    """Adapter-only view of the PEFT model for :func:`save` (full, unsharded weights)."""

    def __init__(self, model, state: dict[str, torch.Tensor], initial: str | None = None) -> None:
        self.model, self.state, self.initial = model, state, initial

    def save_pretrained(self, path: str) -> None:
        if self.initial is None:
            self.model.save_pretrained(path, state_dict=self.state)
            return
        # PEFT's conversion reads the initial adapter from the model's state (a state_dict= would
        # hide it); unsharded here (no FSDP), so the model's own weights are ``self.state``.
        self.model.save_pretrained(path, path_initial_model_for_weight_conversion=self.initial)

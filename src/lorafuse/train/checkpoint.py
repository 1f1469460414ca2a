"""Checkpoints: the interface-C directory layout, written atomically, rotated, verified, read back.

``<output_dir>/checkpoint-<step>/`` and ``<output_dir>/final/`` each hold

* ``adapter_config.json`` + ``adapter_model.safetensors``: a stock PEFT adapter dir
  (``PeftModel.from_pretrained`` loads it unchanged);
* ``lorafuse_config.json``: the resolved :class:`~lorafuse.train.config.TrainConfig`;
* the tokenizer files;
* ``trainer_state.safetensors`` + ``trainer_state.json`` (checkpoints only): step, data position,
  exact trainable weights, optimizer, scheduler and RNG states, enough for ``--resume`` to continue
  bit for bit; tensors in safetensors, the rest in JSON, no pickle (:mod:`.state_file`);
* ``lorafuse_manifest.json``, written last: every other file's size and SHA-256
  (:mod:`lorafuse.manifest`).

A checkpoint is written into ``<output_dir>/.tmp-<name>-<pid>/`` and renamed into place only when
complete, so a crash (or SIGKILL) mid-write never leaves a half checkpoint under a real name; a
file damaged later (a full disk elsewhere, a torn copy) fails its manifest, and ``--resume`` of an
output dir takes the newest checkpoint that passes (:func:`resolve_resume`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch

from lorafuse import files, manifest
from lorafuse.errors import LorafuseError
from lorafuse.train import state_file

CONFIG_NAME = "lorafuse_config.json"
STATE_NAME = "trainer_state.safetensors"  # the tensors of the trainer state
STATE_JSON = "trainer_state.json"  # the rest of it (step, data position, scheduler...)
LEGACY_STATE = "trainer_state.pt"  # the pickle of checkpoints written before the two above
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


def has_state(path: str) -> bool:
    """Whether ``path`` holds a trainer state (this format or an older ``trainer_state.pt``)."""
    return os.path.isfile(os.path.join(path, STATE_NAME)) or os.path.isfile(
        os.path.join(path, LEGACY_STATE)
    )


def _checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """Every ``checkpoint-<step>`` dir of ``output_dir``, complete or not, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete ``checkpoint-<step>`` dirs of ``output_dir`` (they hold a trainer state), oldest
    first. Not verified against their manifests: :func:`resolve_resume` does that."""
    return [(step, path) for step, path in _checkpoint_dirs(output_dir) if has_state(path)]


def damage(path: str) -> str | None:
    """Why checkpoint ``path`` cannot be resumed (a file that fails its manifest, no trainer
    state), or None."""
    if manifest.has_manifest(path):
        found = manifest.problem(path)
        if found is not None:
            return found
    if not has_state(path):
        return f"no {STATE_NAME} (only checkpoints, not final/, can be resumed)"
    return None


def _unverified(path: str) -> str:
    return (
        f"warning: {path} has no {manifest.MANIFEST_NAME} (written by an older lorafuse): "
        "its files are not verified"
    )


def resolve_resume(path: str, say: Callable[[str], None] | None = None) -> str:
    """The checkpoint ``--resume path`` continues: ``path`` itself when it is a checkpoint (an
    error if it is damaged), else the newest checkpoint inside ``path`` that passes its manifest.
    ``say`` gets one line per checkpoint skipped, with why, and a warning for a checkpoint without
    a manifest (older runs: resumed unverified). Nothing is loaded here."""
    say = say or (lambda msg: None)
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume {path}: no such directory")
    if has_state(path) or os.path.isfile(os.path.join(path, CONFIG_NAME)):
        why = damage(path)
        if why is not None:
            good = _newest_intact(os.path.dirname(os.path.abspath(path)))
            then = f"; the newest intact one is {good} (--resume {good})" if good else ""
            raise CheckpointError(f"--resume {path}: cannot resume this checkpoint: {why}{then}")
        if not manifest.has_manifest(path):
            say(_unverified(path))
        return path
    found = _checkpoint_dirs(path)
    if not found:
        raise CheckpointError(f"--resume {path}: no checkpoint-<step> directory there")
    skipped = []
    for _, ckpt in reversed(found):
        why = damage(ckpt)
        if why is None:
            for other, reason in skipped:
                say(f"skipping {other}: {reason}")
            if not manifest.has_manifest(ckpt):
                say(_unverified(ckpt))
            return ckpt
        skipped.append((ckpt, why))
    listed = "; ".join(f"{other}: {reason}" for other, reason in skipped)
    raise CheckpointError(f"--resume {path}: no intact checkpoint ({listed})")


def _newest_intact(output_dir: str) -> str | None:
    for _, path in reversed(_checkpoint_dirs(output_dir)):
        if damage(path) is None:
            return path
    return None


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
                write_state(tmp, trainer_state)
            manifest.write(tmp)  # last: it covers every file above
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


def write_state(directory: str, state: dict[str, Any]) -> None:
    """``state`` as ``trainer_state.safetensors`` + ``trainer_state.json`` in ``directory``
    (:mod:`.state_file`). Each is serialised in memory, then written with one plain write: a full
    disk then raises ENOSPC where the writer can see it."""
    from safetensors.torch import save as tensors_to_bytes

    text, tensors = state_file.encode(state)
    for name, data in ((STATE_NAME, tensors_to_bytes(tensors)), (STATE_JSON, text.encode())):
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)


def rotate(output_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (``keep == 0``: keep all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_state(path: str) -> dict[str, Any]:
    """The trainer state of checkpoint ``path``; nothing in it can run code. An older checkpoint's
    ``trainer_state.pt`` loads only where ``torch.load(weights_only=True)`` can read it."""
    from safetensors import SafetensorError
    from safetensors.torch import load as tensors_from_bytes

    tensors_file, json_file = os.path.join(path, STATE_NAME), os.path.join(path, STATE_JSON)
    if os.path.isfile(tensors_file):
        try:
            with open(tensors_file, "rb") as f:
                tensors = tensors_from_bytes(f.read())
            with open(json_file, encoding="utf-8") as f:
                return state_file.decode(f.read(), tensors)
        except (OSError, ValueError, SafetensorError) as err:
            raise CheckpointError(f"{path}: cannot read the trainer state ({err})") from None
    legacy = os.path.join(path, LEGACY_STATE)
    if os.path.isfile(legacy):
        return state_file.load_legacy(legacy)
    raise CheckpointError(f"{path}: no {STATE_NAME}; only checkpoints (not final/) can be resumed")


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
        # the trained adapter only (ppo may hold a frozen reward-model adapter next to it)
        only = [self.model.active_adapter]
        if self.initial is None:
            self.model.save_pretrained(path, state_dict=self.state, selected_adapters=only)
            return
        # PEFT's conversion reads the initial adapter from the model's state (a state_dict= would
        # hide it); unsharded here (no FSDP), so the model's own weights are ``self.state``.
        self.model.save_pretrained(path, path_initial_model_for_weight_conversion=self.initial,
                                   selected_adapters=only)  # fmt: skip

"""What the image trainer reads and writes besides its step: the kohya LoRA file with its
``ss_*`` metadata (final and in every checkpoint), a checkpoint's exact state (network, optimizer,
scheduler, scaler, RNG, data position) and resuming from it, and ``--network-weights``."""

from __future__ import annotations

import os

import torch

from lorafuse.train import checkpoint as ckpt
from lorafuse.train.loop import TrainingError

STATE_VERSION = 1
LORA_NAME = "lora.safetensors"
SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}


class ImageTrainingError(TrainingError):
    """Image training cannot start or continue; the message says why."""


def unet_layout(trainer):
    from lorafuse.image.kohya_names import UNetLayout

    return UNetLayout.from_config(trainer.sd.unet.config)


def load_network_weights(trainer, path: str) -> None:
    """Start the network from a kohya file's matching modules (``--network-weights``)."""
    from lorafuse.image.kohya import from_kohya_state_dict, load_lora_file

    state, _ = load_lora_file(path)
    tensors = from_kohya_state_dict(state, trainer.sd.family, layout=unet_layout(trainer))
    ours = set(trainer.network.keys())
    used = [k for k in tensors if k in ours]
    if not used:
        raise ImageTrainingError(
            f"--network-weights {path}: none of its {len(tensors)} modules is in this network "
            "(another model family, or text-encoder LoRA without --train-text-encoder?)"
        )
    trainer.network.load_lora_tensors({k: tensors[k] for k in used}, strict=False)
    skipped = len(tensors) - len(used)
    trainer.say(
        f"LoRA initialised from {path}: {len(used)} of {len(ours)} modules"
        + (
            f" ({skipped} of the file's modules are not in this network, left out)"
            if skipped
            else ""
        )
    )


def restore(trainer, resume: str) -> None:
    """Load a checkpoint's exact state into ``trainer`` (``--resume``), checked first."""
    path = ckpt.resolve_resume(resume, trainer.say)  # the newest intact checkpoint
    state = ckpt.load_state(path)
    if state.get("version") != STATE_VERSION or state.get("kind") != "image":
        raise ImageTrainingError(f"{path}: not an image-LoRA checkpoint of this version")
    if state["steps_per_epoch"] != trainer.steps_per_epoch:
        raise ImageTrainingError(
            f"{path}: trained with {state['steps_per_epoch']} steps per epoch, this data/batch "
            f"gives {trainer.steps_per_epoch}; resume needs the same images, buckets and batch size"
        )
    params = dict(trainer.network.named_parameters())
    if set(params) != set(state["network"]):
        raise ImageTrainingError(
            f"{path}: LoRA modules differ from this network (another model, dim, conv_dim or "
            "train_text_encoder?)"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state["network"][n])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler is not None and state.get("scaler"):
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.step, trainer.epoch, trainer.batch_no = state["step"], state["epoch"], state["batch_no"]
    trainer.started_at = state["started_at"]
    trainer.last_checkpoint = path
    trainer.say(f"resuming from {path} (step {trainer.step})")
    ckpt.set_rng_state(state["rng"])  # noise and timesteps continue where the run stopped


def write_lora_file(trainer, path: str) -> None:
    """Write the kohya file (``save_precision``, ss_* metadata) to ``path`` atomically."""
    from lorafuse.image.kohya import build_metadata, save_lora_file, to_kohya_state_dict

    cfg = trainer.cfg
    state = to_kohya_state_dict(trainer.network.lora_tensors(), trainer.sd.family,
                                dtype=SAVE_DTYPES[cfg.save_precision],
                                layout=unet_layout(trainer))  # fmt: skip
    meta = build_metadata(
        family=trainer.sd.family, dim=cfg.network_dim, alpha=cfg.network_alpha,
        conv_dim=cfg.conv_dim, conv_alpha=cfg.conv_alpha, v_parameterization=trainer.v_pred,
        resolution=(cfg.resolution, cfg.resolution),
        num_train_images=sum(i.repeats for i in trainer.items), tag_frequency=trainer.tag_frequency,
        output_name=cfg.output_name, training_started_at=trainer.started_at, steps=trainer.step,
        epoch=trainer.epoch, learning_rate=cfg.lr, unet_lr=cfg.unet_lr or cfg.lr,
        text_encoder_lr=(cfg.text_encoder_lr or cfg.lr) if cfg.train_text_encoder else None,
        seed=cfg.seed, mixed_precision=cfg.mixed_precision, base_model=trainer.sd.source,
        extra={"ss_clip_skip": cfg.clip_skip, "ss_noise_offset": cfg.noise_offset,
               "ss_min_snr_gamma": cfg.min_snr_gamma, "ss_batch_size_per_device": cfg.batch_size,
               "ss_lr_scheduler": cfg.lr_scheduler, "ss_optimizer": cfg.optimizer,
               "ss_enable_bucket": cfg.enable_bucket, "ss_max_train_steps": trainer.total_steps,
               "ss_network_train_unet_only": not cfg.train_text_encoder},
    )  # fmt: skip
    save_lora_file(path, state, meta)


def save_checkpoint(trainer, name: str, full_state: bool) -> str:
    """A checkpoint dir: the kohya file, the config and (``full_state``) the exact state."""
    state = None
    if full_state:
        state = {
            "version": STATE_VERSION, "kind": "image", "step": trainer.step, "epoch": trainer.epoch,
            "batch_no": trainer.batch_no, "steps_per_epoch": trainer.steps_per_epoch,
            "started_at": trainer.started_at,
            "network": {n: p.detach().cpu().clone() for n, p in trainer.network.named_parameters()},
            "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
            "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
            "rng": ckpt.rng_state(),
        }  # fmt: skip
    config = trainer.cfg.to_dict()
    config.update(resume=None, overwrite=False)  # the run, not how it was started
    return ckpt.save(trainer.cfg.output_dir, name, LoraSaver(trainer), None, config, state)


class LoraSaver:
    """``checkpoint.save``'s model: writes the kohya ``lora.safetensors`` into the checkpoint dir."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        write_lora_file(self.trainer, os.path.join(path, LORA_NAME))

"""The image LoRA training loop: ``train_image(config) -> summary``.

One step, as kohya's ``train_network.py``: latents -> noise and DDPM timesteps -> the UNet
predicts epsilon or ``v`` from the captions' text states -> MSE (min-SNR-gamma weighted when set).
Only the LoRA network trains; ``mixed_precision`` stores the frozen models in fp16/bf16, the VAE
stays fp32. Checkpoints hold the RNG state, so ``--resume`` continues bit for bit; the loop shell
is :mod:`lorafuse.train.loop`'s. Details: docs/image.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.nn.functional as F

from lorafuse import hardware, heap
from lorafuse.image import data as D
from lorafuse.image.cache import LatentCache, TextEncoderCache, encode_pixels
from lorafuse.image.config import ImageTrainConfig
from lorafuse.image.run_files import (
    LORA_NAME,
    ImageTrainingError,
    load_network_weights,
    restore,
    save_checkpoint,
)
from lorafuse.train import checkpoint as ckpt
from lorafuse.train import distributed as dist
from lorafuse.train import run_dir
from lorafuse.train.data_order import seed_everything
from lorafuse.train.loop import Cadence, Runner, Totals, execute
from lorafuse.train.optim import build_optimizer, build_scheduler
from lorafuse.train.status import RunStatus

_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return hardware.default_device()


def snr_weights(alphas_cumprod: torch.Tensor, t: torch.Tensor, gamma: float, v_pred: bool):
    """min-SNR-gamma: ``min(SNR, gamma) / SNR`` (epsilon) or ``/ (SNR + 1)`` (v), per sample."""
    ac = alphas_cumprod.to(t.device)[t].float()
    snr = ac / (1.0 - ac)
    return torch.clamp(snr, max=gamma) / (snr + 1.0 if v_pred else snr)


class ImageTrainer(Runner):
    """One run; :meth:`setup` loads everything, :meth:`run` is the shared loop
    (:mod:`lorafuse.train.loop`). Use :func:`train_image`."""

    EVAL_KEY = None  # no held-out loss: the sample images show progress
    NONFINITE_ADVICE = "Try a lower lr, mixed_precision no/bf16, or max_grad_norm > 0."

    def __init__(self, cfg: ImageTrainConfig) -> None:
        # checked before anything is written (status.json): a run that cannot start leaves no dir
        if not cfg.model:
            raise ImageTrainingError(
                "no model: pass --model (a diffusers dir or a .safetensors file)"
            )
        if not cfg.data:
            raise ImageTrainingError("no images: pass --data FOLDER (with N_concept subfolders)")
        self.cfg = cfg
        self.device = _device(cfg.device)
        self.ctx = dist.DistContext(0, 1, 0, self.device, True, "none")  # one process
        self.last_checkpoint: str | None = None

    # ---- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        from lorafuse.image.models import load_sd_model
        from lorafuse.image.network import LoRANetwork

        cfg = self.cfg
        seed_everything(cfg.seed)
        self.amp_dtype = _AMP_DTYPES.get(cfg.mixed_precision)
        self.sd = load_sd_model(
            cfg.model, cfg.model_config, dtype=torch.float32, device=self.device
        )
        sd = self.sd
        self.sdxl = sd.family == "sdxl"
        if cfg.resolution is None:  # resolve the family default into the stored config
            self.cfg = cfg = dataclasses.replace(cfg, resolution=1024 if self.sdxl else 512)
        self.v_pred = (
            cfg.v_parameterization
            if cfg.v_parameterization is not None
            else sd.prediction_type == "v_prediction"
        )
        for m in (sd.unet, sd.vae, *sd.text_encoders):
            m.requires_grad_(False)
            m.eval()
        if self.amp_dtype is not None:
            for m in (sd.unet, *sd.text_encoders):
                m.to(self.amp_dtype)
        if cfg.gradient_checkpointing:
            sd.unet.enable_gradient_checkpointing()
            sd.unet.train()  # diffusers checkpoints only in training mode
        self._setup_data()
        torch.manual_seed(cfg.seed)  # the LoRA init
        self.network = LoRANetwork.create(
            sd.unet, list(sd.text_encoders), dim=cfg.network_dim, alpha=cfg.network_alpha,
            conv_dim=cfg.conv_dim, conv_alpha=cfg.conv_alpha,
            train_text_encoder=cfg.train_text_encoder, fused=cfg.fused,
        ).to(self.device)  # fmt: skip
        self.network.apply_to()
        self.network.train()
        if self.device.type == "cpu":  # freed activations reused, not faulted in (lorafuse.heap)
            # the run's policy: execute() reverts it when the run ends
            self.heap_policy = heap.apply_training_policy(large_buffers=cfg.fused)
            for line in self.heap_policy.notes:
                self.say(line)
        if cfg.network_weights:
            load_network_weights(self, cfg.network_weights)
        self.say(self.network.report().replace("\n", "; "))
        groups = self.network.param_groups(cfg.unet_lr or cfg.lr, cfg.text_encoder_lr or cfg.lr)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer, opt_desc = build_optimizer(cfg, groups)
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        self.scheduler = build_scheduler(cfg, self.optimizer, self.total_steps)
        use_scaler = self.amp_dtype == torch.float16 and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if use_scaler else None
        self.step, self.epoch, self.batch_no = 0, 0, 0
        self.started_at = time.time()  # ss_training_started_at (a resumed run keeps the first)
        self.noise_scheduler = sd.noise_scheduler
        self.alphas_cumprod = sd.noise_scheduler.alphas_cumprod
        self.te_cache = None
        if cfg.cache_text_encoder_outputs:
            self.te_cache = TextEncoderCache([it.caption for it in self.items], self.encode_text)
        if cfg.resume:
            restore(self, cfg.resume)
        self.say(
            f"{sd.family} ({'v-prediction' if self.v_pred else 'epsilon'}) from {sd.source}; "
            f"{len(self.items)} images x repeats = {sum(i.repeats for i in self.items)} per epoch in "
            f"{len(self.buckets)} bucket(s); batch {cfg.batch_size}; {self.steps_per_epoch} steps/epoch, "
            f"{self.total_steps} steps; {opt_desc}"
        )

    def _setup_data(self) -> None:
        cfg = self.cfg
        self.items = D.scan_folder(cfg.data, cfg.caption_extension, cfg.caption_from_folder)
        self.buckets = D.assign_buckets(self.items, cfg)
        self.steps_per_epoch = D.steps_per_epoch(self.items, cfg.batch_size)
        self.tag_frequency = D.tag_frequency(self.items)
        self.latent_cache = None
        if cfg.cache_latents or cfg.cache_latents_to_disk:
            self.latent_cache = LatentCache(self.sd.vae, self.items,
                                            to_disk=cfg.cache_latents_to_disk,
                                            progress=cfg.progress)  # fmt: skip
            s = self.latent_cache.stats
            self.say(f"latents: {s['encoded']} encoded, {s['reused']} reused from disk")

    # ---- model inputs --------------------------------------------------------------------------
    def autocast(self):
        """The context the UNet/text-encoder forwards run in: autocast to the mixed-precision
        dtype, or nothing (also used by sampling)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _tokens(self, tok, captions: list[str]) -> torch.Tensor:
        return tok(captions, padding="max_length", max_length=tok.model_max_length,
                   truncation=True, return_tensors="pt").input_ids.to(self.device)  # fmt: skip

    def encode_text(self, captions: list[str]) -> tuple[torch.Tensor, ...]:
        """SD1/2: ((B, 77, D),), ``clip_skip``-th last hidden state through the final norm (kohya).
        SDXL: ((B, 77, D1 + D2), (B, P)): both encoders' ``-(clip_skip + 1)``-th hidden states
        concatenated, and te2's pooled projection."""
        sd, skip = self.sd, self.cfg.clip_skip
        with self.autocast():
            if not self.sdxl:
                te = sd.text_encoders[0]
                out = te(self._tokens(sd.tokenizers[0], captions), output_hidden_states=skip > 1)
                if skip == 1:
                    return (out.last_hidden_state,)
                norm = getattr(te, "text_model", te).final_layer_norm
                return (norm(out.hidden_states[-skip]),)
            hs = []
            for te, tok in zip(sd.text_encoders, sd.tokenizers):
                out = te(self._tokens(tok, captions), output_hidden_states=True)
                hs.append(out.hidden_states[-(skip + 1)])
            return torch.cat(hs, dim=-1), out.text_embeds

    def _latents(self, idx: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        if self.latent_cache is not None:
            latents, crops = self.latent_cache.batch(idx)
            return latents.to(self.device), crops
        loaded = [D.load_image(self.items[i]) for i in idx]
        pixels = torch.stack([p for p, _ in loaded])  # (B, 3, bh, bw)
        return encode_pixels(self.sd.vae, pixels).to(self.device), [c for _, c in loaded]

    def _time_ids(self, idx: list[int], crops: list[tuple[int, int]]) -> torch.Tensor:
        """(B, 6): original (h, w), crop (top, left), target (h, w): SDXL micro-conditioning."""
        rows = []
        for i, (top, left) in zip(idx, crops):
            (w, h), (bw, bh) = self.items[i].size, self.items[i].bucket
            rows.append([h, w, top, left, bh, bw])
        return torch.tensor(rows, dtype=torch.float32, device=self.device)

    # ---- one step ------------------------------------------------------------------------------
    def _next_batch(self) -> tuple[list[int], list[str]]:
        if getattr(self, "_order_epoch", None) != self.epoch:
            self._order = D.epoch_batches(
                self.items, self.cfg.batch_size, self.cfg.seed, self.epoch
            )
            self._order_epoch = self.epoch
        idx = self._order[self.batch_no]
        captions = D.batch_captions(self.items, idx, self.cfg, self.epoch, self.batch_no)
        self.batch_no += 1
        if self.batch_no >= len(self._order):
            self.epoch, self.batch_no = self.epoch + 1, 0
        return idx, captions

    def loss(self, idx: list[int], captions: list[str]) -> torch.Tensor:
        """The batch's (weighted) diffusion loss, fp32 scalar."""
        cfg = self.cfg
        latents, crops = self._latents(idx)  # (B, C, h, w) fp32
        if self.te_cache is not None:
            text = tuple(t.to(self.device) for t in self.te_cache.batch(captions))
        elif cfg.train_text_encoder:
            text = self.encode_text(captions)
        else:
            with torch.no_grad():
                text = self.encode_text(captions)
        noise = torch.randn_like(latents)
        if cfg.noise_offset:
            b, c = latents.shape[:2]
            noise = noise + cfg.noise_offset * torch.randn(b, c, 1, 1, device=self.device)
        n_train = self.noise_scheduler.config.num_train_timesteps
        t = torch.randint(0, n_train, (latents.shape[0],), device=self.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, t)
        if self.v_pred:
            target = self.noise_scheduler.get_velocity(latents, noise, t)
        else:
            target = noise
        kwargs = {}
        if self.sdxl:
            kwargs["added_cond_kwargs"] = {
                "text_embeds": text[1],
                "time_ids": self._time_ids(idx, crops),
            }
        unet_dtype = next(self.sd.unet.parameters()).dtype
        with self.autocast():
            pred = self.sd.unet(noisy.to(unet_dtype), t, text[0], **kwargs).sample
        loss = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
        if cfg.min_snr_gamma:
            loss = loss * snr_weights(self.alphas_cumprod, t, cfg.min_snr_gamma, self.v_pred)
        return loss.mean()

    def train_step(self) -> dict:
        idx, captions = self._next_batch()
        loss = self.loss(idx, captions)
        value = float(loss.detach())
        self.check_finite("loss", value)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
        else:
            loss.backward()
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.cfg.max_grad_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm(grads))
        lr = self.scheduler.get_last_lr()[-1]  # the UNet group's (last group)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": value, "lr": lr, "grad_norm": grad_norm, "examples": len(idx)}

    def out_of_memory(self, err: BaseException) -> str:
        cfg = self.cfg
        lower = [f"batch_size (now {cfg.batch_size})", f"resolution (now {cfg.resolution})"]
        if not cfg.gradient_checkpointing:
            lower.append("turn on gradient_checkpointing")
        if cfg.mixed_precision == "no":
            lower.append("mixed_precision bf16")
        if not (cfg.cache_latents or cfg.cache_latents_to_disk):
            lower.append("cache_latents")
        return (f"out of memory at step {self.step + 1} (a batch of {cfg.batch_size} images, on "
                f"{self.device}; {type(err).__name__}): lower {', '.join(lower)}")  # fmt: skip

    def save(self, name: str, full_state: bool) -> str:
        return save_checkpoint(self, name, full_state)

    # ---- what the loop shell asks -------------------------------------------------------------
    def cadence(self) -> Cadence:
        c = self.cfg
        return Cadence(c.output_dir, c.logging_steps, c.save_steps, c.save_total_limit,
                       progress=c.progress)  # fmt: skip

    def after_step(self, last: bool) -> None:
        n = self.cfg.sample_every_n_steps
        if n and self.step % n == 0:
            self._sample()

    def summary_fields(self, final: str, totals: Totals) -> dict:
        return {"mean_loss": totals.loss_sum / totals.steps_run if totals.steps_run else None,
                "images": totals.examples, "lora": os.path.join(final, LORA_NAME)}  # fmt: skip

    def _sample(self) -> None:
        from lorafuse.image.sampling import sample_images

        rng = ckpt.rng_state()  # sampling must not move the training RNG (resume exactness)
        self.network.eval()
        try:
            out = sample_images(self, os.path.join(self.cfg.output_dir, "samples"), self.step)
        finally:
            self.network.train()
            ckpt.set_rng_state(rng)
        self.say(f"samples: {out}")


def train_image(cfg: ImageTrainConfig) -> dict:
    """Train a LoRA per ``cfg``; returns the summary (losses, images/s, path of the LoRA file)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    trainer = ImageTrainer(cfg)  # checks what it can before the directory is touched
    # locked for the whole run; a run already there is refused unless resume / overwrite
    with run_dir.claim(cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite):
        # setup + the shared loop, <output_dir>/status.json throughout (as ``lorafuse train``)
        return execute(trainer, RunStatus(cfg.output_dir))  # reverts its heap policy

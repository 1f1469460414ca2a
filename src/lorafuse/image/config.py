"""``ImageTrainConfig``: every setting of an image LoRA run (``lorafuse train-image``), one dataclass.

Like :class:`~lorafuse.train.config.TrainConfig`: flags are generated from the fields
(``--network-dim`` sets ``network_dim``), a YAML/JSON ``--config`` file gives the same fields, and the
resolved config is stored as ``lorafuse_config.json`` in every checkpoint so ``--resume DIR`` needs
nothing else. Names follow ``lorafuse train`` where the meaning is the same (``--max-steps``,
``--lr``...), kohya sd-scripts' otherwise (``--network-dim``, ``--enable-bucket``...).
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafuse.train.config import ConfigFile, option

MIXED_PRECISION = ("no", "fp16", "bf16")
SAVE_PRECISION = ("fp16", "bf16", "float")


@dataclass
class ImageTrainConfig(ConfigFile):
    """A kohya-style LoRA for SD1.x/2.x or SDXL. Field docs are the ``--help`` entries."""

    COMMAND = "lorafuse train-image"

    # model
    model: str | None = option(
        None, "diffusers model dir, or a single-file .safetensors checkpoint"
    )
    model_config: str | None = option(
        None, "local diffusers-layout config dir for a single-file --model (no hub)"
    )
    device: str | None = option(None, "cpu | cuda | cuda:N; default: cuda if available")
    fused: bool = option(
        True, "run the LoRA layers on lorafuse's fused kernels (off: unfused torch)"
    )
    mixed_precision: str = option(
        "no",
        "no | fp16 | bf16: frozen UNet/text encoders in this dtype + autocast (VAE stays fp32)",
    )
    gradient_checkpointing: bool = option(
        False, "recompute UNet activations in backward (less memory, ~30% slower)"
    )
    v_parameterization: bool | None = option(
        None, "train on v-prediction targets; default: the model's scheduler prediction_type"
    )
    clip_skip: int = option(
        1, "use the text encoder's N-th hidden state from the end (SD1/2; 2 = NAI)"
    )
    # LoRA network
    network_dim: int = option(4, "LoRA rank of the attention / feed-forward / proj layers")
    network_alpha: float = option(1.0, "LoRA alpha (scale = alpha / dim)")
    conv_dim: int | None = option(
        None, "also adapt the ResNet 3x3 convs with this rank (off: None)"
    )
    conv_alpha: float | None = option(None, "alpha of the conv LoRA (default: 1.0)")
    network_weights: str | None = option(None, "kohya .safetensors LoRA to start from")
    train_text_encoder: bool = option(False, "also train LoRA on the text encoder(s)")
    # data
    data: str | None = option(None, "image folder holding N_concept subfolders (N = repeats)")
    resolution: int | None = option(
        None, "training side length in px (area = resolution^2); default 512, SDXL 1024"
    )
    caption_extension: str | None = option(
        None, "caption sidecar extension; default: .txt, else .caption"
    )
    caption_from_folder: bool = option(
        False, "images without a caption use the folder's concept name (kohya class tokens)"
    )
    shuffle_caption: bool = option(
        False, "shuffle the comma-separated tags of each caption each time"
    )
    keep_tokens: int = option(0, "with shuffle_caption: keep the first N tags in place")
    caption_dropout_rate: float = option(
        0.0, "probability of training an image with an empty caption"
    )
    enable_bucket: bool = option(False, "aspect-ratio buckets instead of square center crops")
    min_bucket_reso: int = option(256, "smallest bucket side in px")
    max_bucket_reso: int = option(1024, "largest bucket side in px")
    bucket_reso_steps: int = option(64, "bucket sides are multiples of this")
    bucket_no_upscale: bool = option(
        False, "never upscale: small images get a bucket of their size"
    )
    cache_latents: bool = option(False, "encode every image with the VAE once, keep the latents")
    cache_latents_to_disk: bool = option(
        False, "cache latents in safetensors files next to the images, reused across runs"
    )
    cache_text_encoder_outputs: bool = option(
        False, "encode each caption once (needs fixed captions and frozen text encoders)"
    )
    # loss
    noise_offset: float = option(
        0.0, "add this times per-channel noise to the noise (darker/brighter)"
    )
    min_snr_gamma: float | None = option(
        None, "min-SNR-gamma loss weighting (5 is usual; off: None)"
    )
    # optimisation
    epochs: int = option(1, "passes over the images x repeats (ignored when max_steps is set)")
    max_steps: int | None = option(None, "stop after this many optimizer steps")
    batch_size: int = option(1, "images per step (one bucket per batch)")
    lr: float = option(1e-4, "learning rate (of the UNet and text encoder unless set below)")
    unet_lr: float | None = option(None, "UNet LoRA learning rate (default: lr)")
    text_encoder_lr: float | None = option(None, "text-encoder LoRA learning rate (default: lr)")
    lr_scheduler: str = option("constant", "cosine | linear | constant (after warmup)")
    warmup_steps: int = option(0, "linear warmup steps")
    warmup_ratio: float = option(
        0.0, "warmup as a fraction of the total steps (if warmup_steps is 0)"
    )
    optimizer: str = option("adamw", "adamw | adamw_8bit (bitsandbytes)")
    weight_decay: float = option(0.01, "AdamW weight decay")
    adam_betas: list[float] = option([0.9, 0.999], "AdamW betas", nargs=2)
    adam_eps: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (0 = no clipping)")
    seed: int = option(42, "seed for LoRA init, data order, captions, noise and timesteps")
    # run
    output_dir: str = option(
        "lorafuse-image-out", "checkpoints, final/lora.safetensors, samples, logs"
    )
    output_name: str = option("lora", "the LoRA's name in its metadata (ss_output_name)")
    save_precision: str = option("fp16", "fp16 | bf16 | float: dtype of the saved LoRA tensors")
    logging_steps: int = option(1, "write a logging.jsonl line every N steps")
    save_steps: int = option(500, "checkpoint every N steps (0 = only at the end)")
    save_total_limit: int = option(2, "keep the last K checkpoints (0 = keep all)")
    resume: str | None = option(
        None, "checkpoint dir (or output dir: its newest intact checkpoint) to continue from"
    )
    overwrite: bool = option(
        False,
        "start a new run in an output_dir that holds one: the old run's files move to "
        "<output_dir>.old-<time> (nothing is deleted)",
    )
    sample_every_n_steps: int = option(0, "generate the sample prompts every N steps (0 = off)")
    sample_prompts: str | None = option(
        None, "prompts file, one a line, kohya options --n --w --h --s --l --d"
    )
    progress: bool = option(True, "show a progress bar")
    num_threads: int | None = option(None, "torch CPU threads (default: torch's choice)")

    def __post_init__(self) -> None:
        need = self._need
        need(
            self.mixed_precision in MIXED_PRECISION, "mixed_precision", " | ".join(MIXED_PRECISION)
        )
        need(self.save_precision in SAVE_PRECISION, "save_precision", " | ".join(SAVE_PRECISION))
        need(self.clip_skip >= 1, "clip_skip", "must be >= 1")
        need(self.network_dim >= 1, "network_dim", "must be >= 1")
        need(self.network_alpha >= 0, "network_alpha", "must be >= 0")
        need(self.conv_dim is None or self.conv_dim >= 1, "conv_dim", "must be >= 1 (or unset)")
        need(self.conv_alpha is None or self.conv_alpha >= 0, "conv_alpha", "must be >= 0")
        need(
            self.resolution is None or (self.resolution >= 8 and self.resolution % 8 == 0),
            "resolution",
            "must be a positive multiple of 8 (the VAE downsamples by 8)",
        )
        need(
            self.bucket_reso_steps >= 8 and self.bucket_reso_steps % 8 == 0,
            "bucket_reso_steps",
            "must be a multiple of 8",
        )
        need(
            self.min_bucket_reso >= self.bucket_reso_steps,
            "min_bucket_reso",
            ">= bucket_reso_steps",
        )
        need(self.max_bucket_reso >= self.min_bucket_reso, "max_bucket_reso", ">= min_bucket_reso")
        need(self.keep_tokens >= 0, "keep_tokens", "must be >= 0")
        need(0.0 <= self.caption_dropout_rate < 1.0, "caption_dropout_rate", "must be in [0, 1)")
        if self.caption_extension is not None and not self.caption_extension.startswith("."):
            self.caption_extension = "." + self.caption_extension
        need(self.noise_offset >= 0, "noise_offset", "must be >= 0")
        need(self.min_snr_gamma is None or self.min_snr_gamma > 0, "min_snr_gamma", "must be > 0")
        self._check_schedule()
        for name in ("lr", "unet_lr", "text_encoder_lr"):
            need(getattr(self, name) is None or getattr(self, name) > 0, name, "must be > 0")
        for name in ("save_steps", "save_total_limit", "sample_every_n_steps"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        if self.cache_text_encoder_outputs:
            varying = [
                n
                for n, on in (
                    ("train_text_encoder", self.train_text_encoder),
                    ("shuffle_caption", self.shuffle_caption),
                    ("caption_dropout_rate", self.caption_dropout_rate > 0),
                )
                if on
            ]
            need(
                not varying,
                "cache_text_encoder_outputs",
                f"needs fixed captions and frozen text encoders, but {', '.join(varying)} "
                "is on (each step would need fresh text-encoder outputs); turn one of them off",
            )
        need(
            not self.sample_every_n_steps or self.sample_prompts is not None,
            "sample_every_n_steps",
            "needs --sample-prompts FILE",
        )

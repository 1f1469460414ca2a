"""``TrainConfig``: every setting of a fine-tune, as one typed dataclass.

The same fields come from command-line flags (generated from this class: ``--lora-r`` sets
``lora_r``), from a YAML/JSON file (``--config run.yaml``; flags given next to it override it), or
from Python. The resolved config is stored as ``lorafuse_config.json`` in every checkpoint, so later
commands (chat, merge, export, resume) need only the checkpoint path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from lorafuse import files
from lorafuse.data.formats import FORMATS
from lorafuse.data.masking import THINK_TOKENS, TOO_LONG
from lorafuse.data.read_options import parse_columns
from lorafuse.data.vision import DEFAULT_MAX_PIXELS
from lorafuse.errors import ConfigError
from lorafuse.train import recipes
from lorafuse.train.options import (  # noqa: F401 - re-exported: the config's vocabulary
    DPO_LOSS_TYPES,
    GRPO_LOSS_TYPES,
    INITS,
    KL_ESTIMATORS,
    MUTATING_INITS,
    REWARD_SCALES,
    init_kind,
    parse_pattern,
)
from lorafuse.train.trackers import TRACKERS


def option(default, help: str, **kw):  # noqa: A002 - "help" mirrors argparse
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


SCHEDULERS = ("cosine", "linear", "constant")
METHODS = tuple(recipes.METHODS)  # the registry's names (lorafuse.train.recipes)


class ConfigFile:
    """What every settings dataclass shares: dict / YAML / JSON in, atomic JSON out.

    ``COMMAND`` names the command whose ``--help`` lists the fields; ``LIST_FIELDS`` may be
    written as a single string in a file (``data: train.jsonl``).
    """

    COMMAND = "lorafuse train"
    LIST_FIELDS: tuple[str, ...] = ()
    # group name -> its first field; a group runs, in declaration order, up to the next group's
    # first field, so a field added inside a section joins that section's group
    GROUP_STARTS: dict[str, str] = {}

    @classmethod
    def groups(cls) -> dict[str, list[str]]:
        """``{group: [field, ...]}`` in declaration order (empty without ``GROUP_STARTS``)."""
        starts = {first: name for name, first in cls.GROUP_STARTS.items()}
        out: dict[str, list[str]] = {}
        current = None
        for f in dataclasses.fields(cls):
            current = starts.get(f.name, current)
            if current is not None:
                out.setdefault(current, []).append(f.name)
        return out

    @classmethod
    def flatten(cls, values: dict[str, Any], source: str = "config") -> dict[str, Any]:
        """The grouped form (``lora: {r: 16}`` or ``lora: {lora_r: 16}``) as flat fields; flat
        keys pass through. A group named like a field (``model``, ``data``, ``method``) is a group
        only when its value is a mapping; inside, the field of the group's own name is itself."""
        groups, out = cls.groups(), {}

        def put(name: str, value) -> None:
            if name in out:
                raise ConfigError(f"{source}: {name} is given twice (flat and in its group)")
            out[name] = value

        for key, value in values.items():
            if key not in groups or not isinstance(value, dict):
                put(key, value)
                continue
            for sub, v in value.items():
                name = sub if sub in groups[key] else f"{key}_{sub}"
                if name not in groups[key]:
                    raise ConfigError(
                        f"{source}: {key}.{sub} is not a setting of group {key} "
                        f"({', '.join(groups[key])})"
                    )
                put(name, v)
        return out

    def _need(self, cond: bool, name: str, what: str) -> None:
        if not cond:
            raise ConfigError(f"{name}={getattr(self, name)!r}: {what}")

    def _check_schedule(self) -> None:
        """The length, optimiser and logging fields every training config shares, checked alike."""
        need = self._need
        need(self.epochs >= 1, "epochs", "must be >= 1")
        need(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1")
        need(self.batch_size >= 1, "batch_size", "must be >= 1")
        need(self.lr_scheduler in SCHEDULERS, "lr_scheduler", " | ".join(SCHEDULERS))
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio", "must be in [0, 1)")
        need(self.optimizer in ("adamw", "adamw_8bit"), "optimizer", "adamw | adamw_8bit")
        need(
            len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
            "adam_betas",
            "two values in [0, 1)",
        )
        need(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0")
        need(self.logging_steps >= 1, "logging_steps", "must be >= 1")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        self.adam_betas = [float(b) for b in self.adam_betas]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config"):
        values = cls.flatten(values, source)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown setting(s) {unknown}; see `{cls.COMMAND} --help`")
        values = dict(values)
        for key in cls.LIST_FIELDS:
            if isinstance(values.get(key), str):
                values[key] = [values[key]]
        try:
            return cls(**values)
        except TypeError as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_file(cls, path: str, overrides: dict[str, Any] | None = None):
        """Load a ``.yaml``/``.yml``/``.json`` file; ``overrides`` (e.g. from flags) win."""
        values = cls.flatten(load_mapping(path), path)  # flags override the file's settings
        values.update(overrides or {})
        return cls.from_dict(values, source=path)

    def save(self, path: str) -> None:
        """Write as JSON atomically."""
        files.write_json(path, self.to_dict(), sort_keys=True)

    @classmethod
    def resolve(cls, overrides: dict[str, Any], config_path: str | None = None):
        """Flags (``overrides``) over the file ``config_path``, else over the stored config of the
        checkpoint ``overrides["resume"]`` names, else over the defaults."""
        from lorafuse.train import checkpoint as ckpt

        if config_path:
            return cls.from_file(config_path, overrides)
        if overrides.get("resume"):
            path = ckpt.resolve_resume(overrides["resume"])
            stored = ckpt.read_checkpoint_config(path)
            stored.update(overrides)
            return cls.from_dict(stored, source=f"{path}/{ckpt.CONFIG_NAME}")
        return cls.from_dict(overrides, source="flags")

    @classmethod
    def to_flags(cls, values: dict[str, Any]) -> list[str]:
        """The command-line flags that set ``values`` (field -> value), in field order: ``--name
        value``, ``--name`` / ``--no-name`` for a bool, a list as several values."""
        argv: list[str] = []
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            flag, value = "--" + f.name.replace("_", "-"), values[f.name]
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value)]
        return argv


@dataclass
class TrainConfig(ConfigFile):
    """A LoRA / QLoRA fine-tune. Field docs are the ``help`` entries (shown by ``lorafuse train -h``)."""

    LIST_FIELDS = ("data", "eval_data", "reward")
    GROUP_STARTS = {"model": "model", "lora": "lora_r", "vision": "finetune_vision",
                    "data": "data", "optim": "epochs", "run": "output_dir", "method": "method",
                    "grpo": "reward", "ppo": "reward_model", "distill": "teacher"}  # fmt: skip

    # model
    model: str | None = option(
        None, "HF model dir, .gguf file or hub id; default: the built-in SmolLM2-135M-Instruct"
    )
    max_seq_length: int = option(
        2048, "longest row in tokens (examples are truncated / packed to this)"
    )
    dtype: str | None = option(
        None, "float32 | bfloat16 | float16; default: the loader's choice for the device"
    )
    load_in_4bit: bool = option(False, "QLoRA: quantize the frozen base weights to 4 bit")
    load_in_int8: bool = option(
        False,
        "int8 frozen base weights whose products (forward and input gradient) run in int8 "
        "(CPUs with AMX or AVX-512-VNNI; faster at chat-length rows, slower at 2048-token batches, "
        "rows rounded to 8 bits: docs/benchmarks.md)",
    )
    quantize_embeddings: bool = option(
        False,
        "with load_in_4bit: the embeddings and lm_head in 4 bit too (less memory on large "
        "vocabularies; frozen logits from 4-bit weights)",
    )
    device: str | None = option(None, "cpu | cuda | cuda:N; default: cuda if available")
    fused: bool = option(True, "use lorafuse's fused kernels (patch_peft_model); off = stock PEFT")
    compile: bool = option(False, "torch.compile the patched model")
    # LoRA
    lora_r: int = option(16, "LoRA rank")
    lora_alpha: int = option(16, "LoRA alpha (scaling = alpha / r, or alpha / sqrt(r) with rslora)")
    lora_dropout: float = option(0.0, "dropout on the LoRA branch input")
    target_modules: list[str] | None = option(
        None, "module names to adapt; default: all linear layers of the block", nargs="+"
    )
    expert_lora: bool = option(
        True,
        "mixture-of-experts models: LoRA on the routed experts' fused tensors and the routers too "
        "(PEFT target_parameters; needs lora_dropout 0); false leaves them frozen",
    )
    use_rslora: bool = option(
        False, "rank-stabilised LoRA scaling (PEFT's use_rslora: alpha / sqrt(r))"
    )
    rank_pattern: list[str] = option(
        [],
        "per-module ranks as module=rank pairs (PEFT's rank_pattern; YAML: a mapping)",
        nargs="+",
    )
    alpha_pattern: list[str] = option(
        [],
        "per-module alphas as module=alpha pairs (PEFT's alpha_pattern; YAML: a mapping)",
        nargs="+",
    )
    init_lora_weights: str = option(
        "default",
        f"LoRA init (PEFT's init_lora_weights): {' | '.join(INITS)} | pissa_niter_N; "
        "pissa/olora adapters are saved converted to a plain LoRA of rank 2r on the original base",
    )
    lora_bias: bool = option(
        False, "a trainable bias on lora_B (PEFT's lora_bias; runs PEFT's forward)"
    )
    use_dora: bool = option(
        False,
        "DoRA (PEFT's use_dora: a learned magnitude per output row; QDoRA with load_in_4bit); fused",
    )
    loraplus_lr_ratio: float | None = option(
        None, "LoRA+: lora_B (and 1-D adapter params) learn at lr x this (PEFT's loraplus_lr_ratio)"
    )
    gradient_checkpointing: bool | None = option(
        None,
        "recompute activations in backward (less memory, ~30% slower); default: on only where the "
        "estimated activations of a micro-batch exceed half the available memory (vision-language "
        "models: on)",
    )
    # vision-language models (used when the model has a vision tower)
    finetune_vision: bool = option(False, "VLMs: LoRA on the vision encoder's attention/MLP too")
    train_projector: bool = option(False, "VLMs: train the projector (merger / connector) in full")
    max_pixels: int = option(
        DEFAULT_MAX_PIXELS, "VLMs: shrink each image (aspect kept) to at most this many pixels"
    )
    # data
    data: list[str] = option(
        [],
        "training data, one or several: files (.jsonl .json .csv .parquet) or Hugging Face "
        "datasets (.arrow files, save_to_disk folders, hub ids from the local cache, offline)",
        nargs="+",
    )
    data_format: str = option("auto", f"record format: {' | '.join(FORMATS)}")
    data_split: str | None = option(
        None, "Hugging Face datasets: the training split (default: train, or the only one)"
    )
    data_subset: str | None = option(None, "Hugging Face hub datasets: the subset (configuration)")
    data_columns: list[str] = option(
        [],
        "read a column as a record field, field=column (prompt=question,completion=answer); "
        "every source and format (YAML: a mapping)",
        nargs="+",
    )
    eval_data: list[str] = option(
        [], "held-out data for eval (loss; grpo: greedy reward), as data", nargs="+"
    )
    eval_data_split: str | None = option(
        None, "Hugging Face datasets in eval_data: the split (default: test, or validation)"
    )
    eval_split: float = option(
        0.0, "fraction of the training records held out for eval (if no eval_data)"
    )
    train_on_inputs: bool = option(
        False, "loss on every token, not only assistant / completion tokens"
    )
    think_tokens: str = option(
        "mask-empty",
        f"<think> blocks in assistant turns: {' | '.join(THINK_TOKENS)} (mask-empty: not the empty "
        "block Qwen3-style templates inject, nor earlier turns the template strips of reasoning)",
    )
    packing: bool = option(
        True, "several examples per row (position ids reset, attention kept per example)"
    )
    too_long: str = option(
        "truncate", "records longer than max_seq_length: truncate | drop | error"
    )
    skip_bad_records: bool = option(False, "skip (and count) malformed records instead of stopping")
    # optimisation
    epochs: int = option(1, "passes over the training data (ignored when max_steps is set)")
    max_steps: int | None = option(None, "stop after this many optimizer steps")
    batch_size: int = option(1, "rows per micro-batch per process")
    grad_accum: int = option(
        1, "micro-batches per optimizer step (loss normalised by all their target tokens)"
    )
    lr: float = option(2e-4, "peak learning rate")
    lr_scheduler: str = option("cosine", "cosine | linear | constant (after warmup)")
    warmup_steps: int = option(0, "linear warmup steps (overrides warmup_ratio when > 0)")
    warmup_ratio: float = option(0.0, "warmup as a fraction of the total steps")
    optimizer: str = option("adamw", "adamw | adamw_8bit (bitsandbytes)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_betas: list[float] = option([0.9, 0.999], "AdamW betas", nargs=2)
    adam_eps: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (0 = no clipping)")
    seed: int = option(3407, "seed for LoRA init, data order and dropout")
    # run
    output_dir: str = option("lorafuse-out", "checkpoints, final adapter and logging.jsonl go here")
    logging_steps: int = option(1, "write a logging.jsonl line every N steps")
    eval_steps: int = option(0, "eval (loss; grpo: reward) every N steps (0 = only at the end)")
    save_steps: int = option(100, "checkpoint every N steps (0 = only at the end)")
    save_total_limit: int = option(2, "keep the last K checkpoints (0 = keep all)")
    resume: str | None = option(
        None, "checkpoint dir (or output dir: its newest intact checkpoint) to continue from"
    )
    overwrite: bool = option(
        False,
        "start a new run in an output_dir that holds one: the old run's files move to "
        "<output_dir>.old-<time> (nothing is deleted)",
    )
    init_adapter: str | None = option(
        None, "adapter dir whose weights initialise LoRA (no optimizer state)"
    )
    tensorboard: bool = option(False, "also log to TensorBoard (as report_to: tensorboard)")
    report_to: list[str] = option(
        [],
        f"also log the logging.jsonl figures to: {' | '.join(TRACKERS)} (one or several, or "
        "a comma list); each needs its library (pip install 'lorafuse[wandb]' ...)",
        nargs="+",
    )
    progress: bool = option(True, "show a progress bar")
    num_threads: int | None = option(None, "torch CPU threads (default: torch's choice)")
    strategy: str = option("auto", "distributed strategy under torchrun: auto | ddp | fsdp | none")
    # preference training (data: prompt + chosen + rejected records, see docs/preference.md)
    method: str = option(
        "sft",
        " | ".join(recipes.METHODS)
        + " ("
        + "; ".join(f"{name}: {m.help}" for name, m in recipes.METHODS.items())
        + ")",
    )
    beta: float | None = option(
        None,
        "dpo/kto/simpo/cpo: temperature of the implicit reward; orpo: weight of the odds-ratio "
        "term; grpo: weight of the KL to the adapter-disabled model; rloo, ppo: of the KL penalty "
        "in the reward; distill: 0 forward KL, 1 reverse KL, between: generalized JSD (default "
        "0.1; grpo 0; rloo, ppo 0.05; distill 1; rm: none)",
    )
    desirable_weight: float = option(1.0, "kto: weight of the desirable (label true) records' loss")
    undesirable_weight: float = option(1.0, "kto: weight of the undesirable records' loss")
    loss_type: str | None = option(
        None,
        f"dpo/cpo: {' | '.join(DPO_LOSS_TYPES)} (default sigmoid); grpo: "
        f"{' | '.join(GRPO_LOSS_TYPES)} (default dapo: token-level normalisation; dr_grpo: by "
        "max_completion_length; cispo: clipped ratio as weight; sapo: soft gate)",
    )
    label_smoothing: float = option(
        0.0,
        "dpo/cpo sigmoid loss, simpo: assumed fraction of flipped preference labels (cDPO), in "
        "[0, 0.5)",
    )
    simpo_gamma: float = option(0.5, "simpo: target reward margin gamma (TRL's simpo_gamma)")
    center_rewards_coefficient: float | None = option(
        None, "rm: weight of the term pushing rewards toward 0 (TRL's; 0.01 is usual)"
    )
    cpo_alpha: float | None = option(
        None, "simpo/cpo: weight of the chosen responses' NLL (default: cpo 1, simpo 0)"
    )
    # grpo (data: prompts + columns for the rewards, see lorafuse.data.grpo)
    reward: list[str] = option(
        [],
        "grpo/rloo/ppo rewards, each [=weight]: exact[:column] | regex:<pattern> | length[:max_chars] | "
        "module:function | file.py:function (TRL's signature); repeatable",
        nargs="+",
        action="extend",
    )
    num_generations: int | None = option(
        None,
        "grpo/rloo: completions sampled per prompt (the group; default 8); ppo: episodes per "
        "prompt (default 1)",
    )
    max_completion_length: int = option(256, "grpo: longest completion in tokens")
    temperature: float = option(
        1.0,
        "grpo / distill sampling temperature (> 0; the log probabilities and the divergence use it too)",
    )
    top_p: float = option(1.0, "grpo sampling: nucleus probability")
    top_k: int = option(0, "grpo sampling: keep the k likeliest tokens (0 = off)")
    epsilon: float = option(
        0.2, "grpo: clip the importance ratio below at 1 - epsilon; ppo: cliprange (both sides)"
    )
    epsilon_high: float | None = option(
        None,
        "grpo: clip above at 1 + epsilon_high (default epsilon; DAPO uses 0.28); cispo: the "
        "ratio's upper bound itself (default 5.0, as the ScaleRL paper and TRL's docs advise)",
    )
    sapo_temperature_pos: float = option(
        1.0, "grpo sapo: gate temperature of tokens with positive advantage"
    )
    sapo_temperature_neg: float = option(
        1.05, "grpo sapo: gate temperature of tokens whose advantage is <= 0"
    )
    num_iterations: int = option(
        1, "grpo: optimizer steps per generation batch (> 1: importance ratios vs the sampler)"
    )
    scale_rewards: str = option(
        "group", f"grpo advantages divided by the reward std of: {' | '.join(REWARD_SCALES)}"
    )
    normalize_advantages: bool = option(
        False, "rloo: normalise the advantages over the generation batch (mean 0, std 1)"
    )
    kl_correction: bool = option(
        True, "grpo, beta > 0: weight the KL term by the importance ratio (TRL's default)"
    )
    # ppo (data: prompts as grpo; see lorafuse.train.ppo)
    reward_model: str | None = option(
        None,
        "ppo: a reward model trained with --method rm (its output or adapter dir) scores each "
        "completion; with --reward their total is added",
    )
    num_ppo_epochs: int = option(4, "ppo: passes over each rollout batch")
    num_mini_batches: int = option(
        1, "ppo: optimizer steps per pass over a rollout batch (must divide grad_accum)"
    )
    vf_coef: float = option(0.1, "ppo: weight of the value loss")
    cliprange_value: float = option(0.2, "ppo: clip the new values to the old ones +- this")
    gamma: float = option(1.0, "ppo: discount factor")
    lam: float = option(0.95, "ppo: lambda of the generalized advantage estimation")
    whiten_rewards: bool = option(False, "ppo: whiten the per-token rewards (mean kept)")
    kl_estimator: str = option(
        "k1", "ppo: the per-token KL penalty: k1 (log ratio) | k3 (lower variance)"
    )
    missing_eos_penalty: float | None = option(
        None, "ppo: subtracted from the score of a completion that ends without EOS"
    )
    # distill (data: prompt + completion records, as sft)
    teacher: str | None = option(
        None,
        "distill: the teacher, a local model dir with the student's vocabulary; default: the "
        "base itself (the adapter disabled, no second copy)",
    )
    lmbda: float = option(
        0.0,
        "distill: fraction of steps on-policy (the student samples the completions of the rows' "
        "prompts; TRL's GKD lmbda; 1 = TRL's DistillationTrainer); the rest use the data's",
    )

    def __post_init__(self) -> None:
        # each group checks its own fields (a check naming another group's field sits with the
        # field it is about), then the method's entry checks its group
        self._check_model()
        self._check_lora()
        self._check_data()
        self._check_optim()
        self._check_run()
        self._check_method()
        self.recipe.check(self, self._need)

    def _check_model(self) -> None:
        need = self._need
        need(self.max_seq_length >= 8, "max_seq_length", "must be >= 8")
        need(
            self.dtype in (None, "float32", "bfloat16", "float16"),
            "dtype",
            "float32 | bfloat16 | float16",
        )
        need(
            not (self.load_in_int8 and (self.load_in_4bit or self.use_dora or not self.fused)),
            "load_in_int8",
            "a fused LoRA on an int8 base: not with load_in_4bit, use_dora or fused=false",
        )
        need(
            self.load_in_4bit or not self.quantize_embeddings,
            "quantize_embeddings",
            "needs load_in_4bit: true",
        )
        need(self.max_pixels >= 1, "max_pixels", "must be >= 1")

    def _check_lora(self) -> None:
        need = self._need
        need(self.lora_r > 0, "lora_r", "must be > 0")
        need(self.lora_alpha > 0, "lora_alpha", "must be > 0")
        need(0.0 <= self.lora_dropout < 1.0, "lora_dropout", "must be in [0, 1)")
        for name in ("rank_pattern", "alpha_pattern"):
            value = getattr(self, name)
            if isinstance(value, dict):  # YAML / JSON mapping
                value = [f"{k}={v}" for k, v in value.items()]
                setattr(self, name, value)
            parse_pattern(value, name)
        self._check_init()
        need(
            not (self.use_dora and self.load_in_4bit and not self.fused),
            "use_dora",
            "stock PEFT's DoRA forward cannot read lorafuse's NF4 weights; QDoRA needs fused=True",
        )
        need(
            not self.lora_bias or self.init_lora_weights == "default",
            "lora_bias",
            "PEFT allows it only with the default init (init_lora_weights=default)",
        )
        need(
            self.loraplus_lr_ratio is None or self.loraplus_lr_ratio > 0,
            "loraplus_lr_ratio",
            "must be > 0",
        )

    def _check_init(self) -> None:
        """``init_lora_weights`` against the method, the base weights and the other LoRA fields."""
        need, init = self._need, self.init_lora_weights
        need(
            init in INITS or (init.startswith("pissa_niter_") and init[12:].isdigit()),
            "init_lora_weights",
            f"{' | '.join(INITS)} | pissa_niter_N",
        )
        need(
            init != "eva" or (self.recipe.eva and self.init_adapter is None),
            "init_lora_weights",
            "eva initialises from the SFT training rows (lorafuse.train.eva); not with preference "
            "methods or init_adapter",
        )
        mutating = init_kind(init) in MUTATING_INITS  # pissa / olora rewrite the base weight
        need(
            not mutating or not (self.load_in_4bit or self.load_in_int8),
            "init_lora_weights",
            "pissa/olora rewrite the base weight and need a float base; not with "
            + ("load_in_4bit" if self.load_in_4bit else "load_in_int8"),
        )
        need(
            not mutating or self.init_adapter is None,
            "init_lora_weights",
            "pissa/olora initialise from the base weight; not together with init_adapter",
        )
        need(
            not mutating or not (self.use_rslora and (self.rank_pattern or self.alpha_pattern)),
            "init_lora_weights",
            "PEFT cannot convert a pissa/olora adapter with use_rslora and rank/alpha patterns",
        )

    def _check_data(self) -> None:
        need = self._need
        need(self.data_format in FORMATS, "data_format", f"one of {FORMATS}")
        if isinstance(self.data_columns, dict):  # YAML / JSON mapping
            self.data_columns = [f"{k}={v}" for k, v in self.data_columns.items()]
        try:
            parse_columns(self.data_columns)
        except ValueError as err:
            raise ConfigError(f"data_columns={self.data_columns!r}: {err}") from None
        need(self.think_tokens in THINK_TOKENS, "think_tokens", " | ".join(THINK_TOKENS))
        need(0.0 <= self.eval_split < 1.0, "eval_split", "must be in [0, 1)")
        need(self.too_long in TOO_LONG, "too_long", f"one of {TOO_LONG}")

    def _check_optim(self) -> None:
        self._check_schedule()
        self._need(self.grad_accum >= 1, "grad_accum", "must be >= 1")
        self._need(self.lr > 0, "lr", "must be > 0")

    def _check_run(self) -> None:
        need = self._need
        for name in ("eval_steps", "save_steps", "save_total_limit"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(
            self.strategy in ("auto", "ddp", "fsdp", "none"), "strategy", "auto | ddp | fsdp | none"
        )
        # lists may come comma-separated
        names = [n.strip() for item in self.report_to for n in str(item).split(",") if n.strip()]
        unknown = [n for n in names if n not in TRACKERS]
        need(not unknown, "report_to", f"{' | '.join(TRACKERS)}, one or several")
        self.report_to = list(dict.fromkeys(names))

    def _check_method(self) -> None:
        """The method-specific fields every method's entry may read, checked for range here."""
        need = self._need
        need(self.desirable_weight > 0, "desirable_weight", "must be > 0")
        need(self.undesirable_weight > 0, "undesirable_weight", "must be > 0")
        need(self.scale_rewards in REWARD_SCALES, "scale_rewards", " | ".join(REWARD_SCALES))
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", " | ".join(KL_ESTIMATORS))
        need(0.0 <= self.label_smoothing < 0.5, "label_smoothing", "must be in [0, 0.5)")

    @property
    def recipe(self) -> recipes.Method:
        """The entry of ``method`` in the registry (:mod:`lorafuse.train.recipes`)."""
        return recipes.method(self.method)

    def trackers(self) -> list[str]:
        """The trackers to report to: ``report_to``, plus TensorBoard for ``tensorboard``."""
        return list(dict.fromkeys(self.report_to + (["tensorboard"] if self.tensorboard else [])))


def load_mapping(path: str) -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON file, with errors naming the file."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
    except Exception as err:  # yaml.YAMLError / json.JSONDecodeError
        raise ConfigError(f"{path}: cannot parse ({err})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of setting: value")
    return values

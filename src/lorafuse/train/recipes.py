"""The training methods: ``METHODS[name] -> Method``, the one place that names them.

A :class:`Method` holds everything a run needs to know about its method: its config group (the
check of its own settings, :mod:`lorafuse.train.options`), how its rows are built from the data,
its objective (:mod:`lorafuse.train.objective`) and its trainer class (the engine's
:class:`~lorafuse.train.trainer.Trainer`, or a subclass with its own step, like GRPO's).
``TrainConfig`` validates ``method`` and the method's settings through it, and
:func:`lorafuse.train.engine.train` looks the method up and runs its trainer; neither branches on
a method's name. Adding a method is one entry here plus its own files (CONTRIBUTING.md).

The parts import their modules when called: this registry is read by ``TrainConfig`` (which must
stay light: ``lorafuse train --help``), and those modules sit above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from lorafuse.errors import ConfigError
from lorafuse.train import options


@dataclass(frozen=True)
class Method:
    """One training method.

    - ``help``: one line for ``--help``.
    - ``check(cfg, need)``: its config group; fills the defaults of its settings and checks them
      (``need(cond, field, what)`` raises ``ConfigError`` naming the field).
    - ``rows(spec, tokenizer, processor, cfg) -> Prepared``: the train / eval rows of the data.
    - ``objective(cfg, tokenizer, processor, packed, device) -> Objective``: its loss.
    - ``trainer() -> type``: the trainer class that runs it.
    - ``packs``: its rows may be packed; ``vision``: vision-language models train with it;
      ``eva``: EVA may initialise LoRA from its rows (token rows with targets).
    - ``sequences(cfg) -> int``: sequences one row puts through the model per pass (memory).
    """

    help: str
    check: Callable
    rows: Callable
    objective: Callable
    trainer: Callable[[], type]
    packs: bool = False
    vision: bool = False
    eva: bool = False
    sequences: Callable = lambda cfg: 1


# ---- the parts (imported when called) -------------------------------------------------------
def _engine_trainer() -> type:
    from lorafuse.train.trainer import Trainer

    return Trainer


def _sft_rows(spec, tokenizer, processor, cfg):
    if processor is not None:  # a vision-language model
        from lorafuse.data.vision_rows import build_vision

        return build_vision(spec, processor, cfg.max_pixels)
    from lorafuse.data.dataset import build

    return build(spec, tokenizer)


def _sft_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.objective import SFTObjective

    return SFTObjective(tokenizer.pad_token_id, packed, processor is not None, device)


def _pair_rows(spec, tokenizer, processor, cfg):
    from lorafuse.data.preference import build_pairs

    return build_pairs(spec, tokenizer)


def _pair_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.preference import PreferenceObjective

    return PreferenceObjective.from_config(cfg, tokenizer.pad_token_id, device)


def _cpo_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.cpo import CPOObjective

    return CPOObjective.from_config(cfg, tokenizer.pad_token_id, device)


def _rm_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.reward import RewardObjective

    return RewardObjective.from_config(cfg, tokenizer.pad_token_id, device)


def _kto_rows(spec, tokenizer, processor, cfg):
    from lorafuse.data.kto import build_kto

    return build_kto(spec, tokenizer)


def _kto_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.kto import KTOObjective

    return KTOObjective.from_config(cfg, tokenizer.pad_token_id, device)


def _prompt_rows(spec, tokenizer, processor, cfg):
    from lorafuse.data.grpo import build_prompts

    return build_prompts(spec, tokenizer, cfg.max_completion_length)


def _grpo_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.grpo import GRPOObjective

    return GRPOObjective.from_config(cfg, tokenizer.pad_token_id, device)


def _rloo_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.rloo import RLOOObjective

    return RLOOObjective.from_config(cfg, tokenizer.pad_token_id, device)


def _rloo_trainer() -> type:
    from lorafuse.train.rloo_trainer import RLOOTrainer

    return RLOOTrainer


def _distill_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.distill import DistillObjective

    return DistillObjective.from_config(cfg, tokenizer, device)


def _distill_trainer() -> type:
    from lorafuse.train.distill_trainer import DistillTrainer

    return DistillTrainer


def _ppo_objective(cfg, tokenizer, processor, packed, device):
    from lorafuse.train.ppo import PPOObjective

    return PPOObjective.from_config(cfg, tokenizer.pad_token_id, device)


def _ppo_trainer() -> type:
    from lorafuse.train.ppo_trainer import PPOTrainer

    return PPOTrainer


def _grpo_trainer() -> type:
    from lorafuse.train.grpo_trainer import GRPOTrainer

    return GRPOTrainer


def _check_sft(cfg, need):
    options.check_offline(cfg, need, sft=True)


def _check_dpo(cfg, need):
    options.check_offline(cfg, need, dpo=True)


def _check_preference(cfg, need):
    options.check_offline(cfg, need)


METHODS: dict[str, Method] = {
    "sft": Method(
        "supervised: the token loss on the targets", _check_sft, _sft_rows, _sft_objective,
        _engine_trainer, packs=True, vision=True, eva=True,
    ),
    "dpo": Method(
        "preference pairs (chosen / rejected), reference = the adapter disabled", _check_dpo,
        _pair_rows, _pair_objective, _engine_trainer, sequences=lambda cfg: 2,
    ),
    "orpo": Method(
        "preference pairs, odds ratio term on the SFT loss (no reference)", _check_preference,
        _pair_rows, _pair_objective, _engine_trainer, sequences=lambda cfg: 2,
    ),
    "kto": Method(
        "labelled completions (desirable / undesirable)", _check_preference, _kto_rows,
        _kto_objective, _engine_trainer,
    ),
    "grpo": Method(
        "prompts scored by rewards; the policy samples its own completions", options.check_grpo,
        _prompt_rows, _grpo_objective, _grpo_trainer,
        sequences=lambda cfg: cfg.num_generations,
    ),
    "simpo": Method(
        "preference pairs, a margin loss on mean token log probs, no reference (TRL's CPO simpo)",
        partial(options.check_cpo, simpo=True), _pair_rows, _cpo_objective, _engine_trainer,
        sequences=lambda cfg: 2,
    ),
    "cpo": Method(
        "preference pairs, the DPO losses without reference, plus the chosen NLL (TRL's CPO)",
        partial(options.check_cpo, simpo=False), _pair_rows, _cpo_objective, _engine_trainer,
        sequences=lambda cfg: 2,
    ),
    "rloo": Method(
        "prompts scored by --reward, leave one out baselines, the KL as a reward penalty",
        options.check_rloo, _prompt_rows, _rloo_objective, _rloo_trainer,
        sequences=lambda cfg: cfg.num_generations,
    ),
    "rm": Method(
        "a reward model from preference pairs (a scalar score head, the Bradley Terry loss)",
        options.check_rm, _pair_rows, _rm_objective, _engine_trainer, sequences=lambda cfg: 2,
    ),
    "ppo": Method(
        "prompts scored by --reward-model and/or --reward; a value head on the same base, GAE, "
        "clipped policy and value losses, the KL as a reward penalty (TRL's PPO)",
        options.check_ppo, _prompt_rows, _ppo_objective, _ppo_trainer,
        sequences=lambda cfg: cfg.num_generations,
    ),
    "distill": Method(
        "a teacher's next-token distributions (--teacher DIR or the base): forward / reverse KL "
        "or generalized JSD by beta, on the data's completions or the student's own (lmbda)",
        options.check_distill, _sft_rows, _distill_objective, _distill_trainer,
    ),
}  # fmt: skip


def method(name: str) -> Method:
    """The entry of ``name``; ``ConfigError`` naming the methods there are."""
    if name not in METHODS:
        raise ConfigError(f"method={name!r}: {' | '.join(METHODS)}")
    return METHODS[name]

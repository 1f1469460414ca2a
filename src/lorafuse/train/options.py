"""The vocabularies and checks that ``TrainConfig`` shares with the parts it configures.

They sit below both the config and the training modules, so those never import each other:
the LoRA init kinds and per-module patterns (read by :mod:`lorafuse.train.model` and the
trainer), the methods' loss types, and each method's own settings check (its *config group*,
named by the method's entry in :mod:`lorafuse.train.recipes`).
"""

from __future__ import annotations

from collections.abc import Callable

from lorafuse.errors import ConfigError

INITS = ("default", "gaussian", "pissa", "olora", "eva")
MUTATING_INITS = ("pissa", "olora")  # they rewrite the base weight (residual); saved converted
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")  # cpo's too (simpo is its own loss)
GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "cispo", "sapo")
REWARD_SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k3")  # ppo's per-token KL penalty (TRL's kl_estimator)

# need(condition, field name, what it must be): raises ConfigError naming the field's value
Need = Callable[[bool, str, str], None]


def init_kind(init: str) -> str:
    """``init_lora_weights`` without PiSSA's ``_niter_N`` suffix."""
    return "pissa" if init.startswith("pissa_niter_") else init


def parse_pattern(items: list[str], name: str) -> dict[str, int]:
    """``["q_proj=8", ...]`` -> ``{"q_proj": 8}``, errors naming the field and the item."""
    out = {}
    for item in items:
        key, sep, value = str(item).rpartition("=")
        if not sep or not key or not value.strip().isdigit() or int(value) <= 0:
            raise ConfigError(f"{name}: {item!r} is not module=N with N a positive integer")
        out[key.strip()] = int(value)
    return out


# ---- each method's config group: fill its defaults, then check its fields --------------------
def check_offline(cfg, need: Need, *, sft: bool = False, dpo: bool = False) -> None:
    """sft / dpo / orpo / kto: learn from stored rows; ``beta`` and ``loss_type`` are DPO's
    (sft ignores them, but they must still be valid), no rewards."""
    if cfg.beta is None:
        cfg.beta = 0.1
    if cfg.loss_type is None:
        cfg.loss_type = "sigmoid"
    need(cfg.beta > 0, "beta", "must be > 0")
    need(cfg.loss_type in DPO_LOSS_TYPES, "loss_type", " | ".join(DPO_LOSS_TYPES))
    _no_sampling(cfg, need)
    _no_cpo_alpha(cfg, need)
    _no_center(cfg, need)
    _no_distill(cfg, need)
    need(
        cfg.label_smoothing == 0.0 or (dpo and cfg.loss_type == "sigmoid"),
        "label_smoothing",
        "applies to method=dpo with loss_type=sigmoid only",
    )
    need(
        sft or not cfg.train_on_inputs,
        "train_on_inputs",
        "dpo/orpo/kto score the responses only; train_on_inputs applies to sft",
    )


def check_grpo(cfg, need: Need) -> None:
    """grpo: prompts, rewards and the sampling / clipping settings."""
    if cfg.beta is None:
        cfg.beta = 0.0
    if cfg.loss_type is None:
        cfg.loss_type = "dapo"
    if cfg.loss_type == "cispo" and cfg.epsilon_high is None:
        cfg.epsilon_high = 5.0  # cispo's bound on the ratio itself (ScaleRL; TRL's docs)
    need(cfg.beta >= 0, "beta", "grpo: must be >= 0 (0 = no KL term)")
    need(cfg.loss_type in GRPO_LOSS_TYPES, "loss_type", "grpo: " + " | ".join(GRPO_LOSS_TYPES))
    need(not cfg.normalize_advantages, "normalize_advantages", "applies to method=rloo")
    _check_group(cfg, need)
    _check_sampling(cfg, need)


def check_rloo(cfg, need: Need) -> None:
    """rloo: as grpo (prompts, rewards, sampling, clipping), with leave-one-out advantages, a
    sequence-level ratio and the KL as a reward penalty (TRL's RLOOTrainer; beta default 0.05)."""
    if cfg.beta is None:
        cfg.beta = 0.05
    need(cfg.beta >= 0, "beta", "rloo: must be >= 0 (0 = no KL penalty)")
    need(cfg.loss_type is None, "loss_type", "does not apply to method=rloo")
    need(
        cfg.scale_rewards == "group",
        "scale_rewards",
        "applies to grpo (rloo: normalize_advantages)",
    )
    need(cfg.kl_correction, "kl_correction", "applies to grpo (rloo's KL is a reward penalty)")
    _check_group(cfg, need)
    _check_sampling(cfg, need)


def _check_group(cfg, need: Need) -> None:
    """grpo and rloo: rewards, a group of completions per prompt, no ppo settings."""
    if cfg.num_generations is None:
        cfg.num_generations = 8
    need(bool(cfg.reward), "reward", f"{cfg.method} needs at least one --reward")
    need(cfg.num_generations >= 2, "num_generations", "must be >= 2 (a group to compare)")
    need(cfg.reward_model is None, "reward_model", "applies to method=ppo")


def check_ppo(cfg, need: Need) -> None:
    """ppo: prompts scored by a reward model and/or rewards, TRL's PPO settings (kl_coef = beta,
    default 0.05; cliprange = epsilon)."""
    if cfg.beta is None:
        cfg.beta = 0.05
    if cfg.num_generations is None:
        cfg.num_generations = 1
    need(cfg.beta >= 0, "beta", "ppo: must be >= 0 (the KL penalty coefficient; 0 = none)")
    need(cfg.loss_type is None, "loss_type", "does not apply to method=ppo")
    need(
        bool(cfg.reward) or cfg.reward_model is not None,
        "reward",
        "ppo needs --reward-model and/or at least one --reward",
    )
    need(cfg.num_generations >= 1, "num_generations", "ppo: must be >= 1 (episodes per prompt)")
    need(cfg.epsilon_high is None, "epsilon_high", "ppo clips symmetrically (epsilon)")
    need(cfg.num_iterations == 1, "num_iterations", "applies to grpo/rloo (ppo: num_ppo_epochs)")
    need(cfg.scale_rewards == "group", "scale_rewards", "applies to grpo")
    need(not cfg.normalize_advantages, "normalize_advantages", "applies to method=rloo")
    need(cfg.kl_correction, "kl_correction", "applies to grpo (ppo's KL is a reward penalty)")
    need(cfg.num_ppo_epochs >= 1, "num_ppo_epochs", "must be >= 1")
    need(cfg.num_mini_batches >= 1, "num_mini_batches", "must be >= 1")
    need(
        cfg.grad_accum % cfg.num_mini_batches == 0,
        "num_mini_batches",
        f"must divide grad_accum ({cfg.grad_accum}): a minibatch is whole micro-batches",
    )
    need(cfg.vf_coef >= 0, "vf_coef", "must be >= 0")
    need(cfg.cliprange_value > 0, "cliprange_value", "must be > 0")
    need(0 <= cfg.gamma <= 1, "gamma", "must be in [0, 1]")
    need(0 <= cfg.lam <= 1, "lam", "must be in [0, 1]")
    need(
        cfg.missing_eos_penalty is None or cfg.missing_eos_penalty >= 0,
        "missing_eos_penalty",
        "must be >= 0 (subtracted from the score of a completion without EOS)",
    )
    _check_sampling(cfg, need)


def _check_sampling(cfg, need: Need) -> None:
    """What grpo, rloo and ppo share: sampling, clipping, iterations."""
    need(cfg.max_completion_length >= 1, "max_completion_length", "must be >= 1")
    need(
        cfg.max_completion_length < cfg.max_seq_length,
        "max_completion_length",
        f"must be < max_seq_length ({cfg.max_seq_length}): the prompt needs room",
    )
    need(cfg.temperature > 0, "temperature", "must be > 0")
    need(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
    need(cfg.top_k >= 0, "top_k", "must be >= 0")
    need(cfg.epsilon > 0, "epsilon", "must be > 0")
    need(cfg.epsilon_high is None or cfg.epsilon_high > 0, "epsilon_high", "must be > 0")
    need(cfg.num_iterations >= 1, "num_iterations", "must be >= 1")
    need(cfg.sapo_temperature_pos > 0, "sapo_temperature_pos", "must be > 0")
    need(cfg.sapo_temperature_neg > 0, "sapo_temperature_neg", "must be > 0")
    _no_cpo_alpha(cfg, need)
    _no_center(cfg, need)
    _no_distill(cfg, need)
    need(
        cfg.label_smoothing == 0.0,
        "label_smoothing",
        "applies to method=dpo with loss_type=sigmoid only",
    )
    need(
        not cfg.train_on_inputs,
        "train_on_inputs",
        "dpo/orpo/kto score the responses only; train_on_inputs applies to sft",
    )


def check_cpo(cfg, need: Need, *, simpo: bool) -> None:
    """simpo / cpo: preference pairs without a reference (TRL's CPOTrainer); simpo's loss is its
    own, cpo's one of DPO's; ``cpo_alpha`` weighs the chosen NLL (cpo 1, simpo 0)."""
    if cfg.beta is None:
        cfg.beta = 0.1
    if cfg.loss_type is None:
        cfg.loss_type = "simpo" if simpo else "sigmoid"
    if cfg.cpo_alpha is None:
        cfg.cpo_alpha = 0.0 if simpo else 1.0
    need(cfg.beta > 0, "beta", "must be > 0")
    if simpo:
        need(cfg.loss_type == "simpo", "loss_type", "simpo has its own loss (leave unset)")
    else:
        need(cfg.loss_type in DPO_LOSS_TYPES, "loss_type", " | ".join(DPO_LOSS_TYPES))
    need(cfg.cpo_alpha >= 0, "cpo_alpha", "must be >= 0")
    _no_sampling(cfg, need)
    _no_center(cfg, need)
    _no_distill(cfg, need)
    need(
        cfg.label_smoothing == 0.0 or cfg.loss_type in ("sigmoid", "simpo"),
        "label_smoothing",
        "applies to the sigmoid and simpo losses only",
    )
    need(
        not cfg.train_on_inputs,
        "train_on_inputs",
        "simpo/cpo score the responses only; train_on_inputs applies to sft",
    )


def _no_cpo_alpha(cfg, need: Need) -> None:
    need(cfg.cpo_alpha in (None, 0), "cpo_alpha", "applies to method=simpo or cpo")


def _no_center(cfg, need: Need) -> None:
    need(
        cfg.center_rewards_coefficient is None, "center_rewards_coefficient", "applies to method=rm"
    )


def _no_distill(cfg, need: Need) -> None:
    need(cfg.teacher is None, "teacher", "applies to method=distill")
    need(cfg.lmbda == 0.0, "lmbda", "applies to method=distill")


def _no_sampling(cfg, need: Need) -> None:
    """Methods that learn from stored rows: no rewards, no rloo settings."""
    need(not cfg.reward, "reward", "applies to method=grpo, rloo or ppo")
    need(not cfg.normalize_advantages, "normalize_advantages", "applies to method=rloo")
    need(cfg.reward_model is None, "reward_model", "applies to method=ppo")


def check_rm(cfg, need: Need) -> None:
    """rm: a reward model from preference pairs; beta and loss_type do not apply."""
    need(cfg.beta is None, "beta", "does not apply to method=rm")
    need(cfg.loss_type is None, "loss_type", "does not apply to method=rm")
    need(
        cfg.center_rewards_coefficient is None or cfg.center_rewards_coefficient >= 0,
        "center_rewards_coefficient",
        "must be >= 0",
    )
    _no_sampling(cfg, need)
    _no_cpo_alpha(cfg, need)
    _no_distill(cfg, need)
    need(cfg.label_smoothing == 0.0, "label_smoothing", "does not apply to method=rm")
    need(
        not cfg.train_on_inputs,
        "train_on_inputs",
        "rm scores whole sequences; train_on_inputs applies to sft",
    )


def check_distill(cfg, need: Need) -> None:
    """distill: a teacher (a model dir, or the base with the adapter disabled) and the divergence
    ``beta`` picks, as TRL's DistillationTrainer (0 forward KL, 1 reverse KL, between the
    generalized JSD; default 1); ``lmbda`` of the steps sample their completions on-policy."""
    if cfg.beta is None:
        cfg.beta = 1.0
    need(0.0 <= cfg.beta <= 1.0, "beta", "distill: must be in [0, 1] (0 forward KL, 1 reverse KL)")
    need(cfg.loss_type is None, "loss_type", "does not apply to method=distill (beta picks it)")
    need(0.0 <= cfg.lmbda <= 1.0, "lmbda", "must be in [0, 1]")
    need(cfg.teacher is None or bool(str(cfg.teacher).strip()), "teacher", "a model dir")
    need(cfg.temperature > 0, "temperature", "must be > 0")
    if cfg.lmbda > 0:  # on-policy steps sample
        need(cfg.max_completion_length >= 1, "max_completion_length", "must be >= 1")
        need(
            cfg.max_completion_length < cfg.max_seq_length,
            "max_completion_length",
            f"must be < max_seq_length ({cfg.max_seq_length}): the prompt needs room",
        )
        need(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
        need(cfg.top_k >= 0, "top_k", "must be >= 0")
    _no_sampling(cfg, need)
    _no_cpo_alpha(cfg, need)
    _no_center(cfg, need)
    need(cfg.label_smoothing == 0.0, "label_smoothing", "does not apply to method=distill")
    need(
        not cfg.train_on_inputs,
        "train_on_inputs",
        "distill scores the completion tokens (TRL's completion mask); it applies to sft",
    )

"""Each training method's rows and objective: ``METHODS[method](trainer, spec) -> (rows,
objective)``. The objectives share one interface (:mod:`lorafuse.train.objective`), so the
engine's step runs them all alike; ``grpo`` is its own trainer (:mod:`lorafuse.train.grpo_trainer`).
"""

from __future__ import annotations

from lorafuse.data.dataset import DataSpec, Prepared, build
from lorafuse.data.vision_rows import build_vision
from lorafuse.train.objective import SFTObjective


def _sft(trainer, spec: DataSpec) -> tuple[Prepared, SFTObjective]:
    # late-bound: a subclass's (or a wrapped) ``forward_rows`` is the one the objective calls
    obj = SFTObjective(
        lambda rows, n_items: trainer.forward_rows(rows, n_items), trainer.ctx.device
    )
    if trainer.processor is not None:  # a vision-language model (SFT only: setup checks)
        return build_vision(spec, trainer.processor, trainer.cfg.max_pixels), obj
    return build(spec, trainer.tokenizer), obj


def _pairs(trainer, spec: DataSpec):
    from lorafuse.data.preference import build_pairs
    from lorafuse.train.preference import PreferenceObjective

    return build_pairs(spec, trainer.tokenizer), PreferenceObjective.from_config(
        trainer.cfg, trainer.tokenizer.pad_token_id, trainer.ctx.device
    )


def _cpo(trainer, spec: DataSpec):
    from lorafuse.data.preference import build_pairs
    from lorafuse.train.cpo import CPOObjective

    return build_pairs(spec, trainer.tokenizer), CPOObjective.from_config(
        trainer.cfg, trainer.tokenizer.pad_token_id, trainer.ctx.device
    )


def _kto(trainer, spec: DataSpec):
    from lorafuse.data.kto import build_kto
    from lorafuse.train.kto import KTOObjective

    return build_kto(spec, trainer.tokenizer), KTOObjective.from_config(
        trainer.cfg, trainer.tokenizer.pad_token_id, trainer.ctx.device
    )


# method -> (trainer, data spec) -> (rows, objective); the objectives share one interface
# (lorafuse.train.objective); grpo is its own trainer (lorafuse.train.grpo_trainer)
METHODS = {"sft": _sft, "dpo": _pairs, "orpo": _pairs, "kto": _kto, "simpo": _cpo, "cpo": _cpo}

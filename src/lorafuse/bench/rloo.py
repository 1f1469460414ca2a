"""``--method rloo``: TRL's ``RLOOTrainer`` on stock PEFT vs lorafuse's RLOO on the patched model.

The workload is ``--method grpo``'s (:mod:`lorafuse.bench.grpo`): the same random-weight model,
``--batch`` random prompts of ``--seq`` tokens a step, ``--num-generations`` completions of each,
exactly ``--completion-length`` tokens long on both sides, one reward on the completion ids, one
iteration and one micro-batch of all ``batch × G`` completions. RLOO's defaults on both sides
(TRL's ``RLOOConfig``, ``lorafuse train --method rloo``): ``beta`` 0.05, so the KL is a reward
penalty and π_old and π_ref (the adapter disabled) are scored once a step without gradient;
``epsilon`` 0.2, no advantage normalisation. A step is

* generation + scoring: TRL's own ``_generate_and_score_completions`` (``model.generate`` on all
  rows, π_old, π_ref, rewards, the KL penalty, leave-one-out advantages) vs
  :func:`lorafuse.train.rollout.generate` + :func:`~lorafuse.train.rewards.score` + π_old and
  π_ref (:meth:`~lorafuse.train.grpo.GRPOObjective.logps`) +
  :func:`~lorafuse.train.rloo.kl_penalty` + :func:`~lorafuse.train.rloo.rloo_advantages`, as
  :class:`lorafuse.train.rloo_trainer.RLOOTrainer` orders them;
* the update: TRL's ``_compute_loss`` + backward + AdamW vs
  :class:`~lorafuse.train.rloo.RLOOObjective` + backward + AdamW.

By design TRL's update also computes every completion token's entropy (it logs it); lorafuse
takes the entropy from its sampling step. Completions are sampled, so the two sides' differ; each
step records its prompts and token count (:func:`~lorafuse.bench.model.batch_record`).
"""

from __future__ import annotations

from lorafuse.bench.config import model_config
from lorafuse.bench.grpo import GRPOStep, id_reward, trl_generate, trl_trainer
from lorafuse.bench.model import batch_record, build_model

BETA, EPSILON = 0.05, 0.2  # RLOOConfig's defaults, and lorafuse's for --method rloo


def _stock(spec: dict, device, seen: list[dict]):
    import torch
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig, RLOOTrainer

    from lorafuse.dtypes import parse_dtype

    G = spec["num_generations"]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(model_config(spec["model"]))
    base = base.to(dtype=parse_dtype(spec["dtype"]), device=device)
    trainer = trl_trainer(spec, base, RLOOTrainer, RLOOConfig, beta=BETA, epsilon=EPSILON)
    generate_and_score = trl_generate(trainer, G)

    def trl_generate_recorded(model, prompts):
        batch = generate_and_score(model, prompts)
        record = batch_record(batch["prompt_ids"])
        record["tokens"] = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
        seen.append(record)
        return batch

    def trl_update(model, batch):
        return trainer._compute_loss(model, batch)

    return trainer.model, GRPOStep(device, trl_generate_recorded, trl_update)


def rloo_setup(spec: dict):
    """``(model, GRPOStep)`` for ``spec['config']`` under --method rloo; the step's ``seen``
    lists each batch's prompts and tokens."""
    import torch

    from lorafuse.train.grpo import Sample
    from lorafuse.train.rewards import Reward, combine, score
    from lorafuse.train.rloo import RLOOObjective, kl_penalty, rloo_advantages
    from lorafuse.train.rollout import RolloutParams, generate

    device = torch.device(spec["device"])
    seen: list[dict] = []
    if spec["config"] == "stock":
        model, step = _stock(spec, device, seen)
        step.seen = seen
        return model, step
    G, L = spec["num_generations"], spec["completion_length"]
    model = build_model(spec)
    objective = RLOOObjective("grpo", BETA, EPSILON, EPSILON, L, 1.0, 0, device=device)
    params, gen, rewards = (
        RolloutParams(L, 1.0),
        torch.Generator().manual_seed(0),
        [Reward("r", id_reward)],
    )

    def our_generate(model, prompts):
        model.eval()  # sampling, π_old and π_ref without dropout, as the trainer runs them
        try:
            ro = generate(model, prompts, G, params, gen, set(), 0)
            columns = {"completion_ids": ro.completions}
            repeated = [p for p in prompts for _ in range(G)]
            _, per = score(rewards, repeated, [""] * len(ro.completions), columns)
            samples = [Sample(p, c, 0.0) for p, c in zip(repeated, ro.completions)]
            for s, old, ref in zip(samples, objective.logps(model, samples),
                                   objective.logps(model, samples, reference=True)):  # fmt: skip
                s.old_logps = old
                s.ref_logps = ref
            total = combine(rewards, per) - BETA * kl_penalty(samples)
            adv, _ = rloo_advantages(total, G)
        finally:
            model.train()
        for s, a in zip(samples, adv.tolist()):
            s.advantage, s.ref_logps = a, None  # the loss has no KL term
        record = batch_record(torch.tensor(repeated))
        record["tokens"] = sum(s.n_tokens for s in samples)
        seen.append(record)
        return samples

    def our_update(model, samples):
        loss, _ = objective.loss(model, samples, objective.counts(samples))
        return loss

    step = GRPOStep(device, our_generate, our_update)
    step.seen = seen
    return model, step

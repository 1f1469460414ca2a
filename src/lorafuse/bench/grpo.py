"""``--method grpo``: TRL's ``GRPOTrainer`` on stock PEFT vs lorafuse's GRPO on the patched model.

Same random-weight model, same random prompts (``--batch`` prompts of ``--seq`` tokens a step),
``--num-generations`` completions of each, exactly ``--completion-length`` tokens long on both
sides (TRL: ``min_new_tokens``; lorafuse: no EOS), one reward on the completion ids, loss
``dapo``, beta 0, num_iterations 1 (neither side runs an extra forward). A step is

* generation + scoring: TRL's own ``_generate_and_score_completions`` (``model.generate`` on all
  ``batch × G`` rows, its padding, rewards and advantages; prompt tokenization and completion
  decoding are bypassed: the prompts are token ids and the reward reads ids) vs
  :func:`lorafuse.train.rollout.generate` (each prompt prefilled once for its group) +
  :func:`~lorafuse.train.rewards.score` + :func:`~lorafuse.train.grpo.group_advantages`;
* the update: TRL's ``_compute_loss`` + backward + AdamW vs :class:`GRPOObjective` + backward +
  AdamW, one micro-batch of all ``batch × G`` completions.

Each step's generation seconds are recorded apart (``gen_times``), so the table splits the step.
"""

from __future__ import annotations

import tempfile
import time

from lorafuse.bench.config import TARGETS, model_config
from lorafuse.bench.model import build_model, finish_step
from lorafuse.bench.process import sync


def id_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    return [float(sum(ids) % 7) for ids in completion_ids]  # any cheap function of the ids


def grpo_prompts(spec: dict, n: int) -> list[list[list[int]]]:
    """``n`` steps of ``spec['batch']`` random prompts of ``spec['seq']`` token ids."""
    import torch

    g = torch.Generator().manual_seed(1234)
    vocab = model_config(spec["model"]).vocab_size
    return [torch.randint(3, vocab, (spec["batch"], spec["seq"]), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


class GRPOStep:
    """``step(model, opt, prompts) -> loss`` timing its generation part into ``gen_times``."""

    def __init__(self, device, generate, update) -> None:
        self.device, self.generate, self.update = device, generate, update
        self.gen_times: list[float] = []

    def __call__(self, model, opt, prompts) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        batch = self.generate(model, prompts)
        sync(self.device)
        self.gen_times.append(time.perf_counter() - t0)
        return finish_step(self.update(model, batch), opt)


def trl_trainer(spec: dict, base, trainer_cls, config_cls, **method_args):
    """TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (with its config class) on stock PEFT around
    ``base``, fed token-id prompts and scored on completion ids (no text decoding)."""
    import peft
    from datasets import Dataset

    from lorafuse.data.word_tokenizer import word_tokenizer

    G, L = spec["num_generations"], spec["completion_length"]
    args = config_cls(
        output_dir=tempfile.mkdtemp(prefix=f"lorafuse-bench-{trainer_cls.__name__.lower()}-"),
        report_to=[],
        use_cpu=spec["device"] == "cpu", bf16=False, fp16=False,
        gradient_checkpointing=bool(spec["grad_ckpt"]), num_generations=G,
        per_device_train_batch_size=spec["batch"] * G, max_completion_length=L,
        generation_kwargs={"min_new_tokens": L}, temperature=1.0, **method_args,
    )  # fmt: skip
    lora = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["rank"], target_modules=TARGETS)
    tok = word_tokenizer()
    tok.pad_token = tok.eos_token
    trainer = trainer_cls(
        model=base, reward_funcs=[id_reward], args=args,
        train_dataset=Dataset.from_list([{"prompt": "a"}]), processing_class=tok, peft_config=lora,
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), not run here
    trainer.processing_class.batch_decode = lambda ids, **kw: [""] * len(ids)  # ids-only reward
    return trainer


def trl_generate(trainer, G: int):
    """``generate(model, prompts) -> batch``: TRL's own generation + scoring of ``G``
    completions per token-id prompt (its sampler repeats each prompt ``G`` times)."""

    def generate(model, prompts):
        ids = [p for p in prompts for _ in range(G)]
        trainer._tokenize_prompts = lambda texts: (ids, None, {})
        return trainer._generate_and_score_completions([{"prompt": "a"}] * len(ids))

    return generate


def grpo_setup(spec: dict):
    """``(model, GRPOStep)`` for ``spec['config']`` under --method grpo."""
    import torch

    from lorafuse.train.grpo import GRPOObjective, Sample, group_advantages
    from lorafuse.train.rewards import Reward, combine, score
    from lorafuse.train.rollout import RolloutParams, generate

    device = torch.device(spec["device"])
    G, L = spec["num_generations"], spec["completion_length"]
    if spec["config"] == "stock":
        from transformers import LlamaForCausalLM

        from lorafuse.dtypes import parse_dtype

        torch.manual_seed(0)
        base = LlamaForCausalLM(model_config(spec["model"]))
        base = base.to(dtype=parse_dtype(spec["dtype"]), device=device)
        from trl import GRPOConfig, GRPOTrainer

        trainer = trl_trainer(spec, base, GRPOTrainer, GRPOConfig, loss_type="dapo", beta=0.0)

        def trl_update(model, batch):
            return trainer._compute_loss(model, batch)

        return trainer.model, GRPOStep(device, trl_generate(trainer, G), trl_update)
    model = build_model(spec)
    objective = GRPOObjective("dapo", 0.0, 0.2, 0.2, L, 1.0, 0, device=device)
    params, gen, rewards = (
        RolloutParams(L, 1.0),
        torch.Generator().manual_seed(0),
        [Reward("r", id_reward)],
    )

    def our_generate(model, prompts):
        model.eval()
        try:
            ro = generate(model, prompts, G, params, gen, set(), 0)
        finally:
            model.train()
        columns = {"completion_ids": ro.completions}
        _, per = score(
            rewards, [p for p in prompts for _ in range(G)], [""] * len(ro.completions), columns
        )
        adv, _ = group_advantages(combine(rewards, per), G)
        return [
            Sample(prompts[i // G], c, float(a))
            for i, (c, a) in enumerate(zip(ro.completions, adv))
        ]

    def our_update(model, samples):
        loss, _ = objective.loss(model, samples, objective.counts(samples))
        return loss

    return model, GRPOStep(device, our_generate, our_update)

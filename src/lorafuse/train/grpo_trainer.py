"""``lorafuse train --method grpo``: the engine (and its shared loop) with a GRPO step.

One *generation batch* is the step's global rows (``batch_size × grad_accum`` prompts). For it:

1. the policy samples ``num_generations`` completions of each prompt
   (:func:`lorafuse.train.rollout.generate`, LoRA unmerged, dropout off, its own seeded
   generator), one micro-batch of prompts at a time;
2. every reward scores every completion (:func:`lorafuse.train.rewards.score`: a reward that
   raises, returns the wrong number of values or NaN stops the run naming the reward and prompt);
   the group advantages follow (:func:`lorafuse.train.grpo.group_advantages`);
3. with ``num_iterations > 1`` the sampler's log-probs π_old, and with ``beta > 0`` the
   adapter-disabled reference's, are computed once without gradient (dropout off);
4. ``num_iterations`` optimizer steps reuse the batch; each runs the micro-batches of
   ``batch_size`` prompts' completions with the global normalisers, so accumulation is one big
   batch (:class:`lorafuse.train.grpo.GRPOObjective`).

A checkpoint stores the generator's state and, mid-way through a reused batch, the batch itself,
so a resume continues bit for bit. Logged per step (TRL's names): ``reward``, ``reward_std``,
``rewards/<name>/mean|std``, ``frac_reward_zero_std``, ``completions/mean_length``,
``completions/clipped_ratio``, ``clip_ratio/*``, ``kl`` (beta > 0), ``entropy`` (of the sampling
distributions), ``gen_tokens_per_s`` and ``gen_time_s``. Eval (``eval_data`` / ``eval_split``)
is the mean total reward of one greedy completion per held-out prompt (``eval_reward``).
"""

from __future__ import annotations

import dataclasses

import torch

from lorafuse.data.dataset import DataSpec, Prepared
from lorafuse.data.grpo import PromptRow, columns_of
from lorafuse.generation import eos_ids
from lorafuse.train.grpo import GRPOObjective, Sample, group_advantages, nanstd
from lorafuse.train.logprobs import peft_model
from lorafuse.train.loop import TrainingError
from lorafuse.train.rewards import combine, parse_reward, score
from lorafuse.train.rollout import RolloutParams, generate
from lorafuse.train.trainer import Trainer


class GRPOTrainer(Trainer):
    EVAL_KEY = "eval_reward"

    def build_data(self, spec: DataSpec) -> tuple[Prepared, GRPOObjective]:
        cfg = self.cfg
        if self.ctx.world_size > 1:
            raise TrainingError(f"{cfg.method} runs in one process for now (no --nproc / torchrun)")
        self.rewards = [parse_reward(spec_) for spec_ in cfg.reward]
        self.sampling = RolloutParams(cfg.max_completion_length, cfg.temperature, cfg.top_p,
                                      cfg.top_k)  # fmt: skip
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.buffer: list[Sample] | None = None
        self.batch_metrics: dict = {}
        self.batch_prompts = 0
        self.steps_per_batch = cfg.num_iterations
        return super().build_data(spec)  # prompts and GRPOObjective (lorafuse.train.recipes)

    # ---- checkpoint extras ---------------------------------------------------------------------
    def extra_state(self) -> dict:
        reused = self.buffer is not None and self.step % self.cfg.num_iterations != 0
        return {
            "grpo_generator": self.gen.get_state(),
            "grpo_buffer": [dataclasses.asdict(s) for s in self.buffer] if reused else None,
            "grpo_batch_metrics": self.batch_metrics if reused else {},
        }

    def restore_extra(self, state: dict) -> None:
        if "grpo_generator" not in state:
            raise TrainingError(f"{self.resume_path}: not a grpo checkpoint (no generator state)")
        self.gen.set_state(state["grpo_generator"])
        buffer = state["grpo_buffer"]
        self.buffer = None if buffer is None else [Sample(**s) for s in buffer]
        self.batch_metrics = state["grpo_batch_metrics"]

    # ---- one step ------------------------------------------------------------------------------
    def _sample(self, rows: list[PromptRow], params: RolloutParams, n: int, gen):
        """``n`` completions of each of ``rows``, dropout off, no gradient; each call decodes at
        most a micro-batch of completions (``batch_size × num_generations`` rows)."""
        model = peft_model(self.wrapped)
        eos = eos_ids(model, self.tokenizer)
        out, tokens, seconds, entropy = [], 0, 0.0, 0.0
        model.eval()
        try:
            per_call = max(1, self.cfg.batch_size * self.cfg.num_generations // n)
            for start in range(0, len(rows), per_call):
                chunk = [r.prompt_ids for r in rows[start : start + per_call]]
                ro = generate(model, chunk, n, params, gen, eos, self.tokenizer.pad_token_id)
                out += list(zip(ro.completions, ro.truncated))
                tokens, seconds, entropy = (tokens + ro.tokens, seconds + ro.seconds,
                                            entropy + ro.entropy_sum)  # fmt: skip
        finally:
            model.train()
        return out, tokens, seconds, entropy

    def _score(self, rows: list[PromptRow], completions: list[list[int]], n: int):
        """``(total (N,), per-reward values)`` of the completions (prompt-major, ``n`` each)."""
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        prompts = [r.prompt for r in rows for _ in range(n)]
        # as TRL: a chat prompt's completion is a list of (one) assistant message
        shown = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                 for p, t in zip(prompts, texts)]  # fmt: skip
        columns = columns_of(rows, n)
        columns["completion_ids"] = completions
        _, per = score(self.rewards, prompts, shown, columns)
        return combine(self.rewards, per), per

    def _logps(self, samples: list[Sample], reference: bool) -> None:
        model = peft_model(self.wrapped)
        model.eval()  # π_old / π_ref without dropout noise
        try:
            micro = self.cfg.batch_size * self.cfg.num_generations
            for start in range(0, len(samples), micro):
                chunk = samples[start : start + micro]
                for s, lp in zip(chunk, self.objective.logps(model, chunk, reference)):
                    if reference:
                        s.ref_logps = lp
                    else:
                        s.old_logps = lp
        finally:
            model.train()

    def needs_old_logps(self) -> bool:
        """π_old is scored apart only when a generation batch serves several steps."""
        return self.cfg.num_iterations > 1

    def advantages(self, total: torch.Tensor, samples: list[Sample]):
        """``(advantages (N,), zero-std flags (N,), extra batch metrics)`` of the rewards (N,)."""
        adv, zero = group_advantages(total, self.cfg.num_generations, self.cfg.scale_rewards)
        return adv, zero, {}

    def _new_batch(self) -> None:
        cfg, G = self.cfg, self.cfg.num_generations
        rows = [self.data.train[i] for i in self.next_rows()]
        sampled, tokens, seconds, entropy = self._sample(rows, self.sampling, G, self.gen)
        completions = [c for c, _ in sampled]
        total, per = self._score(rows, completions, G)
        self.buffer = [Sample(rows[i // G].prompt_ids, c, 0.0) for i, c in enumerate(completions)]
        if self.needs_old_logps():
            self._logps(self.buffer, reference=False)
        if cfg.beta:
            self._logps(self.buffer, reference=True)
        adv, zero, extra = self.advantages(total, self.buffer)
        for s, a in zip(self.buffer, adv.tolist()):
            s.advantage = a
        lengths = torch.tensor([float(len(c)) for c in completions])
        m = {"reward": float(torch.nanmean(total)), "reward_std": float(nanstd(total))}
        for r, values in zip(self.rewards, per):
            v = torch.tensor(values, dtype=torch.float32)
            m[f"rewards/{r.name}/mean"] = float(torch.nanmean(v))
            m[f"rewards/{r.name}/std"] = float(nanstd(v))
        m["frac_reward_zero_std"] = float(zero.float().mean())
        m["completions/mean_length"] = float(lengths.mean())
        m["completions/clipped_ratio"] = sum(t for _, t in sampled) / len(sampled)
        m["entropy"] = entropy / max(tokens, 1)
        m["gen_tokens_per_s"] = tokens / max(seconds, 1e-9)
        m["gen_time_s"] = seconds
        m.update(extra)
        self.batch_metrics = m
        self.batch_prompts = len(rows)

    def train_step(self) -> dict:
        fresh = self.buffer is None or self.step % self.cfg.num_iterations == 0
        if fresh:
            self._new_batch()
        return self.update_on(self.buffer, fresh)

    def update_on(self, samples: list, fresh: bool) -> dict:
        """One optimizer step over ``samples`` (micro-batches of ``batch_size`` prompts' groups,
        gradients accumulated under the whole set's counts); the step's log record."""
        cfg, obj = self.cfg, self.objective
        micro = cfg.batch_size * cfg.num_generations
        counts = obj.counts(samples)
        loss_sum = torch.zeros((), device=self.ctx.device)
        sums = 0.0
        for start in range(0, len(samples), micro):
            loss, s = obj.loss(self.wrapped, samples[start : start + micro], counts)
            loss.backward()
            loss_sum += loss.detach()
            sums = sums + s
        lr, grad_norm = self.apply_update(float(loss_sum))
        metrics = obj.metrics(sums, counts)
        metrics.update(self.batch_metrics)
        if not fresh:  # a reused batch: nothing was generated in this step
            metrics["gen_time_s"] = 0.0
        return {"loss": float(loss_sum), "lr": lr, "grad_norm": grad_norm,
                "tokens": sum(x.n_tokens for x in samples),
                "examples": max(1, len(samples) // cfg.num_generations),
                "metrics": metrics}  # fmt: skip

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean total reward of one greedy completion per eval prompt (None without eval data)."""
        rows = self.data.eval
        if not rows:
            return None
        greedy = RolloutParams(self.cfg.max_completion_length, 1.0, 1.0, top_k=1)
        sampled, *_ = self._sample(rows, greedy, 1, torch.Generator().manual_seed(0))
        total, _ = self._score(rows, [c for c, _ in sampled], 1)
        return float(torch.nanmean(total))

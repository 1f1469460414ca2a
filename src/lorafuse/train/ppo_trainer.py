"""``lorafuse train --method ppo``: GRPO's trainer (rollouts, rewards, checkpoints) with PPO's
rollout batch and minibatch steps (the equations: :mod:`lorafuse.train.ppo`).

Per rollout batch: sample, score (reward model and/or reward functions), π_old / π_ref log-probs
and old values without gradient, GAE targets, then ``num_ppo_epochs × num_mini_batches``
optimizer steps over seeded permutations. A checkpoint stores the generator and any batch in
flight, so a resume continues bit for bit. The steps and what is logged: docs/grpo.md.
"""

from __future__ import annotations

import dataclasses

import torch

from lorafuse.data.dataset import DataSpec, Prepared
from lorafuse.dtypes import parse_dtype
from lorafuse.train.grpo_trainer import GRPOTrainer
from lorafuse.train.loop import TrainingError
from lorafuse.train.ppo import Episode, PPOObjective, pad_rows, prefix_mask, rollout_targets
from lorafuse.train.reward_model import RewardModel
from lorafuse.train.rewards import RewardError


class PPOTrainer(GRPOTrainer):
    EVAL_KEY = "eval_reward"

    def build_data(self, spec: DataSpec) -> tuple[Prepared, PPOObjective]:
        out = super().build_data(spec)  # prompts, rewards, sampling, generator
        self.steps_per_batch = self.cfg.num_ppo_epochs * self.cfg.num_mini_batches
        self.perms: list[list[int]] = []
        self.reward_model: RewardModel | None = None
        return out

    def setup(self) -> None:
        super().setup()
        cfg = self.cfg
        if cfg.reward_model is not None:
            self.reward_model = RewardModel.load(cfg.reward_model, self.model, cfg.model,
                                                 self.tokenizer, parse_dtype(cfg.dtype),
                                                 self.ctx.device)  # fmt: skip
            where = "the policy's base" if self.reward_model.adapter else "its own base"
            self.say(f"reward model {cfg.reward_model} on {where}")

    # ---- checkpoint extras ---------------------------------------------------------------------
    def extra_state(self) -> dict:
        reused = self.buffer is not None and self.step % self.steps_per_batch != 0
        return {
            "ppo_generator": self.gen.get_state(),
            "ppo_buffer": [dataclasses.asdict(e) for e in self.buffer] if reused else None,
            "ppo_perms": self.perms if reused else [],
            "ppo_batch_metrics": self.batch_metrics if reused else {},
        }

    def restore_extra(self, state: dict) -> None:
        if "ppo_generator" not in state:
            raise TrainingError(f"{self.resume_path}: not a ppo checkpoint (no generator state)")
        self.gen.set_state(state["ppo_generator"])
        buffer = state["ppo_buffer"]
        self.buffer = None if buffer is None else [Episode(**e) for e in buffer]
        self.perms = [list(p) for p in state["ppo_perms"]]
        self.batch_metrics = state["ppo_batch_metrics"]

    # ---- the rollout batch ---------------------------------------------------------------------
    def _score(self, rows, completions: list[list[int]], n: int):
        """``(scores (N,), per-reward values)``: the reward functions' total plus the reward
        model's score (its values last in the list)."""
        total, per = torch.zeros(len(completions)), []
        if self.rewards:
            total, per = super()._score(rows, completions, n)
            missing = torch.isnan(total).nonzero()
            if len(missing):
                prompt = rows[int(missing[0]) // n].prompt
                raise RewardError(
                    f"ppo needs a score for every completion: no reward applies to the completion "
                    f"of prompt {str(prompt)[:80]!r}"
                )
        if self.reward_model is not None:
            prompts = [r.prompt_ids for r in rows for _ in range(n)]
            rm = self.reward_model.scores(prompts, completions, self.cfg.batch_size * n)
            total, per = total + rm, per + [rm.tolist()]
        return total, per

    def _forwards(self, episodes: list[Episode], C: int):
        """``(logps, ref_logps or None, values)`` (N, C) of π_old, π_ref and the old values, no
        gradient, dropout off, ``batch_size × num_generations`` episodes per forward."""
        obj, cfg = self.objective, self.cfg
        logps, refs, values = [], [], []
        self.wrapped.eval()
        try:
            micro = cfg.batch_size * cfg.num_generations
            for start in range(0, len(episodes), micro):
                chunk = episodes[start : start + micro]
                with torch.no_grad():
                    lp, v, _ = obj.forward(self.wrapped, chunk)
                for i, e in enumerate(chunk):
                    L = len(e.completion_ids)
                    logps.append(lp[i, :L])
                    values.append(v[i, : min(L + 1, C)])
                if cfg.beta:
                    ref, _, _ = obj.forward(self.wrapped, chunk, reference=True)
                    refs += [ref[i, : len(e.completion_ids)] for i, e in enumerate(chunk)]
        finally:
            self.wrapped.train()
        dev = self.ctx.device
        ref = pad_rows(refs, C, dev) if cfg.beta else None
        return pad_rows(logps, C, dev), ref, pad_rows(values, C, dev)

    def _new_batch(self) -> None:
        cfg, G = self.cfg, self.cfg.num_generations
        rows = [self.data.train[i] for i in self.next_rows()]
        sampled, tokens, seconds, entropy = self._sample(rows, self.sampling, G, self.gen)
        completions = [c for c, _ in sampled]
        no_eos = torch.tensor([float(t) for _, t in sampled])
        scores, per = self._score(rows, completions, G)
        if cfg.missing_eos_penalty is not None:
            scores = scores - cfg.missing_eos_penalty * no_eos
        episodes = [Episode(rows[i // G].prompt_ids, c) for i, c in enumerate(completions)]
        lengths = torch.tensor([len(c) for c in completions])
        C = int(lengths.max())
        logps, ref, values = self._forwards(episodes, C)
        dev = self.ctx.device
        lengths, scores = lengths.to(dev), scores.to(dev)
        t = rollout_targets(scores, logps, logps if ref is None else ref, values, lengths,
                            beta=cfg.beta, gamma=cfg.gamma, lam=cfg.lam,
                            estimator=cfg.kl_estimator, whiten_rewards=cfg.whiten_rewards)  # fmt: skip
        for i, e in enumerate(episodes):
            L, V = len(e.completion_ids), min(len(e.completion_ids) + 1, C)
            e.old_logps, e.values = logps[i, :L].cpu(), values[i, :V].cpu()
            e.advantages, e.returns = t.advantages[i, :L].cpu(), t.returns[i, :V].cpu()
        self.buffer = episodes
        self.perms = [torch.randperm(len(episodes), generator=self.gen).tolist()
                      for _ in range(cfg.num_ppo_epochs)]  # fmt: skip
        self.batch_metrics = self._batch_metrics(scores, per, t, logps, lengths, sampled,
                                                 (tokens, seconds, entropy))  # fmt: skip
        self.batch_prompts = len(rows)

    def _batch_metrics(self, scores, per, t, logps, lengths, sampled, gen) -> dict:
        cfg = self.cfg
        tokens, seconds, entropy = gen
        valid = prefix_mask(lengths, logps.shape[1])
        kl = t.kl.sum(1).mean()
        non_score = -cfg.beta * kl
        m = {"reward": float(scores.mean()), "objective/scores": float(scores.mean()),
             "objective/non_score_reward": float(non_score),
             "objective/rlhf_reward": float(non_score + scores.mean()),
             "objective/entropy": float((-logps * valid).sum(1).mean())}  # fmt: skip
        if cfg.beta:
            m["objective/kl"] = float(kl)
        names = [r.name for r in self.rewards] + (["reward_model"] if self.reward_model else [])
        for name, values in zip(names, per):
            m[f"rewards/{name}/mean"] = float(torch.nanmean(torch.tensor(values)))
        m["val/num_eos_tokens"] = sum(1 for _, trunc in sampled if not trunc)
        m["completions/mean_length"] = float(lengths.float().mean())
        m["completions/clipped_ratio"] = sum(tr for _, tr in sampled) / len(sampled)
        m["entropy"] = entropy / max(tokens, 1)
        m["gen_tokens_per_s"] = tokens / max(seconds, 1e-9)
        m["gen_time_s"] = seconds
        return m

    # ---- one step: one minibatch ---------------------------------------------------------------
    def minibatch(self, k: int) -> list[Episode]:
        """The episodes of step ``k`` (0-based) of the current rollout batch."""
        epoch, part = divmod(k, self.cfg.num_mini_batches)
        perm, parts = self.perms[epoch], self.cfg.num_mini_batches
        n = len(perm)
        return [self.buffer[i] for i in perm[part * n // parts : (part + 1) * n // parts]]

    def train_step(self) -> dict:
        k = self.step % self.steps_per_batch
        fresh = self.buffer is None or k == 0
        if fresh:
            self._new_batch()
        return self.update_on(self.minibatch(k), fresh)

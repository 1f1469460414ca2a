"""``lorafuse train --method distill``: the engine's step on the data's completions, or, for a
``lmbda`` fraction of the steps, on completions the student samples itself (on-policy, as TRL's
``DistillationTrainer`` does every step and its GKD trainer with probability ``lmbda``).

Per step a draw from the trainer's own seeded generator decides (``lmbda`` 0: never, 1: always).
On an on-policy step each row's prompt (its tokens before the first completion token) gets one
completion from :func:`lorafuse.train.rollout.generate` (LoRA unmerged, dropout off, the same
generator; ``temperature``, ``top_p``, ``top_k``, at most ``max_completion_length`` tokens, the
EOS kept as TRL keeps it; cut to ``max_seq_length``), and the step runs on those rows. The
generator's state is in every checkpoint, so a resume continues bit for bit. Logged per step:
``on_policy`` (0 / 1) and, on on-policy steps, ``completions/mean_length``, ``gen_tokens_per_s``.
"""

from __future__ import annotations

import torch

from lorafuse.data.dataset import DataSpec, Prepared
from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.data.packing import Row
from lorafuse.generation import eos_ids
from lorafuse.train.logprobs import peft_model
from lorafuse.train.loop import TrainingError
from lorafuse.train.rollout import RolloutParams, generate
from lorafuse.train.trainer import Trainer


def prompt_of(row: Row) -> list[int]:
    """The tokens of ``row`` before its first completion (target) token."""
    first = next(i for i, t in enumerate(row.labels) if t != IGNORE_INDEX)
    return row.input_ids[:first]


def completion_row(prompt: list[int], completion: list[int], max_len: int) -> Row:
    """A row of ``prompt + completion`` (cut to ``max_len``), labels on the completion only."""
    ids = (prompt + completion)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt) + completion)[:max_len]
    return Row(ids, labels, list(range(len(ids))), 1)


class DistillTrainer(Trainer):
    def build_data(self, spec: DataSpec) -> tuple[Prepared, object]:
        cfg = self.cfg
        if self.ctx.world_size > 1:
            raise TrainingError("distill runs in one process for now (no --nproc / torchrun)")
        self.sampling = RolloutParams(cfg.max_completion_length, cfg.temperature, cfg.top_p,
                                      cfg.top_k)  # fmt: skip
        self.gen = torch.Generator().manual_seed(cfg.seed)
        return super().build_data(spec)  # rows and DistillObjective (lorafuse.train.recipes)

    def extra_state(self) -> dict:
        return {"distill_generator": self.gen.get_state()}

    def restore_extra(self, state: dict) -> None:
        if "distill_generator" not in state:
            raise TrainingError(f"{self.resume_path}: not a distill checkpoint (no generator)")
        self.gen.set_state(state["distill_generator"])

    def _on_policy(self, rows: list[Row]) -> tuple[list[Row], dict]:
        """``rows`` with their completions sampled by the student; generation metrics."""
        model = peft_model(self.wrapped)
        eos = eos_ids(model, self.tokenizer)
        prompts = [prompt_of(r) for r in rows]
        out, tokens, seconds = [], 0, 0.0
        model.eval()
        try:
            for start in range(0, len(prompts), self.cfg.batch_size):
                chunk = prompts[start : start + self.cfg.batch_size]
                ro = generate(model, chunk, 1, self.sampling, self.gen, eos,
                              self.tokenizer.pad_token_id)  # fmt: skip
                out += ro.completions
                tokens, seconds = tokens + ro.tokens, seconds + ro.seconds
        finally:
            model.train()
        new = [completion_row(p, c, self.cfg.max_seq_length) for p, c in zip(prompts, out)]
        lengths = [len(c) for c in out]
        return new, {"completions/mean_length": sum(lengths) / max(len(lengths), 1),
                     "gen_tokens_per_s": tokens / max(seconds, 1e-9)}  # fmt: skip

    def train_step(self) -> dict:
        idx = self.next_rows()
        lmbda = self.cfg.lmbda
        on_policy = lmbda > 0 and float(torch.rand((), generator=self.gen)) < lmbda
        if not on_policy:
            figures = self.step_on(idx, self.data.train)
            figures["metrics"]["on_policy"] = 0.0
            return figures
        rows, extra = self._on_policy([self.data.train[i] for i in idx])
        figures = self.step_on(list(range(len(rows))), rows)
        figures["metrics"].update(extra, on_policy=1.0)
        return figures

"""PPO (Schulman et al. 2017; Ouyang et al. 2022) on the fused engine, with the equations of TRL's
last ``PPOTrainer`` (``trl/experimental/ppo/ppo_trainer.py``).

Policy and value share one base with its LoRA adapters (``value_head: Linear(H, 1)``, fp32, on
the final hidden states); the reference is the adapters disabled. A rollout batch of N episodes
lies on a grid of C = max length columns: KL-penalised rewards, GAE, whitened advantages; each
minibatch's clipped policy and value losses divide by its own token counts. The equations:
docs/grpo.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorafuse.train.grpo import collate_samples, hidden_logps
from lorafuse.train.logprobs import final_hidden, head_and_decoder, peft_model
from lorafuse.train.objective import Objective, ObjectiveError
from lorafuse.train.options import KL_ESTIMATORS

VALUE_HEAD = "value_head"
# per-minibatch metric sums, in this order (TRL's names; divided by token counts in metrics())
SUMS = ("loss/policy", "loss/value", "policy/clipfrac", "val/clipfrac", "policy/approxkl",
        "val/ratio")  # fmt: skip


class PPOError(ObjectiveError):
    """The model cannot be trained with PPO (the message says why)."""


@dataclass
class Episode:
    """One completion of a prompt and what its loss needs (old log-probs and values, targets)."""

    prompt_ids: list[int]
    completion_ids: list[int]  # L >= 1 tokens, EOS last when the model stopped
    old_logps: torch.Tensor | None = None  # (L,) π_old
    values: torch.Tensor | None = None  # (V,) old values, V = min(L + 1, C)
    advantages: torch.Tensor | None = None  # (L,) whitened
    returns: torch.Tensor | None = None  # (V,)
    n_examples: int = 1

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


# ---- the value head -----------------------------------------------------------------------------
def attach_value_head(model) -> None:
    """Give the PEFT ``model``'s base a trainable fp32 ``value_head`` (normal init with the model's
    ``initializer_range``, as transformers' score heads)."""
    base = peft_model(model).get_base_model()
    if hasattr(base, VALUE_HEAD):
        raise PPOError(f"ppo: the model already has a module named {VALUE_HEAD!r}")
    text = base.config.get_text_config()
    device = base.get_input_embeddings().weight.device
    head = torch.nn.Linear(text.hidden_size, 1, bias=False, device=device, dtype=torch.float32)
    torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
    base.add_module(VALUE_HEAD, head)


def value_head(model) -> torch.nn.Linear:
    head = getattr(peft_model(model).get_base_model(), VALUE_HEAD, None)
    if head is None:
        raise PPOError("ppo: the model has no value head (attach_value_head first)")
    return head


# ---- the rollout batch's targets ------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` over ``mask`` (Bessel-corrected var); with
    ``shift_mean=False`` the mean is added back."""
    n = mask.sum()
    if n < 2:
        raise PPOError("ppo: whitening needs at least two tokens in the rollout batch")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def token_kl(logps, ref_logps, mask, estimator: str = "k1") -> torch.Tensor:
    """(N, C) per-token KL estimate of π_old to π_ref, 0 off ``mask``."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator {estimator!r} is not one of {KL_ESTIMATORS}")
    log_r = (ref_logps - logps) * mask
    return -log_r if estimator == "k1" else torch.expm1(log_r) - log_r


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    """``(advantages, returns)`` (N, C) by generalized advantage estimation (V = 0 past the grid)."""
    C = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    out = [None] * C
    for t in reversed(range(C)):
        nxt = values[:, t + 1] if t < C - 1 else 0.0
        last = rewards[:, t] + gamma * nxt - values[:, t] + gamma * lam * last
        out[t] = last
    adv = torch.stack(out, 1)
    return adv, adv + values


def prefix_mask(lengths: torch.Tensor, C: int) -> torch.Tensor:
    """(N, C) float mask of the first ``lengths[i]`` columns of each row."""
    return (torch.arange(C, device=lengths.device)[None] < lengths[:, None]).float()


def grid_masks(lengths: torch.Tensor, C: int):
    """``(valid, value_valid)`` (N, C) float masks of episodes of ``lengths`` (N,): ``t < L`` and
    ``t <= L`` (within the grid)."""
    return prefix_mask(lengths, C), prefix_mask(lengths + 1, C)


@dataclass
class Targets:
    """A rollout batch's per-token figures on its (N, C) grid."""

    kl: torch.Tensor
    rewards: torch.Tensor  # after the score and the optional whitening
    advantages: torch.Tensor  # whitened, 0 off the valid tokens
    returns: torch.Tensor


def rollout_targets(scores, logps, ref_logps, values, lengths, *, beta: float, gamma: float,
                    lam: float, estimator: str = "k1", whiten_rewards: bool = False) -> Targets:  # fmt: skip
    """The targets of a rollout batch: ``scores`` (N,), ``logps`` / ``ref_logps`` (N, C) of π_old and
    π_ref, old ``values`` (N, C), ``lengths`` (N,) with ``1 <= L <= C`` (docs/grpo.md)."""
    N, C = logps.shape
    valid, vvalid = grid_masks(lengths, C)
    values = values * vvalid
    kl = token_kl(logps, ref_logps, valid, estimator)
    rewards = -beta * kl
    end = torch.where(lengths < C, lengths, lengths - 1)  # the state after the last token
    rewards = rewards.index_put((torch.arange(N, device=end.device), end), scores, accumulate=True)
    if whiten_rewards:
        rewards = masked_whiten(rewards, vvalid, shift_mean=False) * vvalid
    adv, returns = gae(rewards, values, gamma, lam)
    adv = masked_whiten(adv, valid) * valid
    return Targets(kl, rewards, adv, returns)


# ---- the losses -----------------------------------------------------------------------------------
def ppo_token_losses(logps, old_logps, advantages, vpred, old_values, returns, *,
                     cliprange: float, cliprange_value: float):  # fmt: skip
    """``(policy (B, C), value (B, C'), policy clipped (B, C) bool, value clipped (B, C') bool)``:
    TRL's clipped surrogate and clipped value losses per token, before masking and means."""
    ratio = torch.exp(logps - old_logps)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    vclipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf1 = (vpred - returns) ** 2
    vf2 = (vclipped - returns) ** 2
    return torch.max(pg1, pg2), 0.5 * torch.max(vf1, vf2), pg2 > pg1, vf2 > vf1


def pad_rows(values: list[torch.Tensor], C: int, device) -> torch.Tensor:
    """Per-episode (c,) tensors -> (B, C) fp32, zero-padded."""
    out = torch.zeros((len(values), C), dtype=torch.float32, device=device)
    for i, v in enumerate(values):
        out[i, : v.numel()] = v.to(device)
    return out


@dataclass
class PPOObjective(Objective):
    """PPO for the engine: the shared policy / value forward, minibatch normalisers, metrics."""

    cliprange: float
    cliprange_value: float
    vf_coef: float
    temperature: float
    pad_id: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def from_config(cls, cfg, pad_id: int, device) -> PPOObjective:
        return cls(cfg.epsilon, cfg.cliprange_value, cfg.vf_coef, cfg.temperature, pad_id, device)

    def check(self, model) -> None:
        head_and_decoder(model)
        if not hasattr(peft_model(model), "disable_adapter"):
            raise PPOError("ppo needs a PEFT model: the reference is the adapter disabled")
        attach_value_head(model)

    def tokens(self, episode: Episode) -> int:
        return episode.n_tokens

    def counts(self, episodes: list[Episode]) -> torch.Tensor:
        """``[valid tokens, value-valid tokens]`` of the real episodes (a minibatch's)."""
        real = [e for e in episodes if e.n_examples]
        return torch.tensor([float(sum(len(e.completion_ids) for e in real)),
                             float(sum(e.values.numel() for e in real))], device=self.device)  # fmt: skip

    def forward(self, model, episodes: list[Episode], reference: bool = False):
        """``(logps (B, C), values (B, C + 1), batch)`` of one forward of ``model`` (values None for
        the reference, which runs with the adapter disabled and no gradient)."""
        batch = collate_samples(episodes, self.pad_id, self.device)
        if reference:
            with torch.no_grad(), peft_model(model).disable_adapter():
                hidden, head = final_hidden(model, batch["input_ids"], batch["attention_mask"])
                return hidden_logps(hidden, head, batch, self.temperature), None, batch
        hidden, head = final_hidden(model, batch["input_ids"], batch["attention_mask"])
        logps = hidden_logps(hidden, head, batch, self.temperature)
        C = batch["completion_ids"].shape[1]
        P = batch["input_ids"].shape[1] - C
        # the value of each state: before completion token t (t < C) and after the last (t = C)
        h = hidden[:, P - 1 : P + C]  # (B, C + 1, H)
        values = value_head(model)(h.float()).squeeze(-1)  # (B, C + 1)
        return logps, values, batch

    def loss(self, model, episodes: list[Episode], counts: torch.Tensor):
        """``(loss, metric sums)`` of one micro-batch under its minibatch's ``counts``."""
        logps, vpred, batch = self.forward(model, episodes)
        B, C = logps.shape
        real = torch.tensor([float(e.n_examples > 0) for e in episodes], device=self.device)
        lengths = torch.tensor([len(e.completion_ids) for e in episodes], device=self.device)
        v_lengths = torch.tensor([e.values.numel() for e in episodes], device=self.device)
        Cv = int(v_lengths.max())  # <= C + 1
        valid = prefix_mask(lengths, C) * real[:, None]  # (B, C)
        vvalid = prefix_mask(v_lengths, Cv) * real[:, None]  # (B, Cv)
        vpred = vpred[:, :Cv]
        old = pad_rows([e.old_logps for e in episodes], C, self.device)
        adv = pad_rows([e.advantages for e in episodes], C, self.device)
        old_v = pad_rows([e.values for e in episodes], Cv, self.device)
        ret = pad_rows([e.returns for e in episodes], Cv, self.device)
        pg, vf, pg_clip, vf_clip = ppo_token_losses(
            logps, old, adv, vpred, old_v, ret, cliprange=self.cliprange,
            cliprange_value=self.cliprange_value,
        )  # fmt: skip
        pg_sum, vf_sum = (pg * valid).sum(), (vf * vvalid).sum()
        loss = pg_sum / counts[0] + self.vf_coef * vf_sum / counts[1]
        diff = (logps - old).detach()
        self.batch_shape = tuple(batch["input_ids"].shape)
        sums = torch.stack([pg_sum.detach(), vf_sum.detach(), (pg_clip.float() * valid).sum(),
                            (vf_clip.float() * vvalid).sum(), (0.5 * diff**2 * valid).sum(),
                            (diff.exp() * valid).sum()])  # fmt: skip
        return loss, sums

    def metrics(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        """Minibatch sums -> token means (value figures over the value-valid tokens)."""
        n, nv = max(float(counts[0]), 1.0), max(float(counts[1]), 1.0)
        per = (n, nv, n, nv, n, n)
        return {k: float(v) / d for k, v, d in zip(SUMS, sums.tolist(), per)}

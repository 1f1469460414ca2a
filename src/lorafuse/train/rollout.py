"""GRPO rollouts: ``n`` sampled completions per prompt from the policy itself (LoRA unmerged).

No second engine and no weight sync: the training model decodes with its KV cache, as
:func:`lorafuse.generation.stream_generate` does, but for a batch of rows at once. The prompts of
a call are left-padded into one prefill (positions counted from each row's first real token);
the cache is then repeated ``n`` times per prompt (the hybrids' conv and recurrent states too:
:func:`~lorafuse.patching.mixer_cache.repeat_rows`), so a prompt is
prefilled once for its whole group. Each step samples one token per row (temperature, then top-k,
then top-p, as ``chat``) from a caller-owned ``torch.Generator``: the generation stream is
independent of the global RNG and can be saved in a checkpoint. A row stops at an EOS token
(kept in its completion, as TRL keeps it) or at ``max_new_tokens``; finished rows keep decoding
padding, masked out, until every row is done.

The entropy of each sampling distribution (after the temperature, before top-k / top-p) is
summed for the log: it costs nothing here since the step's logits exist anyway.

Where the decode engine runs the policy (:mod:`lorafuse.decode`, ``engine="auto"``), each prompt
is prefilled once into its own KV block and forked ``n`` times, every step is one engine call
for the rows still running (a row that ends leaves the batch), and the policy's LoRA is applied
unmerged from its live parameters (what the optimizer wrote is what the next rollout samples
from). Elsewhere the model's forward runs as above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lorafuse import decode
from lorafuse.errors import LorafuseError
from lorafuse.generation import CACHE_KW, resolve_engine, top_k_top_p
from lorafuse.patching.mixer_cache import repeat_rows


@dataclass
class RolloutParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self) -> None:
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise LorafuseError(
                "grpo sampling needs temperature > 0, 0 < top_p <= 1, top_k >= 0 (got "
                f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k})"
            )
        if self.max_new_tokens < 1:
            raise LorafuseError(f"max_completion_length must be >= 1, got {self.max_new_tokens}")


@dataclass
class Rollout:
    completions: list[list[int]]  # prompt-major: the n completions of prompt 0, then prompt 1...
    truncated: list[bool]  # hit max_new_tokens without EOS
    entropy_sum: float  # over every sampled completion token
    tokens: int  # completion tokens sampled
    seconds: float


def sample_rows(logits: torch.Tensor, params: RolloutParams, gen: torch.Generator):
    """``(tokens (R,), entropies (R,))`` from fp32 logits (R, V)."""
    logits = logits.float() / params.temperature
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)  # (R,)
    logits = top_k_top_p(logits, params.top_k, params.top_p)  # (R, V)
    probs = torch.softmax(logits, -1).cpu()  # the generator lives on the CPU
    return torch.multinomial(probs, 1, generator=gen).squeeze(1).to(logits.device), entropy


def _prefill_inputs(prompts: list[list[int]], pad_id: int, device):
    """Left-padded ids, mask and positions (B, P)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P): each row counts from its first token
    return ids.to(device), mask.to(device), pos.to(device)


@torch.no_grad()
def generate(model, prompts: list[list[int]], n: int, params: RolloutParams,
             gen: torch.Generator, eos: set[int], pad_id: int,
             engine="auto") -> Rollout:  # fmt: skip
    """``n`` completions of each prompt (token ids), sampled by ``model`` with its KV cache
    (``engine``: as :func:`lorafuse.generation.stream_generate` takes it)."""
    eng = resolve_engine(model, engine)
    if eng is not None:
        return _generate_on_engine(eng, model, prompts, n, params, gen, eos)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    ids, mask, pos = _prefill_inputs(prompts, pad_id, device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                logits_to_keep=1)  # fmt: skip
    cache = getattr(out, CACHE_KW)
    repeat_rows(cache, n)  # (B*n rows): each prompt's group shares its prefill
    logits = out.logits[:, -1].repeat_interleave(n, dim=0)  # (B*n, V)
    mask = mask.repeat_interleave(n, dim=0)  # (B*n, P)
    pos = pos[:, -1:].repeat_interleave(n, dim=0)  # (B*n, 1)
    rows = logits.shape[0]
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    steps, entropy_sum, tokens = [], 0.0, 0
    for _ in range(params.max_new_tokens):
        token, entropy = sample_rows(logits, params, gen)
        live = ~done
        entropy_sum += float(entropy[live].sum())
        tokens += int(live.sum())
        token = torch.where(done, pad_id, token)
        steps.append(torch.where(done, -1, token))  # -1: after the row's end
        done = done | torch.isin(token, eos_t)
        if bool(done.all()) or len(steps) == params.max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], 1)
        pos = pos + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=pos,
                    use_cache=True, logits_to_keep=1, **{CACHE_KW: cache})  # fmt: skip
        cache = getattr(out, CACHE_KW)
        logits = out.logits[:, -1]
    table = torch.stack(steps, 1).tolist()  # (B*n, steps)
    completions = [[t for t in row if t >= 0] for row in table]
    truncated = [not c or c[-1] not in eos for c in completions]
    return Rollout(completions, truncated, entropy_sum, tokens, time.perf_counter() - t0)


def _generate_on_engine(engine, model, prompts, n: int, params: RolloutParams,
                        gen: torch.Generator, eos: set[int]) -> Rollout:  # fmt: skip
    """:func:`generate` on the decode engine: one prefill per prompt, forked ``n`` times."""
    t0 = time.perf_counter()
    adapter, seqs, first = decode.active_adapter(model), [], []
    for p in prompts:
        seq = engine.open(adapter, len(p) + params.max_new_tokens)
        logits = engine.prefill(seq, p)
        seqs += [engine.fork(seq, len(p) + params.max_new_tokens) for _ in range(n - 1)] + [seq]
        first += [logits] * n
    logits, live = torch.stack(first), list(range(len(seqs)))  # (B*n, V)
    completions: list[list[int]] = [[] for _ in seqs]
    entropy_sum, tokens = 0.0, 0
    try:
        for step in range(params.max_new_tokens):
            token, entropy = sample_rows(logits, params, gen)
            entropy_sum += float(entropy.sum())
            tokens += len(live)
            for r, t in zip(live, token.tolist()):
                completions[r].append(t)
            live = [r for r in live if completions[r][-1] not in eos]
            if not live or step == params.max_new_tokens - 1:
                break
            logits = engine.step([seqs[r] for r in live], [completions[r][-1] for r in live])
    finally:
        for seq in seqs:
            engine.close(seq)
    truncated = [not c or c[-1] not in eos for c in completions]
    return Rollout(completions, truncated, entropy_sum, tokens, time.perf_counter() - t0)

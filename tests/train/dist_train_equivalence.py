"""Self-contained data-parallel LoRA training on a tiny Llama, for the distributed tests.

Run it directly (1 process) or under ``torchrun --nproc-per-node N``; it uses only
:mod:`lorafuse.train.distributed`, so the 1-rank and N-rank runs must agree:

* the same global batch every step (same seed and order on every rank), each rank keeping its
  strided share (``shard_rows``), padded with zero-weight rows to ``rows_per_rank``;
* micro-batches of ``--micro-batch`` rows with gradient accumulation (``no_grad_sync``);
* the loss normalised by the GLOBAL target-token count, times ``loss_scale``.

Writes ``<out>/losses.json`` (global loss per step + run facts) and ``<out>/adapter/`` (a PEFT
adapter dir saved through ``save_pretrained(state_dict=trainable_state_dict(...))``).
``--save-at K`` also writes ``<out>/ckpt.pt`` after step K (adapter + optimizer state + data
position in global rows); ``--resume <ckpt.pt>`` continues from it at any world size.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lorafuse.testing import tiny_llama_config
from lorafuse.train import distributed as D

N_ROWS = 48
VOCAB = 128


def make_rows(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Variable-length rows (input_ids, labels); a prompt prefix is masked with -100 so ranks
    hold different numbers of target tokens (tests the global-token normalisation)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(N_ROWS):
        length = int(torch.randint(5, 20, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, length - 2, (1,), generator=g))] = -100
        rows.append((ids, labels))
    return rows


def collate(rows, device):
    """Right-pad to the longest row: (B, T) ids / labels (-100 on pads) / attention mask."""
    t = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = x, y, 1
    return ids.to(device), labels.to(device), mask.to(device)


def build_model(args, ctx):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)  # same base + LoRA init on every rank
    model = LlamaForCausalLM(tiny_llama_config()).float()
    if args.load_in_4bit:  # NF4 base: packed weights are buffers, not parameters
        from lorafuse.models.nf4 import quantize_model_

        quantize_model_(model, torch.float32, skip=(model.get_output_embeddings(),))
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    model = get_peft_model(model, cfg).to(ctx.device)
    report = "unpatched"
    if args.patch != "no":
        try:
            from lorafuse import patch_peft_model
        except (ImportError, AttributeError) as err:
            if args.patch == "yes":
                raise
            report = f"unpatched (patching unavailable: {err})"
        else:
            patch_peft_model(model)
            report = str(getattr(model, "lorafuse_report", "patched"))
    return model, report


def micro_batches(global_rows, ctx, micro):
    """This rank's share of the global batch in micro-batches; every rank gets the same number.
    A short rank pads with zero-weight rows (labels all -100: no loss, no tokens)."""
    mine = [global_rows[i] for i in D.shard_rows(len(global_rows), ctx)]
    want = D.rows_per_rank(len(global_rows), ctx)
    pad_ids = global_rows[0][0]
    mine += [(pad_ids, torch.full_like(pad_ids, -100))] * (want - len(mine))
    return [mine[i : i + micro] for i in range(0, want, micro)]


def train_step(model, opt, global_rows, ctx, args) -> tuple[float, int]:
    """One optimizer step over one global batch; returns (global mean token loss, tokens)."""
    batches = [collate(mb, ctx.device) for mb in micro_batches(global_rows, ctx, args.micro_batch)]
    local_tokens = sum(int((y[:, 1:] != -100).sum()) for _, y, _ in batches)
    global_tokens = D.all_reduce_sum(local_tokens, ctx)
    loss_sum = 0.0
    for i, (ids, labels, mask) in enumerate(batches):
        with D.no_grad_sync(model, ctx, skip=i < len(batches) - 1):
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            s = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100, reduction="sum",
            )  # fmt: skip
            (s / global_tokens * D.loss_scale(ctx)).backward()
            loss_sum += float(s.detach())
    if args.dump_grads and not args._dumped:  # the first step's global gradient, unsharded
        grads = D.trainable_state_dict(model, ctx, grads=True)
        if D.is_main(ctx):
            torch.save(grads, Path(args.out) / "grads0.pt")
        args._dumped = True
    opt.step()
    opt.zero_grad(set_to_none=True)
    return D.all_reduce_sum(loss_sum, ctx) / global_tokens, local_tokens


def held_bytes(model) -> dict[str, int]:
    """Bytes this rank holds for parameters (FSDP: its local shards) and buffers (NF4 packs)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    return {"param_bytes": params, "buffer_bytes": sum(b.nbytes for b in model.buffers())}


def save_checkpoint(path: Path, model, opt, ctx, step: int, rows_consumed: int) -> None:
    state = {
        "adapter": D.trainable_state_dict(model, ctx),  # collective under FSDP: every rank
        "optimizer": D.optimizer_state_dict(model, opt, ctx),
        "step": step,
        "rows_consumed": rows_consumed,  # data position in GLOBAL rows: independent of W
        "world_size": ctx.world_size,
    }
    if D.is_main(ctx):
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    D.barrier(ctx)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--patch", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--dump-grads", action="store_true")
    p.add_argument("--load-in-4bit", action="store_true")
    args = p.parse_args()
    args._dumped = False
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ctx = D.setup(args.strategy)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, report = build_model(args, ctx)
    start, ckpt = 0, None
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=True)
        missing = model.load_state_dict(ckpt["adapter"], strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys
        assert ckpt["rows_consumed"] % args.global_batch == 0, "global batch changed on resume"
        start = ckpt["rows_consumed"] // args.global_batch
    model = D.wrap_model(model, ctx)
    held = held_bytes(model)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr,
                            weight_decay=0.0, eps=1e-6)  # fmt: skip
    if ckpt is not None:
        D.load_optimizer_state_dict(model, opt, ckpt["optimizer"], ctx)
    rows = make_rows(args.seed)
    order = torch.randperm(N_ROWS, generator=torch.Generator().manual_seed(args.seed)).tolist()
    losses, tokens, t0 = [], 0, time.perf_counter()
    for step in range(start, args.steps):
        b = args.global_batch
        batch = [rows[order[(step * b + j) % N_ROWS]] for j in range(b)]
        loss, n = train_step(model, opt, batch, ctx, args)
        losses.append(loss)
        tokens += n
        if args.save_at and step + 1 == args.save_at:
            save_checkpoint(out / "ckpt.pt", model, opt, ctx, step + 1, (step + 1) * b)
    per_rank, total = D.throughput(tokens, time.perf_counter() - t0, ctx)
    adapter = D.trainable_state_dict(model, ctx)
    if D.is_main(ctx):
        D.unwrap_model(model).save_pretrained(str(out / "adapter"), state_dict=adapter)
        facts = {"losses": losses, "start_step": start, "world_size": ctx.world_size,
                 "strategy": ctx.strategy, "patch": report, "tokens_per_s_rank0": per_rank,
                 "tokens_per_s_total": total, **held}  # fmt: skip
        (out / "losses.json").write_text(json.dumps(facts, indent=1))
        print(f"world {ctx.world_size} {ctx.strategy}: losses {losses}; tok/s rank0 "
              f"{per_rank:.0f} total {total:.0f}; {report}")  # fmt: skip
    D.cleanup(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

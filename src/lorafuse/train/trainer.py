"""The LLM trainer: one run's state, its setup and its step (:class:`Trainer`). The loop around
the step is :mod:`lorafuse.train.loop`'s; :func:`lorafuse.train.engine.train` runs it.

One optimizer step consumes a *global* batch of ``G = batch_size * grad_accum * world_size`` rows
(taken in order from the epoch's seeded permutation of the rows), split into ``grad_accum``
micro-batches of ``batch_size * world_size`` rows, of which each rank runs its share
(``distributed.shard_rows``; short ranks add zero-weight padding rows so every rank runs the same
passes). The loss of every micro-batch is ``sum(token losses) / N`` with ``N`` the number of target
tokens in the *whole* global batch (all micro-batches, all ranks; ``num_items_in_batch`` of
transformers' loss; the other objectives divide by their own global counts,
:mod:`lorafuse.train.objective`), times ``loss_scale`` (= world size, undoing DDP's gradient
averaging). So k accumulated micro-batches give exactly the gradient of one big batch, and W
ranks that of one rank.

The data position is ``(epoch, row offset)``: with the optimizer, scheduler, RNG states and exact
adapter weights it is all a checkpoint needs for a bit-for-bit resume.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

import torch

from lorafuse.data.dataset import DataSpec, Prepared
from lorafuse.data.read_options import parse_columns
from lorafuse.models import memory
from lorafuse.models.attach import announce
from lorafuse.models.capabilities import packing_supported
from lorafuse.models.fast_model import apply_heap_policy
from lorafuse.patching import moe
from lorafuse.train import checkpoint as ckpt
from lorafuse.train import distributed as dist
from lorafuse.train import eva
from lorafuse.train.data_order import Position, epoch_order, micro_batches, seed_everything
from lorafuse.train.loop import Cadence, Runner, Totals, TrainingError
from lorafuse.train.model import add_lora, load_for_training
from lorafuse.train.optim import build_optimizer, build_scheduler
from lorafuse.train.options import MUTATING_INITS, init_kind

if TYPE_CHECKING:  # not imported at run time: the config imports the registry, which loads us
    from lorafuse.train.config import TrainConfig

STATE_VERSION = 1
INITIAL_ADAPTER = "initial_adapter"  # PiSSA / OLoRA: the adapter before training (output_dir)


class Trainer(Runner):
    """Holds the state of one run; :meth:`run` is the shared loop (:mod:`lorafuse.train.loop`).
    Use :func:`train`.

    Hooks for objectives whose step is not a pass over stored rows (GRPO samples its own
    completions, :mod:`lorafuse.train.grpo_trainer`): :meth:`build_data`, :meth:`train_step`
    (with :meth:`next_rows` and :meth:`apply_update`), :meth:`evaluate`, :meth:`extra_state` /
    :meth:`restore_extra` (saved in the checkpoint), ``steps_per_batch`` (optimizer steps per
    global batch of rows) and ``EVAL_KEY``.
    """

    EVAL_KEY = "eval_loss"
    NONFINITE_ADVICE = (
        "Try a lower lr, max_grad_norm > 0, dtype float32, or check the data around this step."
    )
    steps_per_batch = 1

    def __init__(self, cfg: TrainConfig, ctx: dist.DistContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.recipe = cfg.recipe  # the method's entry (lorafuse.train.recipes)
        self.main = dist.is_main(ctx)
        self.last_checkpoint: str | None = None
        self.resume_path: str | None = None  # the checkpoint this run resumed from
        self._order: list[int] = []  # the current epoch's row order (next_rows)
        self._order_epoch: int | None = None

    # ---- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        seed_everything(cfg.seed)
        base, self.tokenizer, self.processor = load_for_training(
            cfg, ctx.device
        )  # processor: a VLM
        packed = cfg.packing and self.recipe.packs  # e.g. preference rows are pairs, never packed
        if self.processor is not None:
            if not self.recipe.vision:
                raise TrainingError(
                    f"method={cfg.method}: vision-language models cannot train with it (its rows "
                    "hold no images)"
                )
            if packed:
                self.say("packing off: vision-language rows hold one conversation each")
            packed = False
        if packed:
            ok, why = packing_supported(base)
            if not ok:
                self.say(f"packing off: {why}; rows hold one example each (padded)")
                packed = False
        self.packed = packed
        self.cfg = cfg = self._choose_checkpointing(base, ctx.device)
        spec = DataSpec(
            train_files=list(cfg.data), eval_files=list(cfg.eval_data), eval_split=cfg.eval_split,
            data_format=cfg.data_format, max_seq_length=cfg.max_seq_length,
            train_on_inputs=cfg.train_on_inputs, packing=packed, too_long=cfg.too_long,
            skip_bad_records=cfg.skip_bad_records, seed=cfg.seed, data_split=cfg.data_split,
            eval_data_split=cfg.eval_data_split, data_subset=cfg.data_subset,
            data_columns=parse_columns(cfg.data_columns), think_tokens=cfg.think_tokens,
        )  # fmt: skip
        self.data, self.objective = self.build_data(spec)
        self._report_data()
        self.model, report = add_lora(cfg, base, self.processor)
        if report is not None:  # fused: this run owns the process's heap; execute() reverts it
            if ctx.device.type == "cpu":
                self.heap_policy = apply_heap_policy(report)
            announce(self.model, report)
        for line in moe.lora_summary(self.model):  # mixture of experts: what carries LoRA
            self.say(line)
        if cfg.init_lora_weights == "eva":
            eva.initialize(self.model, self.data.train, self.tokenizer.pad_token_id, packed,
                           cfg.batch_size, ctx.device)  # fmt: skip
        self.initial_adapter = self._save_initial_adapter()
        self.objective.check(self.model)
        state = self._load_start_state()
        self.model.train()
        self.wrapped = dist.wrap_model(self.model, ctx)
        if cfg.compile:  # in place: same module object, state_dict keys and DDP wrapper
            self.wrapped.compile()
        named = [(n, p) for n, p in self.wrapped.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optimizer, opt_desc = build_optimizer(cfg, self.params, [n for n, _ in named])
        self.global_rows = cfg.batch_size * cfg.grad_accum * ctx.world_size
        n_rows = len(self.data.train)
        self.steps_per_epoch = math.ceil(n_rows / self.global_rows) * self.steps_per_batch
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        self.scheduler = build_scheduler(cfg, self.optimizer, self.total_steps)
        self.step, self.pos = 0, Position()
        if state is not None:
            self._restore(state)
        torch.manual_seed(cfg.seed + ctx.rank)  # the dropout stream, per rank
        if state is not None:
            ckpt.set_rng_state(state["rng"])  # (rank 0's stream: exact at the same world size 1)
        self.say(
            f"{opt_desc}; {n_rows} rows ({'packed' if packed else 'unpacked'}) of <= {cfg.max_seq_length} "
            f"tokens; global batch {self.global_rows} rows = {cfg.batch_size} x {cfg.grad_accum} accum x "
            f"{ctx.world_size} rank(s); {self.steps_per_epoch} steps/epoch, {self.total_steps} steps total"
        )

    def _choose_checkpointing(self, base, device) -> TrainConfig:
        """The config with ``gradient_checkpointing`` decided where it was left to us (None): on
        only where the memory estimate needs it (``memory.auto_choice``); stored so, so a
        resume keeps the choice."""
        cfg = self.cfg
        if cfg.gradient_checkpointing is not None:
            return cfg
        if self.processor is not None:  # the estimate covers the text layers only
            self.say("gradient checkpointing on (vision-language model; set it to turn it off)")
            return dataclasses.replace(cfg, gradient_checkpointing=True)
        rows = cfg.batch_size * self.recipe.sequences(cfg)  # pairs: 2, GRPO: its generations
        itemsize = next(base.parameters()).element_size()
        on, why = memory.auto_choice(base.config, rows * cfg.max_seq_length, itemsize,
                                            memory.available_bytes(device))  # fmt: skip
        self.say(why + " (--gradient-checkpointing / --no-gradient-checkpointing to choose)")
        return dataclasses.replace(cfg, gradient_checkpointing=on)

    def build_data(self, spec: DataSpec) -> tuple[Prepared, object]:
        """``(rows, objective)`` of the run's method (its entry in :mod:`lorafuse.train.recipes`;
        the objectives: :mod:`lorafuse.train.objective`)."""
        r, cfg = self.recipe, self.cfg
        rows = r.rows(spec, self.tokenizer, self.processor, cfg)
        objective = r.objective(cfg, self.tokenizer, self.processor, self.packed, self.ctx.device)
        return rows, objective

    def cadence(self) -> Cadence:
        c = self.cfg
        return Cadence(c.output_dir, c.logging_steps, c.save_steps, c.save_total_limit,
                       c.eval_steps, c.progress, tuple(c.trackers()), c.to_dict())  # fmt: skip

    def extra_state(self) -> dict:
        """What a subclass adds to the trainer state (restored by :meth:`restore_extra`): tensors,
        numbers, strings, lists, tuples, dicts (:mod:`lorafuse.train.state_file`)."""
        return {}

    def restore_extra(self, state: dict) -> None:
        pass

    def _report_data(self) -> None:
        s = self.data.stats
        notes = [f"{self.data.n_train_examples} train / {self.data.n_eval_examples} eval examples"]
        if s["bad_records_skipped"]:
            notes.append(
                f"skipped {s['bad_records_skipped']} bad records (first: {s['bad_record_examples'][:1]})"
            )
        if s["truncated"]:
            notes.append(f"truncated {s['truncated']} to max_seq_length={self.cfg.max_seq_length}")
        if s["dropped_too_long"]:
            notes.append(f"dropped {s['dropped_too_long']} longer than max_seq_length")
        if s["no_targets"]:
            notes.append(f"dropped {s['no_targets']} with no target tokens left")
        if s.get("identical_pairs"):
            notes.append(
                f"warning: {s['identical_pairs']} pairs with chosen == rejected (no signal)"
            )
        self.say("data: " + "; ".join(notes))

    def _save_initial_adapter(self) -> str | None:
        """PiSSA / OLoRA rewrite the base weight: keep the initial adapter, as PEFT documents, so
        every save converts the trained one into a plain LoRA on the original base (rank 2r)."""
        if init_kind(self.cfg.init_lora_weights) not in MUTATING_INITS:
            return None
        if self.ctx.strategy == "fsdp":  # PEFT converts from the model's own (here sharded) weights
            raise TrainingError(
                f"init_lora_weights={self.cfg.init_lora_weights}: the saved-adapter conversion "
                "needs unsharded weights; use strategy ddp or none"
            )
        path = os.path.join(self.cfg.output_dir, INITIAL_ADAPTER)
        if self.main:
            peft_cfg = self.model.peft_config["default"]
            init, peft_cfg.init_lora_weights = peft_cfg.init_lora_weights, True
            try:  # PEFT: the initial adapter is stored as a plain LoRA (init_lora_weights=True)
                self.model.save_pretrained(path)
            finally:
                peft_cfg.init_lora_weights = init
            self.say(
                f"{self.cfg.init_lora_weights} init: initial adapter in {path}; saved adapters are "
                "converted to a plain LoRA (rank 2r) on the original base"
            )
        dist.barrier(self.ctx)
        return path

    def _load_start_state(self) -> dict | None:
        cfg = self.cfg
        if cfg.init_adapter and cfg.resume:
            raise TrainingError(
                "--init-adapter and --resume exclude each other (resume restores the adapter)"
            )
        if cfg.init_adapter:
            from safetensors.torch import load_file

            file = os.path.join(cfg.init_adapter, "adapter_model.safetensors")
            if not os.path.isfile(file):
                raise TrainingError(
                    f"--init-adapter {cfg.init_adapter}: no adapter_model.safetensors there"
                )
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.model, load_file(file))
            missing = [k for k in result.missing_keys if "lora_" in k]
            if missing:
                raise TrainingError(
                    f"--init-adapter {cfg.init_adapter}: adapter lacks {missing[:3]} (other r/targets?)"
                )
            self.say(f"LoRA weights initialised from {cfg.init_adapter}")
            return None
        if not cfg.resume:
            return None
        path = ckpt.resolve_resume(cfg.resume, self.say)  # the newest intact checkpoint
        state = ckpt.load_state(path)
        if state.get("version") != STATE_VERSION:
            raise TrainingError(
                f"{path}: trainer_state version {state.get('version')} != {STATE_VERSION}"
            )
        if state["n_train_rows"] != len(self.data.train):
            raise TrainingError(
                f"{path}: the checkpoint was trained on {state['n_train_rows']} rows, this data gives "
                f"{len(self.data.train)}; resume needs the same data, max_seq_length, packing and seed"
            )
        ckpt.load_trainable(self.model, state["trainable"], path)
        self.say(f"resuming from {path} (step {state['step']})")
        self.resume_path = path
        return state

    def _restore(self, state: dict) -> None:
        dist.load_optimizer_state_dict(self.wrapped, self.optimizer, state["optimizer"], self.ctx)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.pos = Position(state["epoch"], state["offset"])
        if state["global_rows"] != self.global_rows:
            self.say(f"note: global batch was {state['global_rows']} rows, now {self.global_rows}")
        self.last_checkpoint = self.resume_path
        self.restore_extra(state)

    # ---- one step ----------------------------------------------------------------------------
    def next_rows(self) -> list[int]:
        """Global row indices of the next optimizer step; advances the data position."""
        n = len(self.data.train)
        if self._order_epoch != self.pos.epoch:
            self._order = epoch_order(n, self.cfg.seed, self.pos.epoch)
            self._order_epoch = self.pos.epoch
        rows = self._order[self.pos.offset : self.pos.offset + self.global_rows]
        self.pos.offset += len(rows)
        if self.pos.offset >= n:
            self.pos = Position(self.pos.epoch + 1, 0)
        return rows

    def train_step(self) -> dict:
        """One optimizer step; returns its figures (global loss, tokens, examples...)."""
        return self.step_on(self.next_rows(), self.data.train)

    def step_on(self, rows: list[int], data: list) -> dict:
        """One optimizer step on ``data[i] for i in rows`` (a method that rewrites its rows, like
        distill's on-policy steps, passes its own ``data``)."""
        micros = micro_batches(rows, data, self.cfg.batch_size * self.ctx.world_size, self.ctx)
        obj = self.objective
        # the global normalisers (target tokens; pairs...): every micro-batch divides by them
        n_items = dist.all_reduce_sum(obj.counts([r for mb in micros for r in mb]), self.ctx)
        scale = dist.loss_scale(self.ctx)
        loss_sum = torch.zeros((), device=self.ctx.device)
        metric_sums = 0.0
        for i, mb in enumerate(micros):
            with dist.no_grad_sync(self.wrapped, self.ctx, skip=i < len(micros) - 1):
                loss, sums = obj.loss(self.wrapped, mb, n_items)
                metric_sums = metric_sums + sums
                (loss * scale).backward()
            loss_sum += loss.detach()
        loss_value = float(dist.all_reduce_sum(loss_sum, self.ctx))
        lr, grad_norm = self.apply_update(loss_value)
        return {
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": sum(obj.tokens(r) for mb in micros for r in mb if r.n_examples),
            "examples": sum(data[i].n_examples for i in rows),
            # dpo/orpo/kto: rewards/chosen, rewards/margins, rewards/accuracies...
            "metrics": obj.metrics(dist.all_reduce_sum(metric_sums, self.ctx), n_items),
        }

    def apply_update(self, loss_value: float) -> tuple[float, float]:
        """Check, clip and apply the accumulated gradients; returns ``(lr, grad norm)``."""
        self.check_finite("loss", loss_value)
        if self.cfg.max_grad_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        else:
            grad_norm = float(
                torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
            )
        self.check_finite("gradient norm", grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return lr, grad_norm

    def out_of_memory(self, err: BaseException) -> str:
        cfg = self.cfg
        shape = self.objective.batch_shape
        where = (
            f"micro-batch of shape {shape}" if shape else f"micro-batches of {cfg.batch_size} rows"
        )
        lower = [f"batch_size (now {cfg.batch_size}; raise grad_accum to keep the global batch)",
                 f"max_seq_length (now {cfg.max_seq_length})"]  # fmt: skip
        if not cfg.gradient_checkpointing:
            lower.append("turn on gradient_checkpointing")
        if not cfg.load_in_4bit:
            lower.append("load_in_4bit")
        return (f"out of memory at step {self.step + 1} ({where}, on {self.ctx.device}; "
                f"{type(err).__name__}): lower {', '.join(lower)}")  # fmt: skip

    # ---- eval and checkpoints -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The objective's mean eval loss (all ranks together; SFT: per target token), or None
        without eval data."""
        rows = self.data.eval
        if not rows:
            return None
        self.wrapped.eval()
        micro = self.cfg.batch_size * self.ctx.world_size
        micros = micro_batches(list(range(len(rows))), rows, micro, self.ctx)
        counts = dist.all_reduce_sum(
            self.objective.counts([r for mb in micros for r in mb]), self.ctx
        )
        per_batch, divisor = self.objective.eval_normalisers(counts)
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for mb in micros:
            total += self.objective.loss(self.wrapped, mb, per_batch)[0].double()
        self.wrapped.train()
        return float(dist.all_reduce_sum(total, self.ctx)) / divisor

    def save(self, name: str, full_state: bool) -> str:
        """Write checkpoint ``name`` (collective under FSDP: every rank calls it)."""
        trainable = dist.trainable_state_dict(self.wrapped, self.ctx)
        opt_state = (
            dist.optimizer_state_dict(self.wrapped, self.optimizer, self.ctx)
            if full_state
            else None
        )
        path = os.path.join(self.cfg.output_dir, name)
        if self.main:
            state = None
            if full_state:
                state = {
                    "version": STATE_VERSION, "step": self.step, "epoch": self.pos.epoch,
                    "offset": self.pos.offset, "optimizer": opt_state,
                    "scheduler": self.scheduler.state_dict(), "rng": ckpt.rng_state(),
                    "trainable": trainable, "world_size": self.ctx.world_size,
                    "global_rows": self.global_rows, "n_train_rows": len(self.data.train),
                    **self.extra_state(),
                }  # fmt: skip
            model = dist.unwrap_model(self.wrapped)
            config = self.cfg.to_dict()
            config.update(resume=None, overwrite=False)  # the run, not how it was started
            path = ckpt.save(
                self.cfg.output_dir,
                name,
                ckpt.AdapterSaver(model, trainable, self.initial_adapter),
                self.processor or self.tokenizer,  # a VLM's processor saves its tokenizer too
                config,
                state,
            )
        dist.barrier(self.ctx)
        return path

    def summary_fields(self, final: str, totals: Totals) -> dict:
        return {"packed": self.packed, "adapter": final}

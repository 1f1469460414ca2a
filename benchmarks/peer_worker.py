"""One run of :mod:`benchmarks.peers` inside one tool's own Python environment.

    <tool's python> benchmarks/peer_worker.py JOB.json OUT.json

JOB.json (written by ``peers.py``) names the tool (``hf``, ``trl``, ``unsloth``, ``swift``,
``lorafuse``, ``lorafuse-int8``: its frozen products in int8), the mode (``matched``: the
settings below for every tool; ``defaults``: the tool's own defaults for gradient checkpointing,
autocast and packing), the HF model dir, the dtype, the
rows already tokenized and masked by lorafuse, in the order every tool must consume them, and the
batch size, steps, learning rate, seed and LoRA shape. This file imports only the tool it runs
(never lorafuse, except for the ``lorafuse`` tool), so it runs in a venv that has no lorafuse.

Matched settings: r on all seven projections, alpha = r, no dropout, weights in the job's dtype
(no autocast), AdamW (torch fused) at a constant lr, no weight decay, gradient-norm clipping at 1,
no gradient checkpointing, no packing, the rows in the given order (sequential sampler, no
shuffle), right padding to the batch's longest row, one micro-batch per step.

What comes back (OUT.json): per step the wall seconds and the CPU seconds of this process and its
children (data-loader workers) from the end
of the previous step to the end of this one (the tool's whole step: data loading, forward,
backward, optimizer, its logging), the loss, the real (non-padding) tokens and a fingerprint of the
batch (so ``peers.py`` can check that every tool saw the same batches); the peak RSS above the RSS
when training began (VmHWM reset then, build garbage trimmed first) and the peak total; versions.
With ``profile`` in the job, one step after warmup runs under ``torch.profiler`` and its table of
self CPU time is returned.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import tempfile
import time

# --------------------------------------------------------------------------------------------
# Measurement (no tool imported yet).


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def cpu_seconds() -> float:
    """CPU seconds of this process and its children alive now (a data-loader worker does part of
    a step's work: ms-swift's default), the children's in clock ticks."""
    total, me, tick = time.process_time(), os.getpid(), os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == me:  # ppid; utime, stime are fields 14 and 15 of stat
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class Meter:
    """Step clocks, peak memory and the profiler, driven by the tool's step boundaries."""

    def __init__(self, job: dict):
        self.job = job
        self.wall, self.cpu, self.losses, self.prints = [], [], [], []
        self.base = self.peak = self.peak_total = 0
        self.profile_table = None
        self._prof = None

    def begin(self) -> None:
        """Training starts: trim build garbage, reset the RSS high-water mark, start the clocks."""
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status_kib("VmRSS") * 1024
        self._t, self._c = time.perf_counter(), cpu_seconds()

    def step_begin(self, index: int) -> None:
        if self.job.get("profile") and index == self.job["warmup"] and self._prof is None:
            import torch

            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()

    def step_end(self) -> None:
        t, c = time.perf_counter(), cpu_seconds()
        self.wall.append(t - self._t)
        self.cpu.append(c - self._c)
        if self._prof is not None and self.profile_table is None:
            self._prof.__exit__(None, None, None)
            self.profile_table = self._prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=40
            )
        self._t, self._c = time.perf_counter(), cpu_seconds()

    def finish(self) -> dict:
        """The measurements; batches collated in a data-loader worker (whose records never
        reach this process) are counted from the job's rows, which the tool took in order."""
        if len(self.prints) < len(self.wall):
            b, rows = self.job["batch"], self.job["rows"]
            self.prints = [[sum(len(r["input_ids"]) for r in rows[i * b : (i + 1) * b]), None,
                            None] for i in range(len(self.wall))]  # fmt: skip
        hwm = _status_kib("VmHWM") * 1024
        return {"wall": self.wall, "cpu": self.cpu, "losses": self.losses,
                "fingerprints": self.prints, "peak_bytes": hwm - self.base,
                "peak_total_bytes": hwm, "start_bytes": self.base,
                "load_avg": os.getloadavg()[0], "profile": self.profile_table}  # fmt: skip


def versions(names) -> dict:
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------------------------
# The HF family: stock Trainer, TRL's SFTTrainer, Unsloth (TRL under its CPU backend), ms-swift.


def hf_callback(meter: Meter, base=None):
    """A ``TrainerCallback`` (or a subclass of ``base``) that drives ``meter``."""
    if base is None:
        from transformers import TrainerCallback as base

    class Steps(base):
        def on_train_begin(self, args, state, control, **kw):
            meter.begin()

        def on_step_begin(self, args, state, control, **kw):
            meter.step_begin(state.global_step)

        def on_step_end(self, args, state, control, **kw):
            meter.step_end()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                meter.losses.append(float(logs["loss"]))

    return Steps


def recording(collate, meter: Meter):
    """``collate`` that also records each batch's fingerprint: real (unpadded, by the attention
    mask) tokens, the sum of their ids, target tokens."""

    def wrapped(features):
        batch = collate(features)
        ids, labels = batch["input_ids"], batch["labels"]
        mask = batch.get("attention_mask")
        keep = mask.bool() if mask is not None else ids == ids
        meter.prints.append([int(keep.sum()), int(ids[keep].sum()), int((labels != -100).sum())])
        return batch

    return wrapped


def pad_collate(pad_id: int):
    import torch

    def collate(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), pad_id, dtype=torch.long)
        labels = torch.full((len(features), width), -100, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def torch_dtype(job: dict):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[job["dtype"]]


def trainer_args(job: dict, out_dir: str, cls=None, **extra):
    """The training arguments every HF-family tool gets (TrainingArguments or SFTConfig)."""
    if cls is None:
        from transformers import TrainingArguments as cls
    matched = job["mode"] == "matched"
    kw = dict(
        output_dir=out_dir, per_device_train_batch_size=job["batch"], gradient_accumulation_steps=1,
        max_steps=job["warmup"] + job["steps"], learning_rate=job["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch_fused", logging_steps=1, save_strategy="no", report_to=[],
        train_sampling_strategy="sequential", dataloader_num_workers=0, use_cpu=True,
        seed=job["seed"], disable_tqdm=True,
    )  # fmt: skip
    if matched:  # weights in the job's dtype, no autocast, no recomputation
        kw.update(bf16=False, fp16=False, gradient_checkpointing=False)
    kw.update(extra)
    return cls(**kw)


def lora_config(job: dict):
    from peft import LoraConfig

    return LoraConfig(r=job["rank"], lora_alpha=job["alpha"], lora_dropout=0.0,
                      target_modules=job["targets"], task_type="CAUSAL_LM")  # fmt: skip


def run_hf(job: dict, meter: Meter, out_dir: str) -> dict:
    """Stock transformers ``Trainer`` + PEFT ``get_peft_model``."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer

    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch_dtype(job))
    model.config.use_cache = False
    torch.manual_seed(job["seed"])
    model = get_peft_model(model, lora_config(job))
    collate = recording(pad_collate(tok.pad_token_id), meter)
    trainer = Trainer(model=model, args=trainer_args(job, out_dir), train_dataset=job["rows"],
                      data_collator=collate, callbacks=[hf_callback(meter)()])  # fmt: skip
    trainer.train()
    return {"settings": _hf_settings(trainer)}


def _hf_settings(trainer) -> dict:
    a = trainer.args
    return {"optim": str(getattr(a.optim, "value", a.optim)), "bf16_autocast": bool(a.bf16),
            "gradient_checkpointing": bool(a.gradient_checkpointing),
            "packing": bool(getattr(a, "packing", False)),
            "padding_free": bool(getattr(a, "padding_free", False)),
            "dataloader_num_workers": a.dataloader_num_workers}  # fmt: skip


def _sft_dataset(job: dict):
    from datasets import Dataset

    return Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]}
                              for r in job["rows"]])  # fmt: skip


def _sft_extra(job: dict) -> dict:
    extra = dict(max_length=job["max_seq_length"], packing=False, padding_free=False,
                 shuffle_dataset=False, dataset_num_proc=None)  # fmt: skip
    if job["mode"] == "defaults":  # TRL's own: gradient checkpointing and bf16 autocast on
        extra = dict(max_length=job["max_seq_length"], shuffle_dataset=False)
    return extra


def run_trl(job: dict, meter: Meter, out_dir: str) -> dict:
    """TRL ``SFTTrainer`` on the same PEFT model (pre-tokenized rows, labels as given)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch_dtype(job))
    model.config.use_cache = False
    torch.manual_seed(job["seed"])
    model = get_peft_model(model, lora_config(job))
    args = trainer_args(job, out_dir, SFTConfig, **_sft_extra(job))
    trainer = SFTTrainer(model=model, args=args, train_dataset=_sft_dataset(job),
                         processing_class=tok, callbacks=[hf_callback(meter)()])  # fmt: skip
    trainer.data_collator = recording(trainer.data_collator, meter)
    trainer.train()
    return {"settings": _hf_settings(trainer)}


def run_unsloth(job: dict, meter: Meter, out_dir: str) -> dict:
    """Unsloth's CPU backend: ``FastLanguageModel`` (chunked cross-entropy, its CPU trainer
    defaults) and its ``SFTTrainer``, as its CPU notebooks run it."""
    import unsloth  # noqa: F401 - first, as Unsloth requires
    from trl import SFTConfig, SFTTrainer
    from unsloth import FastLanguageModel

    matched = job["mode"] == "matched"
    model, tok = FastLanguageModel.from_pretrained(
        job["model_dir"], max_seq_length=job["max_seq_length"], dtype=torch_dtype(job),
        load_in_4bit=False,
    )  # fmt: skip
    ckpt = {"use_gradient_checkpointing": False} if matched else {}  # default: "unsloth" (on)
    model = FastLanguageModel.get_peft_model(
        model, r=job["rank"], lora_alpha=job["alpha"], lora_dropout=0.0,
        target_modules=job["targets"], random_state=job["seed"], **ckpt,
    )  # fmt: skip
    args = trainer_args(job, out_dir, SFTConfig, **_sft_extra(job))
    trainer = SFTTrainer(model=model, args=args, train_dataset=_sft_dataset(job),
                         processing_class=tok, callbacks=[hf_callback(meter)()])  # fmt: skip
    trainer.data_collator = recording(trainer.data_collator, meter)
    trainer.train()
    settings = _hf_settings(trainer)
    settings["gradient_checkpointing"] = bool(
        getattr(model, "is_gradient_checkpointing", False) or settings["gradient_checkpointing"]
    )
    return {"settings": settings}


def swift_argv(job: dict, data_file: str, out_dir: str) -> list[str]:
    """The ``swift sft`` arguments of this job (the command line ``peers.py`` prints)."""
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[job["dtype"]]
    argv = ["--model", job["model_dir"], "--model_type", "llama", "--template", "chatml",
            "--dataset", data_file, "--split_dataset_ratio", "0", "--dataset_shuffle", "false",
            "--train_dataloader_shuffle", "false", "--tuner_type", "lora",
            "--lora_rank", str(job["rank"]), "--lora_alpha", str(job["alpha"]),
            "--lora_dropout", "0", "--target_modules", *job["targets"], "--torch_dtype", dtype,
            "--max_length", str(job["max_seq_length"]),
            "--per_device_train_batch_size", str(job["batch"]),
            "--gradient_accumulation_steps", "1", "--max_steps", str(job["warmup"] + job["steps"]),
            "--learning_rate", str(job["lr"]), "--lr_scheduler_type", "constant",
            "--warmup_ratio", "0", "--weight_decay", "0", "--max_grad_norm", "1",
            "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no",
            "--report_to", "none", "--seed", str(job["seed"]), "--output_dir", out_dir,
            "--add_version", "false", "--use_cpu", "true"]  # fmt: skip
    if job["mode"] == "matched":
        argv += ["--gradient_checkpointing", "false", "--packing", "false",
                 "--padding_free", "false", "--optim", "adamw_torch_fused",
                 "--dataloader_num_workers", "0"]  # fmt: skip
    return argv + list(job.get("swift_args", []))


def run_swift(job: dict, meter: Meter, out_dir: str) -> dict:
    """ms-swift's ``swift sft`` (``sft_main``, what the CLI calls), with a step callback and the
    template's encoding of each record replaced by lorafuse's tokens of the same record."""
    from swift.callbacks import TrainerCallback, callbacks_map
    from swift.pipelines import sft_main
    from swift.template import base as template_base

    rows = {_turns(r["messages"]): r for r in job["records"]}
    plain = template_base.Template._encode_truncated
    same = meter.swift_same_tokens = [0, 0]  # swift's own encoding == lorafuse's, of all rows

    def lorafuse_tokens(self, inputs):  # the job's rows: the same batches as every other tool
        encoded = plain(self, inputs)
        row = rows.get(_turns(inputs.messages))
        if row is not None:
            same[0] += encoded["input_ids"] == row["input_ids"]
            same[1] += 1
            encoded["input_ids"], encoded["labels"] = list(row["input_ids"]), list(row["labels"])
            encoded.pop("loss_scale", None)
            encoded["length"] = len(row["input_ids"])
        return encoded

    template_base.Template._encode_truncated = lorafuse_tokens

    class Steps(hf_callback(meter, TrainerCallback)):
        def on_init_end(self, args, state, control, **kw):
            self.trainer.data_collator = recording(self.trainer.data_collator, meter)

    callbacks_map["lorafuse_peer_steps"] = Steps
    data_file = os.path.join(out_dir, "data.jsonl")
    with open(data_file, "w") as f:
        for r in job["records"]:
            f.write(json.dumps({"messages": r["messages"]}) + "\n")
    argv = swift_argv(job, data_file, out_dir) + ["--callbacks", "lorafuse_peer_steps"]
    sft_main(argv)
    return {"settings": {"argv": " ".join(argv[:-2]), "own_tokens_equal": same}}


def _turns(messages) -> str:
    """The non-system turns of a conversation, as a lookup key."""
    return json.dumps([[m["role"], m["content"]] for m in messages if m["role"] != "system"])


# --------------------------------------------------------------------------------------------
# lorafuse: the training engine's own step (collate, loss, clipping, optimizer).


def run_lorafuse(job: dict, meter: Meter, out_dir: str) -> dict:
    """``lorafuse train``'s Trainer: matched (packing off, no checkpointing, the same rows in the
    same order) or with its defaults (packing, its checkpointing choice)."""
    from lorafuse.train import distributed as dist
    from lorafuse.train.config import TrainConfig
    from lorafuse.train.engine import Trainer

    matched = job["mode"] == "matched"
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[job["dtype"]]
    kw = dict(model=job["model_dir"], dtype=dtype, data=[job["data_file"]],
              max_seq_length=job["max_seq_length"], lora_r=job["rank"], lora_alpha=job["alpha"],
              batch_size=job["batch"], lr=job["lr"], lr_scheduler="constant", seed=job["seed"],
              max_steps=job["warmup"] + job["steps"], save_steps=0, output_dir=out_dir,
              progress=False, target_modules=job["targets"])  # fmt: skip
    if matched:
        kw.update(packing=False, gradient_checkpointing=False)
    if job["tool"] == "lorafuse-int8":  # the frozen products in int8 (models/int8.py)
        kw.update(load_in_int8=True)
    trainer = Trainer(TrainConfig(**kw), dist.setup("none"))
    trainer.setup()
    meter.begin()
    loss = trainer.objective.loss

    def recorded(model, rows, counts):  # the batch's fingerprint, as ``recording`` takes it
        ids = [t for r in rows for t in r.input_ids]
        targets = sum(r.n_targets for r in rows)
        meter.prints.append([len(ids), sum(ids), targets])
        return loss(model, rows, counts)

    trainer.objective.loss = recorded
    for i in range(kw["max_steps"]):
        meter.step_begin(i)
        fig = trainer.train_step()
        meter.step_end()
        meter.losses.append(fig["loss"])
    return {"settings": {"packing": trainer.packed, "int8": kw.get("load_in_int8", False),
                         "gradient_checkpointing": bool(trainer.cfg.gradient_checkpointing),
                         "optim": "AdamW (fused)", "rows_per_step": job["batch"]}}  # fmt: skip


TOOLS = {"hf": run_hf, "trl": run_trl, "unsloth": run_unsloth, "swift": run_swift,
         "lorafuse": run_lorafuse, "lorafuse-int8": run_lorafuse}  # fmt: skip
PACKAGES = ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "unsloth",
            "unsloth_zoo", "ms_swift", "lorafuse")  # fmt: skip


def main(job_path: str, out_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    if job.get("threads"):
        import torch

        torch.set_num_threads(job["threads"])
    meter = Meter(job)
    with tempfile.TemporaryDirectory(prefix=f"peer-{job['tool']}-") as out_dir:
        extra = TOOLS[job["tool"]](job, meter, out_dir)
    import torch

    result = {**meter.finish(), **extra, "versions": versions(PACKAGES),
              "threads": torch.get_num_threads(), "python": sys.executable}  # fmt: skip
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))

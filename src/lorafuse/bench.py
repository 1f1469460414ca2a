"""Training speed of stock transformers + PEFT vs lorafuse, in one run (``lorafuse bench``).

Both configurations train the same model (same seed, same random weights) on the same random
token batches with the same LoRA setup (r on all seven projections, AdamW on the adapters);
lorafuse is ``patch_peft_model`` applied to that very PEFT model. Gradient checkpointing is off in
both unless ``--grad-ckpt``.

Every (repeat, configuration) pair runs in a **fresh subprocess**, alternating stock / lorafuse,
so neither inherits the other's allocator state, caches or memory high-water mark, and machine
noise hits both alike. Warmup steps are excluded. Reported per configuration: median step time,
tokens/s (batch*seq / median step time), and peak memory:

* CPU: peak resident set size during training minus the RSS right after the model was built.
  The kernel's high-water mark (``VmHWM``) is reset through ``/proc/self/clear_refs`` once the
  model exists, so model construction does not count; this is allocator-independent (it sees
  glibc, oneDNN and torch allocations alike).
* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the memory
  allocated right after the model was built.

Also reported, weights included: ``peak total MiB``, the process's whole RSS high-water mark
during the steps (CUDA: every allocated byte), after the built model's build-time garbage was
handed back to the OS (``malloc_trim``), with the worker's pre-model RSS (interpreter and
libraries, ``baseline_mib``) and the model's parameter + buffer bytes (``weights_mib``) in the
JSON. ``--quant nf4`` adds ``lorafuse-nf4``: the same model with every base linear but the lm_head
NF4-quantised (as ``load_in_4bit=True``), and ``lorafuse-nf4+emb``: the embeddings and lm_head too
(``quantize_embeddings=True``), each compared with ``lorafuse`` (tokens/s, peak memory).

With the roofline on (the default; ``--no-roofline`` skips it), every run also times, right
before and right after its steps and in the same process, the matrix products a step cannot
avoid, alone, with the run's shapes (:mod:`lorafuse.roofline`): the run's efficiency = the mean of
those two times / its median step time, and each side reports the median of its runs'
efficiencies. Timed next to the steps it divides, the roofline sees the same phase of a shared
machine (separate processes minutes apart saw the products alone take 1.06 to 1.80 s for the same
SmolLM2 step); timed on both sides of them, a phase change during the steps shows as ``drift``
(after / before - 1), printed with the table, instead of skewing the efficiency unseen (one
roofline timed after the steps read 29% for a step whose code measured 55% the day before).

On an AVX2-only CPU bf16 matrix products run ~100x slower than fp32 (no AVX-512-BF16/AMX), so
stock bf16 at 4 x 512 takes minutes per step; measure bf16 with e.g. ``--batch 1 --seq 128``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile

from lorafuse.errors import LorafuseError

MODELS = ("llama-4l-1024", "smollm2-135m", "llama-3.2-1b", "tiny")
CONFIGS = ("stock", "lorafuse")
# --quant nf4 adds this: lorafuse on the same model with its base linears NF4-quantised as
# FastLanguageModel(load_in_4bit=True) does (every nn.Linear but the lm_head; embeddings stay).
NF4 = "lorafuse-nf4"
# ... and this: the embeddings and the lm_head in NF4 too (quantize_embeddings=True).
NF4_EMB = "lorafuse-nf4+emb"
QUANTIZED = (NF4, NF4_EMB)
# Built directly in the run's dtype instead of in fp32 then cast: an fp32
# Llama-3.2-1B is 5 GB before the cast (the other models keep their fp32-then-cast init).
DIRECT_DTYPE_MODELS = ("llama-3.2-1b",)
# --compile adds these: the same two models under torch.compile (default Inductor backend); the
# compile happens in the warmup steps, which are not timed (warmup >= 1 is enforced).
COMPILED = ("stock+compile", "lorafuse+compile")
ROOFLINE = "roofline"  # results key: the unavoidable matrix products alone (timed in each run)
DRIFT_WARN = 0.15  # a roofline drift past this many percent within a run is flagged
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_config(name: str):
    from transformers import LlamaConfig

    if name == "llama-4l-1024":
        return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                           num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                           max_position_embeddings=4096, rms_norm_eps=1e-5,
                           tie_word_embeddings=False)  # fmt: skip
    if name == "smollm2-135m":  # HuggingFaceTB/SmolLM2-135M config.json
        return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                           tie_word_embeddings=True)  # fmt: skip
    if name == "llama-3.2-1b":  # meta-llama/Llama-3.2-1B config.json (1.24 B parameters)
        rope = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}  # fmt: skip
        return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                           rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=True)  # fmt: skip
    if name == "tiny":
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False)  # fmt: skip
    raise LorafuseError(f"unknown --model {name!r}; choose one of {', '.join(MODELS)}")


# --------------------------------------------------------------------------------------------
# Memory probes.


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_cpu_peak() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Peak memory above the moment :meth:`start` is called (see the module docstring)."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device

    def start(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
        else:
            if not _reset_cpu_peak():
                raise RuntimeError("cannot reset VmHWM through /proc/self/clear_refs")
            self.base = _status_kib("VmRSS") * 1024

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return self.torch.cuda.max_memory_allocated() - self.base
        return _status_kib("VmHWM") * 1024 - self.base

    def peak_total_bytes(self) -> int:
        """The whole peak since :meth:`start`, weights included: the process's RSS high-water
        mark (interpreter and libraries too), or on CUDA every allocated byte."""
        if self.device.type == "cuda":
            return self.torch.cuda.max_memory_allocated()
        return _status_kib("VmHWM") * 1024


# --------------------------------------------------------------------------------------------
# One run (in a subprocess).


def _build(spec: dict):
    import peft
    import torch
    from transformers import LlamaForCausalLM

    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    torch.manual_seed(0)
    if spec["model"] in DIRECT_DTYPE_MODELS:
        model = _new_model_in(spec["model"], dtype).to(spec["device"])
    else:
        model = LlamaForCausalLM(model_config(spec["model"])).to(dtype=dtype, device=spec["device"])
    if spec["config"] in QUANTIZED:
        from lorafuse.models import nf4, nf4_embedding

        nf4.quantize_model_(model, dtype, skip=(model.get_output_embeddings(),))
        if spec["config"] == NF4_EMB:
            nf4_embedding.quantize_embeddings_(model, dtype)
    if spec["grad_ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["rank"], target_modules=TARGETS)
    model = peft.get_peft_model(model, cfg)
    if spec["config"].removesuffix("+compile") in ("lorafuse", *QUANTIZED):
        from lorafuse import patch_peft_model

        patch_peft_model(model, backend=spec["backend"])
    model.train()
    if spec["config"].endswith("+compile"):
        model.compile()  # in place, as `lorafuse train --compile`
    return model


def _new_model_in(name: str, dtype):
    """``LlamaForCausalLM`` of ``name`` created in ``dtype`` (its init draws in that dtype)."""
    import torch
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return LlamaForCausalLM(model_config(name))
    finally:
        torch.set_default_dtype(previous)


def _batches(spec: dict, n: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    vocab = model_config(spec["model"]).vocab_size
    return [torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=g) for _ in range(n)]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(model, opt, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


# --------------------------------------------------------------------------------------------
# --method dpo: TRL's DPOTrainer loss on stock PEFT vs lorafuse's DPO objective on the patched model.
# Same random pairs: B pairs of ``seq`` tokens each (the first half a shared prompt), so one step
# runs 2B rows of ``seq`` tokens twice (reference under no_grad, then the policy) on both sides.


def _pairs(spec: dict, n: int) -> list:
    """``n`` steps of ``spec['batch']`` random pairs as lorafuse ``PairRow``s."""
    import torch

    from lorafuse.data.masking import IGNORE_INDEX, Encoded
    from lorafuse.data.preference import PairRow

    g = torch.Generator().manual_seed(1234)
    vocab, seq = model_config(spec["model"]).vocab_size, spec["seq"]
    half = seq // 2
    out = []
    for _ in range(n):
        step = []
        for _ in range(spec["batch"]):
            ids = torch.randint(1, vocab, (3, seq), generator=g).tolist()
            enc = [Encoded(ids[0][:half] + r[half:], [IGNORE_INDEX] * half + r[half:])
                   for r in ids[1:]]  # fmt: skip
            step.append(PairRow(enc[0], enc[1]))
        out.append(step)
    return out


def _trl_dpo(spec: dict, base):
    """A TRL DPOTrainer that wraps ``base`` (a fresh adapter: reference = adapter disabled)."""
    import peft
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from lorafuse.testing import word_tokenizer

    args = DPOConfig(output_dir=tempfile.mkdtemp(prefix="lorafuse-bench-dpo-"), report_to=[],
                     beta=0.1, use_cpu=spec["device"] == "cpu", bf16=False, fp16=False,
                     gradient_checkpointing=bool(spec["grad_ckpt"]))  # fmt: skip
    lora = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["rank"], target_modules=TARGETS)
    data = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    return DPOTrainer(model=base, args=args, train_dataset=data, processing_class=word_tokenizer(),
                      peft_config=lora)  # fmt: skip


def _preference_setup(spec: dict):
    """``(model, step(model, opt, pairs) -> loss)`` for ``spec['config']`` under --method dpo."""
    import torch

    from lorafuse.train.preference import PreferenceObjective

    device = torch.device(spec["device"])
    if spec["config"] == "stock":
        from transformers import LlamaForCausalLM

        dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
        torch.manual_seed(0)
        base = LlamaForCausalLM(model_config(spec["model"])).to(dtype=dtype, device=device)
        trainer = _trl_dpo(spec, base)

        def trl_step(model, opt, pairs):
            from torch.nn.utils.rnn import pad_sequence

            seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
            ids = pad_sequence([torch.tensor(e.input_ids) for e in seqs], batch_first=True)
            mask = pad_sequence([torch.tensor([int(t != -100) for t in e.labels]) for e in seqs],
                                batch_first=True)  # fmt: skip
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "completion_mask": mask}  # fmt: skip
            loss = trainer._compute_loss(model, {k: v.to(device) for k, v in batch.items()}, False)
            return _finish(loss, opt)

        return trainer.model, trl_step
    model = _build(spec)
    objective = PreferenceObjective("dpo", 0.1, "sigmoid", 0.0, 0, device)

    def our_step(model, opt, pairs):
        loss, _ = objective.loss(model, pairs, objective.counts(pairs))
        return _finish(loss, opt)

    return model, our_step


def _finish(loss, opt) -> float:
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def run_worker(spec: dict) -> dict:
    """Build, warm up, time ``spec['steps']`` steps; return times, losses and peak memory, and
    with ``spec['roofline']`` the unavoidable products timed right after (:func:`run_roofline`)."""
    import time

    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    total = spec["warmup"] + spec["steps"]
    baseline = _process_bytes(device)
    if spec.get("method", "sft") == "sft":
        model, step = _build(spec), _step
        batches = [b.to(device) for b in _batches(spec, total)]
    else:
        (model, step), batches = _preference_setup(spec), _pairs(spec, total)
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    weights = _model_bytes(model)
    before = run_roofline(spec) if spec.get("roofline") else None  # timed again after the steps
    _release_free_memory()  # build-time garbage (e.g. the dense weights NF4 replaced)
    probe = MemoryProbe(device)
    probe.start()
    times, losses, warmup_s = [], [], 0.0
    for i, ids in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step(model, opt, ids))
        _sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
        else:
            warmup_s += time.perf_counter() - t0  # includes torch.compile's compile time
    out = {"times": times, "losses": losses, "peak_bytes": probe.peak_bytes(), "warmup_s": warmup_s}
    out.update(
        peak_total_bytes=probe.peak_total_bytes(), start_bytes=probe.base, weight_bytes=weights
    )
    out["baseline_bytes"] = baseline
    if spec["config"].removesuffix("+compile") in ("lorafuse", *QUANTIZED):
        out["report"] = str(model.lorafuse_report)
    if spec.get("profile") and step is _step:
        out["profile"] = _profile(model, opt, batches[-1])
    if spec.get("roofline"):  # after the memory probe: its operands do not count as the step's
        del model, opt, batches
        _release_free_memory()
        out[ROOFLINE] = bracketed(before, run_roofline(spec))
    return out


def bracketed(before: dict, after: dict) -> dict:
    """The roofline timed before and after one run's steps: ``seconds`` is their mean (the steps
    ran in between), ``drift`` = after / before - 1 (how much the machine's speed moved); the
    per-product rows are the later timing's."""
    mean = (before["seconds"] + after["seconds"]) / 2
    drift = after["seconds"] / before["seconds"] - 1
    return {**after, "seconds": mean, "seconds_before": before["seconds"],
            "seconds_after": after["seconds"], "drift": drift}  # fmt: skip


def _adamw(params):
    """AdamW as both sides run it by default: fused where the device has the kernel (HF Trainer's
    ``adamw_torch_fused`` since torch 2.8; ``lorafuse train``), else foreach. The same optimizer
    on both sides, so the ratio compares the forward and backward passes."""
    import torch

    try:
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    except (RuntimeError, TypeError):  # a device / dtype without the fused kernel
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def _process_bytes(device) -> int:
    """RSS of this worker before any model exists, its libraries imported (CPU; 0 on CUDA, where
    the total peak counts allocations only): what every configuration pays regardless."""
    if device.type == "cuda":
        return 0
    import peft  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    from lorafuse import patching  # noqa: F401

    return _status_kib("VmRSS") * 1024


def _release_free_memory() -> None:
    """Collect garbage and hand free heap pages back to the OS (glibc's ``malloc_trim``), so the
    RSS the steps start from holds what the model keeps, not what building it left free."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed pages may stay resident; nothing to do
        pass


def _model_bytes(model) -> int:
    """Bytes of every parameter and buffer as held (NF4 buffers at their packed size)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # tied: counted once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_roofline(spec: dict) -> dict:
    """The unavoidable matrix products of one step of ``spec``, timed alone (same threads)."""
    import torch

    from lorafuse import roofline

    config = model_config(spec["model"])
    products = roofline.training_products(config, spec["batch"], spec["seq"], spec["rank"], TARGETS)
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    return roofline.time_products(products, spec["device"], dtype)


def _profile(model, opt, ids) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, opt, ids)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


# glibc malloc tunables the image bench runs every worker under (``_spawn(..., env=)``): never
# mmap a chunk (so no munmap on free), never trim the heap top, one arena. With glibc's
# defaults, freed activation buffers go back to the kernel and are faulted in again the next step
# (~209k minor faults per SD1.5 step at 128 px in an ad-hoc probe: 0.3-0.7 s of system time).
# The LLM bench keeps glibc's defaults: there these settings raised both sides' peak memory by
# ~20% at 4 x 512 (smollm2-135m bf16: stock 5152 vs ~4300 MiB) and pushed stock past this
# 23 GiB box at 1 x 8192 (killed), so its memory figures would no longer be the user's.
STEADY_MALLOC = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
    "MALLOC_TOP_PAD_": str(2**26),
    "MALLOC_ARENA_MAX": "1",
}


def _spawn(spec: dict, module: str = "lorafuse.bench", env: dict | None = None) -> dict:
    """Run one configuration in a fresh interpreter (``python -m module --worker JSON``, the
    image bench uses its own module), with ``env`` added to its environment; its result comes
    back as JSON."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [
            sys.executable,
            "-m",
            module,
            "--worker",
            json.dumps({**spec, "out": out.name}),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}
        )
        if proc.returncode != 0:
            raise LorafuseError(
                f"{spec['config']} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        return json.load(out)


# --------------------------------------------------------------------------------------------
# Orchestration and the table.


def _summarise(runs: list[dict], tokens_per_step: int) -> dict:
    times = [t for r in runs for t in r["times"]]
    med = statistics.median(times)
    return {
        "step_time_s": med,
        "step_time_min_s": min(times),
        "tokens_per_s": tokens_per_step / med,
        "peak_mem_mib": statistics.median(r["peak_bytes"] for r in runs) / 2**20,
        "peak_total_mib": statistics.median(r.get("peak_total_bytes", 0) for r in runs) / 2**20,
        "weights_mib": runs[0].get("weight_bytes", 0) / 2**20,
        "baseline_mib": statistics.median(r.get("baseline_bytes", 0) for r in runs) / 2**20,
        "first_loss": runs[0]["losses"][0],
        "n_steps": len(times),
        "warmup_s": statistics.median(r.get("warmup_s", 0.0) for r in runs),
    }


def format_table(results: dict, spec: dict) -> str:
    roof = results.get(ROOFLINE)
    rows = [("", "step s (median)", "step s (min)", "tokens/s", "peak mem MiB", "loss@step1")]
    rows[0] += ("roofline eff.",) if roof else ()
    for name in (*CONFIGS, *QUANTIZED, *COMPILED):
        if name in results:
            r = results[name]
            rows.append((name, f"{r['step_time_s']:.3f}", f"{r['step_time_min_s']:.3f}",
                         f"{r['tokens_per_s']:.1f}",
                         f"{r['peak_mem_mib']:.0f}", f"{r['first_loss']:.4f}")
                        + ((f"{r['efficiency']:.0%}",) if roof else ()))  # fmt: skip
    ratios = [("ratio", "lorafuse/stock")] + [(f"ratio {n}", f"{n}/stock") for n in COMPILED]
    ratios += [(f"ratio {n}", f"{n}/lorafuse") for n in QUANTIZED]
    for key, label in ratios:
        if key in results:
            q = results[key]
            rows.append((label, f"{q['step_time']:.2f}x", f"{q['step_time_min']:.2f}x",
                         f"{q['tokens_per_s']:.2f}x", f"{q['peak_mem']:.2f}x", "")
                        + (("",) if roof else ()))  # fmt: skip
    _add_total_column(rows, results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    head = (f"lorafuse bench: {spec['model']} {spec['dtype']} {spec['device']} batch {spec['batch']} "
            f"x seq {spec['seq']}, r={spec['rank']}, grad-ckpt {'on' if spec['grad_ckpt'] else 'off'}")  # fmt: skip
    if spec.get("method", "sft") != "sft":
        head += (f"; {spec['method']}: {spec['batch']} pairs, chosen + rejected = "
                 f"{2 * spec['batch']} rows; stock = TRL DPOTrainer loss")  # fmt: skip
    lines = [head] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for name in COMPILED:
        if name in results:
            lines.append(f"{name}: warmup incl. compile {results[name]['warmup_s']:.1f} s "
                         f"(eager lorafuse warmup {results.get('lorafuse', {}).get('warmup_s', 0):.1f} s)")  # fmt: skip
    if roof:
        lines.append(_roofline_line(results, roof))
    lines += [_nf4_line(results, name) for name in QUANTIZED if name in results]
    return "\n".join(lines)


def _add_total_column(rows: list, results: dict) -> None:
    """Append "peak total MiB" (weights included, see MemoryProbe.peak_total_bytes) to ``rows``."""
    rows[0] += ("peak total MiB",)
    for i, row in enumerate(rows[1:], 1):
        name = row[0]
        if name in results:
            total = results[name].get("peak_total_mib")  # absent in results of older runs
            rows[i] += (f"{total:.0f}",) if total is not None else ("",)
            continue
        key = "ratio" if name == "lorafuse/stock" else f"ratio {name.rsplit('/', 1)[0]}"
        total = results.get(key, {}).get("peak_total_mem")
        rows[i] += (f"{total:.2f}x",) if total is not None else ("",)


def _nf4_line(results: dict, name: str) -> str:
    """nf4 vs bf16 lorafuse: the QLoRA trade (speed for weight memory) in one line."""
    f, line = results[name], f"{name}: weights {results[name]['weights_mib']:.0f} MiB"
    if "lorafuse" in results:
        b, q = results["lorafuse"], results[f"ratio {name}"]
        line += (f" vs {b['weights_mib']:.0f}; vs lorafuse: tokens/s {q['tokens_per_s']:.2f}x, "
                 f"peak total {f['peak_total_mib']:.0f} / {b['peak_total_mib']:.0f} MiB = "
                 f"{q['peak_total_mem']:.2f}x, peak above the built model {q['peak_mem']:.2f}x")  # fmt: skip
        base = f["baseline_mib"]  # the interpreter and libraries, before any model
        if base:
            ours, theirs = f["peak_total_mib"] - base, b["peak_total_mib"] - b["baseline_mib"]
            line += (f"; without the ~{base:.0f} MiB process baseline {ours:.0f} / {theirs:.0f} "
                     f"MiB = {ours / theirs:.2f}x")  # fmt: skip
    return line


def _roofline_line(results: dict, roof: dict) -> str:
    """One line: what the roofline is, and the product GFLOP/s each side achieves."""
    dtype = roof["matmul_dtype"].removeprefix("torch.")
    sides = ", ".join(
        f"{c} {results[c]['achieved_gflops_per_s']:.1f}" for c in CONFIGS if c in results
    )
    line = (
        f"roofline: {roof['gflop']:.1f} GFLOP/step of unavoidable matrix products ({dtype}, "
        f"causal attention): {roof['seconds']:.3f} s alone = {roof['gflops_per_s']:.1f} GFLOP/s\n"
        f"  eff. = roofline s / median step s, each run's roofline the mean of its timings before"
        f" and after its steps (median over runs); achieved GFLOP/s: {sides}"
    )
    drift = roof.get("drift")
    if drift is not None:
        line += (
            f"\n  drift (roofline after / before the steps - 1, largest over runs): {drift:+.0%}"
        )
        if abs(drift) > DRIFT_WARN:
            line += (f": the machine's speed changed by more than {DRIFT_WARN:.0%} during a run,"
                     " so its efficiency is uncertain by about as much; rerun when it is quiet")  # fmt: skip
    return line


def write_json(path: str, data: dict) -> None:
    path = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def compare(
    spec: dict,
    repeats: int,
    only: str | None = None,
    profile: bool = False,
    roofline: bool = True,
    compile: bool = False,  # noqa: A002 - the --compile flag
):
    """Run stock and lorafuse ``repeats`` times each, interleaved, each run in a fresh process.

    Returns ``(results, runs)``: per configuration the summary (and ``ratio`` when both ran), and
    the raw per-run measurements. ``spec`` holds the run settings (model, dtype, device, batch,
    seq, steps, warmup, rank, grad_ckpt, backend, threads). With ``roofline`` every run also
    times the unavoidable products after its steps: ``results['roofline']`` (over all runs) and
    each side's ``efficiency`` (the median of its runs'). With ``compile`` the :data:`COMPILED` configurations run too, each with a
    ``ratio <name>`` against stock.
    """
    from tqdm import tqdm

    configs = [only] if only else list(CONFIGS)
    if spec.get("quant") == "nf4":
        configs += QUANTIZED
    if compile:
        configs += [c for c in COMPILED if only is None or c.startswith(only)]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    plan = [(rep, c) for rep in range(repeats) for c in configs]  # interleaved
    for rep, c in tqdm(plan, desc="bench runs", unit="run"):
        last = rep == repeats - 1
        profiled = c in ("lorafuse", NF4) and (c == NF4 or spec.get("quant") != "nf4")
        run = {**spec, "config": c, "profile": profile and last and profiled, "roofline": roofline}
        runs[c].append(_spawn(run))
    tokens = spec["batch"] * spec["seq"] * (1 if spec.get("method", "sft") == "sft" else 2)
    results: dict = {c: _summarise(runs[c], tokens) for c in configs}
    if "stock" in results and "lorafuse" in results:
        results["ratio"] = _ratio(results["lorafuse"], results["stock"])
    for c in COMPILED:
        if "stock" in results and c in results:
            results[f"ratio {c}"] = _ratio(results[c], results["stock"])
    for c in QUANTIZED:
        if c in results and "lorafuse" in results:
            results[f"ratio {c}"] = _ratio(results[c], results["lorafuse"])
    if roofline:
        results[ROOFLINE] = _summarise_roofline([r[ROOFLINE] for c in configs for r in runs[c]])
        for c in configs:
            results[c].update(_efficiency(results[ROOFLINE], runs[c], results[c]["step_time_s"]))
    return results, runs


def _ratio(f: dict, s: dict) -> dict:
    return {
        "tokens_per_s": f["tokens_per_s"] / s["tokens_per_s"],
        "step_time": f["step_time_s"] / s["step_time_s"],
        "step_time_min": f["step_time_min_s"] / s["step_time_min_s"],
        "peak_mem": f["peak_mem_mib"] / s["peak_mem_mib"],
        "peak_total_mem": f["peak_total_mib"] / s["peak_total_mib"] if s["peak_total_mib"] else 0.0,
    }


def _summarise_roofline(runs: list[dict]) -> dict:
    seconds = statistics.median(r["seconds"] for r in runs)
    drifts = [r["drift"] for r in runs if "drift" in r]
    return {
        "seconds": seconds,
        "seconds_per_repeat": [r["seconds"] for r in runs],
        "gflop": runs[0]["flops"] / 1e9,
        "gflops_per_s": runs[0]["flops"] / 1e9 / seconds,
        "matmul_dtype": runs[0]["matmul_dtype"],
        "drift": max(drifts, key=abs) if drifts else None,
    }


def _efficiency(roof: dict, runs: list[dict], step_time_s: float) -> dict:
    """The median over ``runs`` of each run's unavoidable product seconds / its median step
    seconds, and the achieved product GFLOP/s at the side's median step time."""
    per_run = [r[ROOFLINE]["seconds"] / statistics.median(r["times"]) for r in runs]
    return {
        "efficiency": statistics.median(per_run),
        "efficiency_per_run": per_run,
        "achieved_gflops_per_s": roof["gflop"] / step_time_s,
    }


def _worker_entry(payload: str, run=None) -> int:
    """The worker side of :func:`_spawn`: run ``spec`` (``run``, default this module's
    :func:`run_worker`; the image bench passes its own) and write the result to ``spec['out']``."""
    spec = json.loads(payload)
    out = (run or run_worker)(spec)
    with open(spec["out"], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":  # the subprocess side of _spawn: python -m lorafuse.bench --worker JSON
    parser = argparse.ArgumentParser(prog="lorafuse.bench")
    parser.add_argument("--worker", required=True, help="JSON run spec (internal)")
    raise SystemExit(_worker_entry(parser.parse_args().worker))

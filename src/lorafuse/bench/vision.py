"""``lorafuse bench --task vlm``: vision-language LoRA training steps, stock PEFT vs lorafuse.

Both sides train the same random VLM (a built-in family of :mod:`lorafuse.bench.vlm_models`, "small"
shape by default, or a local HF dir) on the same image+text batches (generated coloured shapes,
loss on the answers) with LoRA r on the language model's seven projections (``--finetune-vision``:
the vision tower's too) and AdamW on the adapters. lorafuse is
:meth:`FastVisionModel.get_peft_model` on that model; stock is ``peft.get_peft_model`` with the
same target regex. Every (repeat, configuration) runs in a fresh process, interleaved, as the LLM
bench does; the table gives median step time, tokens/s, peak memory (the LLM bench's probe) and
lorafuse / stock ratios.
"""

from __future__ import annotations

import argparse
import statistics

from lorafuse.bench.process import MemoryProbe, spawn, sync, worker_entry

CONFIGS = ("stock", "lorafuse")


def _bench_tokenizer():
    """The word-level tokenizer with a pad token (padding the batch's shorter rows)."""
    from lorafuse.data.word_tokenizer import word_tokenizer

    tok = word_tokenizer()
    tok.pad_token = tok.unk_token
    return tok


def _build(spec: dict):
    import peft
    import torch

    from lorafuse.bench.vlm_models import FAMILIES, build_vlm
    from lorafuse.dtypes import parse_dtype
    from lorafuse.models.vision import FastVisionModel, target_pattern

    if spec["vlm"] in FAMILIES:
        model, processor = build_vlm(spec["vlm"], _bench_tokenizer(), size=spec["size"])
    else:
        model, processor = FastVisionModel.from_pretrained(spec["vlm"], dtype="float32")
    model = model.to(dtype=parse_dtype(spec["dtype"]), device=spec["device"])
    vision = spec["finetune_vision"]
    if spec["config"] == "lorafuse":
        model = FastVisionModel.get_peft_model(
            model, r=spec["rank"], lora_alpha=spec["rank"], finetune_vision=vision,
            use_gradient_checkpointing=spec["grad_ckpt"], cpu_heap_policy=True,
        )  # fmt: skip
        report = str(model.lorafuse_report)
    else:
        if spec["grad_ckpt"]:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            model.enable_input_require_grads()
        torch.manual_seed(3407)
        cfg = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["rank"],
                              target_modules=target_pattern(model, None, vision))  # fmt: skip
        model, report = peft.get_peft_model(model, cfg), None
    return model.train(), processor, report


def _batches(spec: dict, processor, n: int) -> list[dict]:
    """``n`` batches of ``spec['batch']`` conversations, one generated image each."""
    import random

    from lorafuse.bench.vlm_models import COLOURS, shape_image
    from lorafuse.data.vision_rows import collate, encode_conversation

    rng = random.Random(1234)
    out = []
    for _ in range(n):
        rows = []
        for _ in range(spec["batch"]):
            colour = rng.choice(COLOURS)
            img = shape_image(colour, size=(spec["image_px"], spec["image_px"]))
            msgs = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": "What colour?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": colour}]}]  # fmt: skip
            rows.append(encode_conversation(processor, msgs, [img], "bench"))
        out.append(collate(rows, processor.tokenizer.pad_token_id))
    return out


def run_worker(spec: dict) -> dict:
    import time

    import torch

    from lorafuse.bench.llm import adamw, finish_step

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    model, processor, report = _build(spec)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    batches = _batches(spec, processor, spec["warmup"] + spec["steps"])
    tokens = int(batches[0]["attention_mask"].sum())
    probe = MemoryProbe(device)
    probe.start()
    times, losses = [], []
    for i, batch in enumerate(batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        if batch["pixel_values"].is_floating_point():
            batch["pixel_values"] = batch["pixel_values"].to(next(model.parameters()).dtype)
        sync(device)
        t0 = time.perf_counter()
        losses.append(finish_step(model(**batch).loss, opt))
        sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    return {"times": times, "losses": losses, "peak_bytes": probe.peak_bytes(), "report": report,
            "tokens": tokens}  # fmt: skip


def compare(spec: dict, repeats: int) -> tuple[dict, dict]:
    from tqdm import tqdm

    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    plan = [(rep, c) for rep in range(repeats) for c in CONFIGS]  # interleaved
    for _, config in tqdm(plan, desc="bench runs", unit="run"):
        runs[config].append(spawn({**spec, "config": config}, module="lorafuse.bench.vision"))
    results = {}
    for config, rs in runs.items():
        step = statistics.median(t for r in rs for t in r["times"])
        results[config] = {"step_time_s": step, "tokens_per_s": rs[0]["tokens"] / step,
                           "peak_mem_mib": statistics.median(r["peak_bytes"] for r in rs) / 2**20,
                           "first_loss": rs[0]["losses"][0]}  # fmt: skip
    s, f = results["stock"], results["lorafuse"]
    results["ratio"] = {"speedup": s["step_time_s"] / f["step_time_s"],
                        "memory": f["peak_mem_mib"] / s["peak_mem_mib"]}  # fmt: skip
    return results, runs


def format_table(results: dict, spec: dict) -> str:
    rows = [("", "step s", "tokens/s", "peak MiB", "first loss")]
    for c in CONFIGS:
        r = results[c]
        rows.append((c, f"{r['step_time_s']:.3f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['peak_mem_mib']:.0f}", f"{r['first_loss']:.4f}"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    ratio = results["ratio"]
    model = spec["vlm"] + (f" ({spec['size']})" if "/" not in spec["vlm"] else "")
    return "\n".join([
        f"lorafuse bench --task vlm: {model}, {spec['dtype']} {spec['device']}, batch "
        f"{spec['batch']} x one {spec['image_px']} px image, LoRA r{spec['rank']} on the language "
        f"model{' and vision tower' if spec['finetune_vision'] else ''}, "
        f"{spec['threads'] or 'default'} threads, medians of {spec['steps']} x {spec['repeats']} steps",
        *("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows),
        f"lorafuse / stock: {ratio['speedup']:.2f}x speed, {ratio['memory']:.2f}x peak memory",
    ])  # fmt: skip


def run(spec: dict, repeats: int, json_path: str | None = None) -> dict:
    results, runs = compare(spec, repeats)
    print(format_table(results, {**spec, "repeats": repeats}))
    print(runs["lorafuse"][-1]["report"])
    if json_path:
        from lorafuse.bench.process import write_json

        write_json(json_path, {"results": results, "spec": spec, "runs": runs})
    return results


if __name__ == "__main__":  # the subprocess side of spawn
    parser = argparse.ArgumentParser(prog="lorafuse.bench.vision")
    parser.add_argument("--worker", required=True, help="JSON run spec (internal)")
    raise SystemExit(worker_entry(parser.parse_args().worker, run_worker))

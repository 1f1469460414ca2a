"""Vision-language LoRA on generated images: name the colour of a shape.

    python examples/vlm_shapes.py                       # a tiny random Qwen2-VL (2 min of CPU)
    python examples/vlm_shapes.py --family idefics3     # SmolVLM's layout
    python examples/vlm_shapes.py --model DIR           # a real local VLM (Qwen2-VL, SmolVLM...)

Each image holds one red, green, blue or yellow square or circle of random size and place on
white (:func:`lorafuse.testing.vlm.write_shape_data`); the question is "What colour is it?". The
held-out images are drawn separately. Accuracy = the fraction of held-out images whose right
colour gets the lowest answer loss among the four, for the base model (adapter disabled) and after
``lorafuse train`` (the same engine, from Python: LoRA on the language model, the projector
trained in full). Chance is 25%; the tiny random Qwen2-VL goes from 9% to 94% (32 held-out
images, seed fixed).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from lorafuse.data.vision import load_image
from lorafuse.data.vision_rows import encode_conversation
from lorafuse.models.resolve import load_resolved, resolve_spec
from lorafuse.testing.vlm import COLOURS, save_tiny_vlm, write_shape_data
from lorafuse.train.config import TrainConfig
from lorafuse.train.engine import train


def accuracy(model, processor, data_file: str) -> float:
    """Fraction of ``data_file``'s records whose own colour has the lowest answer loss."""
    base = os.path.dirname(data_file)
    right = total = 0
    with open(data_file) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for rec in records:
        user = rec["messages"][0]
        image = load_image(user["content"][0]["image"], base)
        prompt = {"role": "user", "content": [{"type": "image"}, user["content"][1]]}
        losses = []
        for colour in COLOURS:
            answer = {"role": "assistant", "content": [{"type": "text", "text": colour}]}
            row = encode_conversation(processor, [prompt, answer], [image], "eval")
            with torch.no_grad():
                losses.append(float(model(**row).loss))
        right += COLOURS[losses.index(min(losses))] == rec["messages"][1]["content"]
        total += 1
    return right / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a local VLM dir (default: a tiny random one)")
    ap.add_argument("--family", default="qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl", "idefics3"))
    ap.add_argument("--train", type=int, default=96, help="training images")
    ap.add_argument("--eval", type=int, default=32, help="held-out images")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", default=None, help="keep the data and adapter here")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="lorafuse-vlm-shapes-")
    model_dir = args.model
    if model_dir is None:
        model_dir = os.path.join(work, "base")
        save_tiny_vlm(model_dir, args.family)
    train_file = write_shape_data(os.path.join(work, "data"), args.train, seed=1, name="train")
    eval_file = write_shape_data(os.path.join(work, "data"), args.eval, seed=2, name="eval")
    cfg = TrainConfig(
        model=model_dir, data=[train_file], output_dir=os.path.join(work, "run"),
        epochs=args.epochs, batch_size=4, lr=args.lr, lora_r=16, lora_alpha=32,
        train_projector=True, dtype="float32", device=args.device, save_steps=0,
        gradient_checkpointing=False, max_pixels=64 * 64,
    )  # fmt: skip
    summary = train(cfg)
    model, _, processor = load_resolved(
        resolve_spec(checkpoint=summary["adapter"]), dtype=torch.float32
    )
    with model.disable_adapter():
        before = accuracy(model, processor, eval_file)
    after = accuracy(model, processor, eval_file)
    print(f"held-out colour accuracy: base {before:.0%} -> trained {after:.0%} "
          f"({args.eval} images, chance 25%; train loss {summary['train_loss']:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()

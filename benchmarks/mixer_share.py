"""How much of a lorafuse training step of a hybrid do its token mixers take (Qwen3.5's
Gated DeltaNet, LFM2's short convolution, Granite 4's Mamba2, as the lorafuse run patches them)?

Builds the ``lorafuse bench`` model (random weights, LoRA on every Linear, patched as the bench's
lorafuse run), then times, interleaved in this one process: a whole training step (forward,
backward, AdamW) on a ``--batch x --seq`` batch, and one mixer layer's forward + backward alone on
hidden states of the same shape (its LoRA Linears included). The share is
``mixer layers x one mixer / step``: the part of the step that kernels for the mixer can shrink.

    python benchmarks/mixer_share.py --model qwen3.5-0.8b --layers 8 --dtype bf16
"""

import argparse

import torch

from lorafuse.bench.config import FAMILY_MODELS
from lorafuse.bench.llm import adamw, build_model, token_batches, train_step
from lorafuse.patching.registry import REGISTRY
from lorafuse.testing.timing import interleaved_medians


def mixers(model):
    spec = REGISTRY[model.config.model_type]
    classes = {spec.cls(name) for name, _ in spec.mixers} - {None}
    found = [m for m in model.modules() if type(m) in classes and "Moe" not in type(m).__name__]
    if not found:
        raise SystemExit(f"{model.config.model_type}: no token mixer in this model")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=FAMILY_MODELS, default="qwen3.5-0.8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    spec = dict(model=a.model, layers=a.layers, dtype=a.dtype, device="cpu", batch=a.batch,
                seq=a.seq, rank=16, grad_ckpt=False, backend=None, config="lorafuse")  # fmt: skip
    model = build_model(spec)
    opt = adamw([q for q in model.parameters() if q.requires_grad])
    ids = token_batches(spec, 1)[0]
    layers = mixers(model)
    dtype = next(model.parameters()).dtype
    x = torch.randn(a.batch, a.seq, model.config.hidden_size, dtype=dtype)

    def mixer_step():
        h = x.detach().requires_grad_()
        layers[0](hidden_states=h).float().square().mean().backward()

    times = interleaved_medians(
        {"step": lambda: train_step(model, opt, ids), "mixer": mixer_step}, repeats=a.repeats
    )
    share = len(layers) * times["mixer"] / times["step"]
    print(f"{a.model} first {a.layers} layers {a.dtype} {a.batch}x{a.seq}: step "
          f"{times['step']:.2f} s; {type(layers[0]).__name__} fwd+bwd {times['mixer']:.3f} s x "
          f"{len(layers)} layers = {len(layers) * times['mixer']:.2f} s ({share:.0%} of the step)")  # fmt: skip


if __name__ == "__main__":
    main()

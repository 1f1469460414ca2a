"""Decoding on CPU: the few-row product of ``csrc/decode_linear.cpp`` vs torch's, per layer and per
generated token.

Per layer (default): one token's product ``x (rows, in) @ Wᵀ`` on the weight shapes of
SmolLM2-135M and Llama-3.2-1B, ``--layers`` distinct weights per shape cycled so that, as in
decoding, they are not in cache; torch's ``F.linear`` in bf16 (what ran before), the kernel in bf16,
and torch in fp32 for scale. Medians of ``--repeats`` interleaved rounds, ms per layer and the
bytes/s at which the weights were read; ratio = torch bf16 / kernel (> 1: the kernel is faster).
Outputs are checked against each other first (fp32 sums in another order: within one bf16
rounding).

    python benchmarks/ops/decode_linear.py [--threads 1] [--rows 1] [--repeats 9] [--layers 8]

``--generate N``: ``model.generate`` of N greedy tokens on the default model
(SmolLM2-135M-Instruct) in bf16 with the stock forwards (torch's product, transformers' RMSNorm:
``decoding.uninstall``), in bf16 with the decoding kernels (``decoding.install``), in fp32, and in
4 bit (``load_in_4bit``: NF4 linears, bf16 head, which the dense kernel takes), and bf16 / 4 bit
without the lean decoding step (``patching/decode_step.py``: the layers routed, the model's own
forward per token); tokens/s medians over ``--repeats`` interleaved rounds, and whether the greedy
texts agree.

    python benchmarks/ops/decode_linear.py --generate 32 [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from lorafuse import backends
from lorafuse.ops import decode_linear
from lorafuse.patching import decoding
from lorafuse.patching.peft_lora import restore_forward
from lorafuse.testing.timing import interleaved_medians

SHAPES = {
    "smollm2 q/o": (576, 576), "smollm2 k/v": (192, 576), "smollm2 gate/up": (1536, 576),
    "smollm2 down": (576, 1536), "smollm2 lm_head": (49152, 576),
    "llama-1b q/o": (2048, 2048), "llama-1b k/v": (512, 2048), "llama-1b gate/up": (8192, 2048),
    "llama-1b down": (2048, 8192),
}  # fmt: skip


def bench_layer(shape, rows: int, layers: int, repeats: int) -> dict:
    """ms per layer and GB/s for torch bf16, the kernel (bf16), torch fp32."""
    n = max(1, min(layers, (256 << 20) // (shape[0] * shape[1] * 2)))  # <= 256 MiB of bf16
    weights = [torch.randn(shape, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    weights32 = [w.float() for w in weights]
    x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
    x32 = x.float()
    ours = decode_linear.decode_linear(x, weights[0], None).float()
    if not torch.allclose(ours, F.linear(x32, weights32[0]), rtol=2**-7, atol=1e-5):
        raise SystemExit(f"the decode kernel differs from torch's product at {shape}")

    def over(fn, ws, inp):
        def run():
            with torch.inference_mode():
                for w in ws:
                    fn(inp, w, None)

        return run

    fns = {
        "torch_bf16": over(F.linear, weights, x),
        "kernel_bf16": over(decode_linear.decode_linear, weights, x),
        "torch_fp32": over(F.linear, weights32, x32),
    }
    ms = {k: v * 1e3 / n for k, v in interleaved_medians(fns, repeats).items()}
    gbs = {k: shape[0] * shape[1] * (4 if "fp32" in k else 2) / (v * 1e6) for k, v in ms.items()}
    return {"ms": ms, "gb_per_s": gbs, "ratio": ms["torch_bf16"] / ms["kernel_bf16"]}


def main_layers(args) -> None:
    print(f"decode products: threads {args.threads}, {args.rows} row(s), load "
          f"{os.getloadavg()[0]:.1f}, median of {args.repeats}, up to {args.layers} weights per "
          "shape; ms per layer (GB/s of weights read)")  # fmt: skip
    print(f"{'weight':>17} {'shape':>11} {'torch bf16':>17} {'kernel bf16':>17} {'ratio':>6} "
          f"{'torch fp32':>17}")  # fmt: skip
    for name, shape in SHAPES.items():
        r = bench_layer(shape, args.rows, args.layers, args.repeats)
        cells = [f"{r['ms'][k]:7.3f} ({r['gb_per_s'][k]:5.1f})" for k in r["ms"]]
        print(f"{name:>17} {shape[0]:>5}x{shape[1]:<5} {cells[0]:>17} {cells[1]:>17} "
              f"{r['ratio']:5.2f}x {cells[2]:>17}")  # fmt: skip


def main_generate(args) -> None:
    from lorafuse.models.fast_model import FastLanguageModel

    models = {}
    for name, dtype, four_bit in (("bf16", "bf16", False), ("fp32", "fp32", False),
                                  ("nf4", "bf16", True)):  # fmt: skip
        model, tok = FastLanguageModel.from_pretrained(None, dtype=dtype, load_in_4bit=four_bit)
        models[name] = FastLanguageModel.for_inference(model)
    ids = tok("The three primary colours are", return_tensors="pt").input_ids
    n = args.generate
    texts: dict[str, str] = {}

    # Each comparison runs on one model, its forwards switched between rounds: two copies of the
    # same weights decoded up to ~10% apart (where each copy's memory landed), more than the step.
    def gen(dtype: str, name: str, stock: bool = False, step: bool = True):
        def run():
            if stock:
                decoding.uninstall(models[dtype])
            elif not step:  # the layers routed, the model's own forward per token
                restore_forward(models[dtype].model)
            try:
                with torch.inference_mode():
                    out = models[dtype].generate(
                        ids, max_new_tokens=n, min_new_tokens=n, do_sample=False
                    )
            finally:
                decoding.install(models[dtype])
            texts[name] = tok.decode(out[0, ids.shape[1] :])

        return run

    fns = {
        "bf16 stock": gen("bf16", "bf16 stock", stock=True),
        "bf16 kernels": gen("bf16", "bf16 kernels"),
        "fp32": gen("fp32", "fp32"),
        "nf4 (bf16)": gen("nf4", "nf4"),
        "bf16, no lean step": gen("bf16", "bf16 no step", step=False),
        "nf4, no lean step": gen("nf4", "nf4 no step", step=False),
    }
    t = interleaved_medians(fns, args.repeats)
    print(f"generate {n} greedy tokens, default model, threads {args.threads}, load "
          f"{os.getloadavg()[0]:.1f}, median of {args.repeats} interleaved rounds")  # fmt: skip
    for name, s in t.items():
        print(f"  {name:>12}: {n / s:6.1f} tokens/s")
    print(f"  bf16 kernels / bf16 stock: {t['bf16 stock'] / t['bf16 kernels']:.2f}x; "
          f"bf16 kernels / fp32: {t['fp32'] / t['bf16 kernels']:.2f}x")  # fmt: skip
    print(f"  lean decoding step (patching/decode_step.py): bf16 "
          f"{t['bf16, no lean step'] / t['bf16 kernels']:.2f}x, 4 bit "
          f"{t['nf4, no lean step'] / t['nf4 (bf16)']:.2f}x; same greedy text: "
          f"{texts['bf16 no step'] == texts['bf16 kernels'] and texts['nf4 no step'] == texts['nf4']}")  # fmt: skip
    a, b = texts["bf16 stock"], texts["bf16 kernels"]
    common = len(os.path.commonprefix([a, b]))
    same = "identical" if a == b else f"identical for the first {common} of {len(a)} characters"
    print(f"  greedy text, bf16 kernels vs bf16 stock: {same} (bf16 products summed in another "
          "order: a near tie can flip a greedy token)")  # fmt: skip
    if a != b:
        print(f"    stock:   {a!r}\n    kernels: {b!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", type=int, default=1, help="rows per product (sequences decoded)")
    ap.add_argument("--layers", type=int, default=8, help="distinct weights per shape")
    ap.add_argument("--generate", type=int, default=0, help="time N generated tokens instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if backends.select_cpu("decode_linear") != "cpp":
        raise SystemExit("the C++ decode kernel is unavailable here (see the warning above)")
    if args.generate:
        return main_generate(args)
    main_layers(args)


if __name__ == "__main__":
    main()

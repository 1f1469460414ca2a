"""Single-stream greedy generation of a small Qwen3-MoE model: the decode engine vs the model's own
forward (transformers' ``generate`` with its KV cache, the path a model without the engine takes).

The model is random (no download) at a small but not trivial shape: hidden 512, 8 layers, 8
query / 4 KV heads of 64, 32 experts of intermediate 256 with 4 chosen per token, vocabulary
4096 (about 111 M parameters, 101 M of them experts; random prompt ids). Each round times the
engine and then transformers on the same prompt (``--prompt`` tokens, then ``--new`` tokens,
greedy), so load from other processes lands on both; the table prints the medians and their
ratio. Both use ``--threads`` threads. Greedy tokens of a random model can differ by a near tie
(fp32 summation order); the line says whether they did.

    python benchmarks/decode_moe.py [--rounds 5] [--prompt 32] [--new 64] [--threads 2] [--weights auto]
"""

from __future__ import annotations

import argparse

import torch

from lorafuse.decode import DecodeEngine
from lorafuse.testing.timing import interleaved_medians

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
             moe_intermediate_size=256, norm_topk_prob=True, vocab_size=4096,
             max_position_embeddings=4096)  # fmt: skip


def build() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).float().eval()


def engine_run(engine: DecodeEngine, ids: list[int], new: int) -> list[int]:
    seq = engine.open(None, len(ids) + new)
    logits, out = engine.prefill(seq, ids), []
    for _ in range(new):
        out.append(int(logits.argmax()))
        logits = engine.step([seq], [out[-1]])[0]
    engine.close(seq)
    return out


def model_run(model, ids: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="auto", help="the engine's weight format")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build()
    engine = DecodeEngine(model, args.weights)
    print(engine.describe())
    ids = torch.randint(
        0, SHAPE["vocab_size"], (args.prompt,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    same = engine_run(engine, ids, args.new) == model_run(model, ids, args.new)  # the warm-up
    fns = {"engine": lambda: engine_run(engine, ids, args.new),
           "model forward": lambda: model_run(model, ids, args.new)}  # fmt: skip
    med = interleaved_medians(fns, args.rounds, warmup=0)
    print(f"prompt {args.prompt} + {args.new} new tokens, {args.threads} threads, "
          f"{args.rounds} rounds; greedy tokens equal: {same}")  # fmt: skip
    print(f"{'path':<14} {'median s':>9} {'tokens/s':>9}")
    for name, t in med.items():
        print(f"{name:<14} {t:9.3f} {args.new / t:9.1f}")
    print(f"engine / model forward tokens/s: {med['model forward'] / med['engine']:.2f}x")


if __name__ == "__main__":
    main()

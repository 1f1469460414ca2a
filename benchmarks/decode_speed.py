"""Single-stream decode tokens/s: the decode engine against llama.cpp, in one process.

The built-in SmolLM2-135M-Instruct: the engine (``--decode`` weights) and llama-cpp-python's
``Llama`` on a GGUF export of the same weights (``--gguf``: f32 against the engine's fp32, q8_0
against its int8), ``--threads`` each, one prompt, ``--tokens`` greedy tokens (the EOS never
chosen on either: the engine takes the argmax over all but EOS, llama.cpp gets a -inf EOS bias).
The two are measured in turn ``--repeats`` times, alternating which goes first; the median of
each is printed with the load average. Prefill is excluded (decode steps only).

    OMP_NUM_THREADS=2 python benchmarks/decode_speed.py --gguf m-f32.gguf --decode fp32
    OMP_NUM_THREADS=2 python benchmarks/decode_speed.py --gguf m-q8_0.gguf --decode int8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def engine_run(engine, ids: list[int], n: int, eos: int) -> float:
    """Decode tokens/s of ``n`` greedy tokens after prefilling ``ids``."""
    seq = engine.open(None, len(ids) + n)
    logits = engine.prefill(seq, ids)
    start = time.perf_counter()
    for _ in range(n):
        logits[eos] = -float("inf")
        logits = engine.step([seq], [int(logits.argmax())])[0]
    dt = time.perf_counter() - start
    engine.close(seq)
    return n / dt


def llama_run(llm, ids: list[int], n: int, eos: int) -> float:
    """Decode tokens/s of llama.cpp's ``n`` greedy tokens after evaluating ``ids``."""
    import llama_cpp

    llm.reset()
    llm.eval(ids)
    bias = {eos: -float("inf")}
    processor = llama_cpp.LogitsProcessorList([lambda _, s: _bias(s, bias)])
    start = time.perf_counter()
    out = []
    for tok in llm.generate([], top_k=1, temp=0.0, repeat_penalty=1.0, reset=False,
                            logits_processor=processor):  # fmt: skip
        out.append(tok)
        if len(out) == n:
            break
    return n / (time.perf_counter() - start)


def _bias(scores, bias):
    for k, v in bias.items():
        scores[k] = v
    return scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--decode", default="fp32", help="the engine's weights (fp32, bf16, int8, q4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import llama_cpp

    from lorafuse.decode import DecodeEngine
    from lorafuse.models.resolve import ModelSpec, load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(ModelSpec(base=None), dtype=torch.float32)
    engine = DecodeEngine(model, args.decode)
    llm = llama_cpp.Llama(args.gguf, n_ctx=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)  # fmt: skip
    ids = tok(PROMPT)["input_ids"]
    runs = {"lorafuse": [], "llama.cpp": []}
    for r in range(args.repeats):
        order = ("lorafuse", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "lorafuse")
        for name in order:
            fn = engine_run if name == "lorafuse" else llama_run
            runs[name].append(fn(engine if name == "lorafuse" else llm, ids, args.tokens,
                                 tok.eos_token_id))  # fmt: skip
    ours, theirs = (statistics.median(runs[k]) for k in ("lorafuse", "llama.cpp"))
    load = os.getloadavg()
    print(f"engine {args.decode} vs llama.cpp {os.path.basename(args.gguf)}, {args.threads} "
          f"threads, {args.tokens} tokens, {args.repeats} repeats; load {load[0]:.1f}")  # fmt: skip
    print(f"lorafuse {ours:.1f} tok/s ({', '.join(f'{x:.1f}' for x in runs['lorafuse'])})")
    print(f"llama.cpp {theirs:.1f} tok/s ({', '.join(f'{x:.1f}' for x in runs['llama.cpp'])})")
    print(f"ratio {ours / theirs:.2f}")


if __name__ == "__main__":
    main()

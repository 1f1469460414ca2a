"""What each decode-engine weight format costs in quality against fp32, on a real model.

SmolLM2-135M-Instruct (the built-in model) in fp32 through transformers is the reference: the
fixed text of ``gguf_quality.py`` (about 400 tokens) teacher-forced, every position's next-token
logits. The decode engine then runs the same text with its weights as fp32, bf16, int8 and q4
(``ops/quant_linear.py``; one prefill with every position's logits) and this prints per format:
the weights' bytes, top-1 agreement with the reference over every position, the text's
perplexity and its difference from the reference's, and the largest logit difference. Nothing
here is timed.

    python benchmarks/decode_quality.py [--formats fp32,bf16,int8,q4] [--json out.json]
"""

from __future__ import annotations

import argparse
import math

import torch
from gguf_quality import TEXT

from lorafuse import files
from lorafuse.decode import DecodeEngine
from lorafuse.models.source import resolve_model_source


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:-1]."""
    logp = torch.log_softmax(logits[:-1].double(), -1)
    return math.exp(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp32,bf16,int8,q4")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_source(None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(TEXT)["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()  # (T, V)
    ref_ppl, ref_top = perplexity(ref, ids), ref.argmax(-1)
    rows = [{"format": "transformers fp32", "mib": None, "top1": 1.0, "ppl": ref_ppl,
             "max_logit_diff": 0.0}]  # fmt: skip
    for fmt in args.formats.split(","):
        engine = DecodeEngine(model, fmt)
        seq = engine.open(None, len(ids))
        logits = engine.prefill(seq, ids, all_logits=True)
        rows.append({"format": f"engine {fmt}", "mib": engine.weight_bytes / 2**20,
                     "top1": (logits.argmax(-1) == ref_top).float().mean().item(),
                     "ppl": perplexity(logits, ids),
                     "max_logit_diff": (logits - ref).abs().max().item()})  # fmt: skip
    print(f"SmolLM2-135M-Instruct, {len(ids)} tokens teacher-forced; reference: transformers fp32")
    print(f"{'weights':>18} | {'MiB':>6} | {'top-1 vs fp32':>13} | {'perplexity':>10} | "
          f"{'Δ ppl':>7} | {'max |Δ logit|':>13}")  # fmt: skip
    for r in rows:
        mib = "" if r["mib"] is None else f"{r['mib']:.0f}"
        print(f"{r['format']:>18} | {mib:>6} | {r['top1']:>13.4f} | {r['ppl']:>10.3f} | "
              f"{r['ppl'] - ref_ppl:>+7.3f} | {r['max_logit_diff']:>13.2e}")  # fmt: skip
    if args.json:
        files.write_json(args.json, {"tokens": len(ids), "rows": rows})


if __name__ == "__main__":
    main()

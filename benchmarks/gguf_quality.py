"""What each GGUF outtype costs in quality, measured by llama.cpp itself.

Exports a model to f32 GGUF and to each quantized outtype through lorafuse's own export
(``write_gguf``: llama.cpp's quantizer for the quantized types), loads every file in llama.cpp
(llama-cpp-python, ``logits_all=True``), runs the same fixed English text through each, and prints
per outtype: file size (MiB, and its ratio to f32), matrices that fell back from K-quants (rows
not a multiple of 256), teacher-forced top-1 agreement with f32 over every position, and the
perplexity of the text with its difference from f32's. Nothing here is timed.

Two models:

* ``--model builtin``: SmolLM2-135M-Instruct (lorafuse's default model). Its rows are 576 wide,
  so most matrices fall back from K-quants to a legacy type; the fallback column says how many.
* ``--model wide``: a random Llama whose widths are multiples of 256 (hidden 512, intermediate
  1536, 4 layers, SmolLM2's tokenizer), so every K-quant applies. Its weights are random (scaled
  as the tests' tiny models, so logits are decisive): its absolute perplexity means nothing, only
  the differences from f32 do.

    python benchmarks/gguf_quality.py --model builtin
    python benchmarks/gguf_quality.py --model wide --outtypes q8_0,q6_k,q5_k_m,q4_k_m,q4_0
"""

from __future__ import annotations

import argparse
import math
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np

from lorafuse import files
from lorafuse.export.gguf_export import write_gguf
from lorafuse.models.loader import resolve_model_source

OUTTYPES = "q8_0,q6_k,q5_k_m,q4_k_m,q4_0"
# A fixed text written for this benchmark (about 400 tokens with SmolLM2's tokenizer).
TEXT = """\
The river rises in the hills north of the town and runs south through farmland for about forty
miles before it reaches the sea. In the spring the water is high and fast, and the old stone
bridge near the mill has been closed twice in the last ten years. Most of the people who live
along the river are farmers, although a few families still fish for trout and salmon. The town
council has asked the government for money to repair the bridge, to build a new school, and to
improve the road that connects the town to the railway station.

The school has two hundred pupils and eleven teachers. Lessons begin at nine in the morning and
end at half past three, and on Fridays the older pupils walk to the library to read newspapers
and write short reports about what they find. The head teacher believes that children learn
best when they can ask questions, so every class keeps a box where pupils leave the questions
they could not answer during the week. On Monday mornings the teachers open the boxes and choose
three questions for the whole school to work on together.

In winter the road to the station is often covered with snow. The council keeps two tractors
with ploughs in a shed behind the town hall, and the drivers start work before dawn so that the
milk lorries can reach the farms. When the snow is deep the trains still run, but they run
slowly, and passengers wait in the small station café, where the owner serves tea, soup and
bread baked the same morning. Visitors who come for the walking in the hills are told to check
the weather forecast, to carry a map and a torch, and to tell someone where they are going.
"""


def wide_model(path: Path, tokenizer_dir: Path) -> Path:
    """A random Llama with every width a multiple of 256 and SmolLM2's tokenizer, as an HF dir."""
    from transformers import AutoTokenizer

    from lorafuse.testing import save_tiny_model

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    save_tiny_model(path, tokenizer=None, vocab_size=len(tok), hidden_size=512,
                    intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                    max_shard_size="2GB")  # fmt: skip
    tok.save_pretrained(path)
    return path


def llama_cpp_logits(gguf_path: Path, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) logits of llama.cpp for the whole text in one context."""
    from llama_cpp import Llama

    llm = Llama(str(gguf_path), n_ctx=len(ids) + 8, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each next token (positions 1..n-1)."""
    shifted = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    nll = log_z - shifted[np.arange(len(ids) - 1), ids[1:]]
    return math.exp(nll.mean())


def measure(model_dir: Path, outtypes: list[str], work: Path) -> tuple[list[dict], int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"]
    f32 = write_gguf(model_dir, work / "f32.gguf", "f32")
    base = llama_cpp_logits(f32, ids)
    rows = [{"outtype": "f32", "mib": f32.stat().st_size / 2**20, "fallbacks": 0, "agreement": 1.0,
             "ppl": perplexity(base, ids)}]  # fmt: skip
    for outtype in outtypes:
        with warnings.catch_warnings(record=True) as caught:  # the export's K-quant fallback count
            warnings.simplefilter("always")
            path = write_gguf(model_dir, work / f"{outtype}.gguf", outtype)
        logits = llama_cpp_logits(path, ids)
        rows.append({
            "outtype": outtype, "mib": path.stat().st_size / 2**20,
            "fallbacks": fallback_count([str(w.message) for w in caught]),
            "agreement": float((logits.argmax(1) == base.argmax(1)).mean()),
            "ppl": perplexity(logits, ids),
        })  # fmt: skip
        path.unlink()
    for row in rows:
        row["ratio"] = row["mib"] / rows[0]["mib"]
        row["dppl"] = row["ppl"] - rows[0]["ppl"]
    return rows, len(ids)


def fallback_count(messages: list[str]) -> int:
    """Matrices the quantizer stored in a fallback type ("N of M matrices have rows ...")."""
    counts = [int(m.group(1)) for msg in messages if (m := re.search(r"(\d+) of \d+", msg))]
    return sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["builtin", "wide"], default="builtin")
    parser.add_argument("--outtypes", default=OUTTYPES, help=f"comma list (default {OUTTYPES})")
    parser.add_argument("--json", help="also write the rows as JSON")
    args = parser.parse_args()
    builtin = Path(resolve_model_source(None))
    with tempfile.TemporaryDirectory(prefix="gguf-quality-") as tmp:
        work = Path(tmp)
        model_dir = builtin if args.model == "builtin" else wide_model(work / "wide", builtin)
        rows, n = measure(model_dir, args.outtypes.split(","), work)
    print(f"{args.model}: {n} tokens of the fixed text, logits from llama.cpp")
    print(f"{'outtype':>8} {'MiB':>8} {'x f32':>6} {'fallback':>9} {'top-1 agree':>12} "
          f"{'perplexity':>11} {'diff':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['outtype']:>8} {r['mib']:8.1f} {r['ratio']:6.3f} {r['fallbacks']:9d} "
              f"{r['agreement']:12.3f} {r['ppl']:11.3f} {r['dppl']:+8.3f}")  # fmt: skip
    if args.json:
        files.write_json(args.json, {"model": args.model, "tokens": n, "rows": rows})


if __name__ == "__main__":
    main()

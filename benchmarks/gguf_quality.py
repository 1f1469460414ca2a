"""What each GGUF outtype costs in quality, measured by llama.cpp itself.

Exports a model to f32 GGUF and to each quantized outtype through lorafuse's own export
(``write_gguf``: llama.cpp's quantizer for the quantized types), loads every file in llama.cpp
(llama-cpp-python, ``logits_all=True``), runs the same fixed English text through each, and prints
per outtype: file size (MiB, and its ratio to f32), matrices that fell back from K-quants (rows
not a multiple of 256), teacher-forced top-1 agreement with f32 over every position, the
perplexity of the text with its difference from f32's, and the mean relative error of the
matrices (dequantized by gguf-py against the f32 file's). Nothing here is timed.

Two models:

* ``--model builtin``: SmolLM2-135M-Instruct (lorafuse's default model). Its rows are 576 wide,
  so most matrices fall back from K-quants to a legacy type; the fallback column says how many.
* ``--model wide``: the same SmolLM2 padded with zeros to widths that are multiples of 256
  (hidden 576 -> 768, 9 -> 12 query heads and 3 -> 4 key/value heads of 64, RMSNorm weights and
  epsilon rescaled for the wider mean), a real trained model that computes exactly SmolLM2's
  function (checked here against transformers) and on which every K-quant applies, no fallback.

    python benchmarks/gguf_quality.py --model builtin
    python benchmarks/gguf_quality.py --model wide --outtypes q8_0,q6_k,q5_k_m,q4_k_m,q4_0
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np

from lorafuse import files
from lorafuse.export.gguf_export import write_gguf
from lorafuse.models.source import resolve_model_source

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


def wide_model(path: Path, src: Path) -> Path:
    """SmolLM2 (``src``) zero-padded to 256-multiple widths, the same function (see the docstring).

    The residual stream's extra features stay zero (every matrix writing them is zero there), so
    RMSNorm over 768 features sees SmolLM2's 576 and a mean 576/768 as large: the norm weights
    and epsilon are scaled to give the same output. Extra query heads read an extra all-zero
    key/value head and their o_proj columns are zero; heads keep their key/value group.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = json.loads((src / "config.json").read_text())
    h, d, nq, nkv = (
        cfg["hidden_size"],
        cfg["head_dim"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    wide = 768
    ratio = h / wide
    padded = {}
    for name, t in load_file(src / "model.safetensors").items():
        t = t.float()
        if name.endswith("norm.weight"):  # RMSNorm over the wider residual
            t = torch.cat([t * ratio**0.5, t.new_zeros(wide - h)])
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            heads = nq + 3 if name.endswith("q_proj.weight") else nkv + 1
            t = _pad(t, (heads * d, wide))
        elif name.endswith("o_proj.weight"):
            t = _pad(t, (wide, (nq + 3) * d))
        elif name.endswith(("gate_proj.weight", "up_proj.weight", "embed_tokens.weight")):
            t = _pad(t, (t.shape[0], wide))
        elif name.endswith("down_proj.weight"):
            t = _pad(t, (wide, t.shape[1]))
        padded[name] = t.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    cfg.update(hidden_size=wide, num_attention_heads=nq + 3, num_key_value_heads=nkv + 1,
               rms_norm_eps=cfg["rms_norm_eps"] * ratio, torch_dtype="float32")  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(padded, path / "model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(src).save_pretrained(path)
    ids = torch.tensor([AutoTokenizer.from_pretrained(src)(TEXT[:400])["input_ids"]])
    with torch.no_grad():
        a = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32)(ids).logits
        b = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
        b.load_state_dict(padded, strict=False)
        b.tie_weights()
        b = b(ids).logits
    err = (a - b).abs().max().item()
    print(f"wide: padded SmolLM2 logits differ from SmolLM2's by at most {err:.2e}")
    assert err < 1e-3, err  # the same function: fp32 rounding only
    return path


def _pad(t, shape):
    """``t`` in the top-left corner of zeros of ``shape`` (q heads keep their key/value group:
    nine query heads in three groups of three stay heads 0-8, the three new ones share the new
    all-zero key/value head 3)."""
    out = t.new_zeros(shape)
    out[: t.shape[0], : t.shape[1]] = t
    return out


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
             "ppl": perplexity(base, ids), "weight_error": 0.0}]  # fmt: skip
    for outtype in outtypes:
        with warnings.catch_warnings(record=True) as caught:  # the export's K-quant fallback count
            warnings.simplefilter("always")
            path = write_gguf(model_dir, work / f"{outtype}.gguf", outtype)
        logits = llama_cpp_logits(path, ids)
        rows.append({
            "outtype": outtype, "mib": path.stat().st_size / 2**20,
            "fallbacks": fallback_count([str(w.message) for w in caught]),
            "agreement": float((logits.argmax(1) == base.argmax(1)).mean()),
            "ppl": perplexity(logits, ids), "weight_error": weight_error(f32, path),
        })  # fmt: skip
        path.unlink()
    for row in rows:
        row["ratio"] = row["mib"] / rows[0]["mib"]
        row["dppl"] = row["ppl"] - rows[0]["ppl"]
    return rows, len(ids)


def weight_error(f32_path: Path, path: Path) -> float:
    """Mean over the matrices of |dequantized - f32| / |f32| (Frobenius), read back with gguf-py."""
    import gguf

    ref = {t.name: t for t in gguf.GGUFReader(f32_path).tensors if len(t.shape) == 2}
    errors = []
    for t in gguf.GGUFReader(path).tensors:
        if t.name in ref:
            want = np.asarray(ref[t.name].data, dtype=np.float32).reshape(-1)
            got = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
            errors.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    return float(np.mean(errors))


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
          f"{'perplexity':>11} {'diff':>8} {'weight err':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['outtype']:>8} {r['mib']:8.1f} {r['ratio']:6.3f} {r['fallbacks']:9d} "
              f"{r['agreement']:12.3f} {r['ppl']:11.3f} {r['dppl']:+8.3f} "
              f"{r['weight_error']:10.4f}")  # fmt: skip
    if args.json:
        files.write_json(args.json, {"model": args.model, "tokens": n, "rows": rows})


if __name__ == "__main__":
    main()

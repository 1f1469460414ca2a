"""What each ONNX Runtime GenAI / OpenVINO outtype costs in quality, measured by the runtimes.

Exports the built-in SmolLM2-135M-Instruct through lorafuse's export to ONNX (fp32, int8, int4:
onnxruntime-genai's model builder) and OpenVINO (fp32, fp16, int8, int4: NNCF), runs the fixed
English text of ``gguf_quality.py`` through each in one forward (ONNX Runtime's
``InferenceSession`` on the folder's ``model.onnx``; OpenVINO's CPU plugin on
``openvino_model.xml`` at f32 inference precision), and prints per outtype: folder size (MiB and
its ratio to the same runtime's fp32), teacher-forced top-1 agreement with that runtime's fp32
at every position, and the text's perplexity with its difference from fp32's. Nothing is timed.

    python benchmarks/deploy_quality.py [--json out.json]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from gguf_quality import TEXT, perplexity  # same directory: the same text and perplexity

from lorafuse import files
from lorafuse.export.onnx import write_onnx
from lorafuse.export.openvino import write_openvino
from lorafuse.models.source import resolve_model_source


def onnx_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) logits of ONNX Runtime for the whole text, empty KV cache."""
    import json

    import onnxruntime as ort

    cfg = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    n = len(ids)
    feeds = {}
    for inp in sess.get_inputs():
        if inp.name == "input_ids":
            feeds[inp.name] = np.array([ids], dtype=np.int64)
        elif inp.name == "attention_mask":
            feeds[inp.name] = np.ones((1, n), dtype=np.int64)
        elif inp.name == "position_ids":
            feeds[inp.name] = np.arange(n, dtype=np.int64)[None]
        elif inp.name.startswith("past_key_values"):
            feeds[inp.name] = np.zeros(
                (1, cfg["num_key_value_heads"], 0, cfg["head_size"]), np.float32
            )
    logits = sess.run(["logits"], feeds)[0]
    return np.asarray(logits[0], dtype=np.float64)


def openvino_logits(folder: Path, ids: list[int]) -> np.ndarray:
    import openvino as ov

    model = ov.Core().compile_model(folder / "openvino_model.xml", "CPU",
                                    {"INFERENCE_PRECISION_HINT": "f32"})  # fmt: skip
    req = model.create_infer_request()
    n = len(ids)
    req.infer({"input_ids": np.array([ids], dtype=np.int64), "attention_mask": np.ones((1, n), np.int64),
               "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)})  # fmt: skip
    return np.asarray(req.get_tensor("logits").data[0], dtype=np.float64)


RUNTIMES = {"onnx": (write_onnx, onnx_logits, ["fp32", "int8", "int4"]),
            "openvino": (write_openvino, openvino_logits, ["fp32", "fp16", "int8", "int4"])}  # fmt: skip


def measure(model_dir: Path, work: Path) -> tuple[list[dict], int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"]
    rows = []
    for runtime, (write, logits_of, outtypes) in RUNTIMES.items():
        ref = ref_size = None
        for outtype in outtypes:
            folder = write(model_dir, work / f"{runtime}-{outtype}", outtype)
            logits, size = logits_of(folder, ids), files.tree_size(folder)
            if ref is None:
                ref, ref_size, ref_ppl = logits, size, perplexity(logits, ids)
            ppl = perplexity(logits, ids)
            rows.append({"runtime": runtime, "outtype": outtype, "mib": size / 2**20,
                         "ratio": size / ref_size,
                         "agreement": float((logits.argmax(1) == ref.argmax(1)).mean()),
                         "ppl": ppl, "dppl": ppl - ref_ppl})  # fmt: skip
    return rows, len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deploy-quality-") as tmp:
        rows, n = measure(Path(resolve_model_source(None)), Path(tmp))
    print(f"SmolLM2-135M-Instruct: {n} tokens of the fixed text")
    print(f"{'runtime':>9} {'outtype':>7} {'MiB':>7} {'x fp32':>7} {'top-1 agree':>12} "
          f"{'perplexity':>11} {'diff':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['runtime']:>9} {r['outtype']:>7} {r['mib']:7.1f} {r['ratio']:7.3f} "
              f"{r['agreement']:12.3f} {r['ppl']:11.3f} {r['dppl']:+8.3f}")  # fmt: skip
    if args.json:
        files.write_json(args.json, {"tokens": n, "rows": rows})


if __name__ == "__main__":
    main()

"""Decode speed and time to first token of one fine-tune in each CPU runtime, one stream.

The fine-tune: the built-in SmolLM2-135M-Instruct with a random rank-8 LoRA on every Linear of
its decoder (non-zero B), merged in fp32. It is exported through lorafuse's own export to GGUF
(q8_0, q4_k_m) for llama.cpp (llama-cpp-python), to ONNX (int4, fp32) for ONNX Runtime GenAI and
to OpenVINO IR (int8, int4) for OpenVINO GenAI's LLMPipeline, and served as is by ``lorafuse
serve`` (fp32 and bf16, HTTP streaming, ``OMP_NUM_THREADS``). Each runtime gets ``--threads``
threads (2 by default), the same prompt token ids (one user turn in the chat template) and
``--tokens`` greedy new tokens (end of text biased away where the runtime allows); it reports the
median over ``--repeats`` runs of the time to the first new token and of the decode rate after it
((n - 1) / (time of the last token - time of the first)).

    python benchmarks/deploy_runtimes.py [--threads 2] [--tokens 64] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def llama_cpp(path: Path, ids: list[int], n: int, threads: int) -> list[float]:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.reset()
    times, start = [], time.perf_counter()
    for _tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter() - start)
        if len(times) == n:
            break
    return times


def onnx_genai(folder: Path, ids: list[int], n: int, threads: int) -> list[float]:
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))  # threads: session_options in genai_config.json (export())
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
    gen = og.Generator(model, params)
    times, start = [], time.perf_counter()
    gen.append_tokens(np.array([ids], dtype=np.int32))
    for _ in range(n):
        gen.generate_next_token()
        times.append(time.perf_counter() - start)
    return times


def openvino_genai(folder: Path, ids: list[int], n: int, threads: int) -> list[float]:
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    pipe = og.LLMPipeline(str(folder), "CPU", INFERENCE_NUM_THREADS=threads)
    times = []
    cfg = og.GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False)
    inputs = og.TokenizedInputs(ov.Tensor(np.array([ids], dtype=np.int64)),
                                ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))  # fmt: skip

    class Clock(og.StreamerBase):
        def write(self, token):  # one id, or a list of ids
            times.extend(
                [time.perf_counter() - start] * (len(token) if isinstance(token, list) else 1)
            )
            return og.StreamingStatus.RUNNING

        def end(self):
            pass

    start = time.perf_counter()
    pipe.generate(inputs, cfg, Clock())
    return times


def lorafuse_serve(
    model_dir: Path, ids: list[int], n: int, threads: int, dtype: str
) -> list[float]:
    import httpx

    from serve import _free_port, server  # same directory

    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "lorafuse", "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", dtype]  # fmt: skip
    with server(cmd, port, env, model_dir.parent / f"serve-{dtype}.log") as url:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        times = []
        with httpx.Client(timeout=600) as client:
            start = time.perf_counter()
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if (
                        line.startswith("data: {")
                        and any(  # not the finish chunk
                            c.get("text") for c in json.loads(line[6:])["choices"]
                        )
                    ):
                        times.append(time.perf_counter() - start)
    return times


def summary(runs: list[list[float]]) -> dict:
    ttft = statistics.median(t[0] for t in runs)
    rate = statistics.median((len(t) - 1) / (t[-1] - t[0]) for t in runs)
    return {"ttft_s": ttft, "decode_tok_s": rate, "tokens": len(runs[0])}


def export(model_dir: Path, work: Path, threads: int) -> dict:
    """name -> (runner, path) for every runtime and outtype."""
    from lorafuse.export.gguf_export import write_gguf
    from lorafuse.export.onnx import write_onnx
    from lorafuse.export.openvino import write_openvino

    out = {}
    for t in ("q8_0", "q4_k_m"):
        out[f"llama.cpp {t}"] = (llama_cpp, write_gguf(model_dir, work / f"m-{t}.gguf", t))
    for t in ("int4", "fp32"):
        folder = write_onnx(model_dir, work / f"onnx-{t}", t)
        cfg = json.loads((folder / "genai_config.json").read_text())
        cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
        (folder / "genai_config.json").write_text(json.dumps(cfg))
        out[f"ONNX Runtime GenAI {t}"] = (onnx_genai, folder)
    for t in ("int8", "int4"):
        out[f"OpenVINO GenAI {t}"] = (
            openvino_genai,
            write_openvino(model_dir, work / f"ov-{t}", t),
        )
    return out


def _in_subprocess(run, path: Path, ids: list[int], args) -> list[float]:
    """One timed generation in a fresh process: each runtime sizes its own thread pool once."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import json, deploy_runtimes as d; "
            f"print(json.dumps(d.{run.__name__}(__import__('pathlib').Path({str(path)!r}), {ids}, {args.tokens}, {args.threads})))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run.__name__} {path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from lorafuse.export.merge import merge_adapter
    from lorafuse.models.source import resolve_model_source
    from lorafuse.testing import save_tiny_adapter

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # onnxruntime's and torch's pools
    work = Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    base = Path(resolve_model_source(None))
    save_tiny_adapter(base, work / "adapter", r=8)
    merged = merge_adapter(base, work / "adapter", work / "merged")
    tok = AutoTokenizer.from_pretrained(merged)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]  # fmt: skip
    runners = {
        name: (run, path, None) for name, (run, path) in export(merged, work, args.threads).items()
    }
    for dtype in ("fp32", "bf16"):
        runners[f"lorafuse serve {dtype}"] = (lorafuse_serve, merged, dtype)
    runs: dict[str, list] = {name: [] for name in runners}
    loads = [os.getloadavg()[0]]
    for r in range(args.repeats):  # interleaved: each repeat times every runtime once
        for name, (run, path, dtype) in runners.items():
            if dtype is not None:
                runs[name].append(run(path, ids, args.tokens, args.threads, dtype))
            else:
                runs[name].append(_in_subprocess(run, path, ids, args))
            print(f"repeat {r + 1}: {name} {summary(runs[name][-1:])}", flush=True)
        loads.append(os.getloadavg()[0])
    results = {name: summary(r) for name, r in runs.items()}
    print(
        f"\n{len(ids)}-token prompt, {args.tokens} new tokens, {args.threads} threads, "
        f"median of {args.repeats} interleaved repeats; load average (1 min) "
        f"{min(loads):.1f}-{max(loads):.1f}"
    )
    print(f"{'runtime':<28} {'TTFT s':>8} {'decode tok/s':>13}")
    for name, r in results.items():
        print(f"{name:<28} {r['ttft_s']:8.3f} {r['decode_tok_s']:13.1f}")
    if args.json:
        from lorafuse import files

        files.write_json(
            args.json,
            {
                "results": results,
                "runs": runs,
                "loads": loads,
                "prompt_tokens": len(ids),
                "threads": args.threads,
            },
        )


if __name__ == "__main__":
    main()

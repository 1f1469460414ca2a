"""Aggregate generated tokens/s of `lorafuse serve` and of llama.cpp's server (llama-cpp-python's
``llama_cpp.server``) on the same model, at 1, 4, 8 and 16 concurrent streams.

One run does both: it exports the model with ``lorafuse export --format gguf`` (unless
``--gguf`` names one), starts ``lorafuse serve`` and ``python -m llama_cpp.server`` on free
ports (both up at once, measured in turn: ``--repeats`` times per stream count, alternating
which goes first, the median kept, so both see the same machine), and drives each with the
``openai`` client: C threads each send ``--rounds`` streamed
``/v1/completions`` requests back to back (the same text prompts, which both tokenize alike;
greedy; ``max_tokens`` N; the EOS token's ``logit_bias`` -100, so every request generates
exactly N tokens on both). A first non-streamed request per server checks that count, and
every stream must end with ``finish_reason: "length"`` (llama_cpp.server by default cuts a
running stream short when another request arrives; turned off here). Tokens/s = all generated
tokens / wall time of the C clients; TTFT = median time to the first streamed text.

llama_cpp.server decodes one request at a time (one lock around its model); lorafuse serve
batches up to ``--max-batch`` sequences. ``--llama-server PATH`` runs llama.cpp's own C++ server
instead (``llama-server``, which batches its slots; built from llama.cpp's sources, e.g. the copy
in llama-cpp-python's sdist under ``vendor/llama.cpp``: ``cmake -B build -DGGML_NATIVE=OFF
-DLLAMA_CURL=OFF && cmake --build build --target llama-server``).

    python benchmarks/serve.py [--dtype fp32] [--decode auto] [--outtype f32] [--threads 2]
        [--max-tokens 64] [--rounds 2] [--streams 1,4,8,16] [--json out.json]

``--decode`` is ``lorafuse serve --decode`` (the decode engine's weights: ``int8`` against
llama.cpp's ``q8_0``, ``auto`` with ``--dtype fp32`` against its ``f32``; ``model``: the
model's own forward).

``llama_cpp.server`` needs ``pip install 'llama-cpp-python[server]'`` (sse-starlette,
starlette-context, pydantic-settings; in the dev extra).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The three most important ideas in physics are",
    "Write a short guide to making bread at home. First,",
    "In the year 2050, cities will",
    "The history of the printing press begins",
    "A good software engineer should always",
    "Here is a recipe for a simple tomato soup:",
    "The main differences between cats and dogs are",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], port: int, env: dict, log: Path):
    """Run ``cmd`` until it answers ``GET /v1/models`` on ``port``; stop it afterwards."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[:4]} exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise SystemExit(f"{cmd[:4]} did not start in 600 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _request(model: str, eos: int, max_tokens: int, extra: dict) -> dict:
    return dict(model=model, max_tokens=max_tokens, temperature=0, logit_bias={str(eos): -100},
                extra_body=extra)  # fmt: skip


def measure(url: str, model: str, eos: int, prompts: list[str], streams: int, rounds: int,
            max_tokens: int, extra: dict) -> dict:  # fmt: skip
    """C concurrent clients, ``rounds`` streamed requests each: tokens/s and median TTFT."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    kw = _request(model, eos, max_tokens, extra)
    ttfts = []

    def one(i: int) -> None:
        for r in range(rounds):
            start, first = time.perf_counter(), None
            prompt = prompts[(i + r * streams) % len(prompts)]
            finish = None
            for chunk in client.completions.create(prompt=prompt, stream=True, **kw):
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - start
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            if finish != "length":  # EOS is biased away: anything else was cut short
                raise SystemExit(f"{url}: a stream ended with finish_reason {finish!r}")
            ttfts.append(first)

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as pool:
        list(pool.map(one, range(streams)))
    wall = time.perf_counter() - start
    tokens = streams * rounds * max_tokens
    return {"streams": streams, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(t for t in ttfts if t is not None)}  # fmt: skip


def _median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s among repeats (its TTFT with it)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def check_length(url: str, model: str, eos: int, prompt: str, max_tokens: int, extra: dict) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    r = client.completions.create(prompt=prompt, **_request(model, eos, max_tokens, extra))
    if r.usage.completion_tokens != max_tokens:
        raise SystemExit(f"{url} generated {r.usage.completion_tokens} tokens, not {max_tokens}")
    return r.choices[0].text


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="fp32", help="lorafuse serve --dtype")
    p.add_argument("--decode", default="auto", help="lorafuse serve --decode")
    p.add_argument("--outtype", default="f32", help="GGUF type for llama.cpp (f32, q8_0, ...)")
    p.add_argument("--gguf", default=None, help="an existing GGUF export (skips the export)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads per server")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="requests per stream")
    p.add_argument("--repeats", type=int, default=3,
                   help="measurements per server and stream count, alternating (median)")  # fmt: skip
    p.add_argument("--streams", default="1,4,8,16")
    p.add_argument("--max-batch", type=int, default=16, help="lorafuse serve --max-batch")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's own C++ server binary (continuous batching, one slot per "
                   "stream) instead of llama-cpp-python's llama_cpp.server")  # fmt: skip
    p.add_argument("--llama-args", default="", metavar="ARGS",
                   help="extra arguments for llama.cpp's server, e.g. '--no-repack' where its AMX "
                   "repacked products crash (seen: llama.cpp 0.3.36's sources built with "
                   "-DGGML_NATIVE=OFF, on an AMX Xeon)")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop("LORAFUSE_API_KEY", None)
    gguf = Path(args.gguf) if args.gguf else work / f"smollm2-{args.outtype}.gguf"
    if not args.gguf:
        subprocess.run([sys.executable, "-m", "lorafuse", "export", "--format", "gguf",
                        "--outtype", args.outtype, "-o", str(gguf)], check=True, env=env)  # fmt: skip
    from transformers import AutoTokenizer  # the exported model's tokenizer, for the EOS id

    from lorafuse.models.source import resolve_model_source

    tok = AutoTokenizer.from_pretrained(resolve_model_source(None))
    eos, prompts = tok.eos_token_id, PROMPTS  # text: llama_cpp.server takes no token ids
    ours_cmd = [sys.executable, "-m", "lorafuse", "serve", "--dtype", args.dtype, "--decode",
                args.decode, "--base-name", "m", "--max-batch", str(args.max_batch),
                "--max-queue", "256"]  # fmt: skip
    cpp_cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias",
               "m", "--n_ctx", "2048", "--n_threads", str(args.threads), "--n_threads_batch",
               str(args.threads), "--interrupt_requests", "false"]  # fmt: skip
    if args.llama_server:  # llama-server: -np slots decode together, the context split among them
        slots = max(streams)
        cpp_cmd = [args.llama_server, "-m", str(gguf), "--alias", "m", "-c", str(512 * slots),
                   "-np", str(slots), "-t", str(args.threads), "-tb", str(args.threads)]  # fmt: skip
    cpp_cmd += args.llama_args.split()
    # llama_cpp.server's own default repeat_penalty is 1.1: greedy means none (as OpenAI's)
    servers = (("lorafuse", ours_cmd, None), ("llama.cpp", cpp_cmd, {"repeat_penalty": 1.0}))
    rows, texts = {name: [] for name, _, _ in servers}, {}
    with contextlib.ExitStack() as stack:  # both up at once, measured in turn (interleaved)
        urls = {}
        for name, cmd, extra in servers:
            port = _free_port()
            urls[name] = stack.enter_context(
                server(cmd + ["--port", str(port)], port, env, work / f"{name}.log")
            )
            texts[name] = check_length(urls[name], "m", eos, prompts[0], args.max_tokens, extra)
        for c in streams:
            runs = {name: [] for name in urls}
            for r in range(args.repeats):  # alternate which server goes first
                for name, _, extra in servers[:: 1 if r % 2 == 0 else -1]:
                    runs[name].append(
                        measure(
                            urls[name], "m", eos, prompts, c, args.rounds, args.max_tokens, extra
                        )
                    )
            for name, got in runs.items():
                rows[name].append(_median_run(got))  # fmt: skip
    load = os.getloadavg()
    cpp_server = "llama-server" if args.llama_server else "llama_cpp.server"
    print(f"\nCPU: {_cpu_name()}, {args.threads} threads per "
          f"server; lorafuse {args.dtype} --decode {args.decode}, llama.cpp ({cpp_server}) {gguf.name}; greedy, {args.max_tokens} tokens "
          f"x {args.rounds} requests per stream; load average {load[0]:.2f} {load[1]:.2f}")  # fmt: skip
    print("same greedy text on both servers:", texts["lorafuse"] == texts["llama.cpp"])
    print(f"{'streams':>7} | {'lorafuse tok/s':>14} | {'llama.cpp tok/s':>15} | {'ratio':>5} | "
          f"{'TTFT ours':>9} | {'TTFT llama.cpp':>14}")  # fmt: skip
    for ours, cpp in zip(rows["lorafuse"], rows["llama.cpp"]):
        print(f"{ours['streams']:>7} | {ours['tokens_per_s']:>14.1f} | {cpp['tokens_per_s']:>15.1f} | "
              f"{ours['tokens_per_s'] / cpp['tokens_per_s']:>5.2f} | {ours['ttft_median_s']:>8.2f}s | "
              f"{cpp['ttft_median_s']:>13.2f}s")  # fmt: skip
    if args.json:
        from lorafuse.files import write_json

        write_json(args.json, {"args": vars(args), "load": load, "rows": rows, "texts": texts})


if __name__ == "__main__":
    main()

"""`lorafuse export`: a model (+ adapter, merged first) to GGUF, a safetensors HF dir, an ONNX
Runtime GenAI folder or an OpenVINO IR folder; or an adapter alone, for llama.cpp, ONNX Runtime
GenAI or OpenVINO GenAI to apply at run time.

Every check that can fail (architecture, outtype, tokenizer, existing output) runs before any
file is written; outputs appear atomically (temp name, then rename).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from lorafuse.commands._args import add_model_arguments, spec_from_args
from lorafuse.commands.merge import STORAGE_DTYPES
from lorafuse.dtypes import parse_dtype
from lorafuse.errors import LorafuseError
from lorafuse.export.runtime_export import RUNTIME_FORMATS
from lorafuse.models.resolve import resolve_hf_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapters="one")
    parser.add_argument(
        "--format",
        choices=["gguf", "gguf-lora", "safetensors", *RUNTIME_FORMATS],
        required=True,
        help="gguf-lora: the --adapter alone, for llama.cpp --lora / Ollama ADAPTER; onnx: ONNX "
        "Runtime GenAI folder; onnx-adapter: the --adapter alone for a --lora-inputs ONNX base; "
        "openvino: OpenVINO IR folder; openvino-adapter: the --adapter alone, for OpenVINO GenAI",
    )
    parser.add_argument(
        "-o", "--output", required=True, help="GGUF file, or output dir for safetensors"
    )
    parser.add_argument(
        "--outtype", default=None,
        help="GGUF tensor type: f32, f16, bf16, q8_0, or one made by llama.cpp's quantizer "
        "(q4_k_m, q5_k_m, q6_k, q4_0, ...; default f16); onnx: fp32 (default), int8, int4; "
        "openvino: fp32, fp16 (default), int8, int4",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=STORAGE_DTYPES, default="auto", help="safetensors storage dtype"
    )
    parser.add_argument("--max-shard-size", default="2GB", help="safetensors shard size")
    parser.add_argument("--name", default=None, help="general.name in the GGUF metadata")
    parser.add_argument(
        "--ollama", action="store_true", help="also write an Ollama Modelfile next to the GGUF"
    )
    parser.add_argument(
        "--base-gguf", default=None, metavar="PATH",
        help="with --format gguf-lora --ollama: the base model's GGUF (from `--format gguf` of the "
        "base), the Modelfile's FROM; the adapter becomes its ADAPTER",
    )  # fmt: skip
    parser.add_argument(
        "--pre-tokenizer", default=None, metavar="NAME",
        help="llama.cpp pre-tokenizer name to write (default: carried over from a source GGUF or "
        "identified from the tokenizer as llama.cpp's converter does)",
    )  # fmt: skip
    parser.add_argument(
        "--lora-inputs", action="store_true",
        help="with --format onnx and --adapter: the base model (not merged) with zero-default LoRA "
        "inputs at the adapter's modules, which --format onnx-adapter files set per request",
    )  # fmt: skip
    parser.add_argument(
        "--base-onnx", default=None, metavar="DIR",
        help="with --format onnx-adapter: the --lora-inputs base folder the adapter is for",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace existing output")


def _precheck_gguf(model_dir: Path, args) -> None:
    from lorafuse.export.gguf_export import check_exportable
    from lorafuse.export.gguf_vocab import read_vocab

    out = Path(args.output)
    if out.suffix != ".gguf":
        raise LorafuseError(f"--output {out}: a GGUF file name must end in .gguf")
    if out.exists() and not args.force:
        raise LorafuseError(f"output {out} exists (use --force to replace it)")
    config = json.loads((model_dir / "config.json").read_text())
    check_exportable(config, args.outtype)  # GGUFExportError is a LorafuseError: one line, exit 2
    # tokenizer problems surface before merging
    read_vocab(model_dir, config["vocab_size"], pre=args.pre_tokenizer)


def run(args: argparse.Namespace) -> int:
    from lorafuse.export.merge import merge_adapter

    spec = spec_from_args(args)
    if len(spec.adapters) > 1:
        raise LorafuseError("export takes one adapter")
    base_dir = Path(resolve_hf_dir(spec.base))
    adapter = next(iter(spec.adapters.values()), None)
    if args.base_gguf is not None and not (args.format == "gguf-lora" and args.ollama):
        raise LorafuseError("--base-gguf is for --format gguf-lora --ollama")
    if args.format in RUNTIME_FORMATS:
        return _write_runtime(base_dir, adapter, spec, args)
    if args.lora_inputs or args.base_onnx:
        raise LorafuseError("--lora-inputs / --base-onnx are for --format onnx / onnx-adapter")
    args.outtype = args.outtype or "f16"
    if args.format == "safetensors":
        out = Path(args.output)
        merge_adapter(base_dir, adapter, out, dtype=parse_dtype(args.dtype), max_shard_size=args.max_shard_size,
                      tokenizer_dir=spec.tokenizer_dir, overwrite=args.force)  # fmt: skip
        print(f"wrote {out} ({'merged ' + adapter if adapter else 'copied'} from {base_dir})")
        return 0
    if args.format == "gguf-lora":
        return _write_lora(base_dir, adapter, spec, args)
    _precheck_gguf(base_dir, args)
    if adapter is None:
        return _write(base_dir, args)
    out_parent = Path(args.output).resolve().parent
    out_parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".lorafuse-merge-", dir=out_parent))
    try:  # fp32 merge so the GGUF conversion starts from exact merged weights
        merged = merge_adapter(base_dir, adapter, work / "merged", dtype=torch.float32,
                               tokenizer_dir=spec.tokenizer_dir)  # fmt: skip
        _precheck_gguf(merged, args)  # the adapter dir's tokenizer may differ from the base's
        return _write(merged, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write(model_dir: Path, args) -> int:
    from lorafuse.export.gguf_export import write_gguf, write_modelfile

    path = write_gguf(model_dir, args.output, args.outtype, name=args.name, overwrite=args.force,
                      pre=args.pre_tokenizer)  # fmt: skip
    print(f"wrote {path} ({args.outtype}, {path.stat().st_size / 2**20:.1f} MiB)")
    if args.ollama:
        print(f"wrote {write_modelfile(path, model_dir)}")
    return 0


def _write_lora(base_dir: Path, adapter: str | None, spec, args) -> int:
    from lorafuse.export.gguf_lora import write_lora_gguf
    from lorafuse.export.ollama import check_base_gguf, write_modelfile

    if adapter is None:
        raise LorafuseError("--format gguf-lora needs --adapter (or an adapter --checkpoint)")
    if args.ollama:
        if args.base_gguf is None:
            raise LorafuseError("--ollama with --format gguf-lora needs --base-gguf: the base "
                                "model's GGUF (`lorafuse export --format gguf` of the base)")  # fmt: skip
        check_base_gguf(args.base_gguf, base_dir)
    path = write_lora_gguf(base_dir, adapter, args.output, args.outtype, name=args.name,
                           overwrite=args.force)  # fmt: skip
    print(f"wrote {path} (LoRA adapter for {base_dir}, {args.outtype}, "
          f"{path.stat().st_size / 2**20:.1f} MiB)")  # fmt: skip
    if args.ollama:
        print(f"wrote {write_modelfile(path, spec.tokenizer_dir or base_dir, args.base_gguf)}")
    return 0


def _write_runtime(base_dir: Path, adapter: str | None, spec, args) -> int:
    from lorafuse.export.runtime_export import export_runtime

    path, what = export_runtime(base_dir, adapter, args.format, args.output, args.outtype,
                                lora_inputs=args.lora_inputs, base_onnx=args.base_onnx,
                                tokenizer_dir=spec.tokenizer_dir, overwrite=args.force)  # fmt: skip
    print(f"wrote {path} ({what})")
    return 0

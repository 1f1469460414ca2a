"""`lorafuse export --format onnx | onnx-adapter | openvino | openvino-adapter`: the CPU
deployment runtimes besides llama.cpp (ONNX Runtime GenAI, OpenVINO GenAI)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from lorafuse.errors import LorafuseError
from lorafuse.files import tree_size

RUNTIME_FORMATS = ("onnx", "onnx-adapter", "openvino", "openvino-adapter")
DEFAULT_OUTTYPE = {"onnx": "fp32", "openvino": "fp16"}


@contextmanager
def _merged(base_dir: Path, adapter: str | None, spec, out: Path):
    """The model to convert: the base, or the adapter merged in fp32 in a temp dir beside ``out``
    (removed afterwards)."""
    if adapter is None:
        yield base_dir
        return
    from lorafuse.export.merge import merge_adapter

    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".lorafuse-merge-", dir=out.resolve().parent))
    try:
        yield merge_adapter(base_dir, adapter, work / "merged", dtype=torch.float32,
                            tokenizer_dir=spec.tokenizer_dir)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_runtime(base_dir: Path, adapter: str | None, spec, args: argparse.Namespace) -> int:
    out = Path(args.output)
    if (
        args.lora_inputs
        and args.format != "onnx"
        or args.base_onnx
        and args.format != "onnx-adapter"
    ):
        raise LorafuseError("--lora-inputs is for --format onnx, --base-onnx for onnx-adapter")
    if args.format.endswith("-adapter"):
        return _write_adapter(adapter, args, out)
    outtype = args.outtype or DEFAULT_OUTTYPE[args.format]
    if args.format == "onnx":
        from lorafuse.export.onnx import write_onnx

        if args.lora_inputs:
            if adapter is None:
                raise LorafuseError("--lora-inputs needs --adapter: its modules get the inputs")
            path = write_onnx(base_dir, out, outtype, lora_from=adapter, overwrite=args.force)
            what = f"base {base_dir} with LoRA inputs at {adapter}'s modules"
        else:
            with _merged(base_dir, adapter, spec, out) as model_dir:
                path = write_onnx(model_dir, out, outtype, overwrite=args.force)
            what = f"{'merged ' + adapter if adapter else base_dir}"
        print(f"wrote {path} (ONNX Runtime GenAI, {outtype}, {what}, "
              f"{tree_size(path) / 2**20:.1f} MiB)")  # fmt: skip
        return 0
    from lorafuse.export.openvino import write_openvino

    with _merged(base_dir, adapter, spec, out) as model_dir:
        path = write_openvino(model_dir, out, outtype, overwrite=args.force)
    print(f"wrote {path} (OpenVINO IR, {outtype}, {'merged ' + adapter if adapter else base_dir}, "
          f"{tree_size(path) / 2**20:.1f} MiB)")  # fmt: skip
    return 0


def _write_adapter(adapter: str | None, args: argparse.Namespace, out: Path) -> int:
    if adapter is None:
        raise LorafuseError(f"--format {args.format} needs --adapter (or an adapter --checkpoint)")
    if args.outtype not in (None, "fp32"):
        raise LorafuseError(f"--format {args.format} writes fp32 LoRA weights (no --outtype)")
    if args.format == "onnx-adapter":
        from lorafuse.export.onnx import write_onnx_adapter

        if args.base_onnx is None:
            raise LorafuseError("--format onnx-adapter needs --base-onnx: the base folder from "
                                "`lorafuse export --format onnx --lora-inputs`")  # fmt: skip
        path = write_onnx_adapter(adapter, args.base_onnx, out, overwrite=args.force)
        where = f"ONNX Runtime adapter for {args.base_onnx}"
    else:
        from lorafuse.export.openvino import write_openvino_adapter

        path = write_openvino_adapter(adapter, out, overwrite=args.force)
        where = "OpenVINO GenAI adapter, alpha 1 = as trained"
    print(f"wrote {path} ({where}, {path.stat().st_size / 2**20:.2f} MiB)")
    return 0

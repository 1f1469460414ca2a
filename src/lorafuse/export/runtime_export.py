"""One model or adapter export for a CPU runtime besides llama.cpp: ONNX Runtime GenAI folders and
adapter files (``export/onnx.py``), OpenVINO IR folders and adapters (``export/openvino.py``).

``export_runtime`` checks the combination of options, merges an adapter first where the format
carries it merged (fp32, in a temp dir beside the output, removed afterwards) and returns what
was written with a one-line description; ``lorafuse export`` only parses and prints.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from lorafuse.errors import LorafuseError
from lorafuse.files import tree_size

RUNTIME_FORMATS = ("onnx", "onnx-adapter", "openvino", "openvino-adapter")
DEFAULT_OUTTYPE = {"onnx": "fp32", "openvino": "fp16"}


@contextmanager
def merged_model(base_dir: Path, adapter: str | None, out: Path, tokenizer_dir=None):
    """The model to convert: ``base_dir``, or ``adapter`` merged into it in fp32 in a temp dir
    beside ``out`` (removed on exit)."""
    if adapter is None:
        yield base_dir
        return
    import torch

    from lorafuse.export.merge import merge_adapter

    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".lorafuse-merge-", dir=out.resolve().parent))
    try:
        yield merge_adapter(base_dir, adapter, work / "merged", dtype=torch.float32,
                            tokenizer_dir=tokenizer_dir)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_options(fmt: str, outtype, lora_inputs: bool, base_onnx) -> None:
    if fmt not in RUNTIME_FORMATS:
        raise LorafuseError(f"unknown runtime format {fmt!r} (one of {', '.join(RUNTIME_FORMATS)})")
    if lora_inputs and fmt != "onnx" or base_onnx and fmt != "onnx-adapter":
        raise LorafuseError("--lora-inputs is for --format onnx, --base-onnx for onnx-adapter")
    if fmt.endswith("-adapter") and outtype not in (None, "fp32"):
        raise LorafuseError(f"--format {fmt} writes fp32 LoRA weights (no --outtype)")


def export_runtime(base_dir: str | os.PathLike, adapter: str | None, fmt: str,
                   out: str | os.PathLike, outtype: str | None = None, *, lora_inputs: bool = False,
                   base_onnx: str | os.PathLike | None = None, tokenizer_dir=None,
                   overwrite: bool = False) -> tuple[Path, str]:  # fmt: skip
    """Write ``fmt`` (one of ``RUNTIME_FORMATS``) to ``out``; returns (path, description).

    onnx / openvino: the base, or base + adapter merged (``lora_inputs``: the unmerged base with
    zero-default LoRA inputs at the adapter's modules); *-adapter: the adapter alone (fp32).
    """
    base_dir, out = Path(base_dir), Path(out)
    _check_options(fmt, outtype, lora_inputs, base_onnx)
    if fmt.endswith("-adapter"):
        return _export_adapter(adapter, fmt, out, base_onnx, overwrite)
    outtype = outtype or DEFAULT_OUTTYPE[fmt]
    what = f"merged {adapter}" if adapter else str(base_dir)
    if fmt == "onnx":
        from lorafuse.export.onnx import write_onnx

        if lora_inputs:
            if adapter is None:
                raise LorafuseError("--lora-inputs needs --adapter: its modules get the inputs")
            path = write_onnx(base_dir, out, outtype, lora_from=adapter, overwrite=overwrite)
            what = f"base {base_dir} with LoRA inputs at {adapter}'s modules"
        else:
            with merged_model(base_dir, adapter, out, tokenizer_dir) as model_dir:
                path = write_onnx(model_dir, out, outtype, overwrite=overwrite)
        return path, f"ONNX Runtime GenAI, {outtype}, {what}, {tree_size(path) / 2**20:.1f} MiB"
    from lorafuse.export.openvino import write_openvino

    with merged_model(base_dir, adapter, out, tokenizer_dir) as model_dir:
        path = write_openvino(model_dir, out, outtype, overwrite=overwrite)
    return path, f"OpenVINO IR, {outtype}, {what}, {tree_size(path) / 2**20:.1f} MiB"


def _export_adapter(adapter: str | None, fmt: str, out: Path, base_onnx, overwrite: bool):
    if adapter is None:
        raise LorafuseError(f"--format {fmt} needs --adapter (or an adapter --checkpoint)")
    if fmt == "onnx-adapter":
        from lorafuse.export.onnx import write_onnx_adapter

        if base_onnx is None:
            raise LorafuseError("--format onnx-adapter needs --base-onnx: the base folder from "
                                "`lorafuse export --format onnx --lora-inputs`")  # fmt: skip
        path = write_onnx_adapter(adapter, base_onnx, out, overwrite=overwrite)
        where = f"ONNX Runtime adapter for {base_onnx}"
    else:
        from lorafuse.export.openvino import write_openvino_adapter

        path = write_openvino_adapter(adapter, out, overwrite=overwrite)
        where = "OpenVINO GenAI adapter, alpha 1 = as trained"
    return path, f"{where}, {path.stat().st_size / 2**20:.2f} MiB"

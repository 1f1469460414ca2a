"""Write a Hugging Face model as an ONNX Runtime GenAI model folder, and LoRA adapters as ONNX
Runtime adapter files that switch per generation over one base.

The folder (``model.onnx`` + ``model.onnx.data``, ``genai_config.json``, tokenizer files with the
chat template) is built by onnxruntime-genai's own model builder
(``onnxruntime_genai.models.builder``), run in this process from the local HF dir: it writes the
graph the runtime's GroupQueryAttention kernels expect and the config the runtime reads. On CPU
it builds ``fp32``, ``int8`` and ``int4`` (weight-only ``MatMulNBits``, block 32, its RTN
quantizer); fp16 is a GPU precision there (the CPU run fails inside the graph), so it is refused.

Run-time LoRA (``lora_from``): the builder writes an adapter's Linear layers as a ``lora_A`` /
``lora_B`` MatMul branch beside each base MatMul, with the weights as initializers
``model.layers.{i}.attn.q_proj.lora_A.MatMul.weight`` (in, r) and ``...lora_B...`` (r, out).
:func:`_lora_inputs` turns each into a graph input with a zero default (an overridable
initializer, ONNX IR >= 4) whose rank dimension is symbolic, so the model alone is the base and
an adapter file (:func:`write_onnx_adapter`, ``onnxruntime.AdapterFormat``) sets its own A and
scaled B of any rank, per request (``og.Adapters`` + ``Generator.set_active_adapter``). The
branch stays fp32 in an int4 / int8 base (excluded from the quantizer). Every file appears
atomically: the folder is built in a temp dir beside the output and renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from lorafuse import files
from lorafuse.errors import LorafuseError
from lorafuse.export.merge import stored_quantized
from lorafuse.export.runtime_adapter import read_lora_pairs

OUTTYPES = ("fp32", "int8", "int4")
# the families whose builder output is checked by ONNX Runtime GenAI in tests/export/test_onnx.py
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Gemma2ForCausalLM", "Phi3ForCausalLM")  # fmt: skip
# families the builder lists but fails on with transformers 5's configs (onnxruntime-genai 0.18)
REFUSED = {
    "Gemma3ForCausalLM": "the builder reads Gemma 3's rope settings in transformers 4's layout "
    "(rope_local_base_freq); transformers 5 keeps them per layer type and the build stops",
    "SmolLM3ForCausalLM": "the builder fails on SmolLM3's no-rope layers (KeyError 'position_ids')",
}
EXTRA = "pip install 'lorafuse[export]'"


class ONNXExportError(LorafuseError):
    """An ONNX export that cannot be done: the message says why."""


def check_exportable(config: dict, outtype: str) -> None:
    """Refuse (before any file is written) what the builder cannot build or was not checked on."""
    if outtype not in OUTTYPES:
        extra = " (fp16 runs on GPUs only in ONNX Runtime GenAI)" if outtype == "fp16" else ""
        raise ONNXExportError(f"ONNX outtype {outtype!r} not supported on CPU{extra}; "
                              f"choose one of {list(OUTTYPES)}")  # fmt: skip
    arch = (config.get("architectures") or [config.get("model_type")])[0]
    if arch in REFUSED:
        raise ONNXExportError(f"{arch} cannot be exported to ONNX: {REFUSED[arch]}")
    if arch not in FAMILIES:
        raise ONNXExportError(f"architecture {arch} not supported for ONNX export; "
                              f"supported: {list(FAMILIES)}")  # fmt: skip
    if stored_quantized(config):
        raise ONNXExportError("model is stored quantized; export needs original-precision weights")
    if arch == "Phi3ForCausalLM":
        mpe, orig = (
            config.get("max_position_embeddings"),
            config.get("original_max_position_embeddings"),
        )
        if orig is not None and mpe != orig:  # the builder takes this for LongRoPE
            raise ONNXExportError(
                f"Phi-3 with max_position_embeddings {mpe} != original_max_position_embeddings "
                f"{orig} (LongRoPE) is not supported for ONNX export"
            )


def _builder():
    try:
        from onnxruntime_genai.models import builder
    except ImportError as err:
        raise ONNXExportError(f"ONNX export needs onnxruntime-genai, onnxruntime, onnx and onnx-ir "
                              f"({err.name or err} is missing): {EXTRA}") from err  # fmt: skip
    return builder


def _lora_nodes(pairs: dict) -> list[str]:
    """The builder's node names of the LoRA MatMuls (kept out of int4 / int8 quantization):
    ``model.layers.0.attn.q_proj`` -> ``/model/layers.0/attn/q_proj/lora_A/MatMul``."""
    nodes = []
    for module in sorted(pairs):
        for name in _builder_module(module):
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if m is None:
                raise ONNXExportError(f"LoRA on {module}: only decoder layers take run-time LoRA")
            nodes += [
                f"/model/layers.{m[1]}/{m[2].replace('.', '/')}/lora_{h}/MatMul" for h in "AB"
            ]
    return nodes


def _builder_module(module: str) -> list[str]:
    """HF module name -> the builder's module names (Phi-3's fused layers are split, A shared)."""
    name = module.replace(".self_attn.", ".attn.")
    if name.endswith(".attn.qkv_proj"):
        return [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    if name.endswith(".mlp.gate_up_proj"):
        return [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
    return [name]


def write_onnx(model_dir: str | os.PathLike, out_dir: str | os.PathLike, outtype: str,
               lora_from: str | os.PathLike | None = None, overwrite: bool = False) -> Path:  # fmt: skip
    """Build the ONNX Runtime GenAI folder of the HF model in ``model_dir`` at ``out_dir``;
    ``lora_from`` (a PEFT adapter dir): give the base zero-default LoRA inputs at that adapter's
    modules, for :func:`write_onnx_adapter` files."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ONNXExportError(f"output {out_dir} exists (use --force to replace it)")
    config = json.loads((model_dir / "config.json").read_text())
    check_exportable(config, outtype)
    builder = _builder()
    options = []
    if lora_from is not None:
        pairs = read_lora_pairs(lora_from, "ONNX Runtime")
        options = [f"adapter_path={lora_from}"]
        if outtype != "fp32":
            nodes = _lora_nodes(pairs)
            options.append("nodes_to_exclude=" + ",".join(nodes))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with files.disk_full_as_error(
            "the ONNX model", out_dir, None, "its partial dir was removed"
        ):
            tmp.mkdir()
            _build(builder, model_dir, tmp, outtype, options)
            if lora_from is not None:
                _lora_inputs(tmp / "model.onnx")
            files.replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _build(builder, model_dir: Path, out: Path, outtype: str, options: list[str]) -> None:
    cache = out / ".builder-cache"
    # the builder reports its progress on stdout; ours is the command's result line
    with contextlib.redirect_stdout(sys.stderr):
        try:
            extra = builder.parse_extra_options("", str(model_dir), str(out), outtype, "cpu",
                                                str(cache), options)  # fmt: skip
            builder.create_model("", str(model_dir), str(out), outtype, "cpu", str(cache), **extra)
        except (LorafuseError, OSError):
            raise
        except Exception as err:  # the builder's own failure, named as such
            raise ONNXExportError(f"onnxruntime-genai's model builder failed on {model_dir}: "
                                  f"{type(err).__name__}: {err}") from err  # fmt: skip
    shutil.rmtree(cache, ignore_errors=True)


def _lora_inputs(model_path: Path) -> None:
    """Make every LoRA initializer an input with a zero default and a symbolic rank dim."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(model_path))
    for init in model.graph.initializer:
        for half in ("A", "B"):
            if init.name.endswith(f".lora_{half}.MatMul.weight"):
                arr = numpy_helper.to_array(init)  # A (in, r), B (r, out)
                rank = init.name.removesuffix(f".lora_{half}.MatMul.weight") + ".rank"
                shape = [arr.shape[0], rank] if half == "A" else [rank, arr.shape[1]]
                model.graph.input.append(
                    helper.make_tensor_value_info(init.name, init.data_type, shape)
                )
                init.CopyFrom(numpy_helper.from_array(np.zeros_like(arr), init.name))
    # the builder recorded the LoRA branch's (.., r) outputs with the build adapter's r fixed
    keep = [v for v in model.graph.value_info if "/lora_A/" not in v.name]
    del model.graph.value_info[:]
    model.graph.value_info.extend(keep)
    data = model_path.with_name(model_path.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save(model, str(model_path), save_as_external_data=True, location=data.name)


def lora_inputs(model_dir: str | os.PathLike) -> dict[str, tuple]:
    """{input name: shape} of the LoRA inputs of an ONNX model folder (empty: a plain model)."""
    import onnx

    path = Path(model_dir) / "model.onnx"
    if not path.is_file():
        raise ONNXExportError(f"{model_dir}: no model.onnx (the --format onnx output folder)")
    model = onnx.load(str(path), load_external_data=False)
    return {i.name: tuple(d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim)
            for i in model.graph.input if ".lora_" in i.name}  # fmt: skip


def write_onnx_adapter(adapter_dir: str | os.PathLike, base_onnx: str | os.PathLike,
                       out: str | os.PathLike, overwrite: bool = False) -> Path:  # fmt: skip
    """Write ``adapter_dir`` as an ONNX Runtime adapter file for the LoRA-input base folder
    ``base_onnx`` (fp32 A (in, r) and scaled B (r, out) per input); every name and width is
    checked against the base's inputs first."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ONNXExportError(f"output {out} exists (use --force to replace it)")
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise ONNXExportError(f"ONNX adapter export needs onnxruntime: {EXTRA}") from err
    slots = lora_inputs(base_onnx)
    if not slots:
        raise ONNXExportError(f"{base_onnx} has no LoRA inputs: export the base with "
                              "--format onnx --lora-inputs (and an --adapter)")  # fmt: skip
    params = {}
    for module, pair in read_lora_pairs(adapter_dir, "ONNX Runtime").items():
        names = _builder_module(module)
        offsets = _split_rows(module, pair.B.shape[0], slots, names)
        for name, (start, stop) in zip(names, offsets):
            a, b = f"{name}.lora_A.MatMul.weight", f"{name}.lora_B.MatMul.weight"
            if a not in slots or b not in slots:
                raise ONNXExportError(f"{adapter_dir}: module {module} has no LoRA input in "
                                      f"{base_onnx}; build the base with this adapter's targets")  # fmt: skip
            params[a] = pair.A.T.contiguous().numpy()  # (in, r)
            params[b] = pair.B[start:stop].T.contiguous().numpy()  # (r, out)
            if params[a].shape[0] != slots[a][0] or params[b].shape[1] != slots[b][1]:
                raise ONNXExportError(f"{adapter_dir}: {module}: widths {params[a].shape[0]} -> "
                                      f"{params[b].shape[1]} do not fit {base_onnx}'s "
                                      f"{slots[a][0]} -> {slots[b][1]}")  # fmt: skip
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in params.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    with files.disk_full_as_error("the ONNX adapter", out, sum(v.nbytes for v in params.values()),
                                  "its partial file was removed"):  # fmt: skip
        with files.atomic_path(out) as tmp:
            fmt.export_adapter(str(tmp))
            _check_written(tmp)
    return out


def _split_rows(module: str, n_rows: int, slots: dict, names: list[str]) -> list[tuple[int, int]]:
    """Row ranges of B for each of ``names`` (one name: all rows; Phi-3's fused q/k/v or
    gate/up: each part's output width, read from the base's lora_B inputs)."""
    if len(names) == 1:
        return [(0, n_rows)]
    widths = [slots.get(f"{n}.lora_B.MatMul.weight", (0, 0))[1] for n in names]
    if sum(widths) != n_rows:
        raise ONNXExportError(f"{module}: {n_rows} output rows do not split into the base's "
                              f"{dict(zip(names, widths))}")  # fmt: skip
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return [(s, s + w) for s, w in zip(starts, widths)]


def _check_written(path: Path) -> None:
    """onnxruntime reports a failed write only by a short file: a full disk leaves one."""
    if path.stat().st_size == 0:
        raise OSError(28, "No space left on device", str(path))

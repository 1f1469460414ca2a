"""Write a Hugging Face model as an OpenVINO IR folder that OpenVINO GenAI's ``LLMPipeline``
loads, and LoRA adapters as the safetensors its ``Adapter`` applies at run time.

The converter is OpenVINO's own (``openvino.convert_model``, its PyTorch frontend) on the
transformers model of this environment, traced through a thin wrapper that takes the KV cache
as flat tensors (``past_key_values.{i}.key|value``) and returns ``logits`` and
``present.{i}.key|value``. The pipeline's layout is then made as optimum-intel makes it
(``optimum/exporters/openvino/stateful.py``): a ``beam_idx`` input gathers every past tensor
(batch dim 0), OpenVINO's ``MakeStateful`` pass turns each past/present pair into a
ReadValue/Assign state, and each state starts as zeros of shape (batch, kv heads, 0, head dim).
Inputs: ``input_ids``, ``attention_mask``, ``position_ids``, ``beam_idx``. optimum-intel itself
is not used: it pins transformers < 5.6 (and torchvision), below the training stack.

Outtypes: ``fp32``, ``fp16`` (weights stored fp16, OpenVINO's default IR), ``int8`` and
``int4`` (weight-only, NNCF's ``compress_weights``: INT8_ASYM per channel; INT4_ASYM in groups
of ``INT4_GROUP`` with the embeddings and LM head kept int8, NNCF's default). The tokenizer is
converted by openvino-tokenizers (``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml``);
the HF tokenizer files (chat template included), ``config.json`` and ``generation_config.json``
go beside it. The folder is built in a temp dir next to the output and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from lorafuse import files
from lorafuse.errors import LorafuseError
from lorafuse.export.merge import TOKENIZER_FILES, stored_quantized
from lorafuse.export.runtime_adapter import read_lora_pairs

OUTTYPES = ("fp32", "fp16", "int8", "int4")
INT4_GROUP = 64  # divides the widths of every family here (SmolLM2: 576 = 9 x 64)
# the families whose IR is checked by OpenVINO GenAI in tests/export/test_openvino.py
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Phi3ForCausalLM", "SmolLM3ForCausalLM")  # fmt: skip
# sliding-window attention traced this way is wrong past the window (Gemma 3: other tokens than
# transformers from a 160-token prompt with a 16-token window; Gemma 2: the CPU plugin stops)
SLIDING = "sliding-window attention layers are not supported by this converter (the traced mask"
SLIDING += " is wrong past the window)"
EXTRA = "pip install 'lorafuse[export]'"
_PREFIX = "base_model.model."


class OpenVINOExportError(LorafuseError):
    """An OpenVINO export that cannot be done: the message says why."""


def check_exportable(config: dict, outtype: str) -> None:
    """Refuse (before any file is written) what this converter was not checked on."""
    if outtype not in OUTTYPES:
        raise OpenVINOExportError(f"OpenVINO outtype {outtype!r} not supported; "
                                  f"choose one of {list(OUTTYPES)}")  # fmt: skip
    arch = (config.get("architectures") or [config.get("model_type")])[0]
    sliding = "sliding_attention" in (config.get("layer_types") or []) or config.get(
        "use_sliding_window", config.get("sliding_window") is not None
    )
    if arch.startswith("Gemma") or sliding:
        raise OpenVINOExportError(f"{arch} cannot be exported to OpenVINO: {SLIDING}")
    if arch not in FAMILIES:
        raise OpenVINOExportError(f"architecture {arch} not supported for OpenVINO export; "
                                  f"supported: {list(FAMILIES)}")  # fmt: skip
    if stored_quantized(config):
        raise OpenVINOExportError(
            "model is stored quantized; export needs original-precision weights"
        )


def _modules():
    try:
        import nncf  # noqa: F401
        import openvino
        import openvino_tokenizers  # noqa: F401
    except ImportError as err:
        raise OpenVINOExportError(f"OpenVINO export needs openvino, openvino-tokenizers and nncf "
                                  f"({err.name or err} is missing): {EXTRA}") from err  # fmt: skip
    return openvino


class _FlatCache(torch.nn.Module):
    """(input_ids, attention_mask, position_ids, *past) -> (logits, *present); past/present
    alternate key, value per layer, each (batch, kv heads, length, head dim)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache()
        for i in range(0, len(past), 2):  # filled directly: update() concatenates to a 1-D empty
            layer = DynamicLayer()
            layer.lazy_initialization(past[i], past[i + 1])
            layer.keys, layer.values = past[i], past[i + 1]
            cache.layers.append(layer)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, use_cache=True)  # fmt: skip
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def _trace(model_dir: Path):
    """The model as an ov.Model with named flat-cache inputs and outputs."""
    from transformers import AutoModelForCausalLM

    ov = _modules()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    n, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    batch, new, old = 2, 3, 2  # any sizes: every dim of the trace stays dynamic
    example = (torch.ones(batch, new, dtype=torch.long), torch.ones(batch, old + new, dtype=torch.long),
               torch.arange(old, old + new).repeat(batch, 1),
               *[torch.zeros(batch, kv, old, hd) for _ in range(2 * n)])  # fmt: skip
    with torch.no_grad():
        ov_model = ov.convert_model(_FlatCache(model), example_input=example)
    kv_names = [f"{i}.{t}" for i in range(n) for t in ("key", "value")]
    names = [
        "input_ids",
        "attention_mask",
        "position_ids",
        *[f"past_key_values.{k}" for k in kv_names],
    ]
    for port, name in zip(ov_model.inputs, names):
        port.get_tensor().set_names({name})
    for port, name in zip(ov_model.outputs, ["logits", *[f"present.{k}" for k in kv_names]]):
        port.get_tensor().set_names({name})
    return ov_model, names[3:], [f"present.{k}" for k in kv_names]


def _make_stateful(ov_model, past: list[str], present: list[str]) -> None:
    """beam_idx gathers the past (dim 0); past/present pairs become zero-started states."""
    import numpy as np
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    beam_idx = opset13.parameter(name="beam_idx", dtype=ov.Type.i32, shape=ov.PartialShape([-1]))
    beam_idx.output(0).get_tensor().add_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    for name in past:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    ov_model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(ov_model, dict(zip(past, present)))
    ids = ov_model.input("input_ids")
    batch = opset13.gather(opset13.shape_of(ids, output_type="i64"), opset13.constant([0]),
                           opset13.constant(0))  # fmt: skip
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":  # (batch, heads, 0, head dim) zeros
            dims = [d.min_length for d in op.get_output_partial_shape(0)]
            parts = [batch] + [opset13.constant(np.array([d], dtype=np.int64)) for d in dims[1:]]
            zeros = opset13.constant(0.0, dtype=op.get_output_element_type(0))
            op.set_arguments([opset13.broadcast(zeros, opset13.concat(parts, axis=0))])
    ov_model.validate_nodes_and_infer_types()


def _compress(ov_model, outtype: str):
    import nncf

    if outtype == "int8":
        return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    if outtype == "int4":
        return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT4_ASYM,
                                     group_size=INT4_GROUP, ratio=1.0)  # fmt: skip
    return ov_model


def write_openvino(model_dir: str | os.PathLike, out_dir: str | os.PathLike, outtype: str,
                   overwrite: bool = False) -> Path:  # fmt: skip
    """Convert the HF model in ``model_dir`` to an OpenVINO GenAI folder at ``out_dir``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise OpenVINOExportError(f"output {out_dir} exists (use --force to replace it)")
    check_exportable(json.loads((model_dir / "config.json").read_text()), outtype)
    ov = _modules()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        ov_model, past, present = _trace(model_dir)
        _make_stateful(ov_model, past, present)
        ov_model = _compress(ov_model, outtype)
        with files.disk_full_as_error("the OpenVINO model", out_dir, None,
                                      "its partial dir was removed"):  # fmt: skip
            tmp.mkdir()
            _save(ov, ov_model, tmp / "openvino_model.xml", outtype == "fp16")
            _write_tokenizer(model_dir, tmp)
            files.replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _save(ov, ov_model, path: Path, fp16: bool) -> None:
    """ov.save_model, with its stream failure on a full disk ("basic_ios::clear: iostream
    error", no errno) reported as ENOSPC when the disk is left with under 1 MiB."""
    try:
        ov.save_model(ov_model, path, compress_to_fp16=fp16)
    except RuntimeError as err:
        if files.free_bytes(path.parent) < 2**20:
            raise OSError(28, "No space left on device", str(path)) from err
        raise


def _write_tokenizer(model_dir: Path, out: Path) -> None:
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    try:
        tok, detok = convert_tokenizer(
            AutoTokenizer.from_pretrained(model_dir), with_detokenizer=True
        )
    except Exception as err:  # openvino-tokenizers' own refusal, named as such
        raise OpenVINOExportError(f"openvino-tokenizers cannot convert {model_dir}'s tokenizer: "
                                  f"{type(err).__name__}: {err}") from err  # fmt: skip
    ov.save_model(tok, out / "openvino_tokenizer.xml")
    ov.save_model(detok, out / "openvino_detokenizer.xml")
    for name in (*TOKENIZER_FILES, "config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)


def write_openvino_adapter(adapter_dir: str | os.PathLike, out: str | os.PathLike,
                           overwrite: bool = False) -> Path:  # fmt: skip
    """``adapter_dir`` as the safetensors OpenVINO GenAI's ``Adapter`` loads: PEFT's names
    (``base_model.model.<module>.lora_A|lora_B.weight``, matched against the IR's MatMul names),
    fp32, PEFT's per-module scale folded into B so that ``alpha=1`` is the trained adapter (the
    pipeline ignores alphas in the file and scales by the caller's alpha alone)."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.suffix != ".safetensors":
        raise OpenVINOExportError(f"--output {out}: an OpenVINO adapter file ends in .safetensors")
    if out.exists() and not overwrite:
        raise OpenVINOExportError(f"output {out} exists (use --force to replace it)")
    tensors = {}
    for module, pair in read_lora_pairs(adapter_dir, "OpenVINO GenAI").items():
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = pair.A.contiguous()  # (r, in)
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = pair.B.contiguous()  # (out, r), scaled
    out.parent.mkdir(parents=True, exist_ok=True)
    size = sum(t.numel() * 4 for t in tensors.values())
    with files.disk_full_as_error(
        "the OpenVINO adapter", out, size, "its partial file was removed"
    ):
        with files.atomic_path(out) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
    return out

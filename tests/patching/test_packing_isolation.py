"""Packing isolation, for every family lorafuse trains: the logits and the summed token loss of
every example inside a packed (and padded) row equal those of the example run alone, fp32.

Each model goes the way ``lorafuse train`` takes it: the load-time mixer patching
(``FastLanguageModel.from_pretrained`` runs :func:`lorafuse.patching.mixers.install`), then
:func:`~lorafuse.models.capabilities.packing_supported` (which must say yes: a family it turns
packing off for would have to be listed here with its reason), then LoRA with the fused patches.
Cases: every registry family (its tiny model), the older arch families and every late-2026 family
(hybrids with Gated DeltaNet, short convolutions or Mamba2 among them). The rows are longer than
the Mamba2 chunk (8) and the conv kernels, so a state crossing an example boundary shows.
"""

from __future__ import annotations

import pytest
import torch

from lorafuse.data.masking import IGNORE_INDEX, Encoded
from lorafuse.data.packing import collate, pack
from lorafuse.models.capabilities import packing_supported
from lorafuse.patching import mixers
from lorafuse.patching.registry import REGISTRY
from lorafuse.testing.arch_families import ARCH_CASES, build_arch_model
from lorafuse.testing.new_families import (
    FAMILY_CASES,
    build_family_model,
    build_qwen3_5_vl_model,
    family_config,
)

VOCAB = 256
# The engine never packs vision-language rows (one conversation each, train/engine.py).
VLM_TYPES = {"idefics3", "qwen2_vl", "qwen2_5_vl"}
# Qwen3.5's small models ship as its vision-language model (model_type qwen3_5); loaded as a
# language model, its text rows pack: its decoder is a case of its own, text-only.
QWEN3_5_VL = "Qwen3_5ForConditionalGeneration"


class _Tok:  # what build_arch_model reads of a tokenizer
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self) -> int:
        return VOCAB


def _model_type(arch: str) -> str:
    if arch == QWEN3_5_VL:
        return "qwen3_5"
    if arch in FAMILY_CASES:
        return family_config(arch).model_type
    import transformers

    return getattr(transformers, ARCH_CASES[arch][0])().model_type


CASES = sorted(ARCH_CASES) + sorted(FAMILY_CASES) + [QWEN3_5_VL]


def test_every_registry_family_is_a_case():
    covered = {_model_type(a) for a in CASES} | VLM_TYPES
    assert set(REGISTRY) <= covered, sorted(set(REGISTRY) - covered)


def _examples():
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (7, 13, 5, 11, 9):
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append(Encoded(ids, [IGNORE_INDEX] + ids[1:]))
    return out


def _lora_model(arch: str):
    from lorafuse import FastLanguageModel

    if arch == QWEN3_5_VL:
        base, arch = build_qwen3_5_vl_model(), "Qwen3_5ForCausalLM"  # its text decoder's targets
    elif arch in FAMILY_CASES:
        base = build_family_model(arch)
    else:
        base = build_arch_model(arch, _Tok())
    mixers.install(base)  # what FastLanguageModel.from_pretrained does at load time
    ok, why = packing_supported(base)
    assert ok, f"packing turned off for {arch}: {why}"
    targets = FAMILY_CASES[arch][3] if arch in FAMILY_CASES else ARCH_CASES[arch][2]
    model = FastLanguageModel.get_peft_model(base, r=4, target_modules=targets,
                                             use_gradient_checkpointing=False,
                                             cpu_heap_policy=False)  # fmt: skip
    with torch.no_grad():  # non-zero B so the LoRA branch matters
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model.eval()


@pytest.mark.parametrize("arch", CASES)
def test_packed_rows_equal_each_example_alone(arch, close):
    model = _lora_model(arch)
    examples = _examples()
    rows = pack(examples, max_seq_length=24)  # [7 + 13], [5 + 11], [9 + padding]
    batch = collate(rows, pad_id=0, packed=True)
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        packed = model(**inputs, use_cache=False).logits  # (3, 24, V)
        packed_loss = model(**batch, num_items_in_batch=1, use_cache=False).loss  # summed
        alone_loss, k = 0.0, 0
        for r, row in enumerate(rows):
            start = 0
            for _ in range(row.n_examples):
                ex = examples[k]
                ids, n = torch.tensor([ex.input_ids]), len(ex.input_ids)
                alone = model(input_ids=ids, use_cache=False).logits[0]  # (n, V)
                scale = alone.abs().max().item()
                close(packed[r, start : start + n], alone, atol=1e-5 * scale, rtol=1e-5,
                      name=f"{arch} example {k} logits")  # fmt: skip
                labels = torch.tensor([ex.labels])
                alone_loss += model(input_ids=ids, labels=labels, num_items_in_batch=1,
                                    use_cache=False).loss  # fmt: skip
                start, k = start + n, k + 1
    close(packed_loss, alone_loss, atol=1e-5 * alone_loss.abs().item(), rtol=1e-5,
          name=f"{arch} summed token loss")  # fmt: skip

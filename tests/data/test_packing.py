"""Packing: several examples per row with no cross-contamination.

The proof: logits and token losses of every example inside a packed (and padded) row equal those
of the example run alone, for the attention implementations packing relies on and for the fused
lorafuse path. fp32 on tiny shapes: differences are summation-order rounding (~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from lorafuse.data.masking import IGNORE_INDEX, Encoded
from lorafuse.data.packing import collate, pack, single_rows


def _examples():
    g = torch.Generator().manual_seed(0)
    out = []
    for n in (5, 9, 3, 7):
        ids = torch.randint(3, 120, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] + ids[1:]
        out.append(Encoded(ids, labels))
    return out


def test_pack_layout():
    rows = pack(_examples(), max_seq_length=16)
    assert [r.n_examples for r in rows] == [2, 2]  # 5+9 fit, 3 does not; 3+7 fit
    assert rows[0].position_ids == list(range(5)) + list(range(9))
    batch = collate(rows, pad_id=0, packed=True)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == (2, 14)
    assert batch["labels"][1, 10:].eq(IGNORE_INDEX).all()  # padding is never a target
    assert batch["position_ids"][1].tolist() == list(range(3)) + list(range(7)) + list(range(4))
    unpacked = collate(single_rows(_examples()), pad_id=0, packed=False)
    assert unpacked["attention_mask"].sum(1).tolist() == [5, 9, 3, 7]


def _model(attn, fused):
    from transformers import LlamaForCausalLM

    from lorafuse.testing import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(attn_implementation=attn)).eval()
    if fused:
        from lorafuse import FastLanguageModel

        model = FastLanguageModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
        with torch.no_grad():  # non-zero B so the LoRA branch matters
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        model.eval()
    return model


@pytest.mark.parametrize("attn, fused", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_packed_equals_alone(attn, fused, close):
    model = _model(attn, fused)
    examples = _examples()
    rows = pack(examples, max_seq_length=16)
    batch = collate(rows, pad_id=0, packed=True)
    with torch.no_grad():
        # use_cache=False: with a KV cache transformers does not look for packed sequences
        packed = model(
            **{k: v for k, v in batch.items() if k != "labels"}, use_cache=False
        ).logits  # (2, 14, V)
        packed_loss = model(
            **batch, num_items_in_batch=1, use_cache=False
        ).loss  # sum of token losses
        alone_loss = 0.0
        k = 0
        for r, row in enumerate(rows):
            start = 0
            for _ in range(row.n_examples):
                ex = examples[k]
                ids = torch.tensor([ex.input_ids])
                alone = model(input_ids=ids).logits[0]  # (n, V)
                n = len(ex.input_ids)
                close(
                    packed[r, start : start + n],
                    alone,
                    atol=2e-5,
                    rtol=1e-5,
                    name=f"example {k} logits",
                )
                alone_loss += model(
                    input_ids=ids, labels=torch.tensor([ex.labels]), num_items_in_batch=1
                ).loss
                start += n
                k += 1
    close(packed_loss, alone_loss, atol=1e-4, rtol=1e-5, name="summed token loss")

"""LoRA unmerged in the decode engine: a batch mixing adapters, prompt lengths and stop points
gives each row what PEFT gives that adapter alone (greedy tokens, logits), the base rows the
bare model's; an in-place update of an adapter (an optimizer step) and a newly loaded adapter are
what the next step uses."""

from __future__ import annotations

import pytest
import torch

from lorafuse import decode
from lorafuse.models.resolve import use_adapter

pytestmark = pytest.mark.cpp
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "hello", "0123",
           "What is the capital of France? The capital of France is"]  # fmt: skip


@pytest.fixture(scope="module")
def peft(tmp_path_factory):
    from lorafuse.models.resolve import ModelSpec, load_resolved
    from lorafuse.testing import make_tiny_workspace

    ws = make_tiny_workspace(tmp_path_factory.mktemp("ws"))
    spec = ModelSpec(str(ws["base"]), {"a": str(ws["adapter_a"]), "b": str(ws["adapter_b"])})
    model, tok, _ = load_resolved(spec, dtype=torch.float32)
    return model, tok, ws


def peft_greedy(model, ids, n, adapter):
    with use_adapter(model, adapter), torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    return out[0, len(ids) :].tolist(), logits


def test_a_mixed_batch_gives_each_row_its_adapter(peft):
    model, tok, _ = peft
    engine = decode.engine_for(model)
    assert engine is not None and engine.adapters == ["a", "b"]
    rows = [(None, PROMPTS[0], 12), ("a", PROMPTS[1], 5), ("b", PROMPTS[2], 16),
            ("a", PROMPTS[3], 9), (None, PROMPTS[1], 3), ("b", PROMPTS[0], 7)]  # fmt: skip
    ids = [tok(p)["input_ids"] for _, p, _ in rows]
    seqs = [engine.open(a, len(i) + n) for (a, _, n), i in zip(rows, ids)]
    first = [engine.prefill(s, i) for s, i in zip(seqs, ids)]
    out = [[int(f.argmax())] for f in first]
    live = list(range(len(rows)))
    while live := [r for r in live if len(out[r]) < rows[r][2]]:  # a row leaves at its length
        logits = engine.step([seqs[r] for r in live], [out[r][-1] for r in live])
        for r, row in zip(live, logits):
            out[r].append(int(row.argmax()))
    for r, ((adapter, _, n), i) in enumerate(zip(rows, ids)):
        want, want_logits = peft_greedy(model, i, n, adapter)
        assert out[r] == want, (r, adapter)
        assert (first[r] - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()
    # the adapters do change the outputs (else the check above would not see a mix-up)
    assert len({tuple(peft_greedy(model, ids[0], 8, a)[0]) for a in (None, "a", "b")}) == 3


def test_in_place_updates_and_new_adapters_are_seen(peft):
    from peft import PeftModel

    model, tok, ws = peft
    ids = tok(PROMPTS[3])["input_ids"]
    engine = decode.engine_for(model)
    before = engine.prefill(engine.open("a", len(ids)), ids)
    lora_b = next(p for n, p in model.named_parameters() if "lora_B.a" in n and "down_proj" in n)
    try:
        with torch.no_grad():
            lora_b.mul_(3.0)  # what an optimizer step does: the same storage, new values
        assert decode.engine_for(model) is engine
        after = engine.prefill(engine.open("a", len(ids)), ids)
        _, want = peft_greedy(model, ids, 1, "a")
        assert not torch.allclose(after, before)
        assert (after - want).abs().max() <= 1e-5 * want.abs().max()
    finally:
        with torch.no_grad():
            lora_b.div_(3.0)
    assert isinstance(model, PeftModel)
    model.load_adapter(str(ws["adapter_b"]), adapter_name="c")
    try:
        engine = decode.engine_for(model)
        assert engine.adapters == ["a", "b", "c"]
        got = engine.prefill(engine.open("c", len(ids)), ids)
        _, want = peft_greedy(model, ids, 1, "c")
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    finally:
        model.delete_adapter("c")
        model.set_adapter("a")


def test_active_adapter_follows_peft(peft):
    model, _, _ = peft
    model.set_adapter("b")
    assert decode.active_adapter(model) == "b"
    with model.disable_adapter():
        assert decode.active_adapter(model) is None
    model.set_adapter("a")
    assert decode.active_adapter(model) == "a"

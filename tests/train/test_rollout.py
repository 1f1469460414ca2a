"""GRPO rollouts: batched KV-cache sampling with left-padded prompts gives each prompt's own
decoding (greedy equals ``stream_generate``), EOS ends a row (kept), the generator makes samples
reproducible, top-k / top-p restrict the support."""

from __future__ import annotations

import pytest
import torch

from lorafuse.errors import LorafuseError
from lorafuse.generation import GenerationResult, SamplingParams, stream_generate
from lorafuse.train.rollout import RolloutParams, generate, sample_rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lorafuse.testing import save_tiny_model

    model, tok = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    prompts = [tok(t)["input_ids"] for t in ("what is 3 and 4", "hi", "a b c d e f g h")]
    return model.eval(), tok, prompts


def _greedy(model, tok, ids, n):
    out = []
    res = GenerationResult()
    params = SamplingParams(max_new_tokens=n)
    list(stream_generate(model, tok, ids, params, result=res, on_token=lambda t, _: out.append(t)))
    return out + ([tok.eos_token_id] if res.finish_reason == "stop" else [])


def test_batched_greedy_equals_one_prompt_at_a_time(tiny):
    model, tok, prompts = tiny
    eos = {tok.eos_token_id}
    ro = generate(model, prompts, 2, RolloutParams(max_new_tokens=12, top_k=1),
                  torch.Generator().manual_seed(0), eos, tok.pad_token_id)  # fmt: skip
    assert len(ro.completions) == 6
    for i, ids in enumerate(prompts):
        want = _greedy(model, tok, ids, 12)
        assert ro.completions[2 * i] == ro.completions[2 * i + 1] == want
    assert ro.tokens == sum(len(c) for c in ro.completions)


def test_eos_ends_a_row_and_is_kept(tiny):
    model, tok, prompts = tiny
    first = _greedy(model, tok, prompts[0], 12)
    stop = first[3]  # make the 4th greedy token an "EOS": row 0 stops there, keeping it
    ro = generate(model, prompts[:1], 1, RolloutParams(max_new_tokens=12, top_k=1),
                  torch.Generator(), {stop}, tok.pad_token_id)  # fmt: skip
    assert ro.completions[0] == first[: first.index(stop) + 1]
    assert ro.truncated == [False]


def test_the_generator_makes_samples_reproducible(tiny):
    model, tok, prompts = tiny
    params = RolloutParams(max_new_tokens=8, temperature=1.3)
    run = lambda seed: generate(model, prompts, 3, params, torch.Generator().manual_seed(seed),  # noqa: E731
                                {tok.eos_token_id}, tok.pad_token_id).completions  # fmt: skip
    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert len({tuple(x) for x in a[:3]}) > 1  # a group's samples differ


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(400, 1)
    g = torch.Generator().manual_seed(0)
    tok, ent = sample_rows(logits, RolloutParams(top_k=2), g)
    assert set(tok.tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    assert ent[0].item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)
    tok, _ = sample_rows(logits, RolloutParams(top_p=0.8), g)  # p = .64 .23 .09 ...: keeps 2
    assert set(tok.tolist()) == {0, 1}
    with pytest.raises(LorafuseError, match="temperature > 0"):
        RolloutParams(temperature=0.0)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.9)])
def test_one_sampler_for_rollouts_and_serving(top_k, top_p):
    """Rollouts (rows of a batch) and chat / serve (one row) filter through the same top-k /
    top-p: a batch filtered at once equals each row filtered alone, and from the same seed both
    draw the same tokens."""
    from lorafuse.generation import sample_next, top_k_top_p

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    batch = top_k_top_p(logits, top_k, top_p)
    for row, filtered in zip(logits, batch):
        assert torch.equal(top_k_top_p(row, top_k, top_p), filtered)
    kept = torch.isfinite(batch).sum(-1)
    assert (kept >= 1).all() and (top_k == 0 or (kept <= top_k).all())
    if top_p < 1.0:
        assert (kept < 50).all()
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    rollout = RolloutParams(temperature=0.8, top_k=top_k, top_p=top_p)
    for row in logits:
        g1, g2 = (torch.Generator().manual_seed(7) for _ in range(2))
        token, _ = sample_rows(row[None], rollout, g1)
        assert int(token) == sample_next(row, params, g2)


def test_engine_rollouts_equal_the_model_forward_s(tiny):
    """Greedy rollouts on the decode engine (one prefill per prompt, forked; rows leave at EOS)
    and through the model's forward (left-padded batch) give the same completions."""
    from lorafuse import decode

    model, tok, prompts = tiny
    assert decode.engine_for(model) is not None
    first = _greedy(model, tok, prompts[0], 12)
    eos = {tok.eos_token_id, first[5]}  # row 0 ends early: the others keep stepping
    runs = [generate(model, prompts, 2, RolloutParams(max_new_tokens=12, top_k=1),
                     torch.Generator().manual_seed(0), eos, tok.pad_token_id, engine=engine)
            for engine in ("auto", None)]  # fmt: skip
    assert runs[0].completions == runs[1].completions
    assert runs[0].truncated == runs[1].truncated and runs[0].tokens == runs[1].tokens
    assert runs[0].completions[0][-1] == first[5]

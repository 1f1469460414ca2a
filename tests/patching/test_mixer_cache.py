"""Generation with the hybrids' patched mixers: each layer's conv and recurrent states live in
transformers' own cache (prefill once, then one token per step), and every decoding path lorafuse
has gives stock transformers' ``generate`` greedy tokens, fp32:

* ``stream_generate`` (chat, infer one prompt at a time, serve's per-sequence path);
* ``generate_batch`` (infer and eval batches: left-padded prompts of different lengths);
* the GRPO rollouts (one left-padded prefill, the cache repeated per completion, top-k 1);
* serve's worker, requests of different lengths queued together: decoded in one padded batch
  (the attention layers' keys and values left-padded, the mixers' per-row states joined).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from lorafuse.generation import GenerationResult, SamplingParams, generate_batch, stream_generate
from lorafuse.patching import mixers
from lorafuse.testing.llm import chat_tokenizer
from lorafuse.testing.new_families import build_family_model
from lorafuse.train.rollout import RolloutParams
from lorafuse.train.rollout import generate as rollout

HYBRIDS = [
    "GraniteMoeHybridForCausalLM",
    "Lfm2ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3NextForCausalLM",
]  # fmt: skip  (the MoE twins share these mixers)
NEW = 10


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def _prompts(tok):
    return [tok(t)["input_ids"] for t in ("The quick brown fox jumps", "hello", "0123 answer")]


def _stock_greedy(arch, tok, ids):
    """transformers' own generate on an unpatched copy: the new tokens (EOS kept)."""
    model = build_family_model(arch, tok)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
    return out[0, len(ids) :].tolist()


def _patched(arch, tok):
    model = build_family_model(arch, tok)
    assert mixers.install(model)
    return model


@pytest.mark.parametrize("arch", HYBRIDS)
def test_every_decoding_path_gives_stocks_greedy_tokens(arch, tok):
    model, prompts = _patched(arch, tok), _prompts(tok)
    want = [_stock_greedy(arch, tok, p) for p in prompts]
    for p, w in zip(prompts, want):
        got, res = [], GenerationResult()
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        on_token = lambda t, _, got=got: got.append(t)  # noqa: E731
        list(stream_generate(model, tok, p, params, result=res, on_token=on_token))
        assert got == w, ("stream_generate", p)
    texts = generate_batch(model, tok, prompts, SamplingParams(max_new_tokens=NEW))
    eos = tok.eos_token_id
    expect = [tok.decode(w[: w.index(eos)] if eos in w else w, skip_special_tokens=True)
              for w in want]  # fmt: skip
    assert texts == expect, "generate_batch"
    ro = rollout(model, prompts, 2, RolloutParams(max_new_tokens=NEW, top_k=1),
                 torch.Generator().manual_seed(0), {-1}, tok.pad_token_id)  # fmt: skip
    assert ro.completions == [w for w in want for _ in range(2)], "rollout"


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "GraniteMoeHybridForCausalLM"])
def test_serve_worker_queued_requests_give_stocks_greedy_tokens(arch, tok):
    from lorafuse.serve.worker import GenerationWorker, Job

    model, prompts = _patched(arch, tok), _prompts(tok)
    want = [_stock_greedy(arch, tok, p) for p in prompts]

    async def main():
        worker = GenerationWorker(model, tok, max_batch=4, start=False)
        loop = asyncio.get_running_loop()
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        jobs = [Job(None, p, params, loop, asyncio.Queue(), index=i, logprobs=1)
                for i, p in enumerate(prompts)]  # fmt: skip
        assert worker.submit_all(jobs)
        worker.start()
        out = []
        for job in jobs:
            while (event := await job.events.get())[1] != "done":
                assert event[1] == "delta", event
            out.append(event[2].text)
        worker.stop()
        return out, worker.stats["peak_batch"]

    texts, peak = asyncio.run(main())
    assert texts == [tok.decode(w, skip_special_tokens=True) for w in want]
    assert peak == len(prompts)  # they shared the decoding steps

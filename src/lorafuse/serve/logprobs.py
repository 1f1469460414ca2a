"""Token log-probabilities in OpenAI's two shapes.

What a logprob is here (the choice vLLM makes by default): ``log_softmax`` of the model's raw
logits at that position, before temperature, top-k/top-p, penalties and ``logit_bias``. So the
numbers describe the model (the adapter included), whatever the sampling settings; a greedy
request's token is the argmax of the sampled distribution, which may differ from the raw top-1
when ``logit_bias`` or penalties are set.

An entry is ``{"token": str, "logprob": float | None, "top": [(str, float), ...]}``; the prompt's
first token has no logprob (nothing precedes it), as OpenAI's and vLLM's ``echo`` return it.
"""

from __future__ import annotations

import torch


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _entry(tokenizer, token: int, logp: torch.Tensor, k: int) -> dict:
    """``logp`` (V,) log-probabilities of the position that produced ``token``."""
    top = []
    if k:
        values, ids = torch.topk(logp, k)
        top = [(_token_text(tokenizer, int(i)), float(v)) for v, i in zip(values, ids)]
    return {"token": _token_text(tokenizer, token), "logprob": float(logp[token]), "top": top}


def token_entry(tokenizer, token: int, logits: torch.Tensor, k: int) -> dict:
    """Entry of one generated ``token`` drawn from raw (V,) ``logits``."""
    return _entry(tokenizer, token, torch.log_softmax(logits.float(), -1), k)


def prompt_entries(model, tokenizer, ids: list[int], k: int, logits=None) -> list[dict]:
    """Entries of every prompt token (one full forward pass unless ``logits`` (T, V) of the
    prompt are given: the decode engine's prefill; the first has logprob None)."""
    if logits is None:
        device = next(model.parameters()).device
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]  # (T, V)
    logp = torch.log_softmax(logits[:-1].float().cpu(), -1)  # (T-1, V): position t predicts t+1
    first = {"token": _token_text(tokenizer, ids[0]), "logprob": None, "top": None}
    return [first] + [_entry(tokenizer, tok, logp[t], k) for t, tok in enumerate(ids[1:])]


def chat_logprobs(entries: list[dict]) -> dict:
    """``choices[].logprobs`` of a chat completion (or of one chunk)."""

    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**one(e["token"], e["logprob"]), "top_logprobs": [one(t, lp) for t, lp in e["top"]]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """``choices[].logprobs`` of a legacy completion: parallel lists; ``text_offset`` counts
    characters of the choice's text from ``offset``. As in OpenAI's and vLLM's answers, each
    ``top_logprobs`` dict holds the top k and the chosen token."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        lps.append(e["logprob"])
        offsets.append(offset)
        offset += len(e["token"])
        if e["top"] is None:
            tops.append(None)
        else:
            top = dict(e["top"])
            top.setdefault(e["token"], e["logprob"])
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

"""A reward model trained with ``--method rm`` scoring completions (PPO's ``--reward-model``).

The rm adapter (LoRA + the ``score`` head, :mod:`lorafuse.train.reward`) is read from its output
dir (its ``final/``) or adapter dir. When it was trained on the policy's base, its LoRA becomes a
second, frozen PEFT adapter ``reward`` on the policy's own model, so no second copy of the base
exists: scoring switches the active adapter to it for one no-gradient forward and back (the
trainable flags restored), and the ``score`` head is a frozen fp32 Linear held here. On another
base, that base is loaded once more with the adapter (same tokenizer vocabulary required: the
completions are scored as token ids).

A sequence's score is the head on the final hidden state of its last token: prompt and completion
right-padded, the rightmost token that is not ``pad_token_id`` (transformers' and ``rm``'s rule), so
a completion scores as ``lorafuse eval --pairs`` and ``AutoModelForSequenceClassification`` score it.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from lorafuse.errors import LorafuseError
from lorafuse.train.logprobs import final_hidden, peft_model
from lorafuse.train.reward import last_token_index

ADAPTER = "reward"  # the rm adapter's name on a shared base
CONFIG = "lorafuse_config.json"


class RewardModelLoadError(LorafuseError, ValueError):
    """``--reward-model`` names nothing a reward model can be built from (the message says why)."""


def adapter_dir(path: str) -> str:
    """The adapter dir of ``path``: itself, or its ``final/`` (an rm run's output dir)."""
    for candidate in (path, os.path.join(path, "final")):
        if os.path.isfile(os.path.join(candidate, "adapter_config.json")):
            return candidate
    raise RewardModelLoadError(
        f"--reward-model {path}: no adapter_config.json there nor in its final/ (give the output "
        "or adapter dir of a --method rm run)"
    )


def base_of(adir: str) -> str | None:
    """The base model the rm was trained on, as its run named it (None: the built-in default)."""
    file = os.path.join(adir, CONFIG)
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return json.load(f).get("model")
    with open(os.path.join(adir, "adapter_config.json"), encoding="utf-8") as f:
        return json.load(f).get("base_model_name_or_path")


def same_base(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def _read(adir: str):
    """``(LoraConfig without the head, LoRA weights, score weight (1, H))`` of an rm adapter."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(adir)
    weights = load_file(os.path.join(adir, "adapter_model.safetensors"))
    heads = [k for k in weights if k.split(".")[-2:] == ["score", "weight"]]
    if len(heads) != 1 or config.task_type != "SEQ_CLS":
        raise RewardModelLoadError(
            f"--reward-model {adir}: not a reward model (a SEQ_CLS adapter with a score head, "
            "from --method rm)"
        )
    head = weights.pop(heads[0]).float()
    config.modules_to_save, config.task_type, config.inference_mode = None, "CAUSAL_LM", True
    return config, weights, head


def _frozen_head(weight: torch.Tensor, device) -> torch.nn.Linear:
    head = torch.nn.Linear(weight.shape[1], 1, bias=False, device=device, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head.requires_grad_(False)


class RewardModel:
    """Scores (N,) of prompt + completion token ids (:meth:`scores`); :meth:`load` builds it."""

    def __init__(self, model, head: torch.nn.Linear, adapter: str | None, pad_id: int) -> None:
        self.model, self.head, self.adapter, self.pad_id = model, head, adapter, pad_id

    @classmethod
    def load(cls, path: str, policy, policy_base: str | None, tokenizer, dtype, device):
        """The rm at ``path`` on the PEFT ``policy`` (trained on ``policy_base``), or on its own
        base when it was trained on another."""
        from peft import set_peft_model_state_dict

        adir = adapter_dir(path)
        config, weights, head = _read(adir)
        if same_base(base_of(adir), policy_base):
            peft = peft_model(policy)
            flags = {n: p.requires_grad for n, p in peft.named_parameters()}
            active = peft.active_adapter
            peft.add_adapter(ADAPTER, config)
            model, adapter = peft, ADAPTER
        else:
            model, adapter = cls._own_base(adir, base_of(adir), config, tokenizer, dtype, device)
            flags, active = None, None
        result = set_peft_model_state_dict(model, weights, adapter_name=adapter)
        if result.unexpected_keys:
            raise RewardModelLoadError(
                f"--reward-model {adir}: weights that fit no module {result.unexpected_keys[:3]}"
            )
        if flags is not None:  # adding an adapter must not change what trains
            model.set_adapter(active)
            for n, p in model.named_parameters():
                p.requires_grad_(flags.get(n, False))
        device = next(model.parameters()).device
        return cls(model, _frozen_head(head, device), adapter if flags is not None else None,
                   tokenizer.pad_token_id)  # fmt: skip

    @staticmethod
    def _own_base(adir, base, config, tokenizer, dtype, device):
        from peft import get_peft_model
        from transformers import AutoTokenizer

        from lorafuse import FastLanguageModel, patch_peft_model

        theirs = AutoTokenizer.from_pretrained(adir)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise RewardModelLoadError(
                f"--reward-model {adir}: its tokenizer differs from the policy's (completions are "
                "scored as token ids)"
            )
        model, _ = FastLanguageModel.from_pretrained(model_name=base, dtype=dtype, device=device)
        model = patch_peft_model(get_peft_model(model, config))
        model.requires_grad_(False)
        return model.eval(), "default"

    @contextlib.contextmanager
    def _active(self):
        """The rm's adapter active (a shared base), eval mode; all restored after."""
        model = self.model
        training = model.training
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        active = model.active_adapter
        model.eval()
        if self.adapter is not None:
            model.set_adapter(self.adapter)
        try:
            yield
        finally:
            if self.adapter is not None:
                model.set_adapter(active)
                for n, p in model.named_parameters():
                    p.requires_grad_(flags[n])
            model.train(training)

    @torch.no_grad()
    def scores(self, prompts: list[list[int]], completions: list[list[int]], rows: int):
        """(N,) fp32 scores of ``prompts[i] + completions[i]``, ``rows`` sequences per forward."""
        device = self.head.weight.device
        out = []
        with self._active():
            for start in range(0, len(prompts), rows):
                seqs = [p + c for p, c in zip(prompts[start : start + rows],
                                              completions[start : start + rows])]  # fmt: skip
                width = max(len(s) for s in seqs)
                ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)  # (B, T)
                mask = torch.zeros_like(ids)
                for i, s in enumerate(seqs):
                    ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
                ids, mask = ids.to(device), mask.to(device)
                hidden, _ = final_hidden(self.model, ids, mask)
                last = hidden[
                    torch.arange(len(seqs), device=device), last_token_index(ids, self.pad_id)
                ]
                out.append(self.head(last.float()).squeeze(-1))
        return torch.cat(out).cpu()

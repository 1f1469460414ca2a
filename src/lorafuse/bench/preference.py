"""``--method dpo``: TRL's DPOTrainer loss on stock PEFT vs lorafuse's DPO objective on the
patched model. Same random pairs: B pairs of ``seq`` tokens each (the first half a shared prompt),
so one step runs 2B rows of ``seq`` tokens twice (reference under no_grad, then the policy) on
both sides."""

from __future__ import annotations

import tempfile

from lorafuse.bench.config import TARGETS, model_config
from lorafuse.bench.model import build_model, finish_step


def preference_pairs(spec: dict, n: int) -> list:
    """``n`` steps of ``spec['batch']`` random pairs as lorafuse ``PairRow``s."""
    import torch

    from lorafuse.data.masking import IGNORE_INDEX, Encoded
    from lorafuse.data.preference import PairRow

    g = torch.Generator().manual_seed(1234)
    vocab, seq = model_config(spec["model"]).vocab_size, spec["seq"]
    half = seq // 2
    out = []
    for _ in range(n):
        step = []
        for _ in range(spec["batch"]):
            ids = torch.randint(1, vocab, (3, seq), generator=g).tolist()
            enc = [Encoded(ids[0][:half] + r[half:], [IGNORE_INDEX] * half + r[half:])
                   for r in ids[1:]]  # fmt: skip
            step.append(PairRow(enc[0], enc[1]))
        out.append(step)
    return out


def _trl_dpo(spec: dict, base):
    """A TRL DPOTrainer that wraps ``base`` (a fresh adapter: reference = adapter disabled)."""
    import peft
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from lorafuse.data.word_tokenizer import word_tokenizer

    args = DPOConfig(output_dir=tempfile.mkdtemp(prefix="lorafuse-bench-dpo-"), report_to=[],
                     beta=0.1, use_cpu=spec["device"] == "cpu", bf16=False, fp16=False,
                     gradient_checkpointing=bool(spec["grad_ckpt"]))  # fmt: skip
    lora = peft.LoraConfig(r=spec["rank"], lora_alpha=spec["rank"], target_modules=TARGETS)
    data = Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])
    return DPOTrainer(model=base, args=args, train_dataset=data, processing_class=word_tokenizer(),
                      peft_config=lora)  # fmt: skip


def preference_setup(spec: dict):
    """``(model, step(model, opt, pairs) -> loss)`` for ``spec['config']`` under --method dpo."""
    import torch

    from lorafuse.train.preference import PreferenceObjective

    device = torch.device(spec["device"])
    if spec["config"] == "stock":
        from transformers import LlamaForCausalLM

        from lorafuse.dtypes import parse_dtype

        dtype = parse_dtype(spec["dtype"])
        torch.manual_seed(0)
        base = LlamaForCausalLM(model_config(spec["model"])).to(dtype=dtype, device=device)
        trainer = _trl_dpo(spec, base)

        def trl_step(model, opt, pairs):
            from torch.nn.utils.rnn import pad_sequence

            seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
            ids = pad_sequence([torch.tensor(e.input_ids) for e in seqs], batch_first=True)
            mask = pad_sequence([torch.tensor([int(t != -100) for t in e.labels]) for e in seqs],
                                batch_first=True)  # fmt: skip
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "completion_mask": mask}  # fmt: skip
            loss = trainer._compute_loss(model, {k: v.to(device) for k, v in batch.items()}, False)
            return finish_step(loss, opt)

        return trainer.model, trl_step
    model = build_model(spec)
    objective = PreferenceObjective("dpo", 0.1, "sigmoid", 0.0, 0, device)

    def our_step(model, opt, pairs):
        loss, _ = objective.loss(model, pairs, objective.counts(pairs))
        return finish_step(loss, opt)

    return model, our_step

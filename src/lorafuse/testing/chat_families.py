"""Tokenizers of the families we export, as far as chat is concerned: each family's real chat
template (``chat_templates``), its control tokens, BOS / EOS as its ``tokenizer_config.json``
has them, over the tiny byte-level BPE of ``llm.chat_tokenizer`` (which llama.cpp reads as
``--pre-tokenizer gpt-2``).

``eot`` is the token the template ends an assistant turn with, where a reply must stop; ``fmt``
the Ollama format the template equals (``export.chat_formats``), None where no TEMPLATE can be
written. Several EOS differ from ``eot``, as in the real models: Gemma's ``<eos>``, Phi-3's
``<|endoftext|>``, the first Llama 3 release's ``<|end_of_text|>``, a Qwen2.5 base model's
``<|endoftext|>`` (it ships the instruct template) - the models that "never stop" when a
generator stops on EOS alone.

``save_family_chat_model`` puts a family's tokenizer on the tiny Llama; ``save_family_replier``
on a tiny model of the family's own architecture (``arch``), fitted to answer one question and
end its turn, so a stop at the end-of-turn token is the model's own greedy choice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lorafuse.testing import chat_templates as T
from lorafuse.testing import chat_templates_2026 as T26
from lorafuse.testing.llm import chat_tokenizer

CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3 = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
          "<|eot_id|>")  # fmt: skip
GEMMA = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
PHI3 = ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
PHI4 = ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>")
QWEN2, PHI = "Qwen2ForCausalLM", "Phi3ForCausalLM"  # Phi-4 is a Phi3ForCausalLM too
LFM2 = ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>")
GRANITE = ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>")
GEMMA4 = ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>")
HARMONY = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>",
           "<|channel|>", "<|constrain|>", "<|call|>")  # fmt: skip


@dataclass(frozen=True)
class ChatFamily:
    template: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    eot: str
    fmt: str | None
    add_bos: bool = False
    arch: str = "LlamaForCausalLM"  # the family's own architecture (``arch_families``)


CHAT_FAMILIES = {
    "qwen2": ChatFamily(T.QWEN2, CHATML, None, "<|im_end|>", "<|im_end|>", "chatml", arch=QWEN2),
    "qwen2.5-base": ChatFamily(T.QWEN2_5, CHATML, None, "<|endoftext|>", "<|im_end|>", "chatml",
                               arch=QWEN2),
    "qwen3": ChatFamily(T.QWEN3, CHATML, None, "<|im_end|>", "<|im_end|>", "chatml",
                        arch="Qwen3ForCausalLM"),
    "llama3": ChatFamily(T.LLAMA3, LLAMA3, "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                         "llama3", add_bos=True),
    "llama3.1": ChatFamily(T.LLAMA3_1, LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>",
                           "llama3", add_bos=True),
    "llama3.2": ChatFamily(T.LLAMA3_2, LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>",
                           None, add_bos=True),  # writes today's date: no Go template
    "gemma2": ChatFamily(T.GEMMA2, GEMMA, "<bos>", "<eos>", "<end_of_turn>", "gemma", add_bos=True,
                         arch="Gemma2ForCausalLM"),
    "gemma3": ChatFamily(T.GEMMA3, GEMMA, "<bos>", "<eos>", "<end_of_turn>", "gemma", add_bos=True,
                         arch="Gemma3ForCausalLM"),
    "phi3": ChatFamily(T.PHI3, PHI3, "<s>", "<|endoftext|>", "<|end|>", "phi3", arch=PHI),
    "phi3.5": ChatFamily(T.PHI3_5, PHI3, "<s>", "<|endoftext|>", "<|end|>", "phi3", arch=PHI),
    "phi4": ChatFamily(T.PHI4, PHI4, None, "<|im_end|>", "<|im_end|>", "phi4", arch=PHI),
    "mistral": ChatFamily(T.MISTRAL, ("<s>", "</s>"), "<s>", "</s>", "</s>", "mistral", add_bos=True,
                          arch="MistralForCausalLM"),
    "mistral-sys": ChatFamily(T.MISTRAL_SYS, ("<s>", "</s>"), "<s>", "</s>", "</s>", "mistral-sys",
                              add_bos=True, arch="MistralForCausalLM"),
    "llama2": ChatFamily(T.LLAMA2, ("<s>", "</s>"), "<s>", "</s>", "</s>", "llama2", add_bos=True),
    # SmolLM3-3B: a Llama 3 vocabulary with ChatML turns, EOS <|im_end|> (config eos_token_id
    # 128012); its template writes no BOS and today's date (no Go template)
    "smollm3": ChatFamily(T.SMOLLM3, ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>",
                                      "<|im_end|>"), None, "<|im_end|>", "<|im_end|>", None,
                          arch="SmolLM3ForCausalLM"),
    # the late-2026 families (templates from llama.cpp's models/templates), on their own
    # architectures (``new_families``)
    "qwen3.5": ChatFamily(T26.QWEN3_5, CHATML, None, "<|im_end|>", "<|im_end|>", "chatml-think",
                          arch="Qwen3_5ForCausalLM"),
    "qwen3.5-moe": ChatFamily(T26.QWEN3_5, CHATML, None, "<|im_end|>", "<|im_end|>",
                              "chatml-think", arch="Qwen3_5MoeForCausalLM"),
    "qwen3-moe": ChatFamily(T.QWEN3, CHATML, None, "<|im_end|>", "<|im_end|>", "chatml",
                            arch="Qwen3MoeForCausalLM"),
    # LFM2 / LFM2.5 and LFM2-MoE: ChatML after a BOS the template writes itself
    "lfm2": ChatFamily(T26.LFM2_5, LFM2, "<|startoftext|>", "<|im_end|>", "<|im_end|>", "chatml",
                       arch="Lfm2ForCausalLM"),
    "lfm2-moe": ChatFamily(T26.LFM2_MOE, LFM2, "<|startoftext|>", "<|im_end|>", "<|im_end|>",
                           "chatml", arch="Lfm2MoeForCausalLM"),
    "granite4": ChatFamily(T26.GRANITE4, GRANITE, None, "<|end_of_text|>", "<|end_of_text|>",
                           "granite", arch="GraniteMoeHybridForCausalLM"),
    "gemma4": ChatFamily(T26.GEMMA4, GEMMA4, "<bos>", "<eos>", "<turn|>", "gemma4", add_bos=True,
                         arch="Gemma4ForCausalLM"),
    # gpt-oss's harmony template writes today's date: no Go template
    "gpt-oss": ChatFamily(T26.GPT_OSS, HARMONY, "<|startoftext|>", "<|return|>", "<|return|>", None,
                          arch="GptOssForCausalLM"),
}  # fmt: skip
# the families whose own tiny architecture is ``arch_families``' (the others: ``new_families``)
OLDER_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "SmolLM3ForCausalLM", QWEN2,
               "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", PHI)  # fmt: skip


def save_family_tokenizer(name: str, path: str | os.PathLike):
    """Write family ``name``'s chat tokenizer to ``path``; returns it (as loaded back)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    fam = CHAT_FAMILIES[name]
    tok = chat_tokenizer()
    new = [s for s in fam.specials if s not in tok.get_vocab()]
    tok.add_tokens(
        [AddedToken(s, special=True, normalized=False) for s in new], special_tokens=True
    )
    tok.bos_token, tok.eos_token = fam.bos, fam.eos
    tok.chat_template = fam.template
    tok.save_pretrained(path)
    cfg_path = Path(path) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = fam.add_bos
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return AutoTokenizer.from_pretrained(path)


def save_family_chat_model(name: str, path: str | os.PathLike):
    """A tiny random Llama (``llm.save_tiny_model``) with family ``name``'s chat tokenizer, its
    config's EOS the family's EOS, at ``path``; returns (model, tokenizer). 2048 positions:
    SmolLM3's template writes a system block of ~1,100 tokens of the tiny tokenizer."""
    from lorafuse.testing.llm import save_tiny_model

    tok = save_family_tokenizer(name, path)
    model, _ = save_tiny_model(path, tokenizer=None, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                               max_position_embeddings=2048)  # fmt: skip
    return model, tok


QUESTION = {"role": "user", "content": "What is the capital of France?"}
ANSWER = "The capital of France is Paris."
MARGIN = 2.0  # logits; llama.cpp's op order moves a tiny fp32 model's by ~1e-4 (test_gguf_families)


def save_family_replier(name: str, path: str | os.PathLike, steps: int = 200):
    """A tiny model of family ``name``'s own architecture (``arch_families.build_arch_model``)
    with its chat tokenizer, fine-tuned (all weights, Adam) until its greedy reply to
    ``[QUESTION]`` is ``ANSWER`` and then the end-of-turn token, each token ahead of the next
    best by ``MARGIN``: a chat model that ends its turns, where a random one never emits the
    end-of-turn token. Saved at ``path``; returns (fp32 model in eval mode, tokenizer)."""
    import torch
    from torch.nn.functional import cross_entropy

    from lorafuse.testing.arch_families import build_arch_model

    fam = CHAT_FAMILIES[name]
    tok = save_family_tokenizer(name, path)
    model = build_arch_model(fam.arch, tok).train()
    prompt = list(tok.apply_chat_template([QUESTION], add_generation_prompt=True)["input_ids"])
    eot = tok.convert_tokens_to_ids(fam.eot)
    answer = tok(ANSWER, add_special_tokens=False)["input_ids"] + [eot]
    ids, target = torch.tensor([prompt + answer]), torch.tensor(answer)  # (1, T), (A,)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # (A, V): predicts answer
        top = logits.topk(2, dim=-1)
        lead = top.values[:, 0] - top.values[:, 1]  # (A,)
        if (top.indices[:, 0] == target).all() and lead.min() > MARGIN:
            break  # teacher-forced argmax = the greedy reply, since every prefix is right
        cross_entropy(logits, target).backward()
        opt.step()
        opt.zero_grad()
    else:
        raise RuntimeError(f"{name}: the tiny {fam.arch} did not learn its reply in {steps} steps")
    model.eval().save_pretrained(path)
    return model, tok

"""What ``lorafuse bench`` runs: the model shapes, the configurations, the LoRA targets."""

from __future__ import annotations

from lorafuse.errors import LorafuseError

MODELS = ("llama-4l-1024", "smollm2-135m", "llama-3.2-1b", "tiny", "qwen3-30b-a3b-2l",
          "qwen3-30b-a3b-1l", "qwen3-moe-tiny")  # fmt: skip
# Mixture-of-experts shapes (Qwen3MoeForCausalLM): LoRA on the routed experts (PEFT
# target_parameters), the routers and attention on both sides (lorafuse.models.moe_targets); no
# roofline (its products are a dense Llama step's).
MOE_MODELS = ("qwen3-30b-a3b-2l", "qwen3-30b-a3b-1l", "qwen3-moe-tiny")
CONFIGS = ("stock", "lorafuse")
# --task sd15|sdxl: the frozen UNet without LoRA (the reference), kohya's unfused LoRA, PEFT on
# diffusers, lorafuse's fused network (lorafuse.bench.image says what each runs).
IMAGE_CONFIGS = ("none", "kohya", "peft", "lorafuse")
# --quant nf4 adds this: lorafuse on the same model with its base linears NF4-quantised as
# FastLanguageModel(load_in_4bit=True) does (every nn.Linear but the lm_head; embeddings stay).
NF4 = "lorafuse-nf4"
# ... and this: the embeddings and the lm_head in NF4 too (quantize_embeddings=True).
NF4_EMB = "lorafuse-nf4+emb"
QUANTIZED = (NF4, NF4_EMB)
# Built directly in the run's dtype instead of in fp32 then cast: an fp32
# Llama-3.2-1B is 5 GB before the cast (the other models keep their fp32-then-cast init).
DIRECT_DTYPE_MODELS = ("llama-3.2-1b", "qwen3-30b-a3b-2l", "qwen3-30b-a3b-1l")
# --compile adds these: the same two models under torch.compile (default Inductor backend); the
# compile happens in the warmup steps, which are not timed (warmup >= 1 is enforced).
COMPILED = ("stock+compile", "lorafuse+compile")
ROOFLINE = "roofline"  # results key: the unavoidable matrix products alone (timed in each run)
DRIFT_WARN = 0.15  # a roofline drift past this many percent within a run is flagged
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_config(name: str):
    from transformers import LlamaConfig

    if name == "llama-4l-1024":
        return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                           num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                           max_position_embeddings=4096, rms_norm_eps=1e-5,
                           tie_word_embeddings=False)  # fmt: skip
    if name == "smollm2-135m":  # HuggingFaceTB/SmolLM2-135M config.json
        return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                           tie_word_embeddings=True)  # fmt: skip
    if name == "llama-3.2-1b":  # meta-llama/Llama-3.2-1B config.json (1.24 B parameters)
        rope = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}  # fmt: skip
        return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                           rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=True)  # fmt: skip
    if name.startswith("qwen3-30b-a3b-") or name == "qwen3-moe-tiny":
        return _qwen3_moe_config(name)
    if name == "tiny":
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False)  # fmt: skip
    raise LorafuseError(f"unknown --model {name!r}; choose one of {', '.join(MODELS)}")


def _qwen3_moe_config(name: str):
    """Qwen/Qwen3-30B-A3B's config.json (48 layers, 30.5 B parameters, 3.3 B active) with 2 or 1
    of its layers: 128 experts of width 768, 8 per token, hidden 2048, 32 query / 4 KV heads of
    128; the vocabulary cut from 151936 to 32768 tokens, so the step is the layers' (1.38 B
    parameters at 2 layers, 0.76 B at 1; stock PEFT's fp32 step at 2 layers needs ~13 GB).
    ``qwen3-moe-tiny``: the same layout at test size."""
    from transformers import Qwen3MoeConfig

    if name == "qwen3-moe-tiny":
        return Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, norm_topk_prob=True, tie_word_embeddings=False)  # fmt: skip
    return Qwen3MoeConfig(vocab_size=32768, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_hidden_layers=int(name[-2]), num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, norm_topk_prob=True,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False)  # fmt: skip

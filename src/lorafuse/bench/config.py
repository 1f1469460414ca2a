"""What ``lorafuse bench`` runs: the model shapes, the configurations, the LoRA targets."""

from __future__ import annotations

from lorafuse.errors import LorafuseError

MODELS = ("llama-4l-1024", "smollm2-135m", "llama-3.2-1b", "tiny")
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
DIRECT_DTYPE_MODELS = ("llama-3.2-1b",)
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
    if name == "tiny":
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False)  # fmt: skip
    raise LorafuseError(f"unknown --model {name!r}; choose one of {', '.join(MODELS)}")

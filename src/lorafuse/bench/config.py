"""What ``lorafuse bench`` runs: the model shapes, the configurations, the LoRA targets."""

from __future__ import annotations

from lorafuse.errors import LorafuseError

LLAMA_MODELS = ("llama-4l-1024", "smollm2-135m", "llama-3.2-1b", "tiny")
# Mixture-of-experts shapes (Qwen3MoeForCausalLM): LoRA on the routed experts (PEFT
# target_parameters), the routers and attention on both sides (lorafuse.models.moe_targets); no
# roofline (its products are a dense Llama step's).
MOE_MODELS = ("qwen3-30b-a3b-2l", "qwen3-30b-a3b-1l", "qwen3-moe-tiny")
# The late-2026 shapes (random weights; model_config says where each width comes from), trained
# with LoRA on every Linear ("all-linear": the hybrids' mixer projections too). The roofline
# counts Llama-shaped products only, so these run without it.
FAMILY_MODELS = ("qwen3.5-0.8b", "qwen3-0.8b-dense", "gemma4-e2b")
MODELS = LLAMA_MODELS + MOE_MODELS + FAMILY_MODELS
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
DIRECT_DTYPE_MODELS = ("llama-3.2-1b", "qwen3-30b-a3b-2l", "qwen3-30b-a3b-1l", *FAMILY_MODELS)
# --compile adds these: the same two models under torch.compile (default Inductor backend); the
# compile happens in the warmup steps, which are not timed (warmup >= 1 is enforced).
COMPILED = ("stock+compile", "lorafuse+compile")
ROOFLINE = "roofline"  # results key: the unavoidable matrix products alone (timed in each run)
DRIFT_WARN = 0.15  # a roofline drift past this many percent within a run is flagged
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def targets(name: str):
    """The LoRA targets of model ``name``: the seven projections, or every Linear."""
    return "all-linear" if name in FAMILY_MODELS else TARGETS


def model_config(name: str, layers: int | None = None):
    """The transformers config of bench model ``name``; ``layers`` trims a family model to its
    first ``layers`` layers (the layer pattern kept; Gemma 4's KV-sharing scaled with it)."""
    if name in FAMILY_MODELS:
        return _family_config(name, layers)
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


def _family_config(name: str, layers: int | None):
    import transformers as tf

    if name in ("qwen3.5-0.8b", "qwen3-0.8b-dense"):
        # Qwen3.5-0.8B as published (Qwen/Qwen3.5-0.8B model card and third-party copies of its
        # config.json: 24 layers, hidden 1024, MLP 3584, 8 query / 2 KV heads of 256, rope theta
        # 1e7 on a quarter of each head, vocab 248320, tied embeddings, 6 x (3 Gated DeltaNet + 1
        # gated attention)); the Gated DeltaNet heads (16 key / 16 value heads of 128, conv 4)
        # from public reimplementations, not the config file itself.
        n = layers or 24
        common = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                      num_hidden_layers=n, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
                      tie_word_embeddings=True)  # fmt: skip
        if name == "qwen3-0.8b-dense":  # every layer full (ungated) attention; the MLP widened
            # to 5120 so the parameters match (0.757 B vs Qwen3.5's 0.752 B at 24 layers)
            return tf.Qwen3Config(**{**common, "intermediate_size": 5120}, rope_theta=1e7)
        rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
        kinds = ["linear_attention"] * 3 + ["full_attention"]
        return tf.Qwen3_5TextConfig(**common, rope_parameters=rope, linear_conv_kernel_dim=4,
                                    linear_key_head_dim=128, linear_value_head_dim=128,
                                    linear_num_key_heads=16, linear_num_value_heads=16,
                                    layer_types=[kinds[i % 4] for i in range(n)])  # fmt: skip
    # gemma4-e2b: google/gemma-4-E2B's text config as third-party copies of its config.json give
    # it: 35 layers (4 sliding of 512 : 1 full), hidden 1536, MLP 6144 (doubled on the last 20,
    # KV-shared, layers), 8 query heads / 1 KV head of 256 (512 on full layers), per-layer inputs
    # of 256, vocab 262144, final soft-capping 30, tied embeddings.
    n = layers or 35
    kinds = ["sliding_attention"] * 4 + ["full_attention"]
    owners = max(5, round(n * 15 / 35 / 5) * 5)  # E2B: 15 layers own their k/v, 20 share them
    return tf.Gemma4TextConfig(
        vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=1536,
        intermediate_size=6144, num_hidden_layers=n, num_attention_heads=8, num_key_value_heads=1,
        head_dim=256, global_head_dim=512, sliding_window=512, hidden_size_per_layer_input=256,
        num_kv_shared_layers=max(0, n - owners), use_double_wide_mlp=True,
        final_logit_softcapping=30.0, max_position_embeddings=131072, rms_norm_eps=1e-6,
        layer_types=[kinds[i % 5] for i in range(n)], tie_word_embeddings=True,
    )  # fmt: skip

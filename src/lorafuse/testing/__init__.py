"""Helpers for testing fused ops and the tools around them (lorafuse's own tests use them; so can
anyone's). Library code never imports this package (``tests/test_layers.py``).

* :mod:`~lorafuse.testing.numerics`: ``assert_close`` (max/mean difference and where),
  ``assert_as_accurate_as_stock`` and the fp32 oracle, ``within_fp32_sum_bound``, ``saved_bytes``;
* :mod:`~lorafuse.testing.cases`: ``available_backends`` / ``op_cases`` (pytest params of the
  backends that run here), ``needs_cpp``, ``count_calls``, ``single_thread``;
* :mod:`~lorafuse.testing.quant`: ``FakeQuant`` and ``nf4_dense_copies``;
* :mod:`~lorafuse.testing.llm`: ``tiny_llama_config``, ``save_tiny_model`` (a stock HF dir with a
  ``chat_tokenizer`` or ``word_tokenizer``), ``save_tiny_adapter``, ``make_tiny_workspace``;
* :mod:`~lorafuse.testing.arch_families`: ``save_arch_model`` (a tiny model of each exported
  architecture); :mod:`~lorafuse.testing.chat_families`: each family's chat tokenizer,
  ``save_family_replier`` (its own architecture, fitted to end its turn);
* :mod:`~lorafuse.testing.new_families`: ``FAMILY_CASES``, ``build_family_model`` /
  ``save_family_model`` (tiny Qwen3.5, Qwen3-Next, LFM2, Granite 4, Gemma 4, OLMo 3 and the MoEs);
* :mod:`~lorafuse.testing.diffusion`: ``build_tiny_sd`` / ``save_tiny_sd``, ``tiny_clip_tokenizer``;
* :mod:`~lorafuse.testing.images`: ``write_image``, ``make_image_folder``;
* :mod:`~lorafuse.testing.faults`: ``small_tmpfs``, ``filling_open`` (a disk that fills), ``one_error_line``;
* :mod:`~lorafuse.testing.harness`: ``write_lm_eval_tasks`` (lm-eval tasks with local data);
* :mod:`~lorafuse.testing.timing`: the benchmarks' one timing harness: ``median_time``,
  ``interleaved_medians`` / ``interleaved_times``, ``paired_ratio``.
"""

from lorafuse.testing.cases import (
    available_backends,
    count_calls,
    needs_cpp,
    op_cases,
    single_thread,
)
from lorafuse.testing.diffusion import (
    build_tiny_sd,
    save_tiny_sd,
    sd_single_file_state_dict,
    tiny_clip_tokenizer,
)
from lorafuse.testing.faults import filling_open, one_error_line, small_tmpfs
from lorafuse.testing.harness import write_lm_eval_tasks
from lorafuse.testing.images import make_image_folder, write_image
from lorafuse.testing.llm import (
    CHAT_TEMPLATE,
    LORA_TARGETS,
    PLAIN,
    TOKENIZERS,
    chat_tokenizer,
    make_tiny_workspace,
    save_tiny_adapter,
    save_tiny_model,
    tiny_llama_config,
    word_tokenizer,
)
from lorafuse.testing.numerics import (
    assert_as_accurate_as_stock,
    assert_close,
    assert_close_to_fp32_oracle,
    fp32_oracle,
    grad_fn_names,
    rms_error,
    saved_bytes,
    within_fp32_sum_bound,
)
from lorafuse.testing.quant import FakeQuant, nf4_dense_copies
from lorafuse.testing.timing import interleaved_medians

__all__ = [
    "CHAT_TEMPLATE",
    "FakeQuant",
    "LORA_TARGETS",
    "PLAIN",
    "TOKENIZERS",
    "assert_as_accurate_as_stock",
    "assert_close",
    "assert_close_to_fp32_oracle",
    "available_backends",
    "build_tiny_sd",
    "chat_tokenizer",
    "count_calls",
    "fp32_oracle",
    "grad_fn_names",
    "interleaved_medians",
    "make_image_folder",
    "make_tiny_workspace",
    "needs_cpp",
    "nf4_dense_copies",
    "op_cases",
    "rms_error",
    "save_tiny_adapter",
    "save_tiny_model",
    "save_tiny_sd",
    "saved_bytes",
    "sd_single_file_state_dict",
    "single_thread",
    "tiny_clip_tokenizer",
    "tiny_llama_config",
    "filling_open",
    "one_error_line",
    "small_tmpfs",
    "write_lm_eval_tasks",
    "within_fp32_sum_bound",
    "word_tokenizer",
    "write_image",
]

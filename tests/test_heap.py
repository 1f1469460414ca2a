"""lorafuse.heap: glibc keeps freed training buffers for reuse (no page faults per step)."""

from __future__ import annotations

import platform
import resource

import peft
import pytest
import torch

from lorafuse import heap, patch_peft_model
from lorafuse.testing import tiny_llama_config

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


@glibc
def test_threshold_only_rises_and_stays_a_power_of_two_above_twice_the_size():
    heap.reuse_freed_buffers_up_to(heap.TRAINING_BYTES)
    first = heap.threshold()
    assert first >= 64 << 20 and first & (first - 1) == 0
    heap.reuse_freed_buffers_up_to(1 << 20)  # smaller: unchanged
    assert heap.threshold() == first
    heap.reuse_freed_buffers_up_to(heap.LIMIT_BYTES + 1)  # beyond the limit: ignored
    assert heap.threshold() == first
    heap.reuse_freed_buffers_up_to(100 << 20)
    assert heap.threshold() >= 200 << 20


@glibc
def test_freed_buffers_above_glibcs_own_limit_are_reused_without_page_faults():
    heap.reuse_freed_buffers_up_to(heap.TRAINING_BYTES)
    nbytes = 40 << 20  # above the 32 MiB glibc's dynamic threshold reaches by itself

    def step_faults() -> int:  # a "step": three buffers allocated, written, freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffers = [torch.empty(nbytes, dtype=torch.uint8).fill_(1) for _ in range(3)]
        del buffers
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    # torch allocates 64-byte aligned, a little more than a freed chunk of the same size holds,
    # so the first steps grow the heap until freed chunks coalesce; with glibc's defaults every
    # step unmaps and faults all 3 x 10240 pages in again.
    faults = [step_faults() for _ in range(10)]
    assert min(faults[-3:]) < 3 * (nbytes >> 12) // 10, f"page faults per step: {faults}"


@glibc
def test_patching_a_cpu_model_sets_the_policy_and_says_so():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    patch_peft_model(model)
    assert heap.threshold() >= 64 << 20
    assert any("lorafuse.heap" in note for note in model.lorafuse_report.notes)

"""lorafuse.heap: freed training buffers reused (no page faults per step) and, for large ones,
never more mapped than was alive at once (lorafuse's allocator, csrc/large_buffers.cpp)."""

from __future__ import annotations

import platform
import resource

import peft
import pytest
import torch

from lorafuse import backends, heap, patch_peft_model
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
def test_patching_leaves_the_heap_alone():
    """The heap is the process's: patching a model must not change it (the run owner does)."""
    from transformers import LlamaForCausalLM

    heap.apply_training_policy().revert()
    model = LlamaForCausalLM(tiny_llama_config())
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    patch_peft_model(model)
    assert heap.threshold() == 0 and heap.large_buffers_from() == 0
    assert not any("lorafuse.heap" in note for note in model.lorafuse_report.notes)


@glibc
def test_training_policy_is_reported_and_reverts():
    policy = heap.apply_training_policy()
    assert heap.threshold() == policy.glibc_threshold >= 64 << 20
    assert any("lorafuse.heap" in note for note in policy.notes)
    if backends.cpp_available():
        assert policy.large_buffers and heap.large_buffers_from() == heap.LARGE_BUFFER_BYTES
        live = heap.large_buffer_stats()["live"]
    policy.revert()
    assert heap.threshold() == 0 and heap.large_buffers_from() == 0 and not policy.large_buffers
    if backends.cpp_available():  # new large tensors come from torch's allocator again
        big = torch.empty(4 * heap.LARGE_BUFFER_BYTES // 4)
        assert heap.large_buffer_stats()["live"] == live
        del big


@glibc
def test_fast_language_model_applies_the_policy_on_cpu(tmp_path):
    from lorafuse import FastLanguageModel
    from lorafuse.testing import save_tiny_model

    save_tiny_model(tmp_path / "m")
    model, _ = FastLanguageModel.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    model = FastLanguageModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    assert heap.threshold() > 0
    assert any("lorafuse.heap" in note for note in model.lorafuse_report.notes)
    heap.revert_training_policy()
    assert heap.threshold() == 0


@pytest.fixture
def large_buffers():
    """The allocator installed and trimmed; reverted after the test."""
    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")
    assert heap.use_large_buffers() is not None
    heap.trim_large_buffers()
    yield heap.large_buffer_stats
    heap.stop_large_buffers()


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_freed_large_buffer_is_handed_back_for_the_same_size_without_faults(large_buffers):
    nbytes = 6 << 20
    first = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    ptr, stats = first.data_ptr(), large_buffers()
    assert stats["live"] >= nbytes and stats["misses"] >= 1
    del first
    assert large_buffers()["cached"] >= nbytes
    before = _minor_faults()
    again = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
    faults = _minor_faults() - before
    assert again.data_ptr() == ptr and large_buffers()["hits"] == stats["hits"] + 1
    assert faults < (nbytes >> 12) // 10, f"{faults} page faults for a reused {nbytes}-byte buffer"
    assert torch.equal(again, torch.full((nbytes,), 2, dtype=torch.uint8))


def test_small_allocations_stay_with_torchs_allocator(large_buffers):
    live = large_buffers()["live"]
    small = torch.empty(heap.LARGE_BUFFER_BYTES // 4 - 1)  # fp32: one byte short of the limit
    assert large_buffers()["live"] == live
    big = torch.empty(heap.LARGE_BUFFER_BYTES // 4)
    assert large_buffers()["live"] >= live + heap.LARGE_BUFFER_BYTES
    del small, big


def test_mapped_bytes_never_exceed_the_most_bytes_alive_at_once(large_buffers):
    """Buffers of shifting sizes allocated and freed out of order (what fragments a heap): the
    mapped total (alive + kept for reuse) never passes the peak of what was alive, and every
    buffer keeps its contents while alive."""
    g = torch.Generator().manual_seed(0)
    alive = []
    for i in range(300):
        if alive and (len(alive) > 6 or torch.rand((), generator=g) < 0.45):
            t, value = alive.pop(int(torch.randint(len(alive), (), generator=g)))
            assert bool((t == value).all()), "a live buffer was overwritten"
        mib = int(torch.randint(1, 24, (), generator=g)) + 4 * (i // 100)  # sizes drift upwards
        alive.append((torch.empty(mib << 20, dtype=torch.uint8).fill_(i % 251), i % 251))
        stats = large_buffers()
        assert stats["live"] + stats["cached"] <= stats["high_water"] <= stats["peak_live"], stats
    assert stats["hits"] > 0 and stats["unmapped"] > 0
    del alive, t
    assert heap.trim_large_buffers() > 0 and large_buffers()["cached"] == 0


def test_large_buffers_show_in_the_profilers_memory_events(large_buffers):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t = torch.ones(4 << 20, dtype=torch.uint8)
        del t
    allocated = max(e.cpu_memory_usage for e in prof.key_averages())
    assert allocated >= 4 << 20, f"the profiler saw {allocated} bytes"


@pytest.mark.skipif(not heap.huge_pages_allowed(), reason="transparent huge pages are off")
def test_buffers_from_4_mib_sit_on_huge_page_boundaries(large_buffers):
    t = torch.empty(4 << 20, dtype=torch.uint8)
    assert t.data_ptr() % (2 << 20) == 0


def test_dense_copies_are_plain_allocations_where_the_allocator_serves_them(large_buffers):
    from lorafuse.ops import weights

    first = weights.dense_buffer((1024, 1024), torch.bfloat16, torch.device("cpu"))  # 2 MiB
    held = weights.dense_buffer((1024, 1024), torch.bfloat16, torch.device("cpu"))
    assert first.data_ptr() != held.data_ptr()
    assert (1024 * 1024, torch.bfloat16, torch.device("cpu")) not in weights._buffers

"""`lorafuse bench`: the CLI runs end to end on a tiny model and writes a sound JSON result;
the roofline counts the products a LoRA step cannot avoid (checked against hand formulas)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from lorafuse import bench, roofline
from lorafuse.bench import llm, process, report
from lorafuse.commands import main

PROBE_SCRIPT = """
import torch
from lorafuse.bench.process import MemoryProbe
probe = MemoryProbe(torch.device("cpu"))
probe.start()
before = probe.peak_bytes()
block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
after = probe.peak_bytes()
print(before, after)
"""


def test_memory_probe_sees_an_allocation_after_start():
    # A fresh process, as `lorafuse bench` uses the probe: inside a long pytest process the
    # allocator may hand back pages that are already resident, which RSS cannot see.
    out = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT], capture_output=True, text=True, check=True
    ).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert after - before >= 250 * 2**20, (before, after)


def test_heap_bytes_follow_an_allocation_and_reach_the_table():
    before = process.heap_bytes()
    if before is None:
        pytest.skip("the C library has no mallinfo2 (not glibc >= 2.33)")
    block = torch.ones(16 * 2**20, dtype=torch.uint8)  # 16 MiB: malloc or large_buffers
    during = process.heap_bytes()
    del block
    after = process.heap_bytes()
    # within 1 MiB: the interpreter's own small allocations move glibc's count meanwhile
    assert during["in_use"] - before["in_use"] >= 15 * 2**20
    assert during["in_use"] - after["in_use"] >= 15 * 2**20
    assert all(h["mapped"] >= h["in_use"] for h in (before, during, after))
    side = {"times": [1.0], "losses": [5.0], "peak_bytes": 0}
    runs = [{**side, "heap_bytes": {"mapped": m << 20, "in_use": u << 20, "free": (m - u) << 20}}
            for m, u in ((300, 200), (500, 250), (400, 300))]  # fmt: skip
    summary = report.summarise(runs, tokens_per_step=8)
    assert (summary["heap_in_use_mib"], summary["heap_mapped_mib"]) == (250, 400)  # medians
    spec = {"model": "tiny", "dtype": "bf16", "device": "cpu", "batch": 1, "seq": 8, "rank": 4,
            "grad_ckpt": False}  # fmt: skip
    table = bench.format_table({"lorafuse": summary}, spec)
    assert "MiB in use / mapped" in table and "lorafuse 250 / 400" in table
    # a run without the heap (CUDA, another C library, older JSON) leaves the line out
    assert "heap after" not in bench.format_table({"lorafuse": report.summarise([side], 8)}, spec)


def test_bad_arguments_are_user_errors(capsys):
    assert main(["bench", "--model", "tiny", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err


# The tiny config: 2 layers, hidden 64, intermediate 96, 4 heads of 16, 2 KV heads, vocab 512,
# untied lm_head. (fan_in, fan_out) of each projection; k/v are narrower (2 KV heads x 16).
TINY_IO = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
           "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}  # fmt: skip


def _tiny_products(batch=3, seq=10, rank=8, targets=bench.TARGETS):
    return roofline.training_products(bench.model_config("tiny"), batch, seq, rank, targets)


def test_roofline_products_match_hand_formula():
    b, t, r, layers, heads, d, hidden, vocab = 3, 10, 8, 2, 4, 16, 64, 512
    m = b * t
    products = _tiny_products(b, t, r)
    counts = {p.name: p.count for p in products}
    # frozen weights: forward every layer; input gradient every layer but the first for q/k/v
    # (layer 0's input comes from the frozen embedding: nobody needs its gradient)
    expected = 0.0
    for name, (fan_in, fan_out) in TINY_IO.items():
        first_dx = name not in ("q_proj", "k_proj", "v_proj")
        dx_layers = layers if first_dx else layers - 1
        assert counts[f"{name}.fwd"] == layers and counts[f"{name}.dx"] == dx_layers
        assert counts[f"{name}.lora_dA"] == layers and counts[f"{name}.lora_dx"] == dx_layers
        expected += 2 * m * fan_in * fan_out * (layers + dx_layers)
        # LoRA: xA, (xA)B, dB, gB, dA per layer; (gB)A where the input gradient is needed
        expected += 2 * m * r * (2 * fan_in + 3 * fan_out) * layers
        expected += 2 * m * r * fan_in * dx_layers
    # attention: 6 products of 2*t*t*d per (sequence, head) per layer, causal = half
    expected += 6 * 2 * t * t * d * b * heads * layers * 0.5
    expected += 2 * (2 * m * hidden * vocab)  # lm_head forward + input gradient
    assert roofline.total_flops(products) == pytest.approx(expected, rel=1e-12)
    assert len(products) == 7 * 2 + 7 * 6 + 6 + 2


def test_roofline_attention_is_causal_half():
    products = _tiny_products(batch=2, seq=32)
    attn = [p for p in products if p.name.startswith("attn_")]
    assert {p.name for p in attn} == set(roofline.ATTENTION_PRODUCTS)
    for p in attn:
        assert p.fraction == 0.5 and p.group == 2 * 4 and p.count == 2 * 2 * 4
        assert p.flops == 0.5 * 2 * p.m * p.k * p.n * p.count
        assert sorted((p.m, p.k, p.n)) == [16, 32, 32]  # (T, d, T) or (T, T, d)
    # quadratic in seq: attention flops x4 when seq doubles (the rest only x2)
    flops = {s: sum(p.flops for p in _tiny_products(seq=s) if p.name.startswith("attn_"))
             for s in (32, 64)}  # fmt: skip
    assert flops[64] == 4 * flops[32]


def test_roofline_gqa_narrows_only_k_and_v():
    by_name = {p.name: p for p in _tiny_products(batch=1, seq=8, rank=4)}
    assert (by_name["q_proj.fwd"].k, by_name["q_proj.fwd"].n) == (64, 64)
    for name in ("k_proj", "v_proj"):
        assert (by_name[f"{name}.fwd"].k, by_name[f"{name}.fwd"].n) == (64, 32)  # 2 KV heads
        assert (by_name[f"{name}.dx"].k, by_name[f"{name}.dx"].n) == (32, 64)
        assert (by_name[f"{name}.lora_xAB"].k, by_name[f"{name}.lora_xAB"].n) == (4, 32)
    # attention runs per query head (K/V heads repeated): group = batch * 4 heads
    assert by_name["attn_QK"].group == 4 and by_name["attn_QK"].k == 16


def test_roofline_lm_head_is_frozen_forward_and_input_gradient():
    products = _tiny_products(batch=2, seq=5)
    lm = {p.name: p for p in products if p.name.startswith("lm_head")}
    assert set(lm) == {"lm_head.fwd", "lm_head.dx"}  # untied, frozen: no weight gradient
    assert (lm["lm_head.fwd"].m, lm["lm_head.fwd"].k, lm["lm_head.fwd"].n) == (10, 64, 512)
    assert (lm["lm_head.dx"].m, lm["lm_head.dx"].k, lm["lm_head.dx"].n) == (10, 512, 64)
    assert all(p.count == 1 for p in lm.values())


def test_roofline_first_layer_counts_only_needed_gradients():
    # only down_proj adapted: in layer 0 nothing trainable sits before down_proj's input, so no
    # input gradient is needed there at all (its dA needs x, not dx); layer 1 needs them all
    counts = {p.name: p.count for p in _tiny_products(batch=1, seq=4, targets=["down_proj"])}
    assert counts["down_proj.dx"] == 1 and counts["down_proj.lora_dx"] == 1
    assert counts["down_proj.lora_dA"] == 2 and counts["down_proj.fwd"] == 2
    assert counts["o_proj.dx"] == 1 and counts["gate_proj.dx"] == 1
    assert counts["attn_dQ"] == 1 * 4 and counts["attn_QK"] == 2 * 4
    assert "q_proj.lora_xA" not in counts
    with pytest.raises(ValueError, match="targets"):
        _tiny_products(targets=["lm_head"])


def test_roofline_times_in_the_fast_matmul_dtype(monkeypatch):
    # emulated bf16 (AVX2): the roofline multiplies in fp32, as lorafuse's fast paths do there
    monkeypatch.setenv("LORAFUSE_CPU_LOW_PRECISION", "emulated")
    products = _tiny_products(batch=1, seq=8, rank=4)
    out = roofline.time_products(products, "cpu", torch.bfloat16, reps=1, warmup=0)
    assert out["matmul_dtype"] == "torch.float32"
    assert out["flops"] == roofline.total_flops(products)
    assert len(out["products"]) == len(products)
    assert out["seconds"] == pytest.approx(sum(row["seconds"] for row in out["products"]))
    monkeypatch.setenv("LORAFUSE_CPU_LOW_PRECISION", "native")
    assert (
        roofline.time_products(products[:1], "cpu", torch.bfloat16, reps=1, warmup=0)[
            "matmul_dtype"
        ]
        == "torch.bfloat16"
    )


def test_table_with_and_without_roofline():
    side = {"step_time_s": 2.0, "step_time_min_s": 1.9, "tokens_per_s": 100.0,
            "peak_mem_mib": 10.0, "first_loss": 6.0}  # fmt: skip
    roof = {"seconds": 1.0, "gflop": 50.0, "gflops_per_s": 50.0, "matmul_dtype": "torch.bfloat16"}
    spec = {"model": "tiny", "dtype": "bf16", "device": "cpu", "batch": 1, "seq": 8, "rank": 4,
            "grad_ckpt": False}  # fmt: skip
    results = {"stock": dict(side), "lorafuse": dict(side)}
    assert "roofline" not in bench.format_table(results, spec)
    # each run's efficiency is its own roofline over its own median step; the side reports the
    # median of those (0.25, 0.5, 0.9 -> 50%), not the median roofline over the median step
    runs = [{"times": [2.0, 2.1, 1.9], "roofline": {"seconds": 1.0}},
            {"times": [4.0], "roofline": {"seconds": 1.0}},
            {"times": [1.0], "roofline": {"seconds": 0.9}}]  # fmt: skip
    for c in ("stock", "lorafuse"):
        results[c].update(report.efficiency(roof, runs, side["step_time_s"]))
    assert results["stock"]["efficiency_per_run"] == pytest.approx([0.5, 0.25, 0.9])
    table = bench.format_table({**results, "roofline": roof}, spec)
    assert "roofline eff." in table and " 50%" in table and "50.0 GFLOP/step" in table


def test_machine_peak_line(monkeypatch):
    """The roofline line names the machine's peak (one square product, median over runs) and each
    side's product rate as a fraction of it; the peak is timed with the roofline's dtype."""
    monkeypatch.setitem(roofline.PEAK_SIZE, "cpu", 32)
    peak = roofline.peak_product("cpu", torch.float32, reps=1, warmup=0)
    assert peak["size"] == 32 and peak["gflops_per_s"] > 0
    assert peak["seconds"] == pytest.approx(2 * 32**3 / 1e9 / peak["gflops_per_s"])
    row = {"flops": 50e9, "matmul_dtype": "torch.bfloat16"}
    runs = [llm.bracketed({**row, "seconds": 1.0, "peak": {"gflops_per_s": g, "size": 2048}},
                          {**row, "seconds": 1.0}) for g in (90.0, 100.0, 200.0)]  # fmt: skip
    roof = report.summarise_roofline(runs)
    assert roof["peak_gflops_per_s"] == 100.0  # the median, not the mean
    side = {"step_time_s": 2.0, "step_time_min_s": 1.9, "tokens_per_s": 100.0,
            "peak_mem_mib": 10.0, "first_loss": 6.0}  # fmt: skip
    per_run = [{"times": [2.0], "roofline": r} for r in runs]
    results = {"stock": {**side, **report.efficiency(roof, per_run, 2.0)}, "roofline": roof}
    assert results["stock"]["peak_fraction"] == pytest.approx(0.25)  # 50 GFLOP / 2 s / 100
    spec = {"model": "tiny", "dtype": "bf16", "device": "cpu", "batch": 1, "seq": 8, "rank": 4,
            "grad_ckpt": False}  # fmt: skip
    table = bench.format_table(results, spec)
    assert "machine peak: 100.0 GFLOP/s (one 2048x2048x2048 bfloat16 product" in table
    assert "stock 25%" in table and "the roofline's own shapes reach 50%" in table


def test_roofline_timed_on_both_sides_of_the_steps():
    """A run's roofline is the mean of its timings before and after the steps; the largest drift
    over runs is printed, and flagged when the machine's speed moved past DRIFT_WARN."""
    row = {"flops": 50e9, "matmul_dtype": "torch.bfloat16"}
    steady = llm.bracketed({**row, "seconds": 1.0}, {**row, "seconds": 1.1})
    assert steady["seconds"] == pytest.approx(1.05) and steady["drift"] == pytest.approx(0.1)
    slowed = llm.bracketed({**row, "seconds": 1.0}, {**row, "seconds": 1.5})
    sped_up = llm.bracketed({**row, "seconds": 1.0}, {**row, "seconds": 0.6})  # drift -40%
    spec = {"model": "tiny", "dtype": "bf16", "device": "cpu", "batch": 1, "seq": 8, "rank": 4,
            "grad_ckpt": False}  # fmt: skip
    side = {"step_time_s": 2.0, "step_time_min_s": 1.9, "tokens_per_s": 100.0,
            "peak_mem_mib": 10.0, "first_loss": 6.0}  # fmt: skip
    cases = (([steady, steady], False), ([steady, slowed], True), ([sped_up, steady], True))
    for runs, flagged in cases:
        roof = report.summarise_roofline(runs)
        per_run = [{"times": [2.0], "roofline": r} for r in runs]
        results = {"lorafuse": {**side, **report.efficiency(roof, per_run, 2.0)}, "roofline": roof}
        table = bench.format_table(results, spec)
        assert f"drift (roofline after / before the steps - 1, largest over runs): " \
               f"{roof['drift']:+.0%}" in table  # fmt: skip
        assert ("uncertain by about as much" in table) == flagged
    assert report.summarise_roofline([slowed, steady])["drift"] == pytest.approx(0.5)
    assert report.summarise_roofline([sped_up, steady])["drift"] == pytest.approx(-0.4)  # by size
    # a roofline without the before timing (older JSON) prints no drift line
    assert report.summarise_roofline([{**row, "seconds": 1.0}])["drift"] is None


@pytest.mark.slow
def test_bench_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--batch", "1", "--seq", "16", "--steps", "2",
            "--repeats", "1", "--threads", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "lorafuse/stock" in table and "patched 14 of 14 LoRA modules" in table
    data = json.loads(out.read_text())
    for name in ("stock", "lorafuse"):
        assert data[name]["n_steps"] == 2 and data[name]["tokens_per_s"] > 0
    # same seed, same weights, same batch: the first losses agree (fp32, fused vs stock loss)
    assert abs(data["stock"]["first_loss"] - data["lorafuse"]["first_loss"]) < 1e-4
    assert data["ratio"]["tokens_per_s"] > 0
    for name in ("stock", "lorafuse"):  # the process's CPU clock beside the wall clock
        assert 0 < data[name]["step_cpu_s"] < 100, data[name]
    assert data["ratio"]["step_cpu_time"] > 0 and "CPU s/step (median): stock" in table
    assert "roofline eff." in table and "roofline:" in table
    roof = data["roofline"]
    assert roof["gflop"] > 0 and math.isfinite(roof["seconds"]) and roof["seconds"] > 0
    assert "drift (roofline after / before the steps" in table and math.isfinite(roof["drift"])
    for name in ("stock", "lorafuse"):
        for key in ("efficiency", "achieved_gflops_per_s"):
            assert math.isfinite(data[name][key]) and data[name][key] > 0, (name, key)


def _nf4_bytes(n: int) -> int:
    """The NF4 format's bytes for n weights: codes, int8 absmaxes padded to 256, scales, offset."""
    nb = -(-n // 64)
    nb2 = -(-nb // 256)
    return nb * 32 + nb2 * 256 + nb2 * 4 + 4


def test_bench_quant_nf4_reports_weights_and_total_peak(tmp_path, capsys, monkeypatch):
    """--quant nf4 adds the lorafuse-nf4 run (NF4 base linears, lm_head kept) and lorafuse-nf4+emb
    (embeddings and lm_head too) with their weight bytes, total peak memory and the nf4/lorafuse
    ratios, in the table and the JSON."""
    # Runs in this process (a fresh interpreter per run costs ~15 s here); no --threads, so the
    # worker leaves this process's thread count alone.
    monkeypatch.setattr(bench, "spawn", llm.run_worker)
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny", "--batch", "1", "--seq", "16", "--steps", "1",
            "--warmup", "0", "--repeats", "1", "--only", "lorafuse", "--quant", "nf4",
            "--no-roofline", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "lorafuse-nf4/lorafuse" in table and "peak total MiB" in table
    assert "lorafuse-nf4: weights" in table and "patched 14 of 14 LoRA modules" in table
    data = json.loads(out.read_text())
    nf4, dense = data["lorafuse-nf4"], data["lorafuse"]
    # Exactly the 14 base linears change format, fp32 (4 B/weight) -> NF4; embeddings and the
    # lm_head stay fp32. (fan_in, fan_out) per layer from TINY_IO, 2 layers.
    sizes = [i * o for i, o in TINY_IO.values()] * 2
    saved = sum(4 * n - _nf4_bytes(n) for n in sizes)
    assert (dense["weights_mib"] - nf4["weights_mib"]) * 2**20 == pytest.approx(saved, abs=0.5)
    for side in (nf4, dense):
        assert side["n_steps"] == 1 and side["tokens_per_s"] > 0
        assert side["peak_total_mib"] > side["weights_mib"] > 0
    ratio = data["ratio lorafuse-nf4"]
    assert ratio["peak_total_mem"] == pytest.approx(nf4["peak_total_mib"] / dense["peak_total_mib"])
    assert ratio["tokens_per_s"] == pytest.approx(nf4["tokens_per_s"] / dense["tokens_per_s"])
    assert data["spec"]["quant"] == "nf4"
    # lorafuse-nf4+emb: the (untied) 512 x 64 embedding and lm_head in NF4 too
    emb = data["lorafuse-nf4+emb"]
    vocab = 2 * (4 * 512 * 64 - _nf4_bytes(512 * 64))
    assert (nf4["weights_mib"] - emb["weights_mib"]) * 2**20 == pytest.approx(vocab, abs=0.5)
    assert "lorafuse-nf4+emb/lorafuse" in table and "lorafuse-nf4+emb: weights" in table
    assert emb["n_steps"] == 1 and emb["first_loss"] == pytest.approx(nf4["first_loss"], rel=0.05)


def test_quant_nf4_rejects_what_it_does_not_measure(capsys):
    assert main(["bench", "--model", "tiny", "--quant", "nf4", "--method", "dpo"]) == 2
    assert "--quant nf4 measures eager LLM SFT steps only" in capsys.readouterr().err


def test_profile_splits_the_step_by_kind_of_work():
    """--profile adds one line: the step's self time by kind (torch's products, the LoRA rank-r
    kernels, attention (ours or torch's), other lorafuse kernels, the optimizer, other torch ops,
    the rest)."""
    from types import SimpleNamespace

    from lorafuse import _ext
    from lorafuse.bench import profile

    kinds = {
        "aten::mm": "matrix products (torch)",
        "lorafuse::lora_rank_mkl_bf16_gemm": "LoRA rank-r products",  # bf16x3 (AMX)
        "lorafuse::attention_mkl_bf16_gemm": "attention",  # bf16 attention, head dim % 16 != 0
        "lorafuse::lora_rank_up_add_": "LoRA rank-r products",
        "lorafuse::attention_backward": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",  # a UNet's, torch's
        "aten::_slow_conv2d_backward": "matrix products (torch)",
        "lorafuse::swiglu_forward": "other lorafuse kernels",
        "aten::_fused_adamw_": "optimizer",
        "Optimizer.step#AdamW.step": "optimizer",
        "aten::add_": "other torch ops",
        "LoRAMLPFunctionBackward": "Python, autograd, the rest",
    }
    assert {name: profile.kind_of(name) for name in kinds} == kinds
    rows = [SimpleNamespace(key=name, self_cpu_time_total=us)
            for name, us in (("aten::mm", 3e5), ("aten::addmm", 1e5), ("aten::add_", 1e5))]  # fmt: skip
    seconds = profile.seconds_by_kind(rows)
    assert seconds["matrix products (torch)"] == pytest.approx(0.4)
    line = profile.format_kinds(seconds)
    assert line.startswith("where the step's 0.500 s go")
    assert "matrix products (torch) 0.400 s (80%)" in line and "attention" not in line

    ext = _ext.load_cpp()
    x = torch.randn(64, 64)
    text = profile.profiled(lambda: ext.swiglu_forward(x @ x, x))
    assert "lorafuse::swiglu_forward" in text  # the kernel's own range (csrc/common.h)
    last = text.splitlines()[-1]
    assert "matrix products (torch)" in last and "other lorafuse kernels" in last


def test_machine_line_flags_runs_that_shared_their_cpus():
    """A run pinned to fewer CPUs than the machine has, or under a load above its CPUs, is
    flagged as noise; a run alone on the machine is not."""
    share = llm.machine_share()
    assert share["cpus"] >= 1 and share["load_avg"] >= 0 and share["machine_cpus"] >= share["cpus"]
    quiet = {"stock": [{"machine": {"cpus": 2, "load_avg": 2.1, "machine_cpus": 2}}]}
    pinned = {"stock": [{"machine": {"cpus": 1, "load_avg": 0.9, "machine_cpus": 2}}]}
    loaded = {"stock": [{"machine": {"cpus": 2, "load_avg": 0.5, "machine_cpus": 2}}],
              "lorafuse": [{"machine": {"cpus": 2, "load_avg": 9.9, "machine_cpus": 2}}]}  # fmt: skip
    assert (
        report.machine_line(quiet)
        == "machine: each run on 2 of 2 CPUs, 1-min load average up to 2.1"
    )
    assert "WARNING" in report.machine_line(pinned) and "1 of 2 CPUs" in report.machine_line(pinned)
    assert "up to 9.9" in report.machine_line(loaded) and "WARNING" in report.machine_line(loaded)
    assert report.machine_line({"stock": [{}]}) is None

"""lorafuse.train.distributed: unit tests at world 1, and real 2-process gloo jobs on this CPU.

The multi-process tests launch ``torchrun --standalone`` (it picks a free port itself) on the
``dist_*.py`` scripts next to this file.  Equivalence tolerances (fp32):

* loss per step, rtol 1e-6: the same token losses summed in another order (per rank, then
  all-reduced) differ by a few ulps (fp32 eps 1.2e-7); measured 4e-8.
* first-step gradient, atol 1e-5 * max|g| per tensor: each element is a sum over ~200 tokens
  reordered across ranks and micro-batches (measured 3e-7 of max|g|).  A missing ``loss_scale``
  (x2) or per-rank instead of global token normalisation (ranks hold 10-40% different token
  counts) is >= 1e-1 of max|g|.
* adapter after 5 AdamW steps (lr 5e-3, eps 1e-6), atol 1e-5: Adam turns a gradient error d into
  an update error <= lr * d / eps (~1e-6 here for d ~ 1e-10 on near-zero elements), measured
  1e-6; any real error moves parameters by ~lr = 5e-3.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lorafuse.errors import LorafuseError, SettingError
from lorafuse.train import distributed as D

HERE = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def world1_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)


def ctx_of(world: int, rank: int = 0, strategy: str = "ddp") -> D.DistContext:
    return D.DistContext(rank, world, rank, torch.device("cpu"), rank == 0, strategy)


def run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``cmd``; returns (exit code, stdout+stderr, seconds). Never hangs past ``timeout``."""
    t0 = time.monotonic()
    full_env = {**os.environ, **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        full_env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


# ---- world 1 and pure functions -----------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 11])
def test_shard_rows_disjoint_covering_balanced(world, n):
    shares = [D.shard_rows(n, ctx_of(world, r)) for r in range(world)]
    flat = [i for s in shares for i in s]
    assert sorted(flat) == list(range(n)) and len(flat) == len(set(flat)), shares
    assert shares[0][:1] == ([0] if n else [])
    assert all(s == list(range(r, n, world)) for r, s in enumerate(shares))  # strided
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    assert D.rows_per_rank(n, ctx_of(world)) == max(sizes)


def test_shard_rows_rejects_negative():
    with pytest.raises(ValueError, match="n_rows"):
        D.shard_rows(-1, ctx_of(2))


def test_loss_scale():
    assert D.loss_scale(ctx_of(2, strategy="ddp")) == 2.0
    assert D.loss_scale(ctx_of(4, strategy="fsdp")) == 4.0
    assert D.loss_scale(ctx_of(1, strategy="none")) == 1.0


def test_setup_world1_is_identity(monkeypatch):
    world1_env(monkeypatch)
    ctx = D.setup("auto", device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.strategy) == (0, 1, 0, "none")
    assert ctx.is_main and D.is_main(ctx) and not ctx.distributed
    assert not torch.distributed.is_initialized()
    assert D.all_reduce_sum(3, ctx) == 3 and type(D.all_reduce_sum(3, ctx)) is int
    assert D.all_reduce_sum(0.5, ctx) == 0.5
    x = torch.arange(3.0)
    y = D.all_reduce_sum(x, ctx)
    assert torch.equal(y, x) and y is not x
    model = torch.nn.Linear(2, 2)
    assert D.wrap_model(model, ctx) is model and D.unwrap_model(model) is model
    with D.no_grad_sync(model, ctx):
        pass
    D.barrier(ctx)
    D.cleanup(ctx)
    D.cleanup(ctx)  # twice is fine
    assert D.throughput(100, 2.0, ctx) == (50.0, 50.0)
    assert D.setup("fsdp", device="cpu").strategy == "none"  # nothing to shard over


def test_setup_rejects_bad_input(monkeypatch):
    # SettingError: one line from `lorafuse train` (a LorafuseError) and still a ValueError
    world1_env(monkeypatch)
    with pytest.raises(SettingError, match="strategy"):
        D.setup("zero3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SettingError, match="'none' cannot run with WORLD_SIZE=2"):
        D.setup("none", device="cpu")
    with pytest.raises(SettingError, match="own GPU"):  # all ranks on one GPU would break NCCL
        D.setup("auto", device="cuda:1")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(SettingError, match="RANK=2, WORLD_SIZE=2"):
        D.setup("auto", device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(SettingError, match="WORLD_SIZE='two'"):
        D.setup("auto", device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_setup_without_cuda_is_a_user_error(monkeypatch):
    world1_env(monkeypatch)
    with pytest.raises(LorafuseError, match="cuda:0 requested but CUDA is not available"):
        D.setup("auto", device="cuda")


def test_all_reduce_sum_rejects_other_types():
    for bad in ("3", True, [1.0]):
        with pytest.raises(TypeError, match="int, float or Tensor"):
            D.all_reduce_sum(bad, ctx_of(1, strategy="none"))


def test_trainable_state_dict_world1():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    ctx = ctx_of(1, strategy="none")
    sd = D.trainable_state_dict(model, ctx)
    assert set(sd) == {"0.bias", "1.weight", "1.bias"}
    assert sd["1.weight"].data_ptr() != model[1].weight.data_ptr()  # a copy, not a view
    with pytest.raises(ValueError, match="has no gradient"):
        D.trainable_state_dict(model, ctx, grads=True)
    model(torch.ones(1, 2)).sum().backward()
    g = D.trainable_state_dict(model, ctx, grads=True)
    assert torch.equal(g["1.weight"], model[1].weight.grad)


# ---- real 2-rank gloo jobs -----------------------------------------------------------------


def test_collectives_two_ranks():
    code, out, _ = run([*TORCHRUN, "--nproc-per-node", "2", str(HERE / "dist_collectives.py")], 90)
    assert code == 0, out[-3000:]
    assert "rank 0: collectives ok" in out and "rank 1: collectives ok" in out


@pytest.mark.parametrize("mode", ["raise", "exit", "hang"])
def test_dead_rank_fails_the_job_quickly(mode):
    """Rank 1 raises / vanishes / stops talking: the job must exit non-zero, not hang, and say why.
    The bound (60 s) covers torch import + rendezvous under load; a hang would hit the 600 s
    default timeout, and here the collective timeout is 5 s."""
    cmd = [*TORCHRUN, "--nproc-per-node", "2", str(HERE / "dist_dies.py"), "--mode", mode]
    code, out, secs = run(cmd, 120, env={"LORAFUSE_DIST_TIMEOUT": "5"})
    assert code != 0, out[-3000:]
    assert secs < 60, f"took {secs:.0f}s to come down"
    assert "ChildFailedError" in out  # torchrun's summary names the failed rank
    if mode == "raise":
        assert "rank 1 failed deliberately" in out
    if mode == "hang":  # rank 0's collective timed out and says what probably happened
        assert "rank 0/2: collective 'all_reduce' failed; another rank probably died or hung" in out
        assert "Timed out" in out


# ---- 1 rank vs 2 ranks: same global batch, same numbers ------------------------------------

SCRIPT = str(HERE / "dist_train_equivalence.py")


def train(out: Path, nproc: int, *extra: str) -> dict:
    """Run the tiny LoRA training (patched when lorafuse.patching is there) on ``nproc`` ranks;
    returns losses.json + the saved adapter + the first-step gradient (if dumped)."""
    from safetensors.torch import load_file

    args = ["--out", str(out), "--patch", "auto", *extra]
    cmd = [sys.executable, SCRIPT, *args] if nproc == 1 else [
        *TORCHRUN, "--nproc-per-node", str(nproc), SCRIPT, *args]  # fmt: skip
    code, log, _ = run(cmd, 300)
    assert code == 0, log[-4000:]
    facts = json.loads((out / "losses.json").read_text())
    assert facts["world_size"] == nproc
    facts["adapter"] = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    if (out / "grads0.pt").exists():
        facts["grads"] = torch.load(out / "grads0.pt", weights_only=True)
    return facts


def assert_same_run(got: dict, want: dict, close, first_step: int = 0) -> None:
    want_losses = want["losses"][first_step:]
    assert len(got["losses"]) == len(want_losses)
    for i, (a, b) in enumerate(zip(got["losses"], want_losses)):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {first_step + i}: loss {a} vs {b}"
    assert set(got["adapter"]) == set(want["adapter"]) and got["adapter"]
    for k, v in want["adapter"].items():
        close(got["adapter"][k], v, atol=1e-5, rtol=0, name=f"adapter {k}")
    for k, g in want.get("grads", {}).items():
        if "grads" in got:
            scale = float(g.abs().max())
            close(got["grads"][k], g, atol=1e-5 * scale, rtol=0, name=f"step-0 grad {k}")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """1 process, 5 steps, global batch 5 in micro-batches of 2, checkpoint after step 3."""
    out = tmp_path_factory.mktemp("ref")
    facts = train(out, 1, "--dump-grads", "--save-at", "3")
    facts["ckpt"] = out / "ckpt.pt"
    losses = facts["losses"]
    assert len(losses) == 5 and len(set(losses)) == 5  # it trained: every step differs
    assert any(float(v.abs().max()) > 1e-3 for k, v in facts["adapter"].items() if "lora_B" in k)
    return facts


@pytest.fixture(scope="module")
def ddp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp2")
    return out, train(out, 2, "--dump-grads", "--save-at", "3")


@pytest.mark.slow
def test_two_rank_ddp_matches_one_rank(ref, ddp2, close):
    """Rank 0 holds 3 rows (2 micro-batches), rank 1 2 rows + a zero-weight padding micro-batch."""
    _, facts = ddp2
    assert facts["strategy"] == "ddp" and facts["patch"] == ref["patch"]
    assert_same_run(facts, ref, close)
    assert facts["tokens_per_s_total"] > 0 and facts["tokens_per_s_rank0"] > 0


@pytest.mark.slow
def test_resume_two_ranks_to_one(ref, ddp2, tmp_path, close):
    """Checkpoint after step 3 of the 2-rank run (adapter + optimizer + data position in global
    rows), resumed on 1 rank: steps 4-5 and the final adapter equal the uninterrupted 1-rank run."""
    out, _ = ddp2
    facts = train(tmp_path / "r", 1, "--resume", str(out / "ckpt.pt"))
    assert facts["start_step"] == 3
    assert_same_run(facts, ref, close, first_step=3)


@pytest.mark.slow
def test_resume_one_rank_to_two(ref, tmp_path, close):
    """The 1-rank checkpoint after step 3, resumed on 2 DDP ranks, finishes like the 1-rank run."""
    facts = train(tmp_path / "r", 2, "--resume", str(ref["ckpt"]))
    assert facts["start_step"] == 3 and facts["strategy"] == "ddp"
    assert_same_run(facts, ref, close, first_step=3)


@pytest.fixture(scope="module")
def fsdp_4bit(tmp_path_factory):
    """1-rank and 2-rank FSDP2 runs over an NF4 base (checkpoint after step 3)."""
    root = tmp_path_factory.mktemp("fsdp4")
    want = train(root / "one", 1, "--load-in-4bit", "--dump-grads")
    got = train(root / "two", 2, "--load-in-4bit", "--dump-grads", "--strategy", "fsdp",
                "--save-at", "3")  # fmt: skip
    return root, want, got


@pytest.mark.slow
def test_fsdp_4bit_two_ranks_match_one_rank(fsdp_4bit, close):
    """FSDP2 (per-layer fully_shard) over an NF4 base: packed base weights are buffers (replicated,
    not sharded); LoRA, embeddings, norms and lm_head are sharded DTensors (half per rank)."""
    _, want, got = fsdp_4bit
    assert got["strategy"] == "fsdp"
    assert got["param_bytes"] * 2 == want["param_bytes"]  # every parameter split in 2
    assert got["buffer_bytes"] == want["buffer_bytes"] > 0  # NF4 packs are not sharded
    assert_same_run(got, want, close)


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_on_one_rank(fsdp_4bit, tmp_path, close):
    """The FSDP checkpoint holds full (gathered) adapter and optimizer tensors: 1 rank resumes it."""
    root, want, _ = fsdp_4bit
    facts = train(tmp_path / "r", 1, "--load-in-4bit", "--resume", str(root / "two" / "ckpt.pt"))
    assert facts["start_step"] == 3
    assert_same_run(facts, want, close, first_step=3)


# ---- the real CLI: `lorafuse train --nproc 2` ------------------------------------------------

# 4 optimizer steps over a global batch of 4 rows: 1 rank = 2 rows x 2 micro-batches,
# 2 ranks = 1 row each x 2 micro-batches.  adam_eps 1e-6 for the reason in the module docstring.
# adam-eps 1e-3: Adam divides by sqrt(v) + eps, so with a tiny eps an adapter entry whose
# gradient is ~0 turns fp32 roundoff (the 1-rank run's padded batches attend through SDPA, the
# 2-rank run's unpadded ones through the C++ kernel) into a visible step; an eps near the
# gradient scale keeps the comparison about the distributed math, at the 1e-5 tolerance.
CLI_COMMON = ["--max-steps", "4", "--save-steps", "2", "--grad-accum", "2", "--max-seq-length",
              "128", "--no-gradient-checkpointing", "--no-progress", "--lr", "1e-3", "--adam-eps",
              "1e-3", "--dtype", "float32", "--device", "cpu"]  # fmt: skip


def cli_train(out: Path, nproc: int, *extra: str) -> dict:
    from safetensors.torch import load_file

    nproc_flag = ["--nproc", "2"] if nproc == 2 else []
    cmd = [sys.executable, "-m", "lorafuse", "train", *nproc_flag, "--output-dir", str(out),
           "--batch-size", str(2 // nproc), *CLI_COMMON, *extra]  # fmt: skip
    code, log, _ = run(cmd, 300)
    assert code == 0, log[-4000:]
    lines = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x and "step" in x]
    return {
        "losses": {x["step"]: x["loss"] for x in steps},
        "adapter": load_file(str(out / "final" / "adapter_model.safetensors")),
        "log": log,
    }


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    from lorafuse.testing import save_tiny_model

    root = tmp_path_factory.mktemp("cli")
    save_tiny_model(root / "tiny")
    rng = random.Random(0)  # mixed lengths: ranks hold different numbers of target tokens
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(48):
            q = "what is " + " and ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(1, 6)))
            a = "the answer is " + " ".join(
                str(rng.randint(0, 99)) for _ in range(rng.randint(1, 8))
            )
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    data = ["--model", str(root / "tiny"), "--data", str(root / "chat.jsonl")]
    return root, data, cli_train(root / "one", 1, *data), cli_train(root / "two", 2, *data)


@pytest.mark.slow
def test_train_cli_nproc2_matches_one_rank(cli_runs, close):
    _, _, one, two = cli_runs
    assert sorted(two["losses"]) == sorted(one["losses"]) == [1, 2, 3, 4]
    for step, want in one["losses"].items():
        # logging.jsonl rounds losses to 6 decimals (~5e-7 relative at loss ~10): 2e-6 relative
        assert abs(two["losses"][step] - want) <= 2e-6 * abs(want), (step, two["losses"], want)
    assert len(set(one["losses"].values())) == 4  # it trained
    for k, v in one["adapter"].items():
        close(two["adapter"][k], v, atol=1e-6, rtol=0, name=f"adapter {k}")
    assert "2 rank(s)" in two["log"] and "tokens_per_s_per_rank" in two["log"]


@pytest.mark.slow
def test_train_cli_resume_two_ranks_on_one(cli_runs, close):
    """checkpoint-2 of the 2-rank run, resumed by 1 rank (batch 2 x 2 accum: same global batch):
    steps 3-4 and the final adapter equal the uninterrupted 1-rank run."""
    root, data, one, _ = cli_runs
    resumed = cli_train(root / "resumed", 1, *data, "--resume", str(root / "two" / "checkpoint-2"))
    assert sorted(resumed["losses"]) == [3, 4], resumed["losses"]
    for step in (3, 4):
        want = one["losses"][step]
        assert abs(resumed["losses"][step] - want) <= 2e-6 * abs(want), (step, resumed, want)
    for k, v in one["adapter"].items():
        close(resumed["adapter"][k], v, atol=1e-5, rtol=0, name=f"adapter {k}")

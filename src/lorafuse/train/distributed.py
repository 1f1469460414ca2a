"""Data-parallel training on PyTorch's own engine: torchrun env, DDP / FSDP2, sharding, collectives.

The loop calls ``setup``, ``wrap_model``, ``shard_rows`` (rank r: rows r, r+W, ...),
``all_reduce_sum`` (the global target-token count), ``loss_scale`` (= W, undoing DDP's average),
``barrier`` and ``cleanup``. Every rank draws the same global batch, so the summed gradient
equals one process's; short ranks run zero-weight padding rows. A hung rank times out after
``LORAFUSE_DIST_TIMEOUT`` seconds. The walk-through: docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lorafuse import hardware
from lorafuse.errors import LorafuseError, SettingError

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "ddp", "fsdp", "none")
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "LORAFUSE_DIST_TIMEOUT"


class DeviceError(LorafuseError, RuntimeError):
    """The requested device is not on this machine (``--device cuda`` without CUDA, more ranks
    than GPUs); the message says which."""


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. ``strategy`` is resolved: "none" | "ddp" | "fsdp"."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    strategy: str

    @property
    def distributed(self) -> bool:
        """True when a process group exists and collectives really communicate."""
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"environment variable {name}={raw!r} is not an integer") from None


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise SettingError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise SettingError(f"{TIMEOUT_ENV} must be > 0 seconds, got {value}")
    return value


def _pick_device(local_rank: int, device: str | torch.device | None) -> torch.device:
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        return dev
    dev = hardware.default_device()
    return torch.device("cuda", local_rank) if dev.type == "cuda" else dev


def setup(strategy: str = "auto", device: str | torch.device | None = None) -> DistContext:
    """Read the torchrun environment and join the process group (none at world size 1).

    ``strategy``: "auto" (DDP when world > 1), "ddp", "fsdp" or "none" (single process only).
    ``device``: None = ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.  Backend: NCCL on CUDA,
    gloo on CPU.  Raises :class:`SettingError` (a ValueError) for a bad strategy / env,
    :class:`DeviceError` (a RuntimeError) for a device this machine does not have: both are the
    user's to fix, so ``lorafuse train`` prints one line.
    """
    if strategy not in STRATEGIES:
        raise SettingError(f"distributed strategy must be one of {STRATEGIES}, got {strategy!r}")
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank if world > 1 else 0)
    if world < 1 or not 0 <= rank < world:
        raise SettingError(f"inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world}")
    dev = _pick_device(local_rank, device)
    if dev.type == "cuda" and world > 1 and dev.index != local_rank:
        raise SettingError(
            f"rank {rank}: device {dev} given, but with {world} ranks each rank must use its own "
            f"GPU cuda:LOCAL_RANK (here cuda:{local_rank}); pass device 'cuda' without an index"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {dev} requested but CUDA is not available")
        if dev.index >= torch.cuda.device_count():
            raise DeviceError(
                f"rank {rank}: LOCAL_RANK {local_rank} needs {dev}, but only "
                f"{torch.cuda.device_count()} CUDA device(s) are visible; use --nproc-per-node <= "
                "the GPU count"
            )
        torch.cuda.set_device(dev)
    if world == 1:
        if strategy in ("ddp", "fsdp"):
            log.info("world size 1: strategy %r has nothing to do, training unwrapped", strategy)
        return DistContext(0, 1, 0, dev, True, "none")
    if strategy == "none":
        raise SettingError(
            f"strategy 'none' cannot run with WORLD_SIZE={world}: every rank would train its own "
            "copy; use 'ddp' or 'fsdp' (or run a single process)"
        )
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=_timeout_s()), **kwargs)
    resolved = "ddp" if strategy == "auto" else strategy
    return DistContext(rank, world, local_rank, dev, rank == 0, resolved)


@contextlib.contextmanager
def _collective(ctx: DistContext, what: str) -> Iterator[None]:
    """Re-raise communication failures with a message that says what probably happened."""
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        raise RuntimeError(
            f"rank {ctx.rank}/{ctx.world_size}: collective {what!r} failed; another rank probably "
            f"died or hung (timeout {_timeout_s():.0f}s, set {TIMEOUT_ENV}): {err}"
        ) from err


def _find_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one: HF ``_no_split_modules`` classes, else the
    children of the largest ``nn.ModuleList``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"FSDP: found no decoder layers in {type(base).__name__} (no _no_split_modules and no "
            "nn.ModuleList) to shard"
        )
    return list(max(lists, key=len))


def _check_device(model: nn.Module, ctx: DistContext) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type != ctx.device.type:
            raise ValueError(
                f"wrap_model: {name} is on {t.device} but this rank trains on {ctx.device}; "
                "move the model first (model.to(ctx.device))"
            )


def wrap_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DDP (a wrapper: use :func:`unwrap_model` for ``save_pretrained``), FSDP2 (in place: each
    decoder layer, then the root, is ``fully_shard``-ed; parameters become DTensor shards), or the
    model itself when there is nothing to do (world 1 / strategy "none")."""
    if ctx.strategy == "none" or not dist.is_initialized():
        return model
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("wrap_model: the model has no trainable parameters (no LoRA adapters?)")
    if ctx.strategy == "ddp":
        _check_device(model, ctx)
        from torch.nn.parallel import DistributedDataParallel as DDP

        # No per-forward buffer sync: buffers (rotary tables, and the packed NF4 base weights,
        # which are buffers) never change in training; re-broadcasting them every forward would
        # send the whole 4-bit model over the wire per step.  Construction still syncs them once
        # from rank 0 where torch has ``forward_sync_buffers`` (2.13+; older: broadcast_buffers).
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
            no_sync = {"forward_sync_buffers": False}
        else:
            no_sync = {"broadcast_buffers": False}
        return DDP(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            find_unused_parameters=False,
            **no_sync,
        )
    if ctx.strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        # Per layer then root: each layer's parameters are gathered just before it runs and freed
        # after, so peak memory holds one full layer, not the model.  Buffers (incl. NF4 packed
        # weights) are NOT sharded by FSDP: every rank keeps them whole.
        for layer in _find_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"wrap_model: unknown strategy {ctx.strategy!r}")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model under a DDP wrapper (FSDP2 shards in place, so nothing to unwrap)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def no_grad_sync(model: nn.Module, ctx: DistContext, skip: bool = True) -> Iterator[None]:
    """Skip the gradient all-reduce for gradient-accumulation micro-steps (all but the last).

    Every rank must use it on the same micro-steps.  Identity at world 1 or when ``skip`` is False.
    """
    if not skip or ctx.strategy == "none":
        yield
        return
    if ctx.strategy == "ddp":
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)  # FSDP2: accumulate unsharded grads locally
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def shard_rows(n_rows: int, ctx: DistContext) -> list[int]:
    """This rank's row indices of a global batch of ``n_rows``: r, r+W, r+2W, ...

    Across ranks the shares are disjoint and cover 0..n_rows-1 (no duplicates, no gaps); their
    sizes differ by at most one.  Short ranks pad to :func:`rows_per_rank` with zero-weight rows.
    """
    if n_rows < 0:
        raise ValueError(f"shard_rows: n_rows must be >= 0, got {n_rows}")
    return list(range(ctx.rank, n_rows, ctx.world_size))


def rows_per_rank(n_rows: int, ctx: DistContext) -> int:
    """Rows every rank processes for a global batch of ``n_rows`` (real + zero-weight padding)."""
    return -(-n_rows // ctx.world_size)


def all_reduce_sum(x, ctx: DistContext):
    """Sum ``x`` (int, float or Tensor) over ranks; returns the same type (ints stay exact).

    A Tensor result is a new tensor on ``x``'s device; the input is not modified.
    """
    if isinstance(x, torch.Tensor):
        if not ctx.distributed:
            return x.clone()
        t = x.detach().to(ctx.device, copy=True)
        with _collective(ctx, "all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.to(x.device)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"all_reduce_sum: expected int, float or Tensor, got {type(x).__name__}")
    if not ctx.distributed:
        return x
    dtype = torch.int64 if isinstance(x, int) else torch.float64  # exact counts, no fp32 rounding
    t = torch.tensor([x], dtype=dtype, device=ctx.device)
    with _collective(ctx, "all_reduce"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return type(x)(t.item())


def loss_scale(ctx: DistContext) -> float:
    """World size under DDP/FSDP (they average gradients over ranks), else 1.0."""
    return float(ctx.world_size) if ctx.strategy in ("ddp", "fsdp") else 1.0


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (no-op at world 1)."""
    if not ctx.distributed or not dist.is_initialized():
        return
    with _collective(ctx, "barrier"):
        if ctx.device.type == "cuda":
            dist.barrier(device_ids=[ctx.device.index])
        else:
            dist.barrier()


def cleanup(ctx: DistContext) -> None:
    """Leave the process group (safe to call twice, and at world 1)."""
    if dist.is_available() and dist.is_initialized():
        # Gloo's worker threads free each finished collective themselves and need the GIL to drop
        # its Python tensors.  If the process group is destroyed (joining those threads, GIL held)
        # before they have, the process hangs at exit: seen in 2 of 3 two-rank runs on torch 2.13.
        # Sleeping releases the GIL so they finish first; 0.1 s is ~1000x what they need.
        time.sleep(0.1)
        dist.destroy_process_group()


def is_main(ctx: DistContext) -> bool:
    """True on global rank 0: the one rank that logs and writes checkpoints."""
    return ctx.rank == 0


# ---- checkpoint state that is independent of the rank count --------------------------------


def trainable_state_dict(
    model: nn.Module, ctx: DistContext, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of the trainable parameters (or, ``grads=True``, of their
    gradients), keyed as in the unwrapped model.

    Collective under FSDP: call it on EVERY rank.  Feed it to PEFT on the main rank:
    ``unwrap_model(model).save_pretrained(dir, state_dict=trainable_state_dict(model, ctx))``.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in unwrap_model(model).named_parameters():
        if not p.requires_grad:
            continue
        if grads and p.grad is None:
            raise ValueError(f"trainable_state_dict(grads=True): {name} has no gradient")
        t = p.grad if grads else p
        t = t.full_tensor() if isinstance(t, DTensor) else t  # FSDP: all-gather the shards
        out[name] = t.detach().to("cpu", copy=True)
    return out


def optimizer_state_dict(model: nn.Module, optimizer, ctx: DistContext) -> dict:
    """Optimizer state keyed by parameter name with full tensors: loadable at any world size
    and strategy by :func:`load_optimizer_state_dict`.  Collective under FSDP (call on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(unwrap_model(model), optimizer, options=opts)


def load_optimizer_state_dict(model: nn.Module, optimizer, state: dict, ctx: DistContext) -> None:
    """Load a state written by :func:`optimizer_state_dict` (any world size) on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(unwrap_model(model), optimizer, optim_state_dict=state, options=opts)


def throughput(tokens: int, seconds: float, ctx: DistContext) -> tuple[float, float]:
    """(this rank's tokens/s, whole job's tokens/s).  Collective: call on every rank."""
    total = all_reduce_sum(int(tokens), ctx)
    slowest = seconds
    if ctx.distributed:  # the job is as fast as its slowest rank
        t = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
        with _collective(ctx, "all_reduce(max)"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest = float(t.item())
    return tokens / max(seconds, 1e-9), total / max(slowest, 1e-9)

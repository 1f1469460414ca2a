"""Quantized weights for the ops' quantized-weight protocol: ``FakeQuant`` and a recorder of the dense copies real NF4 weights hand out."""

from __future__ import annotations

import contextlib

import torch


class FakeQuant:
    """The quantized-weight protocol: ``.shape`` and ``.dequantize(dtype)``, counting calls and
    the dense copies alive at once over every FakeQuant (``FakeQuant.peak_alive`` since the last
    ``FakeQuant.reset_alive()``), so a test can check that no more than one exists at a time."""

    alive = 0
    peak_alive = 0

    def __init__(self, dense: torch.Tensor):
        self._dense = dense
        self.shape = dense.shape
        self.calls = 0

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        import weakref

        self.calls += 1
        out = self._dense.to(dtype).clone()
        FakeQuant.alive += 1
        FakeQuant.peak_alive = max(FakeQuant.peak_alive, FakeQuant.alive)
        weakref.finalize(out, FakeQuant._release)
        return out

    @staticmethod
    def _release() -> None:
        FakeQuant.alive -= 1

    @staticmethod
    def reset_alive() -> None:
        FakeQuant.peak_alive = FakeQuant.alive


@contextlib.contextmanager
def nf4_dense_copies():
    """Inside the block, the bytes of every dense copy an NF4 weight hands out (whole, rows or
    columns), appended to the yielded list."""
    from lorafuse.models.nf4 import NF4Weight

    sizes: list[int] = []
    originals = {name: getattr(NF4Weight, name) for name in ("dequantize", "dequantize_columns")}

    def record(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            sizes.append(out.numel() * out.element_size())
            return out

        return wrapped

    for name, fn in originals.items():
        setattr(NF4Weight, name, record(fn))
    try:
        yield sizes
    finally:
        for name, fn in originals.items():
            setattr(NF4Weight, name, fn)

"""A trainer's exact state without pickle: its tensors in safetensors, everything else in JSON.

A checkpoint's state is a tree of dicts, lists, tuples, numbers, strings, None, tensors and numpy
arrays (step, data position, trainable weights, optimizer and scheduler state, RNG states, a
GRPO buffer...). :func:`encode` turns it into

* ``trainer_state.safetensors``: every tensor, bit for bit, named ``t0``, ``t1``... in the order
  they appear;
* ``trainer_state.json``: the tree, each tensor replaced by ``{"__tensor__": "t3"}``; tuples,
  dicts with keys that are not strings (the optimizer's ``{0: {...}}``) and numpy arrays spelled
  out so they come back as they were (``random.setstate`` wants tuples; an MT19937 state is 624
  uint32 words). Floats are written as Python's shortest repr, which reads back exactly.

Reading either file runs no code from it. Checkpoints written before this format hold a
``trainer_state.pt`` pickle: :func:`load_legacy` reads it with ``torch.load(weights_only=True)``
(plus numpy's array reconstruction, which builds arrays only) and refuses one that needs anything
else, naming the globals it asks for.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from lorafuse.errors import LorafuseError

TENSOR, TUPLE, ITEMS, ARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"
_MARKERS = (TENSOR, TUPLE, ITEMS, ARRAY)


class StateFileError(LorafuseError, ValueError):
    """A trainer state that cannot be written or read safely; the message says which part."""


def encode(state: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """``(json text, tensors by name)`` for ``state``; unknown types raise naming their path."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[int, int]] = set()
    tree = _encode(state, tensors, storages, "state")
    return json.dumps(tree, sort_keys=True), tensors


def decode(text: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The state :func:`encode` was given, from its JSON text and tensors."""
    return _decode(json.loads(text), tensors)


def _encode(obj: Any, tensors: dict, storages: set, path: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        return {TENSOR: _add_tensor(obj, tensors, storages, path)}
    if isinstance(obj, tuple):
        return {TUPLE: [_encode(v, tensors, storages, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, storages, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _MARKERS for k in obj):
            return {k: _encode(v, tensors, storages, f"{path}.{k}") for k, v in obj.items()}
        return {ITEMS: [[_encode(k, tensors, storages, f"{path} key"),
                         _encode(v, tensors, storages, f"{path}[{k!r}]")]
                        for k, v in obj.items()]}  # fmt: skip
    array = _numpy_array(obj)
    if array is not None:
        return {ARRAY: {"dtype": array.dtype.str, "shape": list(array.shape),
                        "data": array.ravel().tolist(), "scalar": array is not obj}}  # fmt: skip
    raise StateFileError(
        f"trainer state: {path} is a {type(obj).__module__}.{type(obj).__qualname__}, which a "
        "checkpoint cannot hold (tensors, numbers, strings, lists, tuples and dicts only)"
    )


def _add_tensor(t: torch.Tensor, tensors: dict, storages: set, path: str) -> str:
    if t.layout != torch.strided:
        raise StateFileError(f"trainer state: {path} is a {t.layout} tensor (dense tensors only)")
    t = t.detach().cpu()
    # safetensors refuses tensors that share memory; a second view of a storage is copied
    key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    if key in storages and t.numel():
        t = t.clone()
    storages.add(key)
    name = f"t{len(tensors)}"
    tensors[name] = t.contiguous()
    return name


def _numpy_array(obj: Any):
    """``obj`` as a numpy array if it is one (or a numpy scalar), else None; numpy stays optional."""
    try:
        import numpy as np
    except ImportError:
        return None
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            return None
        return obj
    if isinstance(obj, np.generic):
        return np.asarray(obj)
    return None


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (key, value), = obj.items()  # fmt: skip
        if key == TENSOR:
            if value not in tensors:
                raise StateFileError(f"trainer state: tensor {value} is missing")
            return tensors[value]
        if key == TUPLE:
            return tuple(_decode(v, tensors) for v in value)
        if key == ITEMS:
            return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in value}
        if key == ARRAY:
            import numpy as np

            array = np.array(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
            return array[()] if value.get("scalar") else array
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# ---- trainer_state.pt of older checkpoints ------------------------------------------------------
def _numpy_globals() -> list:
    """What an old state's numpy RNG state needs: array reconstruction, nothing callable beyond."""
    try:
        import numpy as np
    except ImportError:
        return []
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    dtypes = [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "uint8")]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


def load_legacy(file: str) -> dict:
    """An old ``trainer_state.pt`` through ``torch.load(weights_only=True)``; a pickle that needs
    any other global (a class, a function: code to run) is refused before it is unpickled."""
    import pickle

    allowed = _numpy_globals()
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        try:
            asked = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except Exception:  # not even a readable archive: the first error says enough
            asked = []
        names = {f"{g.__module__}.{g.__name__}" for g in allowed}
        asked = [g for g in asked if g not in names and g.replace("numpy.core", "numpy._core")
                 not in names]  # fmt: skip
        what = f" ({', '.join(asked[:3])})" if asked else ""
        raise StateFileError(
            f"{file}: refusing to load: this pickle needs code beyond tensors and numbers{what}, "
            "which could run anything; lorafuse loads trainer state with weights_only=True only"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StateFileError(f"{file}: cannot read this trainer state ({first})") from None

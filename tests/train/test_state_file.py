"""Trainer state without pickle (lorafuse.train.state_file): everything a checkpoint holds comes
back exactly, an older ``trainer_state.pt`` loads with ``weights_only=True``, and a pickle that
would run code is refused before any of it runs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from lorafuse.errors import LorafuseError
from lorafuse.train import checkpoint as ckpt
from lorafuse.train import state_file


def _write(directory, state) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    ckpt.write_state(str(directory), state)


def test_round_trip_is_exact_for_every_kind_of_value(tmp_path):
    random.seed(5)
    np.random.seed(5)
    np.random.standard_normal()  # a cached gaussian in the numpy state
    base = torch.randn(6, 4)
    state = {
        "rng": ckpt.rng_state(),
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 2)}},
                      "param_groups": [{"betas": (0.9, 0.999), "params": [0], "foreach": None}]},
        "trainable": {"a.lora_A.weight": base, "a.lora_B.weight": base[:2],  # shared storage
                      "bf16": torch.randn(5).bfloat16(), "empty": torch.zeros(0, 3)},
        "floats": [0.1, 1 / 3, -0.0, math.inf, -math.inf, 1e-310],
        "nan": math.nan, "big": 2**70, "flag": True, "none": None, "text": "é",
        "__tensor__": "a user key that looks like a marker",
        "samples": [{"ids": [1, 2], "logps": torch.randn(2), "ref": None}],
        "np": np.arange(4, dtype=np.uint32), "np_scalar": np.float32(0.25),
    }  # fmt: skip
    _write(tmp_path, state)
    back = ckpt.load_state(str(tmp_path))
    assert back.keys() == state.keys()
    random.setstate(back["rng"]["python"])  # these need the exact tuple types back
    np.random.set_state(back["rng"]["numpy"])
    assert back["rng"]["python"] == state["rng"]["python"]
    for a, b in zip(back["rng"]["numpy"], state["rng"]["numpy"]):
        assert np.array_equal(a, b) and type(a) is type(b)
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert list(back["optimizer"]["state"]) == [0]  # an int key stays an int
    assert torch.equal(
        back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    for k, t in state["trainable"].items():
        got = back["trainable"][k]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), k
    assert [struct(x) for x in back["floats"]] == [struct(x) for x in state["floats"]]
    assert math.isnan(back["nan"])
    for k in ("big", "flag", "none", "text", "__tensor__"):
        assert back[k] == state[k] and type(back[k]) is type(state[k]), k
    assert torch.equal(back["samples"][0]["logps"], state["samples"][0]["logps"])
    assert back["np"].dtype == np.uint32 and np.array_equal(back["np"], state["np"])
    assert back["np_scalar"] == np.float32(0.25) and type(back["np_scalar"]) is np.float32


def struct(x: float) -> bytes:
    import struct as s

    return s.pack("<d", x)  # bit for bit: -0.0 and 1e-310 (a subnormal) included


def test_unknown_types_are_refused_naming_where_they_are():
    with pytest.raises(
        state_file.StateFileError, match=r"state\.extra\[1\] is a builtins\.function"
    ):
        state_file.encode({"extra": [1, lambda: 0]})
    with pytest.raises(state_file.StateFileError, match="sparse"):
        state_file.encode({"s": torch.eye(2).to_sparse()})


def _legacy_state():
    return {"version": 1, "step": 2, "rng": ckpt.rng_state(), "trainable": {"w": torch.randn(3)},
            "optimizer": {"state": {0: {"step": torch.tensor(2.0)}},
                          "param_groups": [{"betas": (0.9, 0.99), "params": [0]}]}}  # fmt: skip


def test_an_older_trainer_state_pt_loads_with_weights_only(tmp_path):
    """What the pickle-era trainer wrote (torch.save of the state, numpy RNG state included)."""
    state = _legacy_state()
    torch.save(state, tmp_path / ckpt.LEGACY_STATE)
    back = ckpt.load_state(str(tmp_path))
    assert back["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert torch.equal(back["trainable"]["w"], state["trainable"]["w"])


class _Plant:
    """Unpickling this runs ``exec``: it writes ``path`` (the attack a crafted checkpoint makes)."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('pwned')",))


def test_a_pickle_that_runs_code_is_refused_and_never_runs(tmp_path):
    planted = tmp_path / "ckpt"
    planted.mkdir()
    marker = tmp_path / "pwned"
    torch.save({**_legacy_state(), "x": _Plant(marker)}, planted / ckpt.LEGACY_STATE)
    with pytest.raises(LorafuseError) as err:
        ckpt.load_state(str(planted))
    line = str(err.value)
    assert "refusing to load" in line and "builtins.exec" in line and "\n" not in line
    assert not marker.exists()
    # the plant is live: a full unpickle (what --resume did before) writes the file
    torch.load(planted / ckpt.LEGACY_STATE, weights_only=False)
    assert marker.read_text() == "pwned"


def test_a_torn_legacy_pickle_is_one_line(tmp_path):
    torch.save(_legacy_state(), tmp_path / ckpt.LEGACY_STATE)
    path = tmp_path / ckpt.LEGACY_STATE
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(LorafuseError, match="cannot read this trainer state") as err:
        ckpt.load_state(str(tmp_path))
    assert "\n" not in str(err.value)

"""lorafuse.manifest: a checkpoint's files against their recorded sizes and SHA-256, checked with
real truncation, alteration and removal on disk."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from lorafuse import manifest
from lorafuse.errors import LorafuseError


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "checkpoint-2"
    (d / "sub").mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(os.urandom(3000))
    (d / "adapter_config.json").write_text('{"r": 8}')
    (d / "sub" / "extra.bin").write_bytes(b"x" * 10)
    manifest.write(d)
    return d


def test_write_records_every_file_with_size_and_sha256(ckpt):
    doc = json.loads((ckpt / manifest.MANIFEST_NAME).read_text())
    assert doc["format"] == "lorafuse-manifest" and doc["version"] == 1
    assert sorted(doc["files"]) == ["adapter_config.json", "adapter_model.safetensors",
                                    "sub/extra.bin"]  # fmt: skip
    data = (ckpt / "adapter_model.safetensors").read_bytes()
    want = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # independent
    assert doc["files"]["adapter_model.safetensors"] == want
    assert manifest.problem(ckpt) is None and manifest.verify(ckpt) is True


def test_truncated_file_is_named_with_both_sizes(ckpt):
    os.truncate(ckpt / "adapter_model.safetensors", 1000)
    assert manifest.problem(ckpt) == (
        "adapter_model.safetensors is 1000 bytes, its manifest says 3000 (truncated?)"
    )
    with pytest.raises(manifest.ManifestError) as err:
        manifest.verify(ckpt, "--checkpoint c")
    assert isinstance(err.value, LorafuseError)
    assert str(err.value).startswith("--checkpoint c: damaged checkpoint: adapter_model")
    assert "\n" not in str(err.value)


def test_same_size_alteration_and_missing_file(ckpt):
    path = ckpt / "sub" / "extra.bin"
    path.write_bytes(b"y" * 10)  # same size, other bytes: only the hash tells
    assert "sub/extra.bin does not match its manifest's SHA-256" in manifest.problem(ckpt)
    path.unlink()
    assert manifest.problem(ckpt) == "sub/extra.bin is missing"


def test_no_manifest_is_not_checked_and_a_broken_one_is_a_problem(ckpt):
    (ckpt / manifest.MANIFEST_NAME).write_text("{not json")
    assert "unreadable" in manifest.problem(ckpt)
    (ckpt / manifest.MANIFEST_NAME).write_text('{"format": "other"}')
    assert "not a lorafuse manifest" in manifest.problem(ckpt)
    (ckpt / manifest.MANIFEST_NAME).unlink()
    assert manifest.verify(ckpt) is False  # an older checkpoint or a plain adapter dir

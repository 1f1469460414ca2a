"""A full disk during merge or export: one line naming the output, nothing half-written left
(no temp dir or file, no output under the real name), exit status 2."""

from __future__ import annotations

import os

import pytest
from safetensors import SafetensorError

from lorafuse import files
from lorafuse.commands import main
from lorafuse.export import merge
from lorafuse.testing import (
    filling_open,
    one_error_line,
    save_tiny_adapter,
    save_tiny_model,
    small_tmpfs,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    save_tiny_model(root / "base")
    save_tiny_adapter(root / "base", root / "adapter", r=4)
    return root


def _merge_argv(tiny, out) -> list[str]:
    return ["merge", "--model", str(tiny / "base"), "--adapter", str(tiny / "adapter"), "-o",
            str(out), "--max-shard-size", "40KB"]  # fmt: skip


def test_merge_disk_full_on_the_second_shard(tiny, tmp_path, monkeypatch, capsys):
    real_save, calls = merge.save_file, []

    def filling_save(tensors, path, metadata=None):  # as safetensors reports a full disk
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(merge, "save_file", filling_save)
    out = tmp_path / "merged"
    assert main(_merge_argv(tiny, out)) == 2
    line = one_error_line(capsys, "merge")
    need = files.mb(sum(f.stat().st_size for f in merge.base_shards(tiny / "base")))
    assert f"disk full writing the merged model to {out}: needs about {need}, " in line
    assert os.listdir(tmp_path) == []  # no temp dir, no output


def test_merge_on_a_real_small_tmpfs(tiny, tmp_path, capsys):
    size = files.tree_size(tiny / "base")
    with small_tmpfs(tmp_path / "disk", size // 2) as disk:
        assert main(_merge_argv(tiny, disk / "merged")) == 2
        line = one_error_line(capsys, "merge")
        assert f"disk full writing the merged model to {disk / 'merged'}" in line
        assert os.listdir(disk) == []


def test_gguf_export_disk_full(smol_tiny, tmp_path, monkeypatch, capsys):
    import gguf.gguf_writer

    monkeypatch.setattr(gguf.gguf_writer, "open", filling_open(open, lambda p, m: "w" in m),
                        raising=False)  # fmt: skip
    out = tmp_path / "m.gguf"
    argv = ["export", "--model", str(smol_tiny / "base"), "--adapter", str(smol_tiny / "adapter"),
            "--format", "gguf", "--outtype", "f16", "-o", str(out)]  # fmt: skip
    assert main(argv) == 2
    assert f"disk full writing the GGUF file to {out}" in one_error_line(capsys, "export")
    assert os.listdir(tmp_path) == []  # the temp file and the merge work dir are gone
    out = tmp_path / "a.gguf"
    argv[argv.index("gguf")] = "gguf-lora"
    argv[-1] = str(out)
    assert main(argv) == 2
    line = one_error_line(capsys, "export")
    assert f"disk full writing the LoRA GGUF to {out}: needs about" in line
    assert os.listdir(tmp_path) == []


def test_quantized_gguf_disk_full_on_a_real_small_tmpfs(smol_tiny, tmp_path, capsys):
    """llama.cpp's quantizer only logs ENOSPC ("failed with code 1"): a disk with room for the
    f32 intermediate and half the q4_0 output still ends in the disk-full line, nothing left."""
    from lorafuse.export.gguf_export import write_gguf

    base = smol_tiny / "base"
    sizes = [os.path.getsize(write_gguf(base, tmp_path / f"{t}.gguf", t)) for t in ("f32", "q4_0")]
    capsys.readouterr()
    with small_tmpfs(tmp_path / "disk", sizes[0] + sizes[1] // 2) as disk:
        out = disk / "m.gguf"
        argv = ["export", "--model", str(base), "--format", "gguf", "--outtype", "q4_0", "-o",
                str(out)]  # fmt: skip
        assert main(argv) == 2
        line = one_error_line(capsys, "export")
        assert f"disk full writing the GGUF file to {out}: " in line
        assert "partial file was removed" in line
        assert os.listdir(disk) == []  # the partial output and the f32 intermediate are gone


def test_quantizer_failure_with_room_is_not_called_disk_full(smol_tiny, tmp_path, monkeypatch):
    """The other side of the rule: a failed quantization on a disk with room keeps llama.cpp's
    own failure."""
    import cyllama.llama.llama_cpp as cy

    from lorafuse.export.gguf_export import GGUFExportError, quantize_gguf, write_gguf

    src = write_gguf(smol_tiny / "base", tmp_path / "f32.gguf", "f32")

    def failing(src, dst, params):  # what cyllama raises when llama_model_quantize returns 1
        raise RuntimeError("llama_model_quantize failed with code 1")

    monkeypatch.setattr(cy, "model_quantize", failing)
    with pytest.raises(GGUFExportError, match="could not quantize .* failed with code 1"):
        quantize_gguf(src, tmp_path / "q.gguf", "q4_0")
    assert sorted(os.listdir(tmp_path)) == ["f32.gguf"]

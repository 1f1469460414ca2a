import json

import pytest

from lorafuse import files


def test_write_json_replaces_whole_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("old")
    files.write_json(path, {"b": 1, "a": 2}, sort_keys=True)
    assert json.loads(path.read_text()) == {"a": 2, "b": 1}
    assert path.read_text().endswith("\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_path(path) as tmp:
            tmp.write_text("half of the new")
            raise KeyboardInterrupt
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_temp_path_keeps_suffix_and_directory(tmp_path):
    tmp = files.temp_path_for(tmp_path / "sample.png")
    assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp.name.startswith(".sample.tmp-")


def test_write_jsonl_one_object_per_line(tmp_path):
    path = files.write_jsonl(tmp_path / "d.jsonl", [{"t": "é"}, {"t": 2}])
    assert path.read_text(encoding="utf-8") == '{"t": "é"}\n{"t": 2}\n'


def test_replace_dir_swaps_in_the_new_directory(tmp_path):
    final, tmp = tmp_path / "final", tmp_path / "tmp"
    final.mkdir()
    (final / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    files.replace_dir(tmp, final)
    assert [p.name for p in final.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_disk_full_becomes_one_line_and_other_errors_pass(tmp_path):
    import errno

    with pytest.raises(files.DiskFullError) as info:
        with files.disk_full_as_error("the thing", tmp_path, 2_500_000, then=lambda: "retry"):
            files.write_bytes(tmp_path / "x.bin", b"x")  # a finished write inside the block
            raise OSError(errno.ENOSPC, "No space left on device")
    msg = str(info.value)
    assert msg.startswith(f"disk full writing the thing to {tmp_path}: needs about 2.5 MB, ")
    assert msg.endswith(" free; retry") and "\n" not in msg
    # a library that keeps only the text (safetensors) is recognised; anything else passes
    assert files.is_disk_full(RuntimeError("I/O error: No space left on device (os error 28)"))
    with pytest.raises(PermissionError):
        with files.disk_full_as_error("the thing", tmp_path):
            raise PermissionError(errno.EACCES, "Permission denied")
    assert files.mb(1_500) == "1.5 kB" and files.tree_size(tmp_path) == 1

"""Image folders, captions and buckets follow kohya's rules, and bad input gets an error that
names the folder or file."""

from __future__ import annotations

import pytest
import torch

from lorafuse.image import data as D
from lorafuse.image.config import ImageTrainConfig
from lorafuse.testing import make_image_folder, write_image


def _folder(tmp_path, **kw):
    return make_image_folder(tmp_path / "data", {
        "3_cat": [("a.png", (64, 64), "cat, sitting, red"), ("b.jpg", (96, 64), "cat, sleeping")],
        "1_dog": [("c.webp", (64, 128), "dog")],
    }, **kw)  # fmt: skip


def test_scan_reads_repeats_captions_and_sizes(tmp_path):
    root = _folder(tmp_path)
    items = D.scan_folder(root)
    assert [(i.concept, i.repeats, i.caption, i.size) for i in items] == [
        ("1_dog", 1, "dog", (64, 128)),
        ("3_cat", 3, "cat, sitting, red", (64, 64)),
        ("3_cat", 3, "cat, sleeping", (96, 64)),
    ]
    assert D.tag_frequency(items) == {
        "1_dog": {"dog": 1}, "3_cat": {"cat": 2, "sitting": 1, "red": 1, "sleeping": 1}
    }  # fmt: skip


def test_caption_extensions_and_first_line(tmp_path):
    root = tmp_path / "d"
    (root / "2_x").mkdir(parents=True)
    write_image(root / "2_x" / "a.png")
    write_image(root / "2_x" / "b.bmp")
    (root / "2_x" / "a.caption").write_text("from caption\nsecond line ignored\n")
    (root / "2_x" / "b.txt").write_text("from txt")
    (root / "2_x" / "b.tag").write_text("from tag")
    assert [i.caption for i in D.scan_folder(str(root))] == ["from caption", "from txt"]
    (root / "2_x" / "a.tag").write_text("tag a")
    assert [i.caption for i in D.scan_folder(str(root), ".tag")] == ["tag a", "from tag"]


def test_missing_captions_say_how_many_unless_class_tokens(tmp_path):
    root = make_image_folder(tmp_path / "d", {"5_sks dog": [
        ("a.png", (64, 64), None), ("b.png", (64, 64), None), ("c.png", (64, 64), "has one")]})  # fmt: skip
    with pytest.raises(D.ImageDataError, match=r"2 image\(s\) have no caption.*a\.png.*b\.png"):
        D.scan_folder(root)
    items = D.scan_folder(root, caption_from_folder=True)
    assert [i.caption for i in items] == ["sks dog", "sks dog", "has one"]


@pytest.mark.parametrize("case", ["no_prefix", "zero_repeats", "empty_root", "empty_concept",
                                  "loose_images", "missing"])  # fmt: skip
def test_folder_errors_name_the_culprit(tmp_path, case):
    root = tmp_path / "d"
    root.mkdir()
    expect = {"no_prefix": "mychar: folder name must be N_concept",
              "zero_repeats": "0_x: folder name must be N_concept",
              "empty_root": "no N_concept folders \\(nothing\\)",
              "empty_concept": "2_x: no images", "loose_images": "1 images directly in it",
              "missing": "no such folder"}[case]  # fmt: skip
    if case in ("no_prefix", "zero_repeats"):
        name = "mychar" if case == "no_prefix" else "0_x"
        make_image_folder(root, {name: [("a.png", (64, 64), "x")]})
    elif case == "empty_concept":
        (root / "2_x").mkdir()
        (root / "2_x" / "notes.md").write_text("no images here")
    elif case == "loose_images":
        write_image(root / "a.png")
    with pytest.raises(D.ImageDataError, match=expect):
        D.scan_folder(str(root / "nope") if case == "missing" else str(root))


def test_unreadable_image_names_the_file(tmp_path):
    root = make_image_folder(tmp_path / "d", {"1_x": [("a.png", (64, 64), "ok")]})
    bad = tmp_path / "d" / "1_x" / "broken.jpg"
    bad.write_bytes(b"not a jpeg at all")
    (tmp_path / "d" / "1_x" / "broken.txt").write_text("x")
    with pytest.raises(D.ImageDataError, match=r"broken\.jpg: cannot read the image"):
        D.scan_folder(root)


def test_bucket_resolutions_follow_kohya():
    resos = D.bucket_resolutions(512, 256, 1024, 64)
    assert (512, 512) in resos and (256, 1024) in resos and (1024, 256) in resos
    for w, h in resos:
        assert w % 64 == 0 and h % 64 == 0 and w * h <= 512 * 512
        assert 256 <= w <= 1024 and 256 <= h <= 1024
    # the list sd-scripts logs for --resolution 512 with the default 256..1024 / 64
    portrait = [(256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768),
                (384, 640), (448, 576)]  # fmt: skip
    assert resos == sorted(portrait + [(512, 512)] + [(h, w) for w, h in portrait])


def test_select_bucket_nearest_aspect_and_no_upscale():
    resos = D.bucket_resolutions(512, 256, 1024, 64)
    assert D.select_bucket((1000, 500), resos, 512, 64) == (704, 320)  # ratio 2.2, nearest to 2
    assert D.select_bucket((300, 300), resos, 512, 64) == (512, 512)  # upscaled to the square
    # no upscale: a small image keeps its size rounded down to the step...
    assert D.select_bucket((200, 130), None, 512, 64) == (192, 128)
    # ...a large one is scaled down to <= resolution^2 keeping its aspect ratio (kohya picks the
    # rounding whose ratio is nearer: 640x320 is exactly 2, 704x320 would be 2.2)
    assert D.select_bucket((2000, 1000), None, 512, 64) == (640, 320)


def test_assign_buckets_and_load_image(tmp_path):
    root = _folder(tmp_path)
    items = D.scan_folder(root)
    cfg = ImageTrainConfig(resolution=64, enable_bucket=False)
    assert D.assign_buckets(items, cfg) == [(64, 64)]
    cfg = ImageTrainConfig(resolution=64, enable_bucket=True, min_bucket_reso=32,
                           max_bucket_reso=128, bucket_reso_steps=32)  # fmt: skip
    assert D.assign_buckets(items, cfg) == [(32, 96), (64, 64)]
    # 64x128 -> (32, 96) (ratio 1/3 nearest 1/2 among area <= 64^2); 96x64 (1.5) -> the square
    assert [i.bucket for i in items] == [(32, 96), (64, 64), (64, 64)]
    for it in items:
        pixels, (top, left) = D.load_image(it)
        bw, bh = it.bucket
        assert pixels.shape == (3, bh, bw)
        assert -1.0 <= float(pixels.min()) and float(pixels.max()) <= 1.0
        (rw, rh), t, lft = D.crop_box(it.size, it.bucket)
        assert (t, lft) == (top, left) and rw >= bw and rh >= bh
        assert rw == bw or rh == bh  # scaled to cover, cropped along one side only


def test_epoch_batches_are_per_bucket_seeded_and_complete(tmp_path):
    root = _folder(tmp_path)
    items = D.scan_folder(root)
    for it in items:
        it.bucket = (64, 64) if it.caption.startswith("cat") else (64, 128)
    a = D.epoch_batches(items, 2, seed=1, epoch=0)
    assert a == D.epoch_batches(items, 2, seed=1, epoch=0)
    assert any(D.epoch_batches(items, 2, seed=1, epoch=e) != a for e in range(1, 6))
    flat = sorted(i for b in a for i in b)
    assert flat == sorted(i for i, it in enumerate(items) for _ in range(it.repeats))
    for batch in a:
        assert len({items[i].bucket for i in batch}) == 1
    assert len(a) == D.steps_per_epoch(items, 2) == 3 + 1  # 6 cat -> 3 batches, 1 dog -> 1


def test_caption_shuffle_keep_tokens_and_dropout():
    cap = "sks, girl, red hair, smile, outdoors, tree"
    seen = set()
    for k in range(30):
        g = torch.Generator().manual_seed(k)
        out = D.process_caption(cap, shuffle=True, keep_tokens=2, dropout_rate=0.0, g=g)
        tags = out.split(", ")
        assert tags[:2] == ["sks", "girl"] and sorted(tags) == sorted(cap.split(", "))
        seen.add(out)
    assert len(seen) > 5
    g = torch.Generator().manual_seed(0)
    kept = [D.process_caption(cap, shuffle=False, keep_tokens=0, dropout_rate=0.3, g=g)
            for _ in range(2000)]  # fmt: skip
    dropped = sum(c == "" for c in kept) / len(kept)
    assert 0.25 < dropped < 0.35 and set(kept) == {"", cap}

"""Latent cache: disk entries are reused while image, bucket and VAE are unchanged, rebuilt when
any of them changes; text-encoder outputs are cached once per caption."""

from __future__ import annotations

import os

import pytest
import torch

from lorafuse.image import data as D
from lorafuse.image.cache import CACHE_SUFFIX, LatentCache, TextEncoderCache
from lorafuse.testing import make_image_folder, write_image


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(32,), latent_channels=4, sample_size=32, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
    ).eval()  # fmt: skip


def _items(root, res=32):
    items = D.scan_folder(root)
    for it in items:
        it.bucket = (res, res)
    return items


def test_disk_cache_reused_then_invalidated(tmp_path, vae):
    root = make_image_folder(tmp_path / "d", {"1_x": [("a.png", (64, 64), "a"),
                                                      ("b.png", (48, 64), "b")]})  # fmt: skip
    first = LatentCache(vae, _items(root), to_disk=True, progress=False)
    assert first.stats == {"encoded": 2, "reused": 0}
    assert first.latents[0].shape == (4, 32, 32)  # one-level VAE: no downsampling
    assert all(
        os.path.isfile(os.path.join(root, "1_x", n + CACHE_SUFFIX)) for n in ("a.png", "b.png")
    )
    again = LatentCache(vae, _items(root), to_disk=True, progress=False)
    assert again.stats == {"encoded": 0, "reused": 2}
    for x, y in zip(first.latents, again.latents):
        assert torch.equal(x, y)
    assert again.crops == first.crops
    # in memory: the same draw as the disk entry (seeded by the same key)
    mem = LatentCache(vae, _items(root), to_disk=False, progress=False)
    assert mem.stats == {"encoded": 2, "reused": 0} and torch.equal(
        mem.latents[1], first.latents[1]
    )

    write_image(os.path.join(root, "1_x", "a.png"), (64, 64), seed=99)  # the image changed
    edited = LatentCache(vae, _items(root), to_disk=True, progress=False)
    assert edited.stats == {"encoded": 1, "reused": 1}
    assert not torch.equal(edited.latents[0], first.latents[0])

    other_bucket = LatentCache(vae, _items(root, res=16), to_disk=True, progress=False)
    assert other_bucket.stats == {"encoded": 2, "reused": 0}
    assert other_bucket.latents[0].shape == (4, 16, 16)

    with torch.no_grad():
        vae.decoder.conv_out.bias.add_(0.0)  # unchanged weights: still reused
    assert LatentCache(vae, _items(root, res=16), to_disk=True, progress=False).stats["reused"] == 2
    with torch.no_grad():
        vae.encoder.conv_in.bias.add_(1e-3)  # another VAE
    try:
        changed = LatentCache(vae, _items(root, res=16), to_disk=True, progress=False)
    finally:
        with torch.no_grad():
            vae.encoder.conv_in.bias.sub_(1e-3)
    assert changed.stats == {"encoded": 2, "reused": 0}


def test_damaged_cache_file_is_rebuilt(tmp_path, vae):
    root = make_image_folder(tmp_path / "d", {"1_x": [("a.png", (32, 32), "a")]})
    LatentCache(vae, _items(root), to_disk=True, progress=False)
    with open(os.path.join(root, "1_x", "a.png" + CACHE_SUFFIX), "wb") as f:
        f.write(b"garbage")
    assert LatentCache(vae, _items(root), to_disk=True, progress=False).stats["encoded"] == 1


def test_text_encoder_cache_encodes_each_caption_once():
    calls = []

    def encode(captions):
        calls.append(list(captions))
        return (torch.tensor([[float(len(c))] for c in captions]),)

    cache = TextEncoderCache(["b", "aa", "b", "ccc"], encode, batch_size=2)
    assert sorted(c for chunk in calls for c in chunk) == ["aa", "b", "ccc"]
    (out,) = cache.batch(["ccc", "b"])
    assert out.tolist() == [[3.0], [1.0]]

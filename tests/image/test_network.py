"""kohya-style LoRA network: targets, fused == unfused (kohya's math), restore, training, tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lorafuse.image.network import LoRANetwork, NetworkError
from lorafuse.testing import assert_close, build_tiny_sd, op_cases, single_thread


@pytest.fixture(autouse=True)
def _seed_one_thread():
    torch.manual_seed(0)
    yield from single_thread()  # tiny models: threads only add OpenMP barrier stalls


@pytest.fixture(scope="module")
def sd15():
    pipe = build_tiny_sd("sd15")
    return pipe.unet.requires_grad_(False), pipe.text_encoder.requires_grad_(False)


@pytest.fixture(scope="module")
def sdxl():
    pipe = build_tiny_sd("sdxl")
    return pipe.unet, [pipe.text_encoder, pipe.text_encoder_2]


# Per Transformer2DModel: proj_in, proj_out, attn1/attn2 x (to_q, to_k, to_v, to_out.0), ff x 2.
TRANSFORMER_LEAVES = {"proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"} | {
    f"attn{i}.{p}" for i in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")
}


def _leaf(key: str) -> str:
    path = key.split(":", 1)[1]
    parts = path.split(".")
    if "transformer_blocks" in parts:
        return ".".join(parts[parts.index("transformer_blocks") + 2 :])
    return parts[-1]


def test_unet_targets_match_kohya(sd15):
    unet, _ = sd15
    # tiny SD1.5: 4 Transformer2DModels (down 0, mid, up 1 x 2), 12 layers each
    net = LoRANetwork.create(unet, [], dim=4, alpha=1.0)
    keys = net.keys()
    assert len(keys) == 48 and len(set(keys)) == 48
    assert all(k.startswith("unet:") and ".attentions." in k for k in keys)
    assert {_leaf(k) for k in keys} == TRANSFORMER_LEAVES
    proj_in = net.module_for("unet:down_blocks.0.attentions.0.proj_in")
    assert isinstance(proj_in.lora_down, nn.Conv2d)  # SD1.5: 1x1 conv, 4-D weights in the file
    assert tuple(proj_in.lora_down.weight.shape) == (4, 32, 1, 1)
    assert tuple(proj_in.lora_up.weight.shape) == (32, 4, 1, 1)
    q = net.module_for("unet:mid_block.attentions.0.transformer_blocks.0.attn2.to_k")
    assert tuple(q.lora_down.weight.shape) == (4, 32) and q.scale == 0.25

    conv = LoRANetwork.create(unet, [], dim=4, alpha=1.0, conv_dim=2, conv_alpha=None)
    extra = [k for k in conv.keys() if k not in set(keys)]
    # ResNet/Down/Upsample layers: 3+1 (down 0), 4 (down 1), 6 (mid), 8+1 (up 0), 8 (up 1)
    assert len(extra) == 31 and set(keys) <= set(conv.keys())
    assert {_leaf(k) for k in extra} == {"conv1", "conv2", "conv_shortcut", "time_emb_proj", "conv"}
    c1 = conv.module_for("unet:down_blocks.0.resnets.0.conv1")
    assert tuple(c1.lora_down.weight.shape) == (2, 32, 3, 3) and c1.scale == 1.0  # alpha None
    ds = conv.module_for("unet:down_blocks.0.downsamplers.0.conv").lora_down
    assert ds.stride == (2, 2) and ds.padding == (1, 1) and ds.bias is None
    # kohya: Linear and 1x1 convs inside ResNet blocks take the linear dim, not conv_dim
    assert conv.module_for("unet:down_blocks.1.resnets.0.time_emb_proj").dim == 4
    assert conv.module_for("unet:down_blocks.1.resnets.0.conv_shortcut").dim == 4


def test_text_encoder_targets(sd15, sdxl):
    unet, te = sd15
    assert not any(
        k.startswith("te") for k in LoRANetwork.create(unet, [te], dim=4, alpha=1).keys()
    )
    net = LoRANetwork.create(unet, [te], dim=4, alpha=1, train_text_encoder=True)
    tek = [k for k in net.keys() if k.startswith("te1:")]
    leaves = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
              "mlp.fc1", "mlp.fc2"}  # fmt: skip
    assert len(tek) == 12  # 2 layers x 6
    assert {".".join(k.split(".")[-2:]) for k in tek} == leaves
    assert "te1:encoder.layers.1.mlp.fc2" in tek

    xl_unet, xl_tes = sdxl
    xl = LoRANetwork.create(xl_unet, xl_tes, dim=4, alpha=1, train_text_encoder=True)
    assert len(xl.component_keys("te1")) == 12 and len(xl.component_keys("te2")) == 12
    assert not any("text_projection" in k for k in xl.keys())  # not in CLIPAttention/CLIPMLP
    # SDXL: linear proj_in/out; levels 1-2 with 1 and 2 transformer layers, 2 blocks per level
    assert isinstance(xl.module_for(xl.component_keys("unet")[0]).lora_down, nn.Linear)


def _inputs(te, batch=2, device="cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, te.config.vocab_size - 2, (batch, 77), generator=g)
    latents = torch.randn(batch, 4, 8, 8, generator=g)
    noise = torch.randn(batch, 4, 8, 8, generator=g)
    t = torch.tensor([10, 500])[:batch]
    return tuple(x.to(device) for x in (ids, latents, noise, t))


def _loss(unet, te, ids, latents, noise, t):
    hidden = te(ids).last_hidden_state
    pred = unet(latents + noise, t, encoder_hidden_states=hidden).sample
    return pred, nn.functional.mse_loss(pred, noise)


def _nonzero(net: LoRANetwork) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, m in net.items():
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.1)


@pytest.mark.parametrize(("backend", "device"), op_cases("lora_linear", "lora_conv2d"))
def test_fused_matches_kohya_unfused(sd15, backend, device):
    unet, te = sd15
    nets, results = [], []
    for fused in (True, False):
        u, t_ = copy.deepcopy(unet).to(device), copy.deepcopy(te).to(device)
        kw = dict(dim=4, alpha=2.0, conv_dim=3, conv_alpha=1.5, train_text_encoder=True)
        net = LoRANetwork.create(u, [t_], fused=fused, backend=backend, **kw)
        if nets:
            net.load_lora_tensors(nets[0].lora_tensors())
        else:
            _nonzero(net)
        net.apply_to()
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # fp32 1e-5 on CUDA too
            pred, loss = _loss(u, t_, *_inputs(t_, device=device))
            loss.backward()
        nets.append(net)
        results.append((pred, loss))
    assert nets[0].report().startswith("LoRA network: 91 modules, 91 fused")  # 79 unet + 12 te
    assert nets[1].report().startswith("LoRA network: 91 modules, 0 fused")
    assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5, name="unet output")
    assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-5, name="loss")
    for (key, a), (_, b) in zip(nets[0].items(), nets[1].items()):
        for part in ("lora_down", "lora_up"):
            ga, gb = getattr(a, part).weight.grad, getattr(b, part).weight.grad
            assert ga is not None and gb is not None, key
            assert_close(ga, gb, atol=1e-5, rtol=1e-5, name=f"{key}.{part} grad")
    frozen = [p for m in (nets[0].module_for(k).org_module for k in nets[0].keys())
              for p in m.parameters(recurse=False)]  # fmt: skip
    assert all(not p.requires_grad and p.grad is None for p in frozen)


def test_restore_gives_back_original_outputs(sd15):
    unet, te = sd15
    u = copy.deepcopy(unet)
    u.down_blocks[0].resnets[0].conv1.weight.requires_grad_(True)
    ids, latents, noise, t = _inputs(te)
    hidden = te(ids).last_hidden_state.detach()
    with torch.no_grad():
        before = u(latents, t, encoder_hidden_states=hidden).sample
    net = LoRANetwork.create(u, [], dim=4, alpha=1.0, conv_dim=4)
    _nonzero(net)
    net.apply_to().apply_to()  # idempotent
    assert not u.down_blocks[0].resnets[0].conv1.weight.requires_grad
    with torch.no_grad():
        adapted = u(latents, t, encoder_hidden_states=hidden).sample
    assert not torch.allclose(adapted, before)
    net.restore()
    with torch.no_grad():
        after = u(latents, t, encoder_hidden_states=hidden).sample
    assert torch.equal(after, before)
    assert u.down_blocks[0].resnets[0].conv1.weight.requires_grad  # given back
    assert all("forward" not in m.org_module.__dict__ for _, m in net.items())
    net.apply_to()
    with pytest.raises(NetworkError, match="already has a lorafuse forward"):
        LoRANetwork.create(u, [], dim=4, alpha=1.0).apply_to()  # a second network, same layers
    net.restore()


def test_training_steps_reduce_denoising_loss(sd15):
    unet, te = sd15
    u = copy.deepcopy(unet)
    net = LoRANetwork.create(u, [te], dim=8, alpha=8, conv_dim=4, conv_alpha=4).apply_to()
    opt = torch.optim.AdamW(net.param_groups(1e-2, None), lr=1e-2)
    ids, latents, noise, t = _inputs(te)
    hidden = te(ids).last_hidden_state.detach()
    losses = []
    for _ in range(4):
        pred = u(latents + noise, t, encoder_hidden_states=hidden).sample
        loss = nn.functional.mse_loss(pred, noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses
    net.restore()


def test_dropout_runs_kohya_math_in_training(sd15):
    unet, _ = sd15
    with pytest.warns(RuntimeWarning, match="rank-r activations"):
        net = LoRANetwork.create(copy.deepcopy(unet), [], dim=4, alpha=1, dropout=0.1)
    m = net.module_for(net.keys()[0])
    assert not m.uses_fused() and "dropout 0.1" in net.report()
    net.eval()
    assert m.uses_fused()


def test_lora_tensors_round_trip(sd15):
    unet, te = sd15
    kw = dict(dim=4, alpha=3.0, conv_dim=2, conv_alpha=1.0, train_text_encoder=True)
    a = LoRANetwork.create(unet, [te], **kw)
    _nonzero(a)
    tensors = a.lora_tensors()
    key = "unet:down_blocks.0.downsamplers.0.conv"
    assert tuple(tensors[key]["down"].shape) == (2, 32, 3, 3)
    assert tuple(tensors[key]["up"].shape) == (32, 2, 1, 1) and tensors[key]["alpha"] == 1.0
    b = LoRANetwork.create(unet, [te], dim=4, alpha=1.0, conv_dim=2, train_text_encoder=True)
    b.load_lora_tensors(tensors)
    for (k, x), (_, y) in zip(a.items(), b.items()):
        assert torch.equal(x.lora_down.weight, y.lora_down.weight), k
        assert torch.equal(x.lora_up.weight, y.lora_up.weight), k
        assert x.scale == y.scale and float(x.alpha) == float(y.alpha), k
    c = LoRANetwork.create(unet, [te], dim=4, alpha=1.0, conv_dim=2, train_text_encoder=True)
    c.load_state_dict(a.state_dict())  # a checkpoint resume: the cached scales follow alpha
    assert [m.scale for _, m in c.items()] == [m.scale for _, m in a.items()]
    assert c.module_for(key).scale == 0.5 and c.module_for(c.keys()[0]).scale == 0.75
    unet_only = {k: v for k, v in tensors.items() if k.startswith("unet:")}
    with pytest.raises(NetworkError, match="0 unexpected .*, 12 missing"):
        b.load_lora_tensors(unet_only)
    b.load_lora_tensors(unet_only, strict=False)
    bad = {key: {**tensors[key], "down": torch.zeros(2, 32, 1, 1)}}
    with pytest.raises(NetworkError, match=r"downsamplers.0.conv.down: shape \(2, 32, 1, 1\)"):
        b.load_lora_tensors(bad, strict=False)


def test_param_groups(sd15):
    unet, te = sd15
    net = LoRANetwork.create(unet, [te], dim=4, alpha=1, train_text_encoder=True)
    groups = net.param_groups(1e-4, 5e-5)
    assert [(g["name"], g["lr"], len(g["params"])) for g in groups] == [
        ("text_encoder", 5e-5, 24),
        ("unet", 1e-4, 96),
    ]
    assert [g["lr"] for g in net.param_groups(1e-4, None)] == [1e-4, 1e-4]
    assert [g["name"] for g in net.param_groups(1e-4, 0.0)] == ["unet"]  # lr 0: not trained
    n = sum(p.numel() for g in groups for p in g["params"])
    assert n == sum(p.numel() for p in net.parameters())  # every LoRA parameter, nothing else

"""kohya LoRA files: names (SD1.5 diffusers paths, SDXL SGM layout, ``text_model_``), tensors,
metadata, and the file loading in diffusers with every key used and the same outputs."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch

from lorafuse.image import kohya, kohya_names
from lorafuse.image.kohya_names import LoRAFileError, UNetLayout
from lorafuse.image.network import LoRANetwork
from lorafuse.testing import (
    assert_close,
    build_tiny_sd,
    save_tiny_sd,
    sd_single_file_state_dict,
    single_thread,
)

FAMILY = {"sd15": "sd1", "sdxl": "sdxl"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from single_thread()


@pytest.fixture(scope="module")
def built():
    """Tiny pipelines in memory, built once (the tests below never change their weights)."""
    cache = {}

    def get(fam):
        if fam not in cache:
            cache[fam] = build_tiny_sd(fam)
        return cache[fam]

    return get


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd")
    return {fam: save_tiny_sd(root / fam, fam) for fam in FAMILY}


def _pipe_cls(fam):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    return StableDiffusionXLPipeline if fam == "sdxl" else StableDiffusionPipeline


def _text_encoders(pipe):
    return [pipe.text_encoder] + ([pipe.text_encoder_2] if hasattr(pipe, "text_encoder_2") else [])


def _random_network(pipe, seed=1):
    """Every target kohya has (attention, ff, proj, ResNet/Down/Upsample convs, both text
    encoders) with random non-zero down AND up, rounded to fp16 so the fp16 file is exact.
    Fused (the forward lorafuse trains with; tests/image/test_network.py checks it against
    kohya's unfused math)."""
    net = LoRANetwork.create(pipe.unet, _text_encoders(pipe), dim=4, alpha=2.0, conv_dim=2,
                             conv_alpha=1.0, train_text_encoder=True)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {
        k: {
            "down": (0.3 * torch.randn(v["down"].shape, generator=g)).half().float(),
            "up": (0.3 * torch.randn(v["up"].shape, generator=g)).half().float(),
            "alpha": v["alpha"],
        }  # fmt: skip
        for k, v in net.lora_tensors().items()
    }
    net.load_lora_tensors(tensors)
    return net, tensors


# ---- names ----------------------------------------------------------------------------------

SD15_NAMES = {
    "unet:down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q":
        "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q",
    "unet:down_blocks.0.attentions.0.proj_in": "lora_unet_down_blocks_0_attentions_0_proj_in",
    "unet:mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0":
        "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0",
    "unet:up_blocks.1.attentions.1.transformer_blocks.0.ff.net.0.proj":
        "lora_unet_up_blocks_1_attentions_1_transformer_blocks_0_ff_net_0_proj",
    "unet:down_blocks.0.resnets.0.conv1": "lora_unet_down_blocks_0_resnets_0_conv1",
    "unet:down_blocks.0.downsamplers.0.conv": "lora_unet_down_blocks_0_downsamplers_0_conv",
    "unet:up_blocks.0.upsamplers.0.conv": "lora_unet_up_blocks_0_upsamplers_0_conv",
    "unet:up_blocks.1.resnets.0.conv_shortcut": "lora_unet_up_blocks_1_resnets_0_conv_shortcut",
    "unet:mid_block.resnets.1.time_emb_proj": "lora_unet_mid_block_resnets_1_time_emb_proj",
    "te1:encoder.layers.0.self_attn.q_proj": "lora_te_text_model_encoder_layers_0_self_attn_q_proj",
    "te1:encoder.layers.1.mlp.fc2": "lora_te_text_model_encoder_layers_1_mlp_fc2",
}  # fmt: skip
# kohya's SDXL UNet (sdxl_model_util.make_unet_conversion_map): input_blocks.{3b+i+1}.0|1,
# downsample input_blocks.{3(b+1)}.0.op, output_blocks.{3b+i}.0|1, upsample output_blocks.{3b+2}.2
SDXL_NAMES = {
    "unet:down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q":
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
    "unet:down_blocks.2.attentions.1.transformer_blocks.1.attn2.to_k":
        "lora_unet_input_blocks_8_1_transformer_blocks_1_attn2_to_k",
    "unet:down_blocks.1.attentions.1.proj_out": "lora_unet_input_blocks_5_1_proj_out",
    "unet:down_blocks.0.resnets.1.conv1": "lora_unet_input_blocks_2_0_in_layers_2",
    "unet:down_blocks.0.downsamplers.0.conv": "lora_unet_input_blocks_3_0_op",
    "unet:down_blocks.1.downsamplers.0.conv": "lora_unet_input_blocks_6_0_op",
    "unet:down_blocks.2.resnets.0.time_emb_proj": "lora_unet_input_blocks_7_0_emb_layers_1",
    "unet:down_blocks.1.resnets.0.conv_shortcut": "lora_unet_input_blocks_4_0_skip_connection",
    "unet:mid_block.resnets.0.conv1": "lora_unet_middle_block_0_in_layers_2",
    "unet:mid_block.attentions.0.transformer_blocks.0.ff.net.2":
        "lora_unet_middle_block_1_transformer_blocks_0_ff_net_2",
    "unet:mid_block.resnets.1.conv2": "lora_unet_middle_block_2_out_layers_3",
    "unet:up_blocks.0.attentions.2.transformer_blocks.0.attn1.to_out.0":
        "lora_unet_output_blocks_2_1_transformer_blocks_0_attn1_to_out_0",
    "unet:up_blocks.0.upsamplers.0.conv": "lora_unet_output_blocks_2_2_conv",
    "unet:up_blocks.1.upsamplers.0.conv": "lora_unet_output_blocks_5_2_conv",
    "unet:up_blocks.1.resnets.2.conv_shortcut": "lora_unet_output_blocks_5_0_skip_connection",
    "unet:up_blocks.2.resnets.0.conv2": "lora_unet_output_blocks_6_0_out_layers_3",
    "te1:encoder.layers.0.self_attn.q_proj":
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
    "te2:text_model.encoder.layers.1.mlp.fc2": "lora_te2_text_model_encoder_layers_1_mlp_fc2",
    "te2:text_model.encoder.layers.0.self_attn.out_proj":
        "lora_te2_text_model_encoder_layers_0_self_attn_out_proj",
}  # fmt: skip


@pytest.mark.parametrize("fam,names", [("sd15", SD15_NAMES), ("sdxl", SDXL_NAMES)])
def test_names_are_kohyas_and_read_back(fam, names, built):
    pipe = built(fam)
    net, _ = _random_network(pipe)
    layout = UNetLayout.from_config(pipe.unet.config)
    assert set(names) <= set(net.keys())  # the network adapts every layer named above
    for key, name in names.items():
        assert kohya_names.kohya_name(key, FAMILY[fam], layout) == name
    # every key of the network (both text encoders, conv LoRA) reads back, with and without the
    # model's key list, and no two keys share a name
    by_name = {kohya_names.kohya_name(k, FAMILY[fam], layout): k for k in net.keys()}
    assert len(by_name) == len(net.keys())
    for name, key in by_name.items():
        assert kohya_names.module_key(name, FAMILY[fam], layout) == key
    # The SGM mapping names every UNet tensor as the original checkpoint does (the single-file
    # layout of lorafuse.testing, which diffusers' converter reads back in test_models.py) and
    # inverts; incl. SD1.5's Upsample in a block without attention (output_blocks.N.1.conv).
    ldm = sd_single_file_state_dict(pipe, fam)
    for key in pipe.unet.state_dict():
        path, param = key.rsplit(".", 1)
        sgm = kohya_names.unet_to_sgm(path, layout)
        assert f"model.diffusion_model.{sgm}.{param}" in ldm, key
        assert kohya_names.sgm_to_unet(sgm, layout) == path
    assert {c for k in net.keys() for c in [k.split(":")[0]]} == (
        {"unet", "te1", "te2"} if fam == "sdxl" else {"unet", "te1"}
    )


def test_sdxl_reads_diffusers_named_unet_keys_and_lora_te():
    # kohya's convert_diffusers_to_sai_if_needed: SDXL files with diffusers UNet names exist
    name = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
    assert kohya_names.module_key(name, "sdxl") == f"unet:{name[10:].replace('_', '.')}".replace(
        "down.blocks", "down_blocks"
    ).replace("transformer.blocks", "transformer_blocks").replace("to.q", "to_q")
    assert kohya_names.module_key("lora_te_text_model_encoder_layers_3_mlp_fc1", "sdxl") == (
        "te1:encoder.layers.3.mlp.fc1"
    )


def test_tensors_layout_fp16_and_4d_conv(built):
    pipe = built("sd15")
    _, tensors = _random_network(pipe)
    sd = kohya.to_kohya_state_dict(tensors, "sd1")
    assert len(sd) == 3 * len(tensors) and kohya.guess_family(sd) is None
    assert {v.dtype for v in sd.values()} == {torch.float16}
    name = "lora_unet_down_blocks_0_attentions_0_proj_in"  # 1x1 conv on SD1.5: 4-D
    assert sd[f"{name}.lora_down.weight"].shape == (4, 32, 1, 1)
    assert sd[f"{name}.lora_up.weight"].shape == (32, 4, 1, 1)
    assert sd[f"{name}.alpha"].shape == () and float(sd[f"{name}.alpha"]) == 2.0
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"  # 3x3 conv LoRA: down 3x3, up 1x1
    assert sd[f"{conv}.lora_down.weight"].shape == (2, 32, 3, 3)
    assert sd[f"{conv}.lora_up.weight"].shape == (32, 2, 1, 1)
    assert float(sd[f"{conv}.alpha"]) == 1.0
    lin = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"
    assert sd[f"{lin}.lora_down.weight"].shape == (4, 32)
    assert kohya.to_kohya_state_dict(tensors, "sd1", dtype=None)[f"{lin}.alpha"].dtype == (
        torch.float32
    )


# ---- files ----------------------------------------------------------------------------------


def test_file_round_trip_and_metadata(tmp_path, built):
    pipe = built("sdxl")
    net, tensors = _random_network(pipe)
    meta = kohya.build_metadata(
        family="sdxl", dim=4, alpha=2.0, conv_dim=2, conv_alpha=1.0, resolution=(1024, 768),
        num_train_images=12, tag_frequency={"5_cat": {"cat": 3, "red": 1}}, output_name="mycat",
        training_started_at=1700000000.5, steps=30, epoch=2, learning_rate=1e-4, unet_lr=1e-4,
        text_encoder_lr=5e-5, seed=7, mixed_precision="bf16", base_model="sdxl.safetensors",
    )  # fmt: skip
    sd = kohya.to_kohya_state_dict(tensors, "sdxl", layout=UNetLayout.from_config(pipe.unet.config))
    path = kohya.save_lora_file(tmp_path / "out" / "lora.safetensors", sd, meta)
    assert [p.name for p in path.parent.iterdir()] == ["lora.safetensors"]  # no temp file left
    sd2, meta2 = kohya.load_lora_file(path)
    assert sd2.keys() == sd.keys() and all(torch.equal(sd2[k], sd[k]) for k in sd)
    back = kohya.from_kohya_state_dict(sd2, "sdxl", UNetLayout.from_config(pipe.unet.config))
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert torch.equal(back[k]["down"].float(), t["down"]) and back[k]["alpha"] == t["alpha"]
        assert torch.equal(back[k]["up"].float(), t["up"])
    net2, _ = _random_network(pipe, seed=3)
    net2.load_lora_tensors(back)  # strict: the same modules, the same shapes
    # matched against the model's keys: also in the other spellings kohya/diffusers accept
    sgm = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    other = {k.replace(sgm, "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q")
             .replace("lora_te1_", "lora_te_"): v for k, v in sd2.items()}  # fmt: skip
    layout = UNetLayout.from_config(pipe.unet.config)
    again = kohya.from_kohya_state_dict(other, "sdxl", layout, modules=net.keys())
    assert again.keys() == tensors.keys()
    assert kohya.guess_family(sd2) == "sdxl"
    with pytest.raises(LoRAFileError, match="this LoRA is for SDXL.*the model is sd1"):
        kohya.from_kohya_state_dict(sd2, "sd1")

    m = kohya.read_metadata(meta2)
    assert m["ss_network_module"] == "networks.lora"
    assert (m["ss_network_dim"], m["ss_network_alpha"]) == (4, 2.0)
    assert m["ss_network_args"] == {"conv_dim": "2", "conv_alpha": "1.0"}
    assert m["ss_base_model_version"] == "sdxl_base_v1-0" and m["ss_v2"] == "False"
    assert m["ss_resolution"] == "(1024, 768)" and m["ss_num_train_images"] == 12
    assert m["ss_tag_frequency"] == {"5_cat": {"cat": 3, "red": 1}}
    assert (m["ss_output_name"], m["ss_steps"], m["ss_epoch"]) == ("mycat", 30, 2)
    assert m["ss_training_started_at"] == "1700000000.5" and m["ss_seed"] == "7"
    assert (m["ss_unet_lr"], m["ss_text_encoder_lr"]) == ("0.0001", "5e-05")
    assert m["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert m["modelspec.implementation"] == kohya.IMPL_STABILITY_AI
    assert m["modelspec.resolution"] == "1024x768" and m["modelspec.title"] == "mycat"
    assert m["modelspec.sai_model_spec"] == "1.0.1" and m["modelspec.date"].startswith("2023-11-")
    assert m["modelspec.implementation_version"].startswith("lorafuse/")
    # sshs_model_hash as sd-scripts computes it: sha256 of the tensor bytes after the header
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert meta2["sshs_model_hash"] == hashlib.sha256(raw[8 + n :]).hexdigest()
    assert len(meta2["sshs_legacy_hash"]) == 8


@pytest.mark.parametrize(
    "family,v,version,arch",
    [("sd1", False, "sd_v1", "stable-diffusion-v1/lora"),
     ("sd2", False, "sd_v2", "stable-diffusion-v2-512/lora"),
     ("sd2", True, "sd_v2_v", "stable-diffusion-v2-768-v/lora")],
)  # fmt: skip
def test_metadata_versions(family, v, version, arch):
    m = kohya.build_metadata(family=family, dim=8, alpha=1, v_parameterization=v)
    assert (m["ss_base_model_version"], m["modelspec.architecture"]) == (version, arch)
    assert m["ss_v2"] == str(family == "sd2") and m["modelspec.implementation"] == "diffusers"
    assert m["modelspec.prediction_type"] == ("v" if v else "epsilon")
    assert json.loads(m["ss_network_args"]) == {} and all(isinstance(x, str) for x in m.values())


def test_base_model_name_and_hashes(tmp_path):
    """sd-scripts: the base model's file name, its A1111 old hash (64 KiB at 1 MiB) and sha256."""
    data = bytes(range(256)) * 8192  # 2 MiB
    (tmp_path / "base.safetensors").write_bytes(data)
    m = kohya.build_metadata(
        family="sd1", dim=4, alpha=1, base_model=str(tmp_path / "base.safetensors")
    )
    assert m["ss_sd_model_name"] == "base.safetensors"
    assert m["ss_new_sd_model_hash"] == hashlib.sha256(data).hexdigest()
    assert m["ss_sd_model_hash"] == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    m = kohya.build_metadata(family="sd1", dim=4, alpha=1, base_model=str(tmp_path) + "/")
    assert m["ss_sd_model_name"] == tmp_path.name and "ss_new_sd_model_hash" not in m


def test_bad_files_and_keys_are_named(tmp_path):
    down, up, a = torch.zeros(4, 8), torch.zeros(8, 4), torch.tensor(4.0)
    ok = "lora_unet_down_blocks_0_attentions_0_proj_in"
    with pytest.raises(LoRAFileError, match="hada_w1_a"):  # LyCORIS/LoHa
        kohya.from_kohya_state_dict({f"{ok}.hada_w1_a": down}, "sd1")
    with pytest.raises(LoRAFileError, match="match no layer.*lora_unet_nope_x"):
        kohya.from_kohya_state_dict(
            {"lora_unet_nope_x.lora_down.weight": down, "lora_unet_nope_x.lora_up.weight": up},
            "sd1", modules=["unet:down_blocks.0.attentions.0.proj_in"],
        )  # fmt: skip
    with pytest.raises(LoRAFileError, match="lora_vae_x.*not a kohya sd1 name"):
        kohya.from_kohya_state_dict(
            {"lora_vae_x.lora_down.weight": down, "lora_vae_x.lora_up.weight": up}, "sd1"
        )
    with pytest.raises(LoRAFileError, match=f"{ok}: needs both"):
        kohya.from_kohya_state_dict({f"{ok}.lora_down.weight": down, f"{ok}.alpha": a}, "sd1")
    with pytest.raises(LoRAFileError, match="disagree on the rank"):
        kohya.from_kohya_state_dict(
            {f"{ok}.lora_down.weight": down, f"{ok}.lora_up.weight": torch.zeros(8, 2)}, "sd1"
        )
    with pytest.raises(LoRAFileError, match="lora_te2_.*not a kohya sd1 name"):
        kohya_names.module_key("lora_te2_text_model_encoder_layers_0_mlp_fc1", "sd1")
    with pytest.raises(LoRAFileError, match="te2.*sd1"):
        kohya_names.kohya_name("te2:text_model.encoder.layers.0.mlp.fc1", "sd1")
    with pytest.raises(LoRAFileError, match="family must be"):
        kohya_names.kohya_name("unet:conv_in", "sd3")
    # no alpha: alpha = rank (kohya's default)
    got = kohya.from_kohya_state_dict({f"{ok}.lora_down.weight": down,
                                       f"{ok}.lora_up.weight": up}, "sd1")  # fmt: skip
    assert got["unet:down_blocks.0.attentions.0.proj_in"]["alpha"] == 4.0
    (tmp_path / "x.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoRAFileError, match="x.safetensors: not a readable"):
        kohya.load_lora_file(tmp_path / "x.safetensors")
    with pytest.raises(LoRAFileError, match="does not exist"):
        kohya.load_lora_file(tmp_path / "none.safetensors")
    with pytest.raises(LoRAFileError, match="must be strings"):
        kohya.save_lora_file(tmp_path / "y.safetensors", {}, {"ss_network_dim": 4})


# ---- the file in diffusers ------------------------------------------------------------------


class _Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("fam", ["sd15", "sdxl"])
def test_diffusers_loads_every_key_with_our_outputs(fam, tiny_dirs, tmp_path):
    """Our fp16 kohya file through ``load_lora_weights``: every LoRA becomes a PEFT layer (no
    unexpected/missing keys logged), and UNet and text-encoder outputs equal our network's
    (kohya's math) to fp32 1e-5. The tensors are fp16-exact, so the file loses nothing."""
    cls = _pipe_cls(fam)
    ours = cls.from_pretrained(tiny_dirs[fam], local_files_only=True)
    net, tensors = _random_network(ours)
    net.apply_to()
    layout = UNetLayout.from_config(ours.unet.config)
    sd = kohya.to_kohya_state_dict(tensors, FAMILY[fam], layout=layout)
    meta = kohya.build_metadata(family=FAMILY[fam], dim=4, alpha=2.0, conv_dim=2, conv_alpha=1.0)
    kohya.save_lora_file(tmp_path / "lora.safetensors", sd, meta)

    theirs = cls.from_pretrained(tiny_dirs[fam], local_files_only=True)
    grab, dlog = _Grab(), logging.getLogger("diffusers")
    dlog.addHandler(grab)
    try:
        theirs.load_lora_weights(str(tmp_path), weight_name="lora.safetensors")
    finally:
        dlog.removeHandler(grab)
    problems = [m for m in grab.messages if "unexpected" in m or "missing" in m]
    assert not problems, problems
    comps = {"unet": "unet", "te1": "text_encoder", "te2": "text_encoder_2"}
    for ours_c, theirs_c in comps.items():
        if not hasattr(theirs, theirs_c):
            continue
        mods = getattr(theirs, theirs_c).named_modules()
        n_peft = sum(1 for _, m in mods if hasattr(m, "lora_A") and len(m.lora_A))
        assert n_peft == len(net.component_keys(ours_c)) > 0, theirs_c

    g = torch.Generator().manual_seed(2)
    ids = ours.tokenizer(["a red cat", "dog"], padding="max_length", max_length=77,
                         return_tensors="pt").input_ids  # fmt: skip
    x = torch.randn(2, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 77, ours.unet.config.cross_attention_dim, generator=g)
    kw = {}
    if fam == "sdxl":
        cond = {
            "text_embeds": torch.randn(2, 32, generator=g),
            "time_ids": torch.randn(2, 6, generator=g),
        }
        kw = {"added_cond_kwargs": cond}
    with torch.no_grad():
        for te_ours, te_theirs in zip(_text_encoders(ours), _text_encoders(theirs)):
            assert_close(te_theirs(ids).last_hidden_state, te_ours(ids).last_hidden_state,
                         atol=1e-5, rtol=1e-5, name="text encoder")  # fmt: skip
        got = theirs.unet(x, 500, ctx, **kw).sample
        want = ours.unet(x, 500, ctx, **kw).sample
        net.restore()
        base = ours.unet(x, 500, ctx, **kw).sample
    assert (want - base).abs().max() > 0.1  # the LoRA changes the output: the check has teeth
    assert_close(got, want, atol=1e-5, rtol=1e-5, name="unet")

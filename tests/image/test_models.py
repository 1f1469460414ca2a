"""Loading SD models offline: diffusers dirs and single files, family and prediction type, and
errors that name what is missing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lorafuse.errors import LorafuseError
from lorafuse.image.models import ModelLoadError, detect_family, load_sd_model
from lorafuse.testing import save_tiny_sd, single_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from single_thread()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each family as a diffusers dir ``<fam>`` and a single file ``<fam>.safetensors``."""
    root = tmp_path_factory.mktemp("sd")
    files = {fam: save_tiny_sd(root / fam, fam, single_file=True) for fam in ("sd15", "sdxl")}
    return root, files


def _equal_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("fam,family,n_te", [("sd15", "sd1", 1), ("sdxl", "sdxl", 2)])
def test_dir_and_single_file_load_the_same_model(tiny, fam, family, n_te):
    from diffusers import DDPMScheduler
    from transformers import CLIPTextModelWithProjection

    root, files = tiny
    m = load_sd_model(str(root / fam))
    assert (m.family, m.prediction_type, m.source) == (family, "epsilon", str(root / fam))
    assert len(m.text_encoders) == len(m.tokenizers) == n_te
    assert isinstance(m.noise_scheduler, DDPMScheduler)
    assert m.noise_scheduler.config.clip_sample is False  # sd-scripts' training scheduler
    assert m.noise_scheduler.config.beta_schedule == "scaled_linear"
    assert not any(p.requires_grad for p in m.unet.parameters()) and not m.unet.training
    if fam == "sdxl":
        assert isinstance(m.text_encoders[1], CLIPTextModelWithProjection)
        assert m.unet.config.addition_embed_type == "text_time"
    assert m.tokenizers[0]("a cat").input_ids[0] == m.tokenizers[0].bos_token_id

    one = load_sd_model(files[fam], model_config=str(root / fam), dtype=torch.float32)
    assert one.family == family and one.source == files[fam]
    for a, b in zip([m.unet, m.vae, *m.text_encoders], [one.unet, one.vae, *one.text_encoders]):
        assert _equal_state(a, b), type(a).__name__


def test_v_prediction_and_dtype(tiny, tmp_path):
    root, _ = tiny
    shutil.copytree(root / "sd15", tmp_path / "v")
    cfg_path = tmp_path / "v" / "scheduler" / "scheduler_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "prediction_type": "v_prediction"}))
    m = load_sd_model(str(tmp_path / "v"), dtype=torch.bfloat16)
    assert m.prediction_type == "v_prediction" and m.v_parameterization
    assert m.noise_scheduler.config.prediction_type == "v_prediction"
    assert m.unet.dtype == torch.bfloat16 and m.text_encoders[0].dtype == torch.bfloat16
    cfg_path.write_text(json.dumps({**cfg, "prediction_type": "sample"}))
    with pytest.raises(ModelLoadError, match="prediction_type 'sample' is not supported"):
        load_sd_model(str(tmp_path / "v"))


def test_family_detection():
    assert detect_family({"cross_attention_dim": 768, "use_linear_projection": False}, 1) == "sd1"
    assert detect_family({"cross_attention_dim": 1024, "use_linear_projection": True}, 1) == "sd2"
    assert detect_family({"cross_attention_dim": 2048, "use_linear_projection": True}, 2) == "sdxl"


def test_errors_name_what_is_missing(tiny, tmp_path):
    root, files = tiny
    with pytest.raises(ModelLoadError, match="nowhere does not exist"):
        load_sd_model(str(tmp_path / "nowhere"))
    broken = tmp_path / "broken"
    shutil.copytree(root / "sdxl", broken)
    shutil.rmtree(broken / "unet")
    shutil.rmtree(broken / "tokenizer_2")
    with pytest.raises(
        ModelLoadError, match=r"broken is not a complete .*SDXL: missing unet/, tokenizer_2/"
    ):
        load_sd_model(str(broken))
    noweights = tmp_path / "noweights"
    shutil.copytree(root / "sd15", noweights)
    for f in (noweights / "vae").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="missing vae/ .*with weights"):
        load_sd_model(str(noweights))
    with pytest.raises(ModelLoadError, match="pass --model-config"):
        load_sd_model(files["sd15"])
    with pytest.raises(ModelLoadError, match="--model-config is for single-file"):
        load_sd_model(str(root / "sd15"), model_config=str(root / "sd15"))
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"\x80\x02pickle")
    with pytest.raises(
        ModelLoadError, match=r"model.ckpt: single-file checkpoints must be .safetensors"
    ):
        load_sd_model(str(ckpt), model_config=str(root / "sd15"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"garbage that is no header")
    with pytest.raises(ModelLoadError, match="junk.safetensors: not a readable .safetensors"):
        load_sd_model(str(junk), model_config=str(root / "sd15"))
    with pytest.raises(ModelLoadError, match="model config dir .*nocfg does not exist"):
        load_sd_model(files["sd15"], model_config=str(tmp_path / "nocfg"))
    # an SDXL file with an SD1.5 config dir: diffusers cannot map it; the error names both
    with pytest.raises(LorafuseError, match="sdxl.safetensors.*configs from .*sd15"):
        load_sd_model(files["sdxl"], model_config=str(root / "sd15"))

"""CUDA: dtype/device auto choice, NF4 on the GPU, offloaded gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from lorafuse import FastLanguageModel
from lorafuse.models import grad_checkpointing, nf4
from lorafuse.ops import nf4 as nf4_ops
from lorafuse.testing import PLAIN, save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(path, **PLAIN)
    return path


def test_auto_device_and_dtype(tiny_model_dir):
    model, _ = FastLanguageModel.from_pretrained(str(tiny_model_dir))
    assert model.device.type == "cuda"
    major, _ = torch.cuda.get_device_capability()
    assert model.dtype == (torch.bfloat16 if major >= 8 else torch.float16)


def test_nf4_on_cuda_matches_cpu(close):
    torch.manual_seed(0)
    w = torch.randn(300, 130) * 0.02
    cpu = nf4_ops.quantize_nf4(w)
    gpu = nf4_ops.quantize_nf4(w.cuda())
    assert torch.equal(cpu["codes"], gpu["codes"].cpu())  # amax, division, bucketize: exact
    weight = nf4.NF4Weight(*(gpu[k] for k in ("codes", "absmax_q", "absmax_scale", "absmax_offset")),
                           w.shape, torch.bfloat16)  # fmt: skip
    ref = nf4_ops.dequantize_nf4(**cpu, shape=w.shape, dtype=torch.float32)
    got = weight.dequantize(torch.float32).cpu()
    # scale/offset computed by CUDA reductions may differ from CPU in the last ulp.
    close(got, ref, atol=1e-8, rtol=1e-6, name=f"dequantized ({nf4_ops.dequantizer_name('cuda')})")


@pytest.mark.parametrize("mode", [True, "offload"])
def test_checkpointing_on_cuda_keeps_the_loss(tiny_model_dir, mode, close):
    ids = torch.randint(5, 128, (2, 32), device="cuda")
    losses = []
    for m in (False, mode):
        base, _ = FastLanguageModel.from_pretrained(
            str(tiny_model_dir), dtype=torch.float32, load_in_4bit=True
        )
        model = FastLanguageModel.get_peft_model(
            base, r=4, use_gradient_checkpointing=m, init_lora_weights=False
        )
        assert grad_checkpointing.mode_of(model) == m
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        losses.append((loss.detach(), grads))
    close(losses[1][0], losses[0][0], atol=1e-6, rtol=1e-6, name="loss")
    close(losses[1][1], losses[0][1], atol=1e-6, rtol=1e-5, name="grads")

"""NF4 quantiser: code table, packing, dequantisation vs a plain reference, error bounds,
Linear4bit as a module and as a PEFT LoRA base, memory, and training loss vs unquantised."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lorafuse.models import nf4
from lorafuse.ops import nf4 as nf4_ops
from lorafuse.testing import tiny_llama_config


def normal_map_reference(offset=0.9677083) -> torch.Tensor:
    """NF4 built from N(0,1) quantiles as bitsandbytes' create_normal_map does (float64)."""
    normal = torch.distributions.Normal(0.0, 1.0)
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return values / values.abs().max()


def quantize_reference(w: torch.Tensor):
    """Element by element in float64: nearest code per value, absmax per 64-block, then the
    int8 double quantisation of (absmax - mean) per 256 absmaxes. Returns (idx list, absmax_deq)."""
    code = torch.tensor(nf4_ops.NF4_CODE, dtype=torch.float64)
    flat = w.double().flatten().tolist()
    blocks = [flat[i : i + 64] for i in range(0, len(flat), 64)]
    absmax = [max(abs(v) for v in b) for b in blocks]
    idx = []
    for b, a in zip(blocks, absmax):
        for v in b:
            x = v / a if a > 0 else 0.0
            idx.append(int(torch.argmin((code - x).abs())))
    mean = sum(absmax) / len(absmax)
    deq = []
    for i in range(0, len(absmax), 256):
        group = [a - mean for a in absmax[i : i + 256]]
        scale = max(abs(g) for g in group) / 127
        deq += [(round(g / scale) * scale if scale > 0 else 0.0) + mean for g in group]
    return idx, torch.tensor(absmax, dtype=torch.float64), torch.tensor(deq, dtype=torch.float64)


def test_code_table_is_the_standard_nf4(close):
    # bitsandbytes' table is float32 values of scipy's float64 quantiles: ulp 6e-8 near 0.72,
    # so 2e-7 (~3 ulp) allows storage rounding plus a different erfinv; a wrong entry is >1e-3 off.
    code = torch.tensor(nf4_ops.NF4_CODE, dtype=torch.float64)
    close(code, normal_map_reference(), atol=2e-7, rtol=0, name="NF4 code")
    assert (
        nf4_ops.NF4_CODE[7] == 0.0 and nf4_ops.NF4_CODE[0] == -1.0 and nf4_ops.NF4_CODE[15] == 1.0
    )


def test_packing_first_element_in_high_nibble():
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1], w[0, 3] = 1.0, -1.0, 0.5626170039176941  # codes 15, 0, 13; zeros are code 7
    codes = nf4_ops.quantize_nf4(w)["codes"]
    assert codes.dtype == torch.uint8 and codes.numel() == 32
    assert codes[0].item() == (15 << 4) | 0
    assert codes[1].item() == (7 << 4) | 13
    assert codes[2].item() == (7 << 4) | 7


@pytest.mark.parametrize("shape", [(1, 64), (3, 37), (130, 257), (64, 300)])
def test_dequantize_matches_reference(shape, close):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.02
    buf = nf4_ops.quantize_nf4(w)
    ref_idx, _, ref_absmax = quantize_reference(w)
    n = w.numel()
    ours_idx = torch.stack([buf["codes"] >> 4, buf["codes"] & 15], 1).flatten()[:n].long()
    ref_idx = torch.tensor(ref_idx)
    # A value within float rounding of a midpoint between two codes may go either way.
    code = torch.tensor(nf4_ops.NF4_CODE, dtype=torch.float64)
    mids = (code[1:] + code[:-1]) / 2
    blk = torch.arange(n) // 64
    x = w.double().flatten() / torch.tensor(quantize_reference(w)[1])[blk]
    near_mid = (x[:, None] - mids).abs().min(1).values < 1e-6
    mismatch = (ours_idx != ref_idx) & ~near_mid
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ from the reference"
    nb = -(-n // 64)
    absmax = nf4_ops.dequantize_absmax(
        buf["absmax_q"], buf["absmax_scale"], buf["absmax_offset"], nb
    )
    # fp32 storage of scale/offset vs the float64 reference: a few ulps of the absmax.
    close(absmax.double(), ref_absmax, atol=1e-9, rtol=1e-6, name="absmax")
    expected = (code[ref_idx] * ref_absmax[blk]).view(shape)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-8)):  # bf16: one rounding
        got = nf4_ops.dequantize_nf4(**buf, shape=w.shape, dtype=dtype)
        assert got.dtype == dtype and got.shape == w.shape
        close(got.double(), expected, atol=1e-9, rtol=tol, name=f"dequantized {dtype}")


def test_round_trip_error_bound():
    torch.manual_seed(1)
    w = torch.randn(256, 512) * 0.05
    w[0, :64] *= 20  # an outlier block: its error scales with its own absmax only
    buf = nf4_ops.quantize_nf4(w)
    deq = nf4_ops.dequantize_nf4(**buf, shape=w.shape, dtype=torch.float32)
    blocks = w.view(-1, 64)
    absmax = blocks.abs().amax(1, keepdim=True)
    absmax_deq = nf4_ops.dequantize_absmax(
        buf["absmax_q"], buf["absmax_scale"], buf["absmax_offset"], blocks.shape[0]
    )
    half_gap = max(b - a for a, b in zip(nf4_ops.NF4_CODE, nf4_ops.NF4_CODE[1:])) / 2  # 0.152
    # |w - q·a'| <= |w - q·a| + |q|·|a - a'| <= half_gap·a + |a - a'| (|q| <= 1), plus fp32 rounding
    bound = half_gap * absmax + (absmax - absmax_deq[:, None]).abs() + 1e-6 * absmax
    err = (deq.view(-1, 64) - blocks).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3e}"
    # Gaussian weights: NF4's RMS error is ~0.09 of the std for blocks of 64 (measured 0.0917);
    # 0.1 fails for a broken code table or absmax, passes for the right one.
    rel_rms = ((deq - w)[1:].pow(2).mean().sqrt() / w[1:].std()).item()
    assert rel_rms < 0.1, rel_rms


def test_linear4bit_module_buffers_forward_backward(close):
    torch.manual_seed(2)
    lin = torch.nn.Linear(96, 40, bias=True)
    q = nf4.Linear4bit(lin)
    assert isinstance(q, torch.nn.Linear)
    assert isinstance(q.weight, nf4.NF4Weight) and q.weight.shape == (40, 96)
    assert not any(p.shape == (40, 96) for p in q.parameters()), "a dense weight parameter exists"
    keys = set(q.state_dict())
    assert {"nf4_codes", "nf4_absmax_q", "nf4_absmax_scale", "nf4_absmax_offset", "bias"} == keys
    x = torch.randn(5, 7, 96, requires_grad=True)
    dense = q.weight.dequantize(torch.float32)
    # NF4's largest half-gap is (1 - 0.6962)/2 = 0.152 of a block's absmax (<= the global max).
    close(dense, lin.weight, atol=0.153 * lin.weight.abs().max().item(), rtol=0, name="dequant")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        y = q(x)
    assert (40, 96) not in saved, "a dense weight was saved for backward"
    close(y, F.linear(x, dense, lin.bias), atol=1e-6, rtol=1e-6, name="forward")
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    close(dx, g @ dense, atol=1e-5, rtol=1e-5, name="dx")
    before = q.weight.dequantize(torch.float32)
    q.to(torch.bfloat16)  # a model-wide cast must not round the quantisation constants
    assert q.nf4_codes.dtype == torch.uint8 and q.bias.dtype == torch.bfloat16
    assert torch.equal(q.weight.dequantize(torch.float32), before)


def test_weight_object_is_kept_until_its_buffers_or_dtype_change():
    """``.weight`` is built once (decoding reads it every token) and rebuilt whenever what it
    views changes: buffers copied in place stay seen through it, replaced ones or a new compute
    dtype give a new object, and ``.to()`` drops the kept one (it would hold the old buffers)."""
    torch.manual_seed(3)
    q = nf4.Linear4bit(torch.nn.Linear(128, 16))
    w = q.weight
    assert q.weight is w
    other = nf4.Linear4bit(torch.nn.Linear(128, 16))
    q.load_state_dict(other.state_dict())  # copied in place: the kept views see the new values
    assert q.weight is w and torch.equal(w.dequantize(), other.weight.dequantize())
    q.nf4_codes = other.nf4_codes.clone()  # a replaced buffer
    assert q.weight is not w and q.weight.codes is q.nf4_codes
    w = q.weight
    q.compute_dtype = torch.bfloat16
    assert q.weight is not w and q.weight.dtype == torch.bfloat16
    q.to(torch.float32)
    assert "_nf4_weight" not in q.__dict__


def test_memory_ratio_vs_bf16():
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(
        hidden_size=256, intermediate_size=688, num_hidden_layers=2, vocab_size=128
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    bf16_bytes = sum(t.numel() * 2 for t in tensors)  # rotary inv_freq buffers included
    nf4.quantize_model_(model, torch.bfloat16, skip=(model.get_output_embeddings(),))
    mem = nf4.memory_report(model)
    assert mem["model_bf16"] == bf16_bytes
    # 0.5 B/weight codes + 1/64 B absmax + 4/16384 B scales = 0.2580x of bf16's 2 B/weight.
    assert math.isclose(mem["quantized"] / mem["linear_bf16"], 0.258, abs_tol=0.003)
    assert mem["total"] / mem["model_bf16"] <= 0.35, mem


def _train_losses(model, ids, steps, lr):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_4bit_training_loss_within_band_of_unquantised():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lorafuse.patching import patch_peft_model

    # A random base is blind to weight errors (any permutation of its weights is as good), so
    # first teach the base the data: then a wrong dequantisation costs what it learned.
    torch.manual_seed(3)
    base = LlamaForCausalLM(tiny_llama_config()).float()
    ids = torch.randint(5, 128, (4, 24))
    _train_losses(base, ids, steps=12, lr=1e-2)
    ids[:, 12:] = torch.randint(5, 128, (4, 12))  # half new tokens: something left for LoRA
    runs = {}
    for name in ("fp32", "nf4"):
        model = LlamaForCausalLM(tiny_llama_config()).float()
        model.load_state_dict(base.state_dict())
        if name == "nf4":
            nf4.quantize_model_(model, torch.float32, skip=(model.get_output_embeddings(),))
        torch.manual_seed(4)
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
        runs[name] = _train_losses(
            patch_peft_model(get_peft_model(model, cfg)), ids, steps=6, lr=1e-2
        )
    fp, q = runs["fp32"], runs["nf4"]
    assert q[-1] < 0.75 * q[0], f"4-bit model did not learn: {q}"
    # Band 5%: measured max relative difference 0.4% with NF4; swapping the two nibbles of
    # each byte (a plausible packing bug) gives 13%.
    rel = max(abs(a - b) / b for a, b in zip(q, fp))
    assert rel < 0.05, f"4-bit losses {q} vs fp32 {fp}: max relative difference {rel:.3f}"


def test_dequantiser_choice_is_recorded_with_the_others(monkeypatch):
    """The NF4 dequantiser choice shows in backends.choices()/describe() like every kernel's:
    the C++ kernel on CPU where the extension builds (auto), torch when LORAFUSE_KERNELS=torch."""
    from lorafuse import backends

    cpp = backends.cpp_available()
    assert nf4_ops.dequantizer_name("cpu") == ("lorafuse C++" if cpp else "lorafuse")
    choice = backends.describe()["choices"]["nf4_dequantize (cpu)"]
    assert choice.startswith("cpp: auto" if cpp else "torch: auto"), choice
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert nf4_ops.dequantizer_name("cpu") == "lorafuse"
    assert backends.choices()["nf4_dequantize (cpu)"] == "torch: requested"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, so equality is bit for bit (and NaN-safe)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


# n = rows*cols: 1 (one partial block), 111 (not a multiple of 64), 33410 (not of 64 nor of
# 256 blocks: 523 blocks, 3 absmax scales), 300000 (4688 blocks, 19 scales, a partial tail).
@pytest.mark.cpp
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (130, 257), (300, 1000)])
def test_cpp_dequantize_is_bit_identical_to_torch(shape):
    from lorafuse import backends

    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable here")
    (forward,) = backends.compiled("nf4_dequantize", "cpp", "forward")
    torch.manual_seed(5)
    w = torch.randn(shape) * 0.02
    w.view(-1)[::97] *= 40  # outliers: absmaxes spread, so the int8 absmax codes vary
    if w.numel() >= 256:
        w.view(-1)[64:128] = 0  # an all-zero block: absmax 0 before double quantisation
    buf = nf4_ops.quantize_nf4(w)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = nf4_ops.dequantize_nf4(**buf, shape=shape, dtype=dtype)
        for simd in (True, False):  # the AVX-512 body (where the CPU has it) and the portable one
            out = torch.empty(shape, dtype=dtype)
            forward(buf["codes"], buf["absmax_q"], buf["absmax_scale"], buf["absmax_offset"], out,
                    simd)  # fmt: skip
            differ = int((_bits(out) != _bits(ref)).sum())
            assert differ == 0, f"{shape} {dtype} simd={simd}: {differ} elements differ"
    q = nf4.Linear4bit(torch.nn.Linear(shape[1], shape[0], bias=False))
    assert nf4_ops.dequantizer_name("cpu") == "lorafuse C++"  # so Linear4bit below runs the kernel
    assert torch.equal(q.weight.dequantize(torch.bfloat16), nf4_ops.dequantize_nf4(
        q.nf4_codes, q.nf4_absmax_q, q.nf4_absmax_scale.view(torch.float32),
        q.nf4_absmax_offset.view(torch.float32), shape, torch.bfloat16))  # fmt: skip


@pytest.mark.cpp
def test_cpp_dense_copies_reuse_a_buffer_only_once_nothing_holds_it():
    """Transient dense copies go into ops.weights.dense_buffer: a copy still referenced (itself,
    a view of it, or saved by autograd) is never overwritten; a released one is reused."""
    from lorafuse import backends

    if not backends.cpp_available():
        pytest.skip("C++ extension unavailable")
    torch.manual_seed(2)
    q = nf4.Linear4bit(torch.nn.Linear(96, 40, bias=False))
    first = q.weight.dequantize(torch.bfloat16)
    expect, ptr = first.clone(), first.data_ptr()
    held = [q.weight.dequantize(torch.bfloat16) for _ in range(3)]  # `first` alive: new buffers
    assert ptr not in {h.data_ptr() for h in held} and torch.equal(first, expect)
    view = first.t()
    del first, held
    assert q.weight.dequantize(torch.bfloat16).data_ptr() != ptr  # its view still holds it
    x = torch.randn(5, 96, dtype=torch.bfloat16, requires_grad=True)
    y = x @ view  # autograd saves the view for x's gradient
    del view
    assert q.weight.dequantize(torch.bfloat16).data_ptr() != ptr
    del y
    again = q.weight.dequantize(torch.bfloat16)
    assert again.data_ptr() == ptr and torch.equal(again, expect)


def _weight_shapes(model) -> set[tuple[int, int]]:
    return {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nf4.Linear4bit)}


@pytest.mark.parametrize("mode", ["fused", "fused+ckpt", "unfused"])
def test_no_dense_weight_is_saved_for_backward_on_a_4bit_model(mode):
    """Every path a 4-bit model takes (the fused qkv/o_proj/mlp ops, PEFT's own forward over a
    Linear4bit, gradient checkpointing) dequantises transiently: no tensor of a quantised weight's
    shape is saved for backward. Counted with saved_tensors_hooks over one forward."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lorafuse.patching import patch_peft_model

    torch.manual_seed(6)
    model = LlamaForCausalLM(tiny_llama_config()).to(torch.bfloat16)
    nf4.quantize_model_(model, torch.bfloat16, skip=(model.get_output_embeddings(),))
    shapes = _weight_shapes(model)
    assert len(shapes) >= 3, shapes  # q (64, 64), k/v (32, 64), gate/up (..), down (..)
    if mode == "fused+ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    if mode != "unfused":
        model = patch_peft_model(model)
        assert "patched 14 of 14" in str(model.lorafuse_report), model.lorafuse_report
    model.train()
    ids = torch.randint(0, 128, (1, 24))  # 24 tokens: no activation is (64, 64)-shaped
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(tuple(t.shape)) or t, lambda t: t
    ):
        loss = model(input_ids=ids, labels=ids).loss
    assert saved, "no tensor saved at all: the hook saw nothing"
    dense = [s for s in saved if s in shapes or s[::-1] in shapes]
    assert not dense, f"dense weight copies saved for backward: {dense}"
    loss.backward()  # the dequantise-again backward runs (and the recompute under checkpointing)
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)

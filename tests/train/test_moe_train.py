"""`lorafuse train` on a mixture-of-experts model (tiny gpt-oss): by default LoRA reaches the
routed experts and routers, the log says so; --no-expert-lora leaves them frozen and says that."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from lorafuse.commands import main
from lorafuse.testing import chat_tokenizer
from lorafuse.testing.new_families import save_family_model


@pytest.mark.parametrize(
    "flags, line, experts",
    [([], "expert LoRA: 4 of 4 routed expert tensors, 2 of 2 routers", True),
     (["--no-expert-lora"], "expert LoRA: 0 of 4 routed expert tensors, 0 of 2 routers", False)],
)  # fmt: skip
def test_train_moe_log_says_what_carries_lora(flags, line, experts, chat_file, tmp_path, capsys):
    save_family_model("GptOssForCausalLM", tmp_path / "model", chat_tokenizer())
    out = tmp_path / "out"
    code = main(["train", "--model", str(tmp_path / "model"), "--data", chat_file,
                 "--output-dir", str(out), "--max-seq-length", "48", "--batch-size", "2",
                 "--max-steps", "1", "--no-gradient-checkpointing", "--no-progress", *flags])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert line in err
    keys = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert any(".experts." in k for k in keys) == experts
    assert all(".lora_A." in k or ".lora_B." in k for k in keys)

"""lm-evaluation-harness against `lorafuse serve`: its ``local-completions`` model (token-id
prompts, echo + logprobs for loglikelihood, stop lists for generate_until, our /tokenize routes
as its ``remote`` tokenizer) scores a local task exactly as its own ``hf`` backend does."""

from __future__ import annotations

import pytest

from lorafuse.testing import save_tiny_adapter, save_tiny_model, write_lm_eval_tasks

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow
KEY = "sk-test-123"  # the key conftest.running_server sets


@pytest.fixture(scope="module")
def served(tmp_path_factory, launch_server):
    root = tmp_path_factory.mktemp("lm_eval")
    save_tiny_model(root / "base", max_position_embeddings=1024)
    save_tiny_adapter(root / "base", root / "a", seed=1)
    tasks = write_lm_eval_tasks(root / "tasks")
    args = ["--model", str(root / "base"), "--adapter", f"a={root / 'a'}", "--base-name", "base",
            "--dtype", "fp32"]  # fmt: skip
    with launch_server(args) as (url, _client):
        yield {"url": url, "root": root, "tasks": tasks}


def _evaluate(model: str, model_args: dict, tasks_dir) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["lf_mc", "lf_gen"],
                                   task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                                   log_samples=True, batch_size=4)  # fmt: skip


@pytest.mark.parametrize("model_id", ["base", "a"])
def test_local_completions_scores_like_hf(served, model_id, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # local-completions sends it as the bearer token
    root, tasks_dir = served["root"], served["tasks"]["lf_mc"].parent
    hf_args = {"pretrained": str(root / "base"), "dtype": "float32", "device": "cpu"}
    if model_id != "base":
        hf_args["peft"] = str(root / model_id)
    want = _evaluate("hf", hf_args, tasks_dir)
    got = _evaluate("local-completions", {
        "base_url": served["url"] + "/v1/completions", "model": model_id,
        "tokenizer_backend": "remote", "auth_token": KEY, "max_length": 1024}, tasks_dir)  # fmt: skip
    assert got["results"]["lf_mc"]["acc,none"] == want["results"]["lf_mc"]["acc,none"]
    assert got["results"]["lf_gen"]["exact_match,none"] == want["results"]["lf_gen"]["exact_match,none"]  # fmt: skip
    # Per request, not just the means: every choice's summed logprob (fp32: one full forward
    # pass each side, different batching) and greedy flag, every generated text.
    mc_got, mc_want = got["samples"]["lf_mc"], want["samples"]["lf_mc"]
    assert len(mc_got) == len(mc_want) == 8
    for g, w in zip(mc_got, mc_want):
        assert g["doc_id"] == w["doc_id"]
        for (lp_g, greedy_g), (lp_w, greedy_w) in zip(g["filtered_resps"], w["filtered_resps"]):
            assert lp_g == pytest.approx(lp_w, rel=1e-5, abs=1e-5) and greedy_g == greedy_w
    gen_got = [s["filtered_resps"] for s in got["samples"]["lf_gen"]]
    gen_want = [s["filtered_resps"] for s in want["samples"]["lf_gen"]]
    assert gen_got == gen_want and any(r[0] for r in gen_got)  # texts, and not all empty

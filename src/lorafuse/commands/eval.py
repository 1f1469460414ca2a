"""`lorafuse eval`: base vs adapter(s) side by side: perplexity and task accuracy.

    lorafuse eval --checkpoint out/final --task demo --ppl-data data.jsonl [--json report.json]
    lorafuse eval --checkpoint out/final --lm-eval-tasks my_task.yaml [hellaswag ...]
    lorafuse eval --checkpoint rm-out/final --pairs pairs.jsonl    # a reward model (--method rm)

``--task demo`` is the built-in held-out demo task (src/lorafuse/data/demo/eval.jsonl).
``--pairs`` scores reward-model adapters (lorafuse.evaluation.pairwise): pairwise accuracy on
preference pairs, each adapter loaded as a transformers sequence classifier.
``--lm-eval-tasks`` scores lm-evaluation-harness tasks (names or YAML files, local data only)
through lorafuse's own server, each column by its model id (lorafuse.evaluation.harness).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from lorafuse import files
from lorafuse.commands._args import (
    add_decode_argument,
    add_model_arguments,
    dtype_from_args,
    engine_from_args,
    spec_from_args,
)
from lorafuse.data.demo_task import DEMO_DIR
from lorafuse.data.read_options import ReadOptions, parse_columns
from lorafuse.errors import LorafuseError
from lorafuse.evaluation import harness
from lorafuse.models.resolve import load_model, use_adapter

DEMO_TASK = Path(DEMO_DIR) / "eval.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapters="many", compute_dtype=True)
    add_decode_argument(parser)
    parser.add_argument(
        "--ppl-data", nargs="+", default=[],
        help="data for perplexity: any training format, files or Hugging Face datasets",
    )  # fmt: skip
    parser.add_argument(
        "--task", default=None,
        help="task data {'messages' or 'prompt', 'answer'} (file or Hugging Face dataset), or 'demo'",
    )  # fmt: skip
    parser.add_argument(
        "--pairs", nargs="+", default=[],
        help="preference pairs (as for --method dpo/rm): pairwise accuracy of reward-model adapters",
    )  # fmt: skip
    parser.add_argument(
        "--data-split", default=None,
        help="Hugging Face datasets: the split (default: test, or validation, or the only one)",
    )  # fmt: skip
    parser.add_argument("--data-subset", default=None, help="Hugging Face hub datasets: the subset")
    parser.add_argument(
        "--data-columns", nargs="+", default=[], metavar="FIELD=COLUMN",
        help="read a column as a record field (prompt=question,answer=solution)",
    )  # fmt: skip
    parser.add_argument(
        "--limit", type=int, default=None, help="use only the first N records of each dataset"
    )
    parser.add_argument(
        "--lm-eval-tasks", nargs="+", default=[], metavar="NAME|YAML",
        help="lm-evaluation-harness tasks (needs lm_eval; tasks with local data files)",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-seq-length", type=int, default=1024)
    parser.add_argument(
        "--all-tokens", action="store_true", help="perplexity over prompts too, not just targets"
    )
    parser.add_argument("--no-base", action="store_true", help="skip the base-model column")
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="also write the results as JSON ('-' = stdout)"
    )


def _variants(model, spec, with_base: bool):
    """[(column name, context manager activating it)] : base (adapters off), then each adapter."""
    names = ([None] if with_base or not spec.adapters else []) + list(spec.adapters)
    return [(name or "base", functools.partial(use_adapter, model, name)) for name in names]


def evaluate(args: argparse.Namespace) -> dict:
    from lorafuse.evaluation.metrics import encode_dataset, perplexity, read_task, task_accuracy

    if not args.ppl_data and not args.task and not args.lm_eval_tasks and not args.pairs:
        raise LorafuseError("nothing to evaluate: give --ppl-data FILE..., --task FILE|demo, "
                            "--lm-eval-tasks NAME|YAML... or --pairs FILE...")  # fmt: skip
    try:
        options = ReadOptions(args.data_split, args.data_subset, parse_columns(args.data_columns),
                              role="eval")  # fmt: skip
    except ValueError as err:
        raise LorafuseError(f"--data-columns: {err}") from None
    if args.pairs:
        return evaluate_pairs(args)
    task_path = str(DEMO_TASK) if args.task == "demo" else args.task
    task = read_task(task_path, args.limit, options) if task_path else None  # before loading
    manager = None
    if args.lm_eval_tasks:
        manager = harness.task_manager(args.lm_eval_tasks)
        harness.check_tasks(args.lm_eval_tasks, manager)
    spec = spec_from_args(args)
    model, tokenizer, _ = load_model(spec, dtype=dtype_from_args(args))
    rows = (
        encode_dataset(
            args.ppl_data, tokenizer, args.max_seq_length, args.limit, args.all_tokens, options
        )  # fmt: skip
        if args.ppl_data
        else None
    )
    engine = engine_from_args(model, args) if task is not None or manager is not None else None
    results: dict = {"model": spec.base_label, "adapters": dict(spec.adapters), "columns": {}}
    for name, ctx in _variants(model, spec, not args.no_base):
        col = {}
        with ctx():
            if rows is not None:
                col["perplexity"] = perplexity(model, rows, args.batch_size, desc=f"ppl {name}")
            if task is not None:
                r = task_accuracy(
                    model,
                    tokenizer,
                    task,
                    args.max_new_tokens,
                    args.batch_size,
                    desc=f"task {name}",
                    engine=engine,
                )
                col["task"] = {
                    "n": r.n,
                    "exact_match": r.exact_match,
                    "contains": r.contains_rate,
                    "samples": r.samples,
                }
        results["columns"][name] = col
    if manager is not None:
        run_harness(args, model, tokenizer, manager, results, engine)
    results["ppl_data"], results["task"] = list(args.ppl_data), task_path
    return results


def evaluate_pairs(args: argparse.Namespace) -> dict:
    """``--pairs``: each adapter (reward models only) loaded as a sequence classifier."""
    from transformers import AutoTokenizer

    from lorafuse.data.dataset import DataSpec
    from lorafuse.data.preference import build_pairs
    from lorafuse.evaluation.pairwise import load_reward_model, pairwise_accuracy
    from lorafuse.models.resolve import resolve_hf_dir

    if args.ppl_data or args.task or args.lm_eval_tasks:
        raise LorafuseError("--pairs scores reward models only; run the other metrics separately")
    spec = spec_from_args(args)
    if not spec.adapters:
        raise LorafuseError("--pairs needs a reward-model adapter (--checkpoint or --adapter)")
    base_dir = resolve_hf_dir(spec.base)
    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_dir or base_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = DataSpec(train_files=list(args.pairs), max_seq_length=args.max_seq_length,
                    data_split=args.data_split, data_subset=args.data_subset,
                    data_columns=parse_columns(args.data_columns))  # fmt: skip
    pairs = build_pairs(data, tokenizer).train[: args.limit]
    results: dict = {"model": spec.base_label, "adapters": dict(spec.adapters), "columns": {}}
    for name, path in spec.adapters.items():
        model = load_reward_model(base_dir, path, tokenizer, dtype_from_args(args))
        r = pairwise_accuracy(model, pairs, tokenizer.pad_token_id, args.batch_size)
        results["columns"][name] = {"pairs": {"n": r.n, "accuracy": r.accuracy,
                                              "margin": r.margin, "mean_reward": r.mean_reward}}  # fmt: skip
    results["pairs"] = list(args.pairs)
    return results


def run_harness(args, model, tokenizer, manager, results: dict, engine) -> None:
    """Each column's lm-eval scores through one in-process server (model id = column name)."""
    from lorafuse.generation import context_length

    ids = {name: (None if name == "base" else name) for name in results["columns"]}
    with harness.served(model, tokenizer, ids, engine) as (url, key):
        for name in ids:
            results["columns"][name]["lm_eval"] = harness.run_tasks(
                url, key, name, args.lm_eval_tasks, manager, context_length(model),
                args.limit, args.batch_size)  # fmt: skip
    results["lm_eval_tasks"] = list(args.lm_eval_tasks)


def format_table(results: dict) -> str:
    cols = list(results["columns"])
    rows: list[tuple[str, list[str]]] = []
    first = results["columns"][cols[0]]
    if "perplexity" in first:
        rows.append((f"perplexity ({first['perplexity']['tokens']} tokens)",
                     [f"{results['columns'][c]['perplexity']['perplexity']:.3f}" for c in cols]))  # fmt: skip
    if "task" in first:
        n = first["task"]["n"]
        rows.append(
            (
                f"exact match (n={n})",
                [f"{results['columns'][c]['task']['exact_match']:.1%}" for c in cols],
            )
        )
        rows.append(
            (
                f"contains (n={n})",
                [f"{results['columns'][c]['task']['contains']:.1%}" for c in cols],
            )
        )
    if "pairs" in first:
        n = first["pairs"]["n"]
        for key, label, fmt in (("accuracy", f"pairwise accuracy (n={n})", "{:.1%}"),
                                ("margin", "mean reward margin", "{:.4f}")):  # fmt: skip
            rows.append((label, [fmt.format(results["columns"][c]["pairs"][key]) for c in cols]))
    for task, metrics in first.get("lm_eval", {}).items():
        for metric in (m for m in metrics if "_stderr" not in m):
            rows.append((f"{task} {metric.removesuffix(',none')}",
                         [f"{results['columns'][c]['lm_eval'][task][metric]:.4f}" for c in cols]))  # fmt: skip
    w0 = max(len("metric"), *(len(r[0]) for r in rows))
    widths = [max(len(c), *(len(r[1][i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(["metric".ljust(w0), *(c.rjust(w) for c, w in zip(cols, widths))])]
    lines.append("  ".join(["-" * w0, *("-" * w for w in widths)]))
    lines += [
        "  ".join([label.ljust(w0), *(v.rjust(w) for v, w in zip(vals, widths))])
        for label, vals in rows
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise LorafuseError("--batch-size and --max-new-tokens must be >= 1")
    results = evaluate(args)
    text = json.dumps(results, indent=2)
    if args.json == "-":
        print(text)
        print(format_table(results), file=sys.stderr)
        return 0
    print(format_table(results))
    if args.json:
        files.write_text(args.json, text)
    return 0

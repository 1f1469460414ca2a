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
from lorafuse.evaluation.compare import add_harness_scores, compare, format_table
from lorafuse.evaluation.pairwise import score_adapters
from lorafuse.models.resolve import load_resolved

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


def evaluate(args: argparse.Namespace) -> dict:
    """The results ``--json`` writes: ``model``, ``adapters``, ``columns`` (per variant, see
    :mod:`lorafuse.evaluation.compare`) and what was evaluated."""
    from lorafuse.evaluation.metrics import encode_dataset, read_task

    if not args.ppl_data and not args.task and not args.lm_eval_tasks and not args.pairs:
        raise LorafuseError("nothing to evaluate: give --ppl-data FILE..., --task FILE|demo, "
                            "--lm-eval-tasks NAME|YAML... or --pairs FILE...")  # fmt: skip
    try:
        columns = parse_columns(args.data_columns)
    except ValueError as err:
        raise LorafuseError(f"--data-columns: {err}") from None
    options = ReadOptions(args.data_split, args.data_subset, columns, role="eval")
    if args.pairs:
        return evaluate_pairs(args, columns)
    task_path = str(DEMO_TASK) if args.task == "demo" else args.task
    task = read_task(task_path, args.limit, options) if task_path else None  # before loading
    manager = None
    if args.lm_eval_tasks:
        manager = harness.task_manager(args.lm_eval_tasks)
        harness.check_tasks(args.lm_eval_tasks, manager)
    spec = spec_from_args(args)
    model, tokenizer, _ = load_resolved(spec, dtype=dtype_from_args(args))
    rows = None
    if args.ppl_data:
        rows = encode_dataset(args.ppl_data, tokenizer, args.max_seq_length, args.limit,
                              args.all_tokens, options)  # fmt: skip
    engine = engine_from_args(model, args) if task is not None or manager is not None else None
    results: dict = {"model": spec.base_label, "adapters": dict(spec.adapters)}
    results["columns"] = compare(
        model, tokenizer, list(spec.adapters), rows=rows, task=task,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        with_base=not args.no_base, engine=engine,
    )  # fmt: skip
    if manager is not None:
        add_harness_scores(model, tokenizer, results["columns"], args.lm_eval_tasks, manager,
                           args.limit, args.batch_size, engine)  # fmt: skip
        results["lm_eval_tasks"] = list(args.lm_eval_tasks)
    results["ppl_data"], results["task"] = list(args.ppl_data), task_path
    return results


def evaluate_pairs(args: argparse.Namespace, columns) -> dict:
    """``--pairs``: each adapter (reward models only) loaded as a sequence classifier."""
    if args.ppl_data or args.task or args.lm_eval_tasks:
        raise LorafuseError("--pairs scores reward models only; run the other metrics separately")
    spec = spec_from_args(args)
    if not spec.adapters:
        raise LorafuseError("--pairs needs a reward-model adapter (--checkpoint or --adapter)")
    results: dict = {"model": spec.base_label, "adapters": dict(spec.adapters)}
    results["columns"] = score_adapters(
        spec.base, spec.adapters, args.pairs, tokenizer_dir=spec.tokenizer_dir,
        max_seq_length=args.max_seq_length, limit=args.limit, batch_size=args.batch_size,
        dtype=dtype_from_args(args), data_split=args.data_split, data_subset=args.data_subset,
        data_columns=columns,
    )  # fmt: skip
    results["pairs"] = list(args.pairs)
    return results


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

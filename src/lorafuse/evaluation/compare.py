"""Base vs adapter(s) side by side: one column per variant (the bare base, then each adapter) of
perplexity, task accuracy and lm-eval scores, and the table ``lorafuse eval`` prints.

    model, tokenizer, _ = load_resolved(resolve_spec(checkpoint="out/final"))
    columns = compare(model, tokenizer, ["adapter"], rows=encode_dataset(["eval.jsonl"], tokenizer, 1024))
    print(format_table({"columns": columns}))

Each column is a dict: ``perplexity`` (:func:`~lorafuse.evaluation.metrics.perplexity`), ``task``
(``n``, ``exact_match``, ``contains``, ``samples``), ``lm_eval`` (task -> metric -> value) and, for
reward models, ``pairs`` (:func:`lorafuse.evaluation.pairwise.score_adapters`).
"""

from __future__ import annotations

import functools

from lorafuse.evaluation import harness
from lorafuse.evaluation.metrics import perplexity, task_accuracy
from lorafuse.models.resolve import use_adapter


def variants(model, adapters: list[str], with_base: bool = True) -> list[tuple[str, object]]:
    """``[(column name, context manager factory activating it)]``: the base (adapters off; always
    where there are no adapters), then each adapter."""
    names = ([None] if with_base or not adapters else []) + list(adapters)
    return [(name or "base", functools.partial(use_adapter, model, name)) for name in names]


def compare(model, tokenizer, adapters: list[str], *, rows=None, task=None,
            max_new_tokens: int = 32, batch_size: int = 8, with_base: bool = True,
            engine=None) -> dict[str, dict]:  # fmt: skip
    """``{column: {"perplexity": ..., "task": ...}}`` of every variant of ``model``: perplexity
    over encoded ``rows`` (:func:`~lorafuse.evaluation.metrics.encode_dataset`) and accuracy on
    ``task`` records (:func:`~lorafuse.evaluation.metrics.read_task`), each where given."""
    columns: dict[str, dict] = {}
    for name, ctx in variants(model, adapters, with_base):
        col = {}
        with ctx():
            if rows is not None:
                col["perplexity"] = perplexity(model, rows, batch_size, desc=f"ppl {name}")
            if task is not None:
                r = task_accuracy(model, tokenizer, task, max_new_tokens, batch_size,
                                  desc=f"task {name}", engine=engine)  # fmt: skip
                col["task"] = {"n": r.n, "exact_match": r.exact_match,
                               "contains": r.contains_rate, "samples": r.samples}  # fmt: skip
        columns[name] = col
    return columns


def add_harness_scores(model, tokenizer, columns: dict[str, dict], tasks: list[str], manager,
                       limit: int | None = None, batch_size: int = 8, engine=None) -> None:  # fmt: skip
    """Each column's lm-eval scores (``columns[name]["lm_eval"]``) through one in-process server
    (:mod:`lorafuse.evaluation.harness`; model id = column name, "base" the bare base)."""
    from lorafuse.generation import context_length

    ids = {name: (None if name == "base" else name) for name in columns}
    with harness.served(model, tokenizer, ids, engine) as (url, key):
        for name in ids:
            columns[name]["lm_eval"] = harness.run_tasks(
                url, key, name, tasks, manager, context_length(model), limit, batch_size
            )


def format_table(results: dict) -> str:
    """The metrics of ``results["columns"]`` as a text table, one column per variant."""
    cols = list(results["columns"])
    at = results["columns"]
    rows: list[tuple[str, list[str]]] = []
    first = at[cols[0]]
    if "perplexity" in first:
        rows.append((f"perplexity ({first['perplexity']['tokens']} tokens)",
                     [f"{at[c]['perplexity']['perplexity']:.3f}" for c in cols]))  # fmt: skip
    if "task" in first:
        n = first["task"]["n"]
        rows.append((f"exact match (n={n})", [f"{at[c]['task']['exact_match']:.1%}" for c in cols]))
        rows.append((f"contains (n={n})", [f"{at[c]['task']['contains']:.1%}" for c in cols]))
    if "pairs" in first:
        n = first["pairs"]["n"]
        for key, label, fmt in (("accuracy", f"pairwise accuracy (n={n})", "{:.1%}"),
                                ("margin", "mean reward margin", "{:.4f}")):  # fmt: skip
            rows.append((label, [fmt.format(at[c]["pairs"][key]) for c in cols]))
    for task, metrics in first.get("lm_eval", {}).items():
        for metric in (m for m in metrics if "_stderr" not in m):
            rows.append((f"{task} {metric.removesuffix(',none')}",
                         [f"{at[c]['lm_eval'][task][metric]:.4f}" for c in cols]))  # fmt: skip
    w0 = max(len("metric"), *(len(r[0]) for r in rows))
    widths = [max(len(c), *(len(r[1][i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(["metric".ljust(w0), *(c.rjust(w) for c, w in zip(cols, widths))])]
    lines.append("  ".join(["-" * w0, *("-" * w for w in widths)]))
    lines += [
        "  ".join([label.ljust(w0), *(v.rjust(w) for v, w in zip(vals, widths))])
        for label, vals in rows
    ]
    return "\n".join(lines)

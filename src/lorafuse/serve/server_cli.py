"""`lorafuse serve`: OpenAI-compatible server for a base model plus named LoRA adapters."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lorafuse.cli import CLIError
from lorafuse.serve.loading import add_model_arguments, load_model, spec_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapters="many")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (env LORAFUSE_API_KEY)"
    )
    parser.add_argument(
        "--base-name", default=None, help="model id of the bare base (default: its name)"
    )
    parser.add_argument("--max-body-bytes", type=int, default=1_000_000)
    parser.add_argument("--default-max-tokens", type=int, default=512)
    parser.add_argument("--max-queue", type=int, default=64, help="queued requests before 503")
    parser.add_argument("--log-level", default="warning")


def model_ids(spec, base_name: str | None) -> dict[str, str | None]:
    """Public id -> adapter name (None = base). The base id must not clash with an adapter name."""
    from lorafuse.serve.loading import DEFAULT_GGUF

    base_id = base_name or (
        Path(spec.base).name.removesuffix(".gguf") if spec.base else DEFAULT_GGUF.split(".")[0]
    )
    if base_id in spec.adapters:
        raise CLIError(f"base model id {base_id!r} clashes with an adapter name; pass --base-name")
    return {base_id: None, **{name: name for name in spec.adapters}}


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from lorafuse.serve.server import create_app
    except ImportError as err:
        raise CLIError(
            f"serve needs fastapi and uvicorn: pip install 'lorafuse[serve]' ({err})"
        ) from err
    spec = spec_from_args(args)
    ids = model_ids(spec, args.base_name)
    model, tokenizer = load_model(spec)
    api_key = args.api_key or os.environ.get("LORAFUSE_API_KEY") or None
    app = create_app(model, tokenizer, ids, api_key=api_key, max_body_bytes=args.max_body_bytes,
                     default_max_tokens=args.default_max_tokens, max_queue=args.max_queue)  # fmt: skip
    print(f"serving {', '.join(ids)} on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if api_key else ''}", flush=True)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    app.state.worker.stop()
    return 0

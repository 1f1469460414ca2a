"""`lorafuse serve`: OpenAI-compatible server for a base model plus named LoRA adapters."""

from __future__ import annotations

import argparse
import os

from lorafuse.commands._args import (
    add_decode_argument,
    add_model_arguments,
    dtype_from_args,
    engine_from_args,
    spec_from_args,
)
from lorafuse.errors import LorafuseError
from lorafuse.models.resolve import base_model_id, load_resolved


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapters="many", compute_dtype=True)
    add_decode_argument(parser)
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
    parser.add_argument(
        "--max-batch", type=int, default=8,
        help="most sequences decoded together (continuous batching; 1 = one at a time)",
    )  # fmt: skip
    parser.add_argument(
        "--max-n", type=int, default=8, help="most choices ('n') one request may ask for"
    )
    parser.add_argument(
        "--image-dir", default=None,
        help="vision-language models: image_url parts may name local files under this directory "
        "(data: URLs always work; remote URLs never: nothing is fetched)",
    )  # fmt: skip
    parser.add_argument("--log-level", default="warning")


def model_ids(spec, base_name: str | None) -> dict[str, str | None]:
    """Public id -> adapter name (None = base). The base id must not clash with an adapter name."""
    base_id = base_name or base_model_id(spec)
    if base_id in spec.adapters:
        raise LorafuseError(
            f"base model id {base_id!r} clashes with an adapter name; pass --base-name"
        )
    return {base_id: None, **{name: name for name in spec.adapters}}


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from lorafuse.serve.server import create_app
    except ImportError as err:
        raise LorafuseError(
            f"serve needs fastapi and uvicorn: pip install 'lorafuse[serve]' ({err})"
        ) from err
    if args.max_batch < 1:
        raise LorafuseError(f"--max-batch must be at least 1 (got {args.max_batch})")
    spec = spec_from_args(args)
    ids = model_ids(spec, args.base_name)
    model, tokenizer, processor = load_resolved(spec, dtype=dtype_from_args(args))
    api_key = args.api_key or os.environ.get("LORAFUSE_API_KEY") or None
    engine = None if processor is not None else engine_from_args(model, args)
    app = create_app(model, tokenizer, ids, api_key=api_key, max_body_bytes=args.max_body_bytes,
                     default_max_tokens=args.default_max_tokens, max_queue=args.max_queue,
                     max_n=args.max_n, processor=processor,
                     image_dir=args.image_dir, max_batch=args.max_batch,
                     engine=engine)  # fmt: skip
    print(f"serving {', '.join(ids)} on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if api_key else ''}", flush=True)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    app.state.worker.stop()
    return 0

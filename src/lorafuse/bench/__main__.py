"""The worker side of :func:`lorafuse.bench.process.spawn`: ``python -m lorafuse.bench --worker
JSON`` runs one LLM bench configuration (:func:`lorafuse.bench.llm.run_worker`)."""

import argparse

from lorafuse.bench.llm import run_worker
from lorafuse.bench.process import worker_entry

parser = argparse.ArgumentParser(prog="lorafuse.bench")
parser.add_argument("--worker", required=True, help="JSON run spec (internal)")
raise SystemExit(worker_entry(parser.parse_args().worker, run_worker))

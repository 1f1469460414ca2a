"""Training-speed benchmark, stock transformers + PEFT vs lorafuse: a thin wrapper over
``lorafuse bench`` (same flags; see ``lorafuse bench --help`` and docs/benchmarks.md).

    python benchmarks/train.py --model llama-4l-1024 --dtype fp32 --batch 4 --seq 512
"""

from __future__ import annotations

import sys

from lorafuse.commands import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))

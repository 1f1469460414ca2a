"""``lorafuse build-ext``: compile the C++ CPU kernels ahead of time (else: on first use).

Builds the variant this CPU loads (``backends.cpu_variant``: the widest it runs, or
``$LORAFUSE_CPU_CAPABILITY``); ``--all`` builds every variant this CPU can run. Prints where each
build lives and how long it took; ``--force`` rebuilds from scratch. Exits
non-zero with a one-line reason when it cannot build (no compiler, no ninja, compile error).
"""

from __future__ import annotations

import argparse
import time

from lorafuse.errors import LorafuseError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--force", action="store_true", help="delete this version's build and compile again"
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="build every CPU variant this machine runs, not only its own",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show the compiler commands and output"
    )


def run(args: argparse.Namespace) -> int:
    from lorafuse import _ext, backends

    variants = backends.cpu_variants() if args.all else (backends.cpu_variant(),)
    for variant in variants:
        _build_one(_ext, variant, args)
    return 0


def _build_one(_ext, variant: str, args: argparse.Namespace) -> None:
    if args.force or not _ext.is_built(variant):
        print(
            f"lorafuse build-ext: compiling {len(_ext.sources())} sources from {_ext.CSRC} "
            f"({variant} variant, flags: {' '.join(_ext.compile_flags(variant))}); this takes a "
            "minute or more",
            flush=True,
        )
    start = time.perf_counter()
    try:
        module, directory, compiled = _ext.build(variant, force=args.force, verbose=args.verbose)
    except _ext.ExtensionUnavailable as err:
        raise LorafuseError(f"cannot build the C++ kernels: {err}") from err
    seconds = time.perf_counter() - start
    if compiled:
        state = f"built in {seconds:.1f} s"
    else:
        state = f"already built, loaded from the cache in {seconds:.2f} s"
    ops = sorted(n.split("_forward")[0] for n in dir(module) if "_forward" in n)
    print(f"lorafuse build-ext: {variant}: {state}")
    print(f"  cache: {directory}")
    print(f"  kernels: {', '.join(ops)}")

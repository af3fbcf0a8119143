"""``attn2ssm convert | distill | eval | generate | bench (generate | quality | train) | data (shards | info) | export | recipes | upgrade``.

One module per command group (``convert``, ``distill``, ``eval``, ``generate``, ``bench``, ``data``,
``export`` (export and upgrade), ``recipes``), each with ``add_parser(subparsers)`` and its ``run`` function(s)
(a group too long for one module keeps subcommands in modules beside it: ``bench_generate``,
``bench_quality``, ``bench_train``, ``data_info``, ``eval_report``);
this module puts their parsers together and runs the command. Every user-facing failure is an
``Attn2SSMError``: printed as one line, no traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import os
import sys

from attn2ssm.cli import bench, convert, data, distill, export, generate, recipes
from attn2ssm.cli import eval as evaluate
from attn2ssm.errors import Attn2SSMError, Interrupted

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# in the order `attn2ssm --help` lists them
GROUPS = (
    convert,
    distill,
    evaluate,
    generate,
    bench,
    data,
    export,
    recipes,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attn2ssm",
        description="Distil a Hugging Face Transformer into a linear-attention / SSM / hybrid student.",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what was typed (benchmarks record it)
    try:
        return args.func(args)
    except Attn2SSMError as exc:
        if args.debug:
            raise
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # always one line
        if isinstance(exc, Interrupted):  # a run stopped on a signal, its work saved: not an error
            print(message, file=sys.stderr)
            return exc.exit_code
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

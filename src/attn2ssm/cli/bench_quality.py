"""``attn2ssm bench quality``: the quality scoreboard's flags checked into its grid settings (one-line
errors, before any model loads), then the grid in ``attn2ssm.bench.quality``."""

from __future__ import annotations

import shlex
from pathlib import Path

from attn2ssm.bench.quality import (
    DEFAULT_TEACHER,
    EvalSettings,
    GridSettings,
    format_markdown,
    format_plan,
    parse_family_table,
    plan_cells,
    run_grid,
    select_cells,
)
from attn2ssm.cli.parsing import int_list
from attn2ssm.errors import ConfigError
from attn2ssm.teachers import resolve_teacher


def add_parser(bsub) -> None:
    bq = bsub.add_parser(
        "quality",
        help="quality scoreboard: student families × token budgets distilled from one teacher, "
        "each cell scored against it (perplexity ratio, top-1 and greedy agreement, passkey, and the evaluation suite)",
    )
    _add_grid_flags(bq)
    _add_scoring_flags(bq)
    bq.add_argument(
        "--plan",
        action="store_true",
        help="list the cells, their status (done / trained / partial / todo) and commands; run nothing",
    )
    bq.add_argument("--no-progress", action="store_true")
    bq.set_defaults(func=run_quality)


def _add_grid_flags(bq) -> None:
    """Which cells: the teacher, families, budgets, recipe overrides, and where the grid is written."""
    bq.add_argument(
        "--teacher", default=None, help="teacher spec for every cell (default: the built-in smollm2-135m)"
    )
    bq.add_argument(
        "--families", default=None, help="comma-separated families (default: every family in the table)"
    )
    bq.add_argument(
        "--budgets",
        default=None,
        help="training tokens per cell, comma-separated (default 65536,262144,1048576; 2^16 works too)",
    )
    bq.add_argument(
        "--only",
        default=None,
        metavar="FAMILY@TOKENS,...",
        help="run just these cells (instead of --families × --budgets)",
    )
    bq.add_argument(
        "--family",
        action="append",
        metavar="NAME=RECIPE",
        help="add a family (or remap one) to a recipe name or YAML path (repeatable)",
    )
    bq.add_argument(
        "--set",
        action="append",
        metavar="[FAMILY:]KEY=VALUE",
        help="recipe override for every cell, or with FAMILY: for that family's cells "
        "(variants of one recipe: --family w32=lolcats --set w32:student.mixer_options.window=32); applied before the budget's stage tokens",
    )
    bq.add_argument(
        "--out-dir",
        default="runs/quality",
        help="grid directory: one run directory per cell, the teacher's cached references",
    )
    bq.add_argument(
        "--json",
        default="benchmarks/results/quality.json",
        help="grid JSON (the PNG and markdown table go beside it)",
    )


def _add_scoring_flags(bq) -> None:
    """How every cell is scored: corpora, windows, agreement, passkey and the evaluation suite."""
    bq.add_argument(
        "--corpora",
        default="sotu,moby-dick",
        help="held-out corpora to score (the first also gives the agreement prompts)",
    )
    bq.add_argument("--windows", default="1024,2048", help="perplexity windows (stride = window / 2)")
    bq.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens scored per corpus")
    bq.add_argument(
        "--agreement-prompts",
        type=int,
        default=16,
        help="held-out prompts for greedy 32-token continuation agreement (0 = skip)",
    )
    bq.add_argument(
        "--passkey-lengths", default="1024,2048", help="passkey context lengths in tokens ('none' = skip)"
    )
    bq.add_argument("--passkey-depths", default="0,0.5,1")
    bq.add_argument("--passkey-trials", type=int, default=2, help="keys per length and depth")
    bq.add_argument(
        "--suite",
        default="quick",
        help="also score every cell on the evaluation suite (docs/evaluation.md): quick (default), standard "
        "(400 items a task, 20 needle trials; hours of CPU a cell), or none; cached cells are scored on it without retraining",
    )


def run_quality(args) -> int:
    table = parse_family_table(args.family)
    cells = select_cells(table, args.families, args.budgets, args.only)
    settings = GridSettings(
        teacher=args.teacher or DEFAULT_TEACHER,
        families=table,
        cells=cells,
        sets=list(args.set or []),
        grid_dir=Path(args.out_dir),
        json_path=Path(args.json),
        eval=_quality_eval(args),
    )
    # a missing recipe, an unscalable stage, a budget too small: before anything loads
    planned = plan_cells(settings)
    if args.plan:
        print(format_plan(planned, settings.eval))
        return 0
    resolve_teacher(settings.teacher)  # a missing path fails before any cell starts
    command = shlex.join(["attn2ssm", *args.argv])
    result = run_grid(settings, command=command, progress=not args.no_progress, cells=planned)
    print()
    print(format_markdown(result))
    out = Path(args.json)
    print(
        f"\nwrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.md')} ({len(result['cells'])} cells of {settings.grid_dir})"
    )
    return 0


def _quality_eval(args) -> EvalSettings:
    """How every cell is scored: --corpora, --windows, --eval-tokens, agreement and passkey flags."""
    corpora = tuple(c.strip() for c in args.corpora.split(",") if c.strip())
    if not corpora:
        raise ConfigError(
            f"--corpora {args.corpora!r} names no corpus", "write e.g. --corpora sotu,moby-dick"
        )
    windows = int_list("--windows", args.windows)
    if min(windows) < 2:
        raise ConfigError(
            f"--windows {args.windows!r} has a window shorter than 2 tokens", "write e.g. --windows 1024,2048"
        )
    if args.eval_tokens < max(windows) // 2 + 2:
        raise ConfigError(
            f"--eval-tokens {args.eval_tokens} is too few for windows up to {max(windows)}",
            f"use at least {max(windows)}, e.g. --eval-tokens 16384",
        )
    if args.agreement_prompts < 0 or args.passkey_trials < 1:
        raise ConfigError(
            "--agreement-prompts must be >= 0 and --passkey-trials >= 1",
            "e.g. --agreement-prompts 16 --passkey-trials 2",
        )
    try:
        depths = tuple(float(v) for v in args.passkey_depths.split(",") if v.strip())
    except ValueError:
        depths = (-1.0,)
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ConfigError(
            f"--passkey-depths {args.passkey_depths!r} is not a list of fractions in 0..1",
            "write e.g. --passkey-depths 0,0.5,1",
        )
    lengths = (
        ()
        if args.passkey_lengths in ("", "0", "none")
        else int_list("--passkey-lengths", args.passkey_lengths)
    )
    return EvalSettings(
        corpora=corpora,
        windows=windows,
        eval_tokens=args.eval_tokens,
        agreement_prompts=args.agreement_prompts,
        passkey_lengths=lengths,
        passkey_depths=depths,
        passkey_trials=args.passkey_trials,
        suite=_quality_suite(args.suite),
    )


def _quality_suite(name: str):
    """--suite quick | standard | none: the evaluation suite every cell is also scored on."""
    from attn2ssm.eval.suite_settings import suite_settings

    if name == "none":
        return None
    if name not in ("quick", "standard"):
        raise ConfigError(
            f"--suite {name!r} is not a suite", "use --suite quick (the default), standard, or none"
        )
    return suite_settings("standard", quick=name == "quick")

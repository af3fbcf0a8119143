"""``attn2ssm eval --report`` (the teacher-vs-student report) and ``eval --suite standard [--quick]``
(the evaluation suite): their flags checked, then the runs in ``attn2ssm.eval``; and for every
``eval`` mode, its outputs checked up front (``check_outputs``) and the perplexity table written."""

from __future__ import annotations

import json
from pathlib import Path

from attn2ssm.cli.parsing import int_list
from attn2ssm.devices import resolve_device
from attn2ssm.errors import ConfigError
from attn2ssm.eval.compare import ReportSettings, compare_report, format_markdown
from attn2ssm.eval.harness import resolve_tasks
from attn2ssm.eval.output import KeptOutput
from attn2ssm.eval.suite_settings import check_lengths


def run_report(args) -> int:
    """``eval --report``: the teacher-vs-student report (markdown printed, report.md/json/png written)."""
    lengths = int_list("--needle-lengths", args.needle_lengths) if args.needle_lengths else ()
    depths = _floats("--needle-depths", args.needle_depths)
    if any(not 0 <= d <= 1 for d in depths):
        raise ConfigError(
            f"--needle-depths {args.needle_depths!r} has depths outside 0..1",
            "write fractions, e.g. --needle-depths 0,0.5,1",
        )
    tasks = tuple(resolve_tasks(args.tasks)) if args.tasks else ()
    settings = ReportSettings(
        corpora=tuple(c.strip() for c in args.corpus.split(",") if c.strip()),
        window=args.window,
        max_tokens=args.max_tokens,
        tasks=tasks,
        limit=args.limit,
        needle_lengths=lengths,
        needle_depths=depths,
        agreement_prompts=args.agreement_prompts,
        fidelity_blocks=args.blocks,
        curve_windows=(
            check_lengths("--curve-windows", "windows", int_list("--curve-windows", args.curve_windows), 16)
            if args.curve_windows
            else ()
        ),
        # else the report's default
        **({} if args.needle_trials is None else {"needle_trials": args.needle_trials}),
    )
    out = Path(args.out_dir) if args.out_dir else Path(args.model) / "eval" / "report"
    report = compare_report(args.model, args.against, out, settings, device=resolve_device(args.device))
    print(format_markdown(report))
    print(f"wrote {out / 'report.md'}, report.json and report.png")
    return 0


def run_suite_command(args) -> int:
    """``eval --suite standard [--quick] [--targets FILE]``: the suite's table and its targets checked
    (printed; suite.json / .md / .png written)."""
    from attn2ssm.eval.suite import run_suite  # heavy: torch (when run)
    from attn2ssm.eval.suite_settings import select_needles, select_perplexity, select_rows, suite_settings
    from attn2ssm.eval.tables import format_suite_markdown
    from attn2ssm.eval.targets import load_targets
    from attn2ssm.teachers import resolve_teacher

    settings = select_needles(
        select_rows(suite_settings(args.suite, quick=args.quick), args.rows),
        lengths=int_list("--needle-lengths", args.needle_lengths) if args.needle_lengths else None,
        trials=args.needle_trials,
    )
    # an unknown suite, row group, needle or perplexity setting: one line, before anything loads
    settings = select_perplexity(
        settings,
        corpora=tuple(args.corpora.split(",")) if args.corpora is not None else None,
        windows=int_list("--windows", args.windows) if args.windows else None,
        curve=int_list("--curve-windows", args.curve_windows) if args.curve_windows else None,
    )
    targets = load_targets(args.targets) if args.targets else None  # a malformed file: one line, now
    resolve_teacher(args.against or "smollm2-135m")  # a missing teacher path fails before the student loads
    out = KeptOutput(_suite_dir(args))  # scores that cannot be written there go to a temporary folder
    report = run_suite(
        args.model,
        args.against,
        out,
        settings,
        cache_dir=args.suite_cache,
        branch=args.branch or "both",
        device=resolve_device(args.device),
        targets=targets,
    )
    print(format_suite_markdown(report))
    print(f"wrote {out.path / 'suite.md'}, suite.json and suite.png")
    return 0


def _suite_dir(args) -> Path:
    """Where ``--suite`` writes: --out, else MODEL/eval/suite (suite-<branch> for one branch)."""
    branch = args.branch or "both"
    if args.out_dir:
        return Path(args.out_dir)
    return Path(args.model) / "eval" / ("suite" if branch == "both" else f"suite-{branch}")


def check_outputs(args) -> None:
    """Refuse, before any model loads, an output of this ``eval`` that cannot be written (--json, and
    the folder --suite, --report or --attention writes in: --out, else under MODEL/eval)."""
    from attn2ssm.paths import check_writable

    if args.json:
        check_writable(Path(args.json), flag="--json")
    folder, flag = None, "--out"
    if args.suite:
        folder = _suite_dir(args)
    elif args.report or args.attention:
        folder = Path(args.out_dir) if args.out_dir else Path(args.model) / "eval"
    elif args.tasks and not args.json and args.tasks.strip() != "list" and Path(args.model).is_dir():
        folder, flag = Path(args.model) / "eval" / "lm_eval.json", "--json"  # its default
    if folder is not None:
        check_writable(folder, flag=flag, folder=flag == "--out")


def print_perplexity(args, rows: list[tuple[str, str, dict]]) -> None:
    """The (role, name, result) rows of ``eval``'s perplexity as a table, and written to --json (to
    a temporary folder, said on stderr, when --json cannot be written after all)."""
    from attn2ssm.paths import atomic_write_text

    branch = f", {args.branch} branch" if args.branch not in (None, "both") else ""
    print(
        f"held-out perplexity on {args.corpus} ({rows[0][2]['tokens']} tokens, window {args.window}{branch})"
    )
    for role, name, r in rows:
        print(f"  {role:<8} {r['ppl']:>10.2f}   {name}")
    if args.json:
        body = {
            role: {"path": name, **r, **({"branch": args.branch} if role == "model" and args.branch else {})}
            for role, name, r in rows
        }
        KeptOutput(args.json, file=True).write(
            lambda path: atomic_write_text(path, json.dumps(body, indent=1))
        )


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r} is not a comma-separated list of numbers", f"write e.g. {flag} 0,0.5,1"
        ) from None

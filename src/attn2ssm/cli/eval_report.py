"""``attn2ssm eval --report`` (the teacher-vs-student report) and ``eval --suite standard [--quick]``
(the evaluation suite): their flags checked, then the runs in ``attn2ssm.eval``."""

from __future__ import annotations

from pathlib import Path

from attn2ssm.cli.parsing import int_list
from attn2ssm.devices import resolve_device
from attn2ssm.errors import ConfigError
from attn2ssm.eval.compare import ReportSettings, compare_report, format_markdown
from attn2ssm.eval.harness import resolve_tasks


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
        **(
            {} if args.needle_trials is None else {"needle_trials": args.needle_trials}
        ),  # else the report's default
    )
    out = Path(args.out_dir) if args.out_dir else Path(args.model) / "eval" / "report"
    report = compare_report(args.model, args.against, out, settings, device=resolve_device(args.device))
    print(format_markdown(report))
    print(f"wrote {out / 'report.md'}, report.json and report.png")
    return 0


def run_suite_command(args) -> int:
    """``eval --suite standard [--quick]``: the suite's table (printed; suite.json / .md / .png written)."""
    from attn2ssm.eval.suite import (
        format_suite_markdown,
        run_suite,
        select_needles,
        select_perplexity,
        select_rows,
        suite_settings,
    )  # heavy: torch (when run)
    from attn2ssm.teachers import resolve_teacher

    settings = select_needles(
        select_rows(suite_settings(args.suite, quick=args.quick), args.rows),
        lengths=int_list("--needle-lengths", args.needle_lengths) if args.needle_lengths else None,
        trials=args.needle_trials,
    )
    settings = select_perplexity(
        settings,
        corpora=tuple(args.corpora.split(",")) if args.corpora is not None else None,
        windows=int_list("--windows", args.windows) if args.windows else None,
    )  # an unknown suite, row group, needle or perplexity setting: one line, before anything loads
    resolve_teacher(args.against or "smollm2-135m")  # a missing teacher path fails before the student loads
    branch = args.branch or "both"
    out = (
        Path(args.out_dir)
        if args.out_dir
        else Path(args.model) / "eval" / ("suite" if branch == "both" else f"suite-{branch}")
    )
    report = run_suite(
        args.model,
        args.against,
        out,
        settings,
        cache_dir=args.suite_cache,
        branch=branch,
        device=resolve_device(args.device),
    )
    print(format_suite_markdown(report))
    print(f"wrote {out / 'suite.md'}, suite.json and suite.png")
    return 0


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r} is not a comma-separated list of numbers", f"write e.g. {flag} 0,0.5,1"
        ) from None

"""``attn2ssm eval``: held-out perplexity, attention fidelity (--attention), lm-eval tasks (--tasks),
the teacher-vs-student report (--report), or the evaluation suite (--suite standard [--quick])."""

from __future__ import annotations

import json
from pathlib import Path

from attn2ssm.cli.parsing import int_list
from attn2ssm.errors import ConfigError, DataError
from attn2ssm.eval.compare import ReportSettings, compare_report, format_markdown
from attn2ssm.eval.harness import add_eval_task_args, cmd_eval_tasks, resolve_tasks


def add_parser(subparsers) -> None:
    e = subparsers.add_parser("eval", help="held-out perplexity of a student or teacher")
    e.add_argument("model", help="student directory or teacher spec")
    e.add_argument("--against", default=None, help="teacher to evaluate beside it")
    e.add_argument("--corpus", default="sotu")
    e.add_argument("--window", type=int, default=256)
    e.add_argument("--stride", type=int, default=None)
    e.add_argument("--max-tokens", type=int, default=20000)
    e.add_argument(
        "--quantize",
        default=None,
        help="int8: score MODEL with int8 weight-only linears (as generate --quantize int8; --dtype sets the rest)",
    )
    e.add_argument("--json", default=None, help="also write results to this JSON file")
    e.add_argument(
        "--attention",
        action="store_true",
        help="instead of perplexity: per-layer attention fidelity of a student to its teacher (KL, entropy, monotonicity) and heat-maps",
    )
    e.add_argument(
        "--text", default=None, help="with --attention: also score this text, and draw the heat-maps from it"
    )
    e.add_argument(
        "--blocks",
        type=int,
        default=4,
        help="with --attention: held-out blocks of --window tokens to score (0 = only --text)",
    )
    e.add_argument(
        "--out-dir",
        "--out",
        dest="out_dir",
        default=None,
        help="with --attention: where attention_fidelity.json and the PNGs go (default MODEL/eval); "
        "with --report: where the report goes (default MODEL/eval/report); with --suite: where suite.{json,md,png} go (default MODEL/eval/suite)",
    )
    e.add_argument(
        "--report",
        action="store_true",
        help="teacher-vs-student report against --against (default: the built-in teacher): perplexity on "
        "each --corpus (comma-separated), generation agreement, passkey retrieval (--needle-lengths), attention fidelity, --tasks",
    )
    e.add_argument(
        "--needle-lengths",
        default=None,
        help="with --report: passkey context lengths in tokens, e.g. 256,512,1024",
    )
    e.add_argument(
        "--needle-depths",
        default="0,0.25,0.5,0.75,1",
        help="with --report: needle depths (fractions of the filler)",
    )
    e.add_argument("--needle-trials", type=int, default=3)
    e.add_argument(
        "--agreement-prompts",
        type=int,
        default=16,
        help="with --report: held-out prompts for generation agreement (0 = skip)",
    )
    e.add_argument(
        "--suite",
        default=None,
        metavar="standard",
        help="the evaluation suite against --against (default: the built-in teacher): perplexity at "
        "windows 1024 and 2048 on five corpora, 0-shot core tasks, MMLU 0- and 5-shot, RULER-form needles at 1k-4k, TriviaQA exact match; "
        "per row teacher, student, recovered, standard errors, n and CPU seconds (docs/evaluation.md)",
    )
    e.add_argument(
        "--quick",
        action="store_true",
        help="with --suite: fewer items, trials and tokens (larger standard errors; the table says them)",
    )
    e.add_argument(
        "--suite-cache",
        default=None,
        help="with --suite: where the teacher's scores are cached (default <attn2ssm cache>/suite)",
    )
    e.add_argument(
        "--branch",
        default=None,
        metavar="both|window|linear",
        help="perplexity or --suite with one branch of a LoLCATs-style student "
        "(linear_attention with a softmax window): window (the sliding-window softmax alone), linear (linear attention without the "
        "window) or both (as trained, the default); --suite then writes MODEL/eval/suite-<branch>",
    )
    add_eval_task_args(e)
    e.set_defaults(func=run)


def run(args) -> int:
    if args.quick and not args.suite:
        raise ConfigError("--quick is a form of the suite", "add --suite standard")
    modes = [
        flag
        for flag, on in (
            ("--tasks", args.tasks),
            ("--attention", args.attention),
            ("--report", args.report),
            ("--suite", args.suite),
        )
        if on
    ]
    if len(modes) > 1 and not (set(modes) == {"--tasks", "--report"}):
        raise ConfigError(
            f"{' and '.join(modes)} are different evaluations",
            "run them one at a time (--report takes --tasks to include lm-eval tasks)",
        )
    if args.branch is not None:
        from attn2ssm.mixers.linear_attention import BRANCHES  # heavy: torch

        if args.branch not in BRANCHES:
            raise ConfigError(
                f"--branch {args.branch!r} is not a branch", f"use one of: {', '.join(BRANCHES)}"
            )
        if args.report or args.tasks or args.attention:
            raise ConfigError(
                "--branch applies to perplexity and --suite",
                "drop --branch, or run eval MODEL --suite standard --branch ...",
            )
    if args.suite:
        return run_suite_command(args)
    if args.report:
        return run_report(args)
    if args.tasks:
        return cmd_eval_tasks(args)

    if args.window < 2:
        raise ConfigError(
            f"--window {args.window} is too short", "use a window of at least 2 tokens, e.g. --window 256"
        )
    if args.stride is not None and not 0 < args.stride <= args.window:
        raise ConfigError(
            f"--stride {args.stride} is outside 1..{args.window} (the window)",
            "use a stride between 1 and --window",
        )
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ConfigError(
            f"--max-tokens {args.max_tokens} leaves nothing to score",
            "use at least 2, e.g. --max-tokens 20000",
        )
    if args.attention:  # fidelity of a student's mixing weights to its teacher's softmax, not perplexity
        from attn2ssm.eval.attention import run_attention_eval  # heavy: torch

        run_attention_eval(
            args.model,
            against=args.against,
            corpus=args.corpus,
            window=args.window,
            max_tokens=args.max_tokens,
            blocks=args.blocks,
            text=args.text,
            out_dir=args.out_dir,
            json_path=args.json,
        )
        return 0
    return _perplexity(args)


def _perplexity(args) -> int:
    """Held-out perplexity of MODEL (and of --against beside it): a table, and --json."""
    from attn2ssm.data import prepare_corpus  # heavy: torch
    from attn2ssm.decode.quantize import apply_weight_format, check_weight_format  # heavy: torch
    from attn2ssm.eval.perplexity import perplexity  # heavy: torch
    from attn2ssm.student.loading import (
        load_model_and_tokenizer,
        position_limit,
    )  # heavy: torch + transformers

    check_weight_format(args.dtype, args.quantize)
    model, tokenizer = load_model_and_tokenizer(args.model)
    if args.branch is not None:
        from attn2ssm.mixers.linear_attention import set_window_branch  # heavy: torch

        set_window_branch(model, args.branch, args.model)
    apply_weight_format(model, args.dtype, args.quantize)  # the forms generate --dtype / --quantize decode in
    teacher = (
        load_model_and_tokenizer(args.against)[0] if args.against else None
    )  # before any scoring: a bad --against fails now
    for name, m in ((args.model, model), (args.against, teacher)):
        limit = position_limit(m.config) if m is not None else None
        if limit is not None and args.window > limit:
            raise ConfigError(
                f"--window {args.window} is longer than {name} reads positions for (at most {limit})",
                f"use --window {limit} or less",
            )
    corpus = prepare_corpus(args.corpus, tokenizer, max_heldout_tokens=args.max_tokens, max_train_tokens=0)
    if corpus.heldout_ids.numel() < 2:
        raise DataError(
            f"corpus {args.corpus!r} has no held-out text to score ({corpus.heldout_ids.numel()} tokens)",
            "use a corpus with several documents or paragraphs (the last ~5% of a single document is held out)",
        )
    rows = [
        (
            "model",
            args.model,
            perplexity(
                model,
                corpus.heldout_ids,
                window=args.window,
                stride=args.stride,
                max_tokens=args.max_tokens,
                progress=True,
            ),
        )
    ]
    if teacher is not None:
        rows.append(
            (
                "teacher",
                args.against,
                perplexity(
                    teacher,
                    corpus.heldout_ids,
                    window=args.window,
                    stride=args.stride,
                    max_tokens=args.max_tokens,
                    progress=True,
                ),
            )
        )
    branch = f", {args.branch} branch" if args.branch not in (None, "both") else ""
    print(
        f"held-out perplexity on {args.corpus} ({rows[0][2]['tokens']} tokens, window {args.window}{branch})"
    )
    for role, name, r in rows:
        print(f"  {role:<8} {r['ppl']:>10.2f}   {name}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    role: {
                        "path": name,
                        **r,
                        **({"branch": args.branch} if role == "model" and args.branch else {}),
                    }
                    for role, name, r in rows
                },
                indent=1,
            )
        )
    return 0


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
        needle_trials=args.needle_trials,
        agreement_prompts=args.agreement_prompts,
        fidelity_blocks=args.blocks,
    )
    out = Path(args.out_dir) if args.out_dir else Path(args.model) / "eval" / "report"
    report = compare_report(args.model, args.against, out, settings)
    print(format_markdown(report))
    print(f"wrote {out / 'report.md'}, report.json and report.png")
    return 0


def run_suite_command(args) -> int:
    """``eval --suite standard [--quick]``: the suite's table (printed; suite.json / .md / .png written)."""
    from attn2ssm.eval.suite import (
        format_suite_markdown,
        run_suite,
        suite_settings,
    )  # heavy: torch (when run)
    from attn2ssm.teachers import resolve_teacher

    settings = suite_settings(
        args.suite, quick=args.quick
    )  # an unknown suite: one line, before anything loads
    resolve_teacher(args.against or "smollm2-135m")  # a missing teacher path fails before the student loads
    branch = args.branch or "both"
    out = (
        Path(args.out_dir)
        if args.out_dir
        else Path(args.model) / "eval" / ("suite" if branch == "both" else f"suite-{branch}")
    )
    report = run_suite(args.model, args.against, out, settings, cache_dir=args.suite_cache, branch=branch)
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

"""``attn2ssm eval``: held-out perplexity, attention fidelity (--attention), lm-eval tasks (--tasks),
the teacher-vs-student report (--report), or the evaluation suite (--suite standard [--quick]); the
last two run from ``cli.eval_report``."""

from __future__ import annotations

from attn2ssm.cli.eval_report import check_outputs, print_perplexity, run_report, run_suite_command
from attn2ssm.devices import resolve_device
from attn2ssm.errors import ConfigError, DataError
from attn2ssm.eval.harness import add_eval_task_args, cmd_eval_tasks


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
    _add_attention_args(e)
    _add_report_args(e)
    _add_suite_args(e)
    add_eval_task_args(e)
    e.set_defaults(func=run)


def _add_attention_args(e) -> None:
    """--attention: a student's attention fidelity to its teacher, and where its files go."""
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


def _add_report_args(e) -> None:
    """--report: the teacher-vs-student report's needles and agreement prompts."""
    e.add_argument(
        "--report",
        action="store_true",
        help="teacher-vs-student report against --against (default: the built-in teacher): perplexity on "
        "each --corpus (comma-separated), generation agreement, passkey retrieval (--needle-lengths), attention fidelity, --tasks",
    )
    e.add_argument(
        "--needle-lengths",
        default=None,
        help="with --report: passkey context lengths in tokens, e.g. 256,512,1024; with --suite: the "
        "needles' lengths instead of the suite's 1024,2048,4096",
    )
    e.add_argument(
        "--needle-depths",
        default="0,0.25,0.5,0.75,1",
        help="with --report: needle depths (fractions of the filler)",
    )
    e.add_argument(
        "--needle-trials",
        type=int,
        default=None,
        help="keys per length and depth with --report (default 3); with --suite: trials per needle form and "
        "length instead of the suite's (20, --quick 5)",
    )
    e.add_argument(
        "--agreement-prompts",
        type=int,
        default=16,
        help="with --report: held-out prompts for generation agreement (0 = skip)",
    )


def _add_suite_args(e) -> None:
    """--suite: the evaluation suite, its quick form and teacher cache; --branch."""
    e.add_argument(
        "--suite",
        default=None,
        metavar="standard",
        help="the evaluation suite against --against (default: the built-in teacher): perplexity at "
        "windows 1024-8192 on five corpora and its length curve, 0-shot core tasks, MMLU 0- and 5-shot, RULER-form needles at 1k-8k, "
        "TriviaQA exact match, the KV cache at 8k against the teacher's; "
        "per row teacher, student, recovered, standard errors, n and CPU seconds (docs/evaluation.md)",
    )
    e.add_argument(
        "--quick",
        action="store_true",
        help="with --suite: fewer items, trials and tokens (larger standard errors; the table says them)",
    )
    e.add_argument(
        "--rows",
        default=None,
        metavar="GROUPS",
        help="with --suite: only these row groups (comma-separated): perplexity, tasks (the 0-shot core tasks), "
        "mmlu, generation, needles; default every row",
    )
    e.add_argument(
        "--corpora",
        default=None,
        help="with --suite: the perplexity rows' held-out corpora instead of the suite's five (comma-separated "
        "corpus specs: built-ins, a local file or folder, ...), e.g. emails,kjv,pydoc",
    )
    e.add_argument(
        "--windows",
        default=None,
        help="with --suite: the perplexity rows' windows in tokens instead of the suite's (1024-8192; --quick "
        "1024,2048), e.g. 1024; without --curve-windows the length curve is drawn over these",
    )
    e.add_argument(
        "--curve-windows",
        default=None,
        help="the length curve's windows (student / teacher perplexity against the window), e.g. 1024,2048,4096: "
        "with --suite instead of its 512-8192 (--quick 512-4096); with --report the curve is scored at these",
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
    e.add_argument("--targets", metavar="FILE", help="with --suite: check the targets of this YAML file")


def run(args) -> int:
    _check_modes(args)
    check_outputs(args)  # a read-only output: one line now, not after the scoring
    if args.suite:
        return run_suite_command(args)
    if args.report:
        return run_report(args)
    if args.tasks:
        return cmd_eval_tasks(args)
    _check_window(args)
    if args.attention:  # fidelity of a student's mixing weights to its teacher's softmax, not perplexity
        from attn2ssm.eval.attention import run_attention_eval  # heavy: torch

        run_attention_eval(
            args.model,
            device=resolve_device(args.device),
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


def _check_modes(args) -> None:
    """One evaluation at a time, and the flags that belong to it (--quick, --rows, ... to --suite)."""
    if args.quick and not args.suite:
        raise ConfigError("--quick is a form of the suite", "add --suite standard")
    for flag, value in (("--rows", args.rows), ("--corpora", args.corpora), ("--windows", args.windows)):
        if value is not None and not args.suite:
            raise ConfigError(f"{flag} chooses rows of the suite", "add --suite standard")
    if args.targets is not None and not args.suite:
        raise ConfigError("--targets checks a run of the suite", "add --suite standard")
    if args.curve_windows is not None and not (args.suite or args.report):
        raise ConfigError(
            "--curve-windows sets the length curve of --suite or --report",
            "add --suite standard, or --report",
        )
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


def _check_window(args) -> None:
    """--window, --stride and --max-tokens of perplexity and --attention."""
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


def _perplexity(args) -> int:
    """Held-out perplexity of MODEL (and of --against beside it): a table, and --json."""
    from attn2ssm.data import prepare_corpus  # heavy: torch
    from attn2ssm.eval.perplexity import perplexity  # heavy: torch

    model, tokenizer, teacher = _perplexity_models(args)
    corpus = prepare_corpus(args.corpus, tokenizer, max_heldout_tokens=args.max_tokens, max_train_tokens=0)
    if corpus.heldout_ids.numel() < 2:
        raise DataError(
            f"corpus {args.corpus!r} has no held-out text to score ({corpus.heldout_ids.numel()} tokens)",
            "use a corpus with several documents or paragraphs (the last ~5% of a single document is held out)",
        )
    rows = [
        (
            role,
            name,
            perplexity(
                m,
                corpus.heldout_ids,
                window=args.window,
                stride=args.stride,
                max_tokens=args.max_tokens,
                progress=True,
            ),
        )
        for role, name, m in (("model", args.model, model), ("teacher", args.against, teacher))
        if m is not None
    ]
    print_perplexity(args, rows)
    return 0


def _perplexity_models(args):
    """MODEL (in its --branch, --dtype and --quantize), its tokenizer and the --against teacher (or None),
    all loaded before any scoring (a bad --against fails now), each checked to read --window positions."""
    from attn2ssm.decode.quantize import apply_weight_format, check_weight_format  # heavy: torch
    from attn2ssm.student.loading import (  # heavy: torch + transformers
        load_model_and_tokenizer,
        position_limit,
    )

    check_weight_format(args.dtype, args.quantize)
    device = resolve_device(args.device)
    model, tokenizer = load_model_and_tokenizer(args.model, device)
    if args.branch is not None:
        from attn2ssm.mixers.linear_attention import set_window_branch  # heavy: torch

        set_window_branch(model, args.branch, args.model)
    apply_weight_format(model, args.dtype, args.quantize)  # the forms generate --dtype / --quantize decode in
    teacher = load_model_and_tokenizer(args.against, device)[0] if args.against else None
    for name, m in ((args.model, model), (args.against, teacher)):
        limit = position_limit(m.config) if m is not None else None
        if limit is not None and args.window > limit:
            raise ConfigError(
                f"--window {args.window} is longer than {name} reads positions for (at most {limit})",
                f"use --window {limit} or less",
            )
    return model, tokenizer, teacher

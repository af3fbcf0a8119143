"""``attn2ssm bench generate | quality | train``: each benchmark's flags checked into its settings
(one-line errors, before any model loads), then the run in ``attn2ssm.bench``."""

from __future__ import annotations

import shlex
import sys
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
from attn2ssm.bench.results import write_result
from attn2ssm.cli.parsing import draft_tokens, int_list
from attn2ssm.errors import CheckpointError, ConfigError
from attn2ssm.export.llamacpp import OUTTYPES, converter_dir, load_runtime
from attn2ssm.ops.kernels import KERNELS
from attn2ssm.teachers import resolve_teacher


def add_parser(subparsers) -> None:
    b = subparsers.add_parser(
        "bench",
        help="benchmarks (generate: decode speed / memory vs context, speculative decoding; quality: the family × budget scoreboard)",
    )
    bsub = b.add_subparsers(dest="bench", required=True)
    _add_generate(bsub)
    _add_quality(bsub)
    _add_train(bsub)


def _add_generate(bsub) -> None:
    bg = bsub.add_parser(
        "generate",
        help="decode tokens/s, prefill time and memory vs context for the teacher and students (PyTorch or llama.cpp); "
        "speculative decoding with the student as target with --spec",
    )
    bg.add_argument("--teacher", default=None, help="teacher spec (default: the built-in smollm2-135m)")
    bg.add_argument(
        "--backend",
        default="torch",
        choices=("torch", "llama.cpp"),
        help="torch: the HF models in PyTorch; llama.cpp: GGUFs of the teacher "
        "and its students (exported with export --format gguf) in llama-cpp-python, on the CPU ('make llama-cpp' installs it)",
    )
    bg.add_argument(
        "--models",
        default=None,
        help="teacher and/or untrained students: linear, mamba, mamba2, hybrid25, gdn (default: all but gdn; llama.cpp: teacher,mamba2,hybrid25,gdn)",
    )
    bg.add_argument(
        "--contexts", default="1024,2048,4096,8192,16384,32768", help="context lengths (prompt tokens)"
    )
    bg.add_argument(
        "--max-context",
        action="append",
        metavar="MODEL=TOKENS",
        help="skip longer contexts for a model (repeatable), e.g. teacher=16384",
    )
    bg.add_argument("--new-tokens", type=int, default=16, help="greedy tokens decoded per point")
    bg.add_argument(
        "--spec",
        action="store_true",
        help="speculative decoding with the student as the target (Mamba in the Llama §4): "
        "speedup over the target's plain greedy decode, acceptance, tokens per target forward (writes benchmarks/results/speculative.json)",
    )
    bg.add_argument(
        "--spec-targets",
        default=None,
        help="with --spec: targets, NAME (an untrained conversion: mamba2, hybrid25, ...) or NAME=DIR "
        "(a trained student), comma-separated (default mamba2,hybrid25)",
    )
    bg.add_argument(
        "--spec-drafters",
        default=None,
        help="with --spec: model-free drafters, ngram or ngram:N (prompt lookup; default ngram; '' for none)",
    )
    bg.add_argument(
        "--draft",
        action="append",
        default=None,
        metavar="DIR",
        help="with --spec: a draft model (student directory or teacher spec "
        "sharing the tokenizer, e.g. a shallow student from recipes/draft_shallow.yaml); repeatable",
    )
    bg.add_argument("--spec-contexts", default="1024,8192")
    bg.add_argument(
        "--spec-k",
        default="2,4,6,auto",
        help="with --spec: draft tokens per target forward (auto: chosen each round)",
    )
    bg.add_argument("--spec-new-tokens", type=int, default=64)
    bg.add_argument("--corpus", default="sotu", help="text the prompts are cut from")
    bg.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    bg.add_argument("--threads", type=int, default=None)
    bg.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="decode rounds per point (models take turns; rates from the median token time)",
    )
    bg.add_argument(
        "--no-cpu-layout",
        action="store_true",
        help="keep HF's weight layout on CPU (default: cpu_decode_layout for every model, teacher included)",
    )
    bg.add_argument(
        "--compile",
        action="store_true",
        help="CPU: pure students decode through a torch.compile'd step (compiled before timing; the teacher runs HF's forward)",
    )
    bg.add_argument(
        "--dtype",
        default="float32",
        help="torch: comma-separated weight dtypes, float32 and/or bfloat16 (rows NAME@bfloat16)",
    )
    bg.add_argument(
        "--quantize",
        default="none",
        help="torch: comma-separated none and/or int8 (int8 weight-only linears; rows NAME@int8, NAME@bfloat16+int8)",
    )
    bg.add_argument(
        "--plain-check",
        default="shortest",
        help="also time each model's plain generate (a user's call) beside the rounds at the "
        "shortest context (default), all contexts, or none; JSON: plain_generate_tokens_per_second, benchmark_vs_plain_generate",
    )
    bg.add_argument(
        "--quant", default=None, help="llama.cpp: GGUF types, teacher and students alike (default q8_0,f16)"
    )
    bg.add_argument(
        "--gguf-dir",
        default=None,
        help="llama.cpp: keep the GGUF files here and reuse those already there (default: a temporary folder)",
    )
    bg.add_argument(
        "--no-flash-attn",
        action="store_true",
        help="llama.cpp: without flash attention (default on, as llama.cpp's CLI picks on CPU)",
    )
    bg.add_argument(
        "--out",
        default=None,
        help="JSON (the PNG goes beside it); default benchmarks/results/generate_speed.json, "
        "speculative.json with --spec; e.g. benchmarks/results/generate_speed_llama_cpp.json for llama.cpp",
    )
    bg.add_argument("--no-progress", action="store_true")
    bg.set_defaults(func=run_generate)


def _add_quality(bsub) -> None:
    bq = bsub.add_parser(
        "quality",
        help="quality scoreboard: student families × token budgets distilled from one teacher, "
        "each cell scored against it (perplexity ratio, top-1 and greedy agreement, passkey, and the evaluation suite)",
    )
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
    bq.add_argument(
        "--plan",
        action="store_true",
        help="list the cells, their status (done / trained / partial / todo) and commands; run nothing",
    )
    bq.add_argument("--no-progress", action="store_true")
    bq.set_defaults(func=run_quality)


def _add_train(bsub) -> None:
    bt = bsub.add_parser(
        "train",
        help="training tokens/s of each stage kind (the trainer's own step) against the teacher's forward "
        "(the bound) and the teacher's own forward + backward, fp32 and bf16",
    )
    bt.add_argument("--teacher", default=None, help="teacher spec (default: the built-in smollm2-135m)")
    bt.add_argument(
        "--cases",
        default="attention_transfer,hidden_alignment,kd_lora,kd_ce_mixers",
        help="stage cases (see attn2ssm.bench.train.CASES)",
    )
    bt.add_argument(
        "--lengths", default="1024", help="block lengths in tokens, comma-separated (e.g. 1024,4096,16384)"
    )
    bt.add_argument(
        "--step-tokens",
        type=int,
        default=2048,
        help="tokens per optimizer step (batch = step-tokens // length, at least 1)",
    )
    bt.add_argument(
        "--precisions",
        default="no,auto",
        help="mixed precision settings: no (fp32), auto (bf16 where it is fast), bf16 (autocast), fp16",
    )
    bt.add_argument(
        "--kernels",
        default="auto",
        help="comma-separated kernel choices, each point run under each: auto, torch, fla (fla: CUDA)",
    )
    bt.add_argument("--steps", type=int, default=3, help="timed steps per point, after one warm-up")
    bt.add_argument("--threads", type=int, default=None)
    bt.add_argument("--corpus", default="sotu", help="text the blocks are cut from")
    bt.add_argument(
        "--no-profile", action="store_true", help="skip the profiled step (top operators by self time)"
    )
    bt.add_argument("--out", default="benchmarks/results/train_speed.json")
    bt.add_argument("--no-progress", action="store_true")
    bt.set_defaults(func=run_train)


# --------------------------------------------------------------------------------------------- generate
def run_generate(args) -> int:
    from attn2ssm.bench.generate import (  # heavy: torch + transformers
        LLAMA_CPP_STUDENTS,
        STUDENTS,
        BenchSettings,
        format_generate_bench,
        format_spec_bench,
        plot_generate_bench,
        plot_spec_bench,
        run_generate_bench,
    )

    if args.models is None:
        args.models = (
            "teacher," + ",".join(LLAMA_CPP_STUDENTS)
            if args.backend == "llama.cpp"
            else "teacher,linear,mamba,mamba2,hybrid25"
        )
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = [m for m in models if m != "teacher" and m not in STUDENTS]
    if unknown or not models:
        raise ConfigError(
            f"--models {args.models!r} names unknown models {unknown}",
            f"choose from teacher, {', '.join(STUDENTS)}",
        )
    quants = _llama_cpp_quants(args, models, LLAMA_CPP_STUDENTS)
    spec_targets, spec_drafters = _spec_models(args, STUDENTS, BenchSettings)
    limits = {}
    for item in args.max_context or []:
        name, sep, value = item.partition("=")
        if not sep or name not in models or not value.isdigit():
            raise ConfigError(
                f"--max-context {item!r} is not MODEL=TOKENS for a benchmarked model",
                "write e.g. --max-context teacher=16384",
            )
        limits[name] = int(value)
    if args.new_tokens < 3 or args.spec_new_tokens < 1:
        raise ConfigError(
            "--new-tokens must be at least 3 (one prefill token, two to time decode)",
            "use e.g. --new-tokens 16",
        )
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds} must be at least 1", "use e.g. --rounds 3")
    settings = BenchSettings(
        teacher=args.teacher,
        contexts=int_list("--contexts", args.contexts),
        models=models,
        new_tokens=args.new_tokens,
        max_context=limits,
        spec=args.spec,
        spec_targets=spec_targets,
        spec_drafters=spec_drafters,
        draft=tuple(args.draft or ()) or None,
        spec_contexts=int_list("--spec-contexts", args.spec_contexts),
        spec_ks=tuple(draft_tokens("--spec-k", v) for v in args.spec_k.split(",")),
        spec_new_tokens=args.spec_new_tokens,
        corpus=args.corpus,
        device=args.device,
        threads=args.threads,
        rounds=args.rounds,
        cpu_layout=not args.no_cpu_layout,
        compile_students=args.compile,
        backend=args.backend,
        quants=quants or BenchSettings.quants,
        flash_attn=not args.no_flash_attn,
        gguf_dir=args.gguf_dir,
    )
    if args.compile and args.no_cpu_layout:
        raise ConfigError("--compile needs the CPU decode layout", "drop --no-cpu-layout (or --compile)")
    settings.formats = _weight_formats(args)
    if args.plain_check not in ("shortest", "all", "none"):
        raise ConfigError(f"--plain-check {args.plain_check!r}", "use shortest, all or none")
    settings.plain_check = args.plain_check
    result = run_generate_bench(settings, progress=not args.no_progress)
    result["command"] = (
        shlex.join(["attn2ssm", *sys.argv[1:]])
        if sys.argv[0].endswith(("attn2ssm", "__main__.py"))
        else "attn2ssm bench generate"
    )
    if args.spec:
        write_result(
            result, args.out or "benchmarks/results/speculative.json", plot_spec_bench, format_spec_bench
        )
    else:
        write_result(
            result,
            args.out or "benchmarks/results/generate_speed.json",
            plot_generate_bench,
            format_generate_bench,
        )
    return 0


def _llama_cpp_quants(args, models: tuple[str, ...], llama_cpp_students: tuple[str, ...]) -> tuple[str, ...]:
    """The llama.cpp backend's flags checked (before anything loads); returns the GGUF types."""
    if args.backend != "llama.cpp":
        if args.quant is not None or args.gguf_dir is not None or args.no_flash_attn:
            raise ConfigError(
                "--quant, --gguf-dir and --no-flash-attn are for --backend llama.cpp",
                "add --backend llama.cpp, or drop them",
            )
        return ()
    other = [m for m in models if m != "teacher" and m not in llama_cpp_students]
    if other:
        raise ConfigError(
            f"--backend llama.cpp cannot run {other}: only Mamba-2 and pure gated_delta students export to GGUF",
            f"choose from teacher, {', '.join(llama_cpp_students)}",
        )
    for flag, value in (
        ("--spec", args.spec),
        ("--draft", args.draft),
        ("--compile", args.compile),
        ("--device", args.device not in (None, "cpu")),
    ):
        if value:
            raise ConfigError(
                f"{flag} is for the torch backend",
                f"drop {flag} with --backend llama.cpp (it decodes on the CPU)",
            )
    quants = tuple(q.strip() for q in (args.quant or "q8_0,f16").split(",") if q.strip())
    bad = [q for q in quants if q not in OUTTYPES]
    if bad or not quants:
        raise ConfigError(
            f"--quant {args.quant!r} names GGUF types llama.cpp has not here: {bad}",
            f"choose from {', '.join(OUTTYPES)}, e.g. --quant q8_0,f16",
        )
    converter_dir()  # missing converter or runtime: one line naming make llama-cpp
    load_runtime()
    return quants


def _spec_models(args, students: dict, defaults) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--spec's targets (NAME or NAME=DIR) and drafters checked before anything loads."""
    if not args.spec:
        if args.draft or args.spec_targets or args.spec_drafters:
            raise ConfigError(
                "--draft, --spec-targets and --spec-drafters are for the speculative benchmark", "add --spec"
            )
        return defaults.spec_targets, defaults.spec_drafters
    targets = tuple(t.strip() for t in (args.spec_targets or "mamba2,hybrid25").split(",") if t.strip())
    for item in targets:
        name, sep, path = item.partition("=")
        if sep and not (Path(path) / "config.json").exists():
            raise CheckpointError(
                f"--spec-targets {item}: {path} has no config.json",
                "point NAME=DIR at a student directory (e.g. runs/quality/hybrid25-65536/student)",
            )
        if not sep and name not in students:
            raise ConfigError(
                f"--spec-targets names an unknown student {name!r}",
                f"use NAME=DIR for a trained student, or one of {', '.join(students)}",
            )
    drafters = tuple(
        d.strip()
        for d in (args.spec_drafters if args.spec_drafters is not None else "ngram").split(",")
        if d.strip()
    )
    bad = [
        d for d in drafters if d.partition(":")[0] != "ngram" or not (d.partition(":")[2] or "3").isdigit()
    ]
    if bad:
        raise ConfigError(
            f"--spec-drafters {bad}",
            "use ngram or ngram:N (prompt lookup of the last N..1 tokens); model drafts go in --draft DIR",
        )
    for path in args.draft or ():
        if not (Path(path) / "config.json").exists():
            raise CheckpointError(
                f"--draft {path} has no config.json",
                "point it at a student directory (e.g. runs/draft_shallow/student)",
            )
    if not drafters and not args.draft:
        raise ConfigError("--spec with no drafter", "keep --spec-drafters ngram or add --draft DIR")
    return targets, drafters


def _weight_formats(args) -> tuple[str, ...]:
    """``bench generate --dtype D1,D2 --quantize none,int8``: every dtype x quantize pair, checked
    (one-line errors), named as the benchmark rows name them (float32, bfloat16, int8, bfloat16+int8)."""
    from attn2ssm.decode.quantize import check_weight_format, format_name  # heavy: torch

    dtypes = [d.strip() for d in (args.dtype or "float32").split(",") if d.strip()] or ["float32"]
    quants = [q.strip() for q in (args.quantize or "none").split(",") if q.strip()] or ["none"]
    if args.backend == "llama.cpp" and (dtypes != ["float32"] or quants != ["none"]):
        raise ConfigError(
            "--dtype and --quantize are for the torch backend",
            "use --quant (GGUF types) with --backend llama.cpp",
        )
    formats = []
    for d in dtypes:
        for q in quants:
            check_weight_format(d, q)
            formats.append(format_name(d, q))
    return tuple(dict.fromkeys(formats))


# --------------------------------------------------------------------------------------------- quality
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
    planned = plan_cells(
        settings
    )  # a missing recipe, an unscalable stage, a budget too small: before anything loads
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
    from attn2ssm.eval.suite import suite_settings

    if name == "none":
        return None
    if name not in ("quick", "standard"):
        raise ConfigError(
            f"--suite {name!r} is not a suite", "use --suite quick (the default), standard, or none"
        )
    return suite_settings("standard", quick=name == "quick")


# --------------------------------------------------------------------------------------------- train
def run_train(args) -> int:
    from attn2ssm.bench.train import (
        CASES,
        TrainBenchSettings,
        format_train_bench,
        plot_train_bench,
        run_train_bench,
    )  # heavy: torch
    from attn2ssm.precision import PRECISIONS  # heavy: torch

    cases = tuple(c.strip() for c in args.cases.split(",") if c.strip())
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise ConfigError(
            f"--cases {args.cases!r} names unknown stage cases {unknown}", f"choose from {', '.join(CASES)}"
        )
    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    if not precisions or any(p not in PRECISIONS for p in precisions):
        raise ConfigError(
            f"--precisions {args.precisions!r} is not a list of {' / '.join(PRECISIONS)}",
            "write e.g. --precisions no,auto",
        )
    kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    if not kernels or any(k not in KERNELS for k in kernels):
        raise ConfigError(
            f"--kernels {args.kernels!r} is not a list of {' / '.join(KERNELS)}",
            "write e.g. --kernels torch,fla",
        )
    if args.steps < 1 or args.step_tokens < 1:
        raise ConfigError(
            "--steps and --step-tokens must be positive", "use e.g. --steps 3 --step-tokens 2048"
        )
    settings = TrainBenchSettings(
        teacher=args.teacher,
        cases=cases,
        lengths=int_list("--lengths", args.lengths),
        step_tokens=args.step_tokens,
        precisions=precisions,
        kernels=kernels,
        steps=args.steps,
        threads=args.threads,
        profile=not args.no_profile,
        corpus=args.corpus,
    )
    result = run_train_bench(settings, progress=not args.no_progress)
    result["command"] = shlex.join(["attn2ssm", *args.argv])
    write_result(result, args.out, plot_train_bench, format_train_bench)
    return 0

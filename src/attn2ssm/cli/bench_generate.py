"""``attn2ssm bench generate``: decode speed and memory vs context (``--backend torch | llama.cpp``),
or speculative decoding with the student as target (``--spec``); the flags checked into its
settings (one-line errors, before any model loads, ``cli.bench_generate_flags``), then the run in
``attn2ssm.bench.generate``."""

from __future__ import annotations

import shlex
import sys

from attn2ssm.bench.results import write_result
from attn2ssm.cli.bench_generate_flags import (
    bench_models,
    context_limits,
    llama_cpp_quants,
    spec_models,
    weight_formats,
)
from attn2ssm.cli.parsing import draft_tokens, int_list
from attn2ssm.errors import ConfigError


def add_parser(bsub) -> None:
    bg = bsub.add_parser(
        "generate",
        help="decode tokens/s, prefill time and memory vs context for the teacher and students (PyTorch or llama.cpp); "
        "speculative decoding with the student as target with --spec",
    )
    _add_model_args(bg)
    _add_spec_args(bg)
    _add_run_args(bg)
    _add_llama_cpp_args(bg)
    bg.add_argument(
        "--out",
        default=None,
        help="JSON (the PNG goes beside it); default benchmarks/results/generate_speed.json, "
        "speculative.json with --spec; e.g. benchmarks/results/generate_speed_llama_cpp.json for llama.cpp",
    )
    bg.add_argument("--no-progress", action="store_true")
    bg.set_defaults(func=run_generate)


def _add_model_args(bg) -> None:
    """The teacher, the backend, the models and the contexts they decode at."""
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
        help="teacher and/or untrained students: linear, mamba, mamba2, hybrid25, gdn, and the long-context "
        "recipes' students linear_hybrid25, retrieval_heads (their architecture exactly); NAME=DIR for a "
        "trained student (default: teacher,linear,mamba,mamba2,hybrid25; llama.cpp: teacher,mamba2,hybrid25,gdn)",
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


def _add_spec_args(bg) -> None:
    """--spec: speculative decoding with the student as the target."""
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


def _add_run_args(bg) -> None:
    """How the points are timed: corpus, device, rounds, decode layout, weight formats."""
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


def _add_llama_cpp_args(bg) -> None:
    """--backend llama.cpp: GGUF types, where the GGUFs go, flash attention."""
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


def run_generate(args) -> int:
    from attn2ssm.bench.generate import (  # heavy: torch + transformers
        format_generate_bench,
        format_spec_bench,
        plot_generate_bench,
        plot_spec_bench,
        run_generate_bench,
    )

    result = run_generate_bench(_settings(args), progress=not args.no_progress)
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


def _settings(args):
    """Every flag checked, in the order the errors come, into the benchmark's settings."""
    from attn2ssm.bench.generate import (  # heavy: torch
        LLAMA_CPP_STUDENTS,
        RECIPE_STUDENTS,
        STUDENTS,
        BenchSettings,
    )

    students = (*STUDENTS, *RECIPE_STUDENTS)
    models = bench_models(args, students, LLAMA_CPP_STUDENTS)
    quants = llama_cpp_quants(args, models, LLAMA_CPP_STUDENTS)
    spec_targets, spec_drafters = spec_models(args, students, BenchSettings)
    limits = context_limits(args, models)
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
    settings.formats = weight_formats(args)
    if args.plain_check not in ("shortest", "all", "none"):
        raise ConfigError(f"--plain-check {args.plain_check!r}", "use shortest, all or none")
    settings.plain_check = args.plain_check
    return settings

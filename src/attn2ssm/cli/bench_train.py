"""``attn2ssm bench train``: the training-speed benchmark's flags checked into its settings (one-line
errors, before any model loads), then the run in ``attn2ssm.bench.train``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from attn2ssm.bench.results import write_result
from attn2ssm.cli.parsing import int_list
from attn2ssm.errors import ConfigError
from attn2ssm.ops.kernels import KERNELS
from attn2ssm.paths import atomic_write_text, check_writable


def add_parser(bsub) -> None:
    bt = bsub.add_parser(
        "train",
        help="training tokens/s of each stage kind (the trainer's own step) against the teacher's forward "
        "(the bound) and the teacher's own forward + backward, fp32 and bf16",
    )
    bt.add_argument("--teacher", default=None, help="teacher spec (default: the built-in smollm2-135m)")
    bt.add_argument(
        "--cases",
        default="attention_transfer,hidden_alignment,kd_lora,kd_ce_mixers,kd_gdn",
        help="stage cases (see attn2ssm.bench.train.CASES; kd_gdn: gdn_hybrid25's student in KD)",
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
    bt.add_argument(
        "--out",
        default="benchmarks/results/train_speed.json",
        help="results JSON (rewritten after each row: a killed run keeps the rows it measured) and its PNG",
    )
    bt.add_argument("--no-progress", action="store_true")
    bt.set_defaults(func=run_train)


def run_train(args) -> int:
    # heavy: torch
    from attn2ssm.bench.train import (
        CASES,
        TrainBenchSettings,
        format_train_bench,
        plot_train_bench,
        run_train_bench,
    )
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
    command = shlex.join(["attn2ssm", *args.argv])
    check_writable(Path(args.out))

    def keep(partial: dict) -> None:  # each row on disk as soon as it is measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.out), json.dumps({**partial, "command": command}, indent=2) + "\n")

    result = run_train_bench(settings, progress=not args.no_progress, on_row=keep)
    result["command"] = command
    write_result(result, args.out, plot_train_bench, format_train_bench)
    return 0

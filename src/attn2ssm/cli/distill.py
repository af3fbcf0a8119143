"""``attn2ssm distill``: run a distillation recipe into a run directory."""

from __future__ import annotations

from pathlib import Path

from attn2ssm.teachers import resolve_teacher


def add_parser(subparsers) -> None:
    d = subparsers.add_parser("distill", help="run a distillation recipe (default: quickstart)")
    d.add_argument("recipe", nargs="?", default=None, help="built-in recipe name or YAML path")
    d.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a recipe field, e.g. stages.0.tokens=20000",
    )
    d.add_argument("--out", default=None, help="run directory (default runs/<recipe>)")
    d.add_argument("--teacher", default=None, help="override the recipe's teacher")
    d.add_argument(
        "--kernels",
        choices=("auto", "torch", "fla"),
        default=None,
        help="what the mixers' chunked forms run (overrides the recipe's kernels): auto (fla on CUDA when it imports), torch, fla",
    )
    d.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its latest checkpoint, with the recipe saved there; "
        "--set may then change only what leaves the steps already taken as they were: eval.*, stages.N.save_every, "
        "stages.N.keep_checkpoints, stages.N.eval_every, stages.N.eval_batches, device, mixed_precision and kernels (the "
        "last three for the remaining steps); any other changed key is refused, naming it. Without a recipe named, --out must hold a "
        "run; with one, it must be that run's recipe, and an --out without a run starts it there (said on stderr). SIGTERM / Ctrl-C stop "
        "a run after the current step with a checkpoint and print this command to resume",
    )
    d.add_argument(
        "--from-delta",
        metavar="RUN",
        default=None,
        help="start --out (a new run directory) from the delta checkpoint of RUN (RUN/delta/: the tensors "
        "its finished stages trained): the student is converted again with this recipe and seed, checked "
        "against the delta's base, the delta's stages replayed, and the run goes on at the next stage",
    )
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=run)


def run(args) -> int:
    from attn2ssm.distill.recipe import load_recipe  # torch (through attn2ssm.precision), not transformers

    if args.from_delta and args.resume:
        from attn2ssm.errors import ConfigError

        raise ConfigError("--from-delta starts a new run; --resume continues one", "drop one of them")
    if args.resume and args.recipe is None:  # the run's own recipe: the one saved in --out
        return _resume(args)
    recipe = load_recipe(args.recipe, args.set)  # recipe errors fail before the trainer's heavy imports
    if args.teacher:
        recipe.teacher = args.teacher
    if args.kernels:
        recipe.kernels = args.kernels
    if args.resume:  # a recipe named: resumed when --out holds its run, else started (said on stderr)
        out = Path(args.out or f"runs/{recipe.name}")
        return _train(recipe, out, args, _resume_overrides(args, out))
    if recipe.images is None:  # (a resumed run reads its teacher from the run directory)
        resolve_teacher(recipe.teacher)
    if args.from_delta:
        return _from_delta(recipe, Path(args.out or f"runs/{recipe.name}"), args)
    return _train(recipe, Path(args.out or f"runs/{recipe.name}"), args, None)


def _from_delta(recipe, out: Path, args) -> int:
    """``--from-delta RUN``: ``out`` prepared from RUN's delta (distill/from_delta.py), then resumed."""
    from attn2ssm.distill.delta import read_delta
    from attn2ssm.distill.from_delta import prepare_from_delta  # heavy: torch + transformers

    read_delta(args.from_delta)  # a missing or damaged delta: one line before anything loads
    prepare_from_delta(recipe, out, args.from_delta, progress=not args.no_progress)
    args.resume = True
    return _train(recipe, out, args, None)


def _resume(args) -> int:
    """``distill --out RUN --resume``: continue the run saved in RUN (refused when there is none)."""
    from attn2ssm.distill.recipe import recipe_from_dict
    from attn2ssm.distill.run_dir import saved_recipe
    from attn2ssm.errors import ConfigError
    from attn2ssm.paths import check_writable

    out = Path(args.out or "runs/quickstart")  # the default recipe's default --out
    check_writable(out, folder=True)
    saved = saved_recipe(out)
    if saved is None:
        raise ConfigError(
            f"--resume: {out} holds no run to resume (no recipe.yaml): check --out",
            f"or name the recipe to start a run there: attn2ssm distill RECIPE --out {out}",
        )
    return _train(recipe_from_dict(saved), out, args, _resume_overrides(args, out))


def _resume_overrides(args, out: Path) -> list[str]:
    """A resume's changes to the saved recipe, checked there against distill.recipe.RESUMABLE:
    ``--set`` as given, ``--kernels`` as ``kernels=``; ``--teacher`` must name the saved teacher."""
    from attn2ssm.distill.run_dir import saved_recipe
    from attn2ssm.errors import ConfigError

    saved = saved_recipe(out) or {}
    if args.teacher and "teacher" in saved and args.teacher != saved["teacher"]:
        raise ConfigError(
            f"--resume --teacher {args.teacher}: the run in {out} was trained from teacher {saved['teacher']!r}",
            "drop --teacher to resume it, or start a new run with that teacher in another --out",
        )
    return [*(args.set or []), *([f"kernels={args.kernels}"] if args.kernels else [])]


def _train(recipe, out: Path, args, overrides: list[str] | None) -> int:
    from attn2ssm.distill.trainer import distill  # heavy: torch + transformers

    results = distill(recipe, out, resume=args.resume, overrides=overrides, progress=not args.no_progress)
    if results and "student_top1" in results:  # an image recipe
        print(f"\n{'model':<10} {'top-1':>8}   ({results['test_images']} test images)")
        print(
            f"{'teacher':<10} {results['teacher_top1']:>8.4f}\n{'student':<10} {results['student_top1']:>8.4f}"
        )
        print(
            f"\nstudent:    {out / 'student'} (AutoModelForImageClassification)\nreport:     {out / 'report.md'}\nmetrics:    {out / 'metrics.jsonl'}"
        )
    elif results:
        print()
        print(f"{'model':<10} {'held-out ppl':>14}")
        print(
            f"{'teacher':<10} {results['teacher_ppl']:>14.2f}"
            if results["teacher_ppl"] is not None
            else f"{'teacher':<10} {'–':>14} (not loaded: logit cache)"
        )
        print(f"{'student':<10} {results['student_ppl']:>14.2f}")
        print(f"\nstudent:    {out / 'student'}")
        print(f"report:     {out / 'report.md'} (loss curve {out / 'loss.png'})")
        print(f"metrics:    {out / 'metrics.jsonl'}")
    return 0

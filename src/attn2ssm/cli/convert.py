"""``attn2ssm convert``: an untrained student built from a teacher, its weights reused."""

from __future__ import annotations

import os
from pathlib import Path

from attn2ssm.config import parse_value
from attn2ssm.errors import ConfigError
from attn2ssm.paths import (
    LOCK,
    apply_umask,
    check_writable,
    lock_dir,
    remove_stale_staging,
    replace_dir,
    staging_beside,
    writing,
)
from attn2ssm.teachers import load_teacher, resolve_teacher


def add_parser(subparsers) -> None:
    c = subparsers.add_parser("convert", help="build an untrained student from a teacher (weights reused)")
    c.add_argument(
        "--teacher",
        default=None,
        help="built-in name, HF directory, .gguf file or hub id (default smollm2-135m)",
    )
    c.add_argument("--mixer", default="linear_attention")
    c.add_argument(
        "--attention-ratio",
        type=float,
        default=0.0,
        help="fraction of layers keeping softmax attention (interleaved, last of each group)",
    )
    c.add_argument(
        "--keep",
        default=None,
        help="comma-separated layer indices that keep attention (overrides the ratio), or 'auto': "
        "keep the ratio's worth of layers whose conversion alone hurts the teacher most",
    )
    c.add_argument("--calibration", default=None, help="corpus for --keep auto (default: sotu)")
    c.add_argument(
        "--kv-budget",
        type=float,
        default=None,
        help="a head-level hybrid (--mixer linear_attention): the KV groups a retrieval probe of the teacher "
        "ranks best keep softmax attention, as many as this fraction of the teacher's KV cache allows (e.g. 0.05)",
    )
    c.add_argument(
        "--probe-examples", type=int, default=8, help="--kv-budget: the probe's examples (default 8)"
    )
    c.add_argument(
        "--probe-pairs",
        type=int,
        default=16,
        help="--kv-budget: key-value lines per probe example (default 16)",
    )
    c.add_argument(
        "--init",
        choices=("attention", "random"),
        default="attention",
        help="mixers from the teacher's q/k/v/o, or random (ablation)",
    )
    c.add_argument(
        "--option", action="append", help="mixer option key=value (repeatable), e.g. feature_map=elu"
    )
    c.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the weights not taken from the teacher (new mixer parameters, --init random): "
        "the same teacher, flags and seed give the same student (default 0)",
    )
    c.add_argument("--out", required=True)
    c.add_argument(
        "--force",
        action="store_true",
        help="replace a model or run already in --out (written beside it first, so a failure keeps the old one)",
    )
    c.set_defaults(func=run)


def run(args) -> int:
    # Cheap checks first, so a typo fails in a fraction of a second, not after loading the teacher.
    keep, options = _keep(args.keep), _options(args.option)
    _check_kv_budget(args)
    out = Path(args.out)
    resolve_teacher(args.teacher)  # a missing path fails here, before torch/transformers load
    # and so does an --out that cannot be written, or is a file
    check_writable(out, beside=True, folder=True)
    made, had_lock = not out.exists(), (out / LOCK).exists()
    lock = lock_dir(out)  # one convert (or run) at a time in --out: a second one is refused
    try:
        remove_stale_staging(out.parent)  # what a killed convert / export left beside it
        held = _held_model(out)
        # as distill never overwrites a run: a trained student is not replaced silently
        if held and not args.force:
            raise ConfigError(
                f"--out {out} already holds {held}", "pass --force to replace it, or choose another --out"
            )
        from attn2ssm.mixers.registry import check_mixer_options  # torch + the mixers

        options = check_mixer_options(args.mixer, options)  # before the teacher loads
        plan = _convert_and_write(args, out, keep, options, replace=bool(held))
    finally:
        _release(lock, out, made=made, had_lock=had_lock)
    kept = [i for i, k in enumerate(plan) if k == "attention"]
    heads = [i for i, k in enumerate(plan) if k == "linear_attention_heads"]
    print(
        f"wrote {out}: {len(plan) - len(kept)}/{len(plan)} layers → {args.mixer}, attention kept at {kept or 'none'}"
        + (f", softmax KV groups kept in layers {heads}" if heads else "")
    )
    return 0


def _convert_and_write(args, out: Path, keep: list[int] | None, options: dict, replace: bool) -> list[str]:
    """Load the teacher, build the student (its new weights drawn from ``--seed``) and write it to
    ``out``. Returns the layer plan."""
    import torch

    from attn2ssm.student.convert import convert  # heavy: torch + transformers

    teacher, tokenizer, source = load_teacher(args.teacher, check_supported=True)
    torch.manual_seed(args.seed)
    plan = (
        _auto_plan(args, teacher, tokenizer, options) if args.keep == "auto" else _plan(args, teacher, keep)
    )
    by_kind, record = {args.mixer: options}, None
    if args.kv_budget is not None:
        from attn2ssm.distill.recipe_schema import KeepHeadsConfig
        from attn2ssm.distill.retrieval_probe import describe_kept, head_level_plan_for

        keep_heads = KeepHeadsConfig(
            args.kv_budget, args.probe_examples, args.probe_pairs, min(4, args.probe_pairs)
        )
        plan, by_kind, record = head_level_plan_for(teacher, tokenizer, plan, options, keep_heads, args.seed)
        print(describe_kept(record))
    student = convert(teacher, plan, by_kind, teacher_info={"source": source.describe()}, init=args.init)
    if record is not None:
        from attn2ssm.distill.retrieval_probe import keep_probe_record

        keep_probe_record(student, record)
    _write_student(student, tokenizer, out, replace=replace)
    return plan


def _check_kv_budget(args) -> None:
    """--kv-budget and the probe's flags, before anything loads."""
    if args.kv_budget is None:
        return
    if args.mixer != "linear_attention":
        raise ConfigError(
            f"--kv-budget keeps KV groups inside linear_attention layers, not {args.mixer}",
            "use --mixer linear_attention with --kv-budget",
        )
    if not 0.0 <= args.kv_budget <= 1.0:
        raise ConfigError(
            f"--kv-budget {args.kv_budget} is not a fraction in [0, 1]", "use e.g. --kv-budget 0.05"
        )
    if args.probe_examples < 1 or not 1 <= args.probe_pairs <= 40:
        raise ConfigError(
            f"--probe-examples {args.probe_examples} / --probe-pairs {args.probe_pairs} are out of range",
            "use --probe-examples >= 1 and --probe-pairs in 1..40",
        )


def _release(lock, out: Path, *, made: bool, had_lock: bool) -> None:
    """Let go of ``out``: the lock file this convert made goes (a student folder carries none), and
    so does ``out`` itself if this convert made it and wrote nothing there."""
    if lock is None:
        return
    if not had_lock:
        (out / LOCK).unlink(missing_ok=True)
    lock.close()
    if made and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _keep(text: str | None) -> list[int] | None:
    """--keep as layer indices (None: by --attention-ratio, or auto)."""
    try:
        return [int(i) for i in text.split(",") if i.strip()] if text not in (None, "auto") else None
    except ValueError:
        raise ConfigError(
            f"--keep {text!r} is not a comma-separated list of layer indices", "write e.g. --keep 0,6,12"
        ) from None


def _options(items: list[str] | None) -> dict:
    """--option key=value pairs, the values parsed as YAML scalars."""
    options = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option {item!r} is not key=value", "write e.g. --option feature_map=elu")
        options[key.strip()] = parse_value(value)
    return options


def _plan(args, teacher, keep: list[int] | None) -> list[str]:
    from attn2ssm.student.plans import make_plan  # heavy: torch + transformers

    return make_plan(
        teacher.config.num_hidden_layers,
        args.mixer,
        attention_ratio=args.attention_ratio,
        keep_attention=keep,
        align="last",
    )


def _auto_plan(args, teacher, tokenizer, options: dict) -> list[str]:
    """--keep auto: keep attention where converting a layer alone hurts the teacher most (printed)."""
    from attn2ssm.data import block_indices, pack_blocks, prepare_corpus  # heavy: torch
    from attn2ssm.distill.layer_selection import auto_plan  # heavy: torch + transformers

    blocks = pack_blocks(
        prepare_corpus(
            "sotu" if args.calibration is None else args.calibration,
            tokenizer,
            max_train_tokens=8 * 256 + 1,
            max_heldout_tokens=256,
        ).train_ids,
        256,
    )
    plan, scores = auto_plan(
        teacher,
        blocks[block_indices(len(blocks), 0, 0, min(8, len(blocks)))],
        args.mixer,
        options,
        args.attention_ratio,
        batch_size=2,
    )
    print(
        "layer damage (mean KL when converted alone): "
        + ", ".join(f"{i}:{s:.6g}" for i, s in enumerate(scores))
    )
    return plan


def _held_model(out: Path) -> str:
    """What in ``out`` a convert would overwrite: a saved model or a distillation run ("" if neither)."""
    if (out / "config.json").is_file():
        return "a saved model (config.json)"
    if (out / "checkpoints").exists() or (out / "student").exists():
        return "a distillation run (checkpoints/ or student/)"
    return ""


def _write_student(student, tokenizer, out: Path, replace: bool) -> None:
    """Save into a staging directory beside ``out``, then move it into place: a failed write
    leaves what ``out`` held untouched (and no staging), and one for want of space or permission
    ends with one line naming ``out``. ``replace`` (--force over a model): the staged directory
    replaces ``out`` whole; otherwise ``out`` is new or empty, or its other files stay beside the student's."""
    with (
        writing(out, "the student", "run the command again (what --out held is unchanged)"),
        staging_beside(out, "convert") as staging,
    ):
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        apply_umask(staging)  # 0755 / 0644 under umask 022, not mkdtemp's and safetensors' private modes
        if replace or not out.exists() or not [p for p in out.iterdir() if p.name != LOCK]:
            replace_dir(staging, out)
        else:
            for path in staging.iterdir():
                os.replace(path, out / path.name)

"""``attn2ssm bench generate``'s flags checked before anything loads (one-line errors): the models,
their context limits, the llama.cpp backend's GGUF types, the speculative targets and drafters, the
weight formats."""

from __future__ import annotations

from pathlib import Path

from attn2ssm.errors import CheckpointError, ConfigError
from attn2ssm.export.llamacpp import OUTTYPES, converter_dir, load_runtime


def bench_models(args, students, llama_cpp_students: tuple[str, ...]) -> tuple[str, ...]:
    """--models checked (its default filled in on ``args`` by --backend): ``students`` names the
    untrained ones; NAME=DIR is a trained student. Returns the items as given."""
    if args.models is None:
        args.models = (
            "teacher," + ",".join(llama_cpp_students)
            if args.backend == "llama.cpp"
            else "teacher,linear,mamba,mamba2,hybrid25"
        )
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    for item in models:
        name, sep, path = item.partition("=")
        if sep and (not name or name == "teacher" or not (Path(path) / "config.json").exists()):
            raise CheckpointError(
                f"--models {item}: not NAME=DIR with a config.json in DIR",
                "point NAME=DIR at a student directory (e.g. retrieval_heads=runs/retrieval_heads/student)",
            )
    names = [m.partition("=")[0] for m in models]
    unknown = [m for m in models if m != "teacher" and "=" not in m and m not in students]
    unknown += sorted({n for n in names if names.count(n) > 1})
    if unknown or not models:
        raise ConfigError(
            f"--models {args.models!r} names unknown models or repeated ones: {unknown}",
            f"choose from teacher, {', '.join(students)}, or NAME=DIR for a trained student, each once",
        )
    return models


def context_limits(args, models: tuple[str, ...]) -> dict[str, int]:
    """--max-context MODEL=TOKENS (repeatable), each for a benchmarked model."""
    limits, names = {}, [m.partition("=")[0] for m in models]
    for item in args.max_context or []:
        name, sep, value = item.partition("=")
        if not sep or name not in names or not value.isdigit():
            raise ConfigError(
                f"--max-context {item!r} is not MODEL=TOKENS for a benchmarked model",
                "write e.g. --max-context teacher=16384",
            )
        limits[name] = int(value)
    return limits


def llama_cpp_quants(args, models: tuple[str, ...], llama_cpp_students: tuple[str, ...]) -> tuple[str, ...]:
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


def spec_models(args, students: dict, defaults) -> tuple[tuple[str, ...], tuple[str, ...]]:
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


def weight_formats(args) -> tuple[str, ...]:
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

"""``bench generate``'s decode table: ``run_generate_bench`` (the torch backend here; ``--spec`` and
``--backend llama.cpp`` handed to their modules), each row against its bandwidth bound, the plot
and the table it prints."""

from __future__ import annotations

from pathlib import Path

import torch

from attn2ssm.bench.generate.llama_cpp import run_llama_cpp_bench
from attn2ssm.bench.generate.models import BenchSettings, build_models, prompt_ids
from attn2ssm.bench.generate.speculative import run_spec_bench
from attn2ssm.bench.generate.timing import decode_by_context, stream_rate, warm_up
from attn2ssm.bench.results import save_figure
from attn2ssm.decode.plan import compiled_step_status


def run_generate_bench(settings: BenchSettings, progress: bool = True) -> dict:
    """``bench generate``: the decode table of the teacher and its untrained students on torch (the
    CPU decode layout, and ``--compile``d student steps compiled before any timing); with ``spec``
    the speculative benchmark, with ``backend="llama.cpp"`` the same table from GGUFs."""
    from attn2ssm.eval.report import environment
    from attn2ssm.teachers import load_teacher

    if settings.backend == "llama.cpp":
        return run_llama_cpp_bench(settings, progress)
    if settings.spec:
        return run_spec_bench(settings, progress)
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    teacher, tokenizer, _ = load_teacher(settings.teacher, device=device)
    models = build_models(teacher, settings.models, device, settings.formats)
    layout = settings.cpu_layout and device.type == "cpu"
    if layout:
        from attn2ssm.decode.layout import cpu_decode_layout

        for model in [teacher, *models.values()]:
            cpu_decode_layout(model, compile=settings.compile_students and model is not teacher)
    compiled = {}
    # compile now (a minute each), not inside a timed decode
    if layout and settings.compile_students:
        warm = prompt_ids(tokenizer, settings.corpus, 16, device)
        for name, model in models.items():
            if model is teacher:
                compiled[name] = "not compiled: HF's forward with its KV cache"
                continue
            compiled[name] = compiled_step_status(model)
            if compiled[name] == "compiled":
                warm_up(model, warm)
                compiled[name] = compiled_step_status(model)
    prompt = prompt_ids(tokenizer, settings.corpus, max(settings.contexts), device)
    stream = stream_rate(device)
    decode = decode_by_context(models, settings, prompt, progress)
    weights = {name: model.__dict__.get("weight_format", {}) for name, model in models.items()}
    _bandwidth_bound(decode, weights, stream)
    result = {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()},
        "backend": "torch",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "compiled_decode_step": compiled,  # student → "compiled" or why it decodes eagerly
        "models": {
            name: model.__dict__.get("bench_model") for name, model in models.items()
        },  # what each row is
        "environment": environment(),
        "stream_rate": stream,  # GB/s this machine streams: the bandwidth bound's denominator
        "weight_formats": weights,
        "decode": decode,
    }
    return result


def _bandwidth_bound(decode: dict, weights: dict, stream: dict) -> None:
    """Each row's token time against its bandwidth bound: weight bytes a step reads / the measured
    stream rate (sum); ``fraction_of_bandwidth_bound`` = bound / measured time (1 = at the bound).
    The ``_with_cache`` pair also counts reading the cache once (the KV of attention layers)."""
    rate = stream.get("sum_gb_per_s")
    for name, rows in decode.items():
        size = weights.get(name, {}).get("weight_bytes")
        if not rate or not size:
            continue
        for row in rows:
            if "skipped" in row:
                continue
            row["weight_mb_per_token"] = size / 2**20
            row["bandwidth_bound_ms"] = 1000 * size / (rate * 1e9)
            row["fraction_of_bandwidth_bound"] = row["bandwidth_bound_ms"] / row["decode_ms_per_token"]
            row["bandwidth_bound_with_cache_ms"] = 1000 * (size + row["cache_mb"] * 2**20) / (rate * 1e9)
            row["fraction_of_bandwidth_bound_with_cache"] = (
                row["bandwidth_bound_with_cache_ms"] / row["decode_ms_per_token"]
            )


def plot_generate_bench(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("decode_tokens_per_second", "decode tokens/s (1 / median token time)", True),
        ("speedup_vs_teacher", "decode speed / teacher's", False),
        ("prefill_seconds", "prefill seconds", True),
        ("cache_mb", "cache MB after decode", True),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.2))
    for ax, (key, label, log) in zip(axes, panels):
        for i, (name, rows) in enumerate(result["decode"].items()):
            pts = [
                (r["context"], r[key])
                for r in rows
                if "skipped" not in r and r.get(key) is not None and r[key] > 0
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=name)
            if key == "decode_tokens_per_second":  # interquartile range of the token times
                band = [
                    (r["context"], 1000 / r["decode_ms_per_token_p75"], 1000 / r["decode_ms_per_token_p25"])
                    for r in rows
                    if "decode_ms_per_token_p25" in r
                ]
                if band:
                    ax.fill_between(*zip(*band), color=f"C{i}", alpha=0.15, linewidth=0)
        if key == "speedup_vs_teacher":
            ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    compiled = sorted(
        name for name, how in result.get("compiled_decode_step", {}).items() if how == "compiled"
    )
    note = f"; compiled decode step: {', '.join(compiled)}" if compiled else ""
    where = f"{result['device']} ({result['environment'].get('cuda') or result['environment'].get('processor')}, {result['threads']} threads)"
    if result.get("backend") == "llama.cpp":
        version = result["environment"].get("llama_cpp", {}).get("llama_cpp_python")
        fig.suptitle(
            f"llama.cpp (llama-cpp-python {version}) on {where}, GGUF {' / '.join(result['settings']['quants'])}: teacher and students at the same type",
            fontsize=10,
        )
    else:
        formats = " / ".join(result["settings"].get("formats") or ["float32"])
        fig.suptitle(f"generation on {where}, weights {formats}{note}", fontsize=10)
    return save_figure(fig, path)


def format_generate_bench(result: dict) -> str:
    """The table ``bench generate`` prints: per model, tokens/s | prefill s | cache MB at each context."""
    engine = "llama.cpp, " if result.get("backend") == "llama.cpp" else ""
    lines = [
        f"decode ({engine}{result['device']}, {result['threads']} threads): tokens/s | prefill s | cache MB, by context"
    ]
    for name, rows in result["decode"].items():
        cells = []
        for r in rows:
            if "skipped" in r:
                cells.append(f"{r['context']}: skipped")
            else:
                speedup = f" ({r['speedup_vs_teacher']:.2f}x teacher)" if "speedup_vs_teacher" in r else ""
                if "benchmark_vs_plain_generate" in r:  # a user's plain generate beside the rounds
                    speedup += f" [plain generate {r['plain_generate_tokens_per_second']:.2f}]"
                if "fraction_of_bandwidth_bound" in r:
                    speedup += f" [{r['fraction_of_bandwidth_bound']:.0%} of bound]"
                cells.append(
                    f"{r['context']}: {r['decode_tokens_per_second']:.2f}{speedup} | {r['prefill_seconds']:.1f} | {r['cache_mb']:.1f}"
                )
        lines.append(f"  {name:<{max(9, *map(len, result['decode']))}} " + "; ".join(cells))
    return "\n".join(lines)

"""A run's report: teacher vs student held-out perplexity (table + JSON) and the loss curve (PNG)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

import attn2ssm
from attn2ssm.eval.kv_cache import kept_kv_groups
from attn2ssm.eval.perplexity import perplexity
from attn2ssm.mixers.kept_heads import list_kept
from attn2ssm.paths import atomic_write_text


def environment() -> dict:
    import transformers  # heavy: this module imports torch only

    return {
        "attn2ssm": attn2ssm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def read_metrics(run_dir: Path) -> list[dict]:
    """The per-step training records of a run (event lines such as layer selection are skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "event" not in rec:
            out.append(rec)
    return out


def plot_losses(metrics: list[dict], path: Path, title: str = "") -> Path | None:
    if not metrics:
        return None
    import matplotlib  # heavy: matplotlib, and the Agg backend is chosen only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: as above, once the backend is set

    fig, ax = plt.subplots(figsize=(7, 4))
    stages = []
    for rec in metrics:
        if rec["stage"] not in stages:
            stages.append(rec["stage"])
    for name in stages:
        recs = [r for r in metrics if r["stage"] == name]
        ax.plot([r["total_tokens"] for r in recs], [r["loss"] for r in recs], label=f"{name} (train)")
        ev = [r for r in recs if "eval_loss" in r]
        if ev:
            ax.plot(
                [r["total_tokens"] for r in ev],
                [r["eval_loss"] for r in ev],
                "o--",
                label=f"{name} (held-out CE)",
            )
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    run_dir: Path,
    recipe,
    teacher,
    student,
    corpus,
    *,
    progress: bool = True,
    settings: dict | None = None,
    teacher_ppl: float | None = None,
) -> dict:
    """Score teacher and student on the held-out text; write results.json (with ``settings``: how the
    run computed — device, mixed precision, kernels), report.md and loss.png.

    ``teacher`` None: a run that never loaded the teacher (distillation from a complete logit cache)
    reports ``teacher_ppl`` (the value an earlier run measured on the same teacher and held-out text)
    or, without one, no teacher perplexity and a note saying why."""
    run_dir = Path(run_dir)
    e = recipe.eval
    window = e.window or recipe.data.block_len
    stride = e.stride or window // 2
    kwargs = dict(
        window=window, stride=stride, batch_size=e.batch_size, max_tokens=e.max_tokens, progress=progress
    )
    t = (
        {"ppl": teacher_ppl}
        if teacher is None
        else perplexity(teacher, corpus.heldout_ids, desc="teacher perplexity", **kwargs)
    )
    s = perplexity(student, corpus.heldout_ids, desc="student perplexity", **kwargs)
    metrics = read_metrics(run_dir)
    plot = plot_losses(metrics, run_dir / "loss.png", f"{recipe.name}: {recipe.student.mixer}")
    plan = student.config.layer_plan
    results = _results(
        recipe, plan, metrics, {"window": window, "stride": stride, "tokens": s["tokens"]}, t, s
    )
    results["kv_groups_kept"] = {str(i): g for i, g in kept_kv_groups(student).items()}
    results.update(settings or {}, environment=environment())
    if teacher is None:
        results["teacher_ppl_source"] = (
            "measured by an earlier run on the same teacher and held-out text (this run read the teacher from its logit cache)"
            if t["ppl"] is not None
            else "not measured: this run read every teacher distribution from its logit cache "
            "and never loaded the teacher"
        )
    atomic_write_text(run_dir / "results.json", json.dumps(results, indent=1))
    # its card, written before these results existed, gains them
    if (run_dir / "student" / "config.json").is_file():
        from attn2ssm.student.card import write_student_card  # heavy: transformers

        write_student_card(run_dir / "student")
    markdown = _report_markdown(recipe, results, plan, window, stride, t, s, plot)
    atomic_write_text(run_dir / "report.md", markdown)
    return results


def _results(recipe, plan, metrics: list[dict], heldout: dict, t: dict, s: dict) -> dict:
    """results.json's record of the run: recipe, held-out perplexities, plan, tokens and stages."""
    return {
        "recipe": recipe.name,
        "teacher": recipe.teacher,
        "corpus": recipe.data.describe(),
        "heldout": heldout,
        "teacher_ppl": t["ppl"],
        "student_ppl": s["ppl"],
        "ppl_ratio": s["ppl"] / t["ppl"] if t["ppl"] else None,
        "layer_plan": plan,
        "attention_layers": [i for i, k in enumerate(plan) if k == "attention"],
        "train_tokens": metrics[-1]["total_tokens"] if metrics else 0,
        "stages": [{"name": st.name, "kind": st.kind, "tokens": st.tokens} for st in recipe.stages],
        "mixed_precision": {"requested": recipe.mixed_precision, "used": recipe.mixed_precision},
    }


def _kept_groups_text(kept: dict | None) -> str:
    """'; KV groups kept as softmax attention: layer 3: [1], …' for a head-level hybrid, else ''."""
    if not kept:
        return ""
    return f"; KV groups kept as softmax attention ({sum(map(len, kept.values()))}): {list_kept(kept)}"


def _report_markdown(recipe, results: dict, plan, window: int, stride: int, t: dict, s: dict, plot) -> str:
    """report.md: the run, the held-out perplexities of teacher (``t``) and student (``s``), the
    stages and the loss curve (``plot``, when there is one)."""
    lines = [
        f"# {recipe.name}",
        "",
        f"{recipe.description}".strip(),
        "",
        f"Teacher `{recipe.teacher}` → student with {len(plan) - len(results['attention_layers'])}/{len(plan)} layers "
        f"as `{recipe.student.mixer}` (attention kept at {results['attention_layers'] or 'none'}"
        f"{_kept_groups_text(results.get('kv_groups_kept'))}).",
        f"Corpus `{recipe.data.describe()}`; held-out perplexity over {s['tokens']} tokens, window {window}, stride {stride}.",
        "",
        "| model | held-out perplexity |",
        "|---|---|",
        f"| teacher | {t['ppl']:.2f} |"
        if t["ppl"] is not None
        else f"| teacher | – ({results['teacher_ppl_source']}) |",
        f"| student | {s['ppl']:.2f} |",
        "",
        "| stage | kind | tokens |",
        "|---|---|---|",
        *[f"| {st.name} | {st.kind} | {st.tokens} |" for st in recipe.stages],
        "",
    ]
    if plot:
        lines += ["![loss curve](loss.png)", ""]
    return "\n".join(lines)

"""The length curve: student / teacher perplexity against the window (512 … 8192 tokens), per corpus
and as the geometric mean over the corpora, one line per model.

A student that holds its teacher's quality as the context grows keeps a flat ratio; one that only
learnt its training blocks' length rises past them (issue 48: the ``make demo`` student was 1.3× at
1024 tokens and 3.4× at 8192). ``eval --suite`` builds the curve from its perplexity units
(:func:`curve_from_scores`), ``eval --report`` scores it (:func:`score_length_curve`); both write the
same block into their JSON (``length_curve``), a markdown table and a plot."""

from __future__ import annotations

import math

AVERAGE = "geometric mean over the corpora"


def fit_windows(windows, limit: int | None) -> tuple[int, ...]:
    """``windows`` sorted, without those past ``limit`` positions (None: any)."""
    return tuple(sorted({w for w in windows if limit is None or w <= limit}))


def build_curve(windows, teacher: dict, student: dict) -> dict | None:
    """The ``length_curve`` block from per-corpus perplexities ``{corpus: {window: ppl}}`` of each
    model: windows, each corpus's teacher / student / ratio lists, and their geometric mean over the
    corpora ("mean"). A window is kept where both models have every corpus's perplexity; None
    without two such windows (a curve needs two points)."""
    corpora = [c for c in teacher if c in student]
    kept = [
        w for w in sorted(windows) if corpora and all(w in teacher[c] and w in student[c] for c in corpora)
    ]
    if len(kept) < 2:
        return None
    per = {
        c: {
            "teacher": [teacher[c][w] for w in kept],
            "student": [student[c][w] for w in kept],
            "ratio": [student[c][w] / teacher[c][w] for w in kept],
        }
        for c in corpora
    }

    def gmean(side: str) -> list[float]:
        return [
            math.exp(sum(math.log(per[c][side][i]) for c in corpora) / len(corpora)) for i in range(len(kept))
        ]

    mean = {"teacher": gmean("teacher"), "student": gmean("student")}
    mean["ratio"] = [s / t for s, t in zip(mean["student"], mean["teacher"])]
    return {"windows": kept, "average": AVERAGE, "corpora": per, "mean": mean}


def curve_from_scores(corpora, windows, teacher_scores: dict, student_scores: dict) -> dict | None:
    """The curve from the suite's unit scores (row ids ``ppl/<corpus>/<window>``)."""

    def side(scores: dict) -> dict:
        return {
            c: {w: scores[f"ppl/{c}/{w}"]["value"] for w in windows if f"ppl/{c}/{w}" in scores}
            for c in corpora
        }

    return build_curve(windows, side(teacher_scores), side(student_scores))


def score_length_curve(teacher, student, ids_by_corpus: dict, windows, progress: bool = False) -> dict | None:
    """Score both models at each window (stride = window / 2, as the suite) on each corpus's held-out
    ids, and build the curve; a window longer than a corpus's ids is skipped for every corpus."""
    from attn2ssm.eval.perplexity import perplexity  # heavy: torch

    shortest = min(ids.numel() for ids in ids_by_corpus.values())
    windows = [w for w in windows if w <= shortest]
    ppl: dict = {"teacher": {}, "student": {}}
    for name, model in (("teacher", teacher), ("student", student)):
        for corpus, ids in ids_by_corpus.items():
            ppl[name][corpus] = {
                w: perplexity(
                    model,
                    ids,
                    window=w,
                    stride=w // 2,
                    batch_size=max(1, 4096 // w),
                    progress=progress,
                    desc=f"{name} {corpus} @{w}",
                )["ppl"]
                for w in windows
            }
    return build_curve(windows, ppl["teacher"], ppl["student"])


def format_curve(curve: dict | None) -> list[str]:
    """The curve as markdown: a row per corpus and the mean, a column per window (student / teacher
    perplexity ratio), then the mean perplexities of each model."""
    if not curve:
        return []
    head = "| student / teacher perplexity | " + " | ".join(f"@{w}" for w in curve["windows"]) + " |"
    lines = [head, "|---|" + "---|" * len(curve["windows"])]
    for corpus, c in curve["corpora"].items():
        lines.append(f"| {corpus} | " + " | ".join(f"{r:.2f}×" for r in c["ratio"]) + " |")
    mean = curve["mean"]
    lines.append("| **mean** | " + " | ".join(f"**{r:.2f}×**" for r in mean["ratio"]) + " |")
    for side in ("teacher", "student"):
        lines.append(f"| {side} ppl (mean) | " + " | ".join(f"{v:.2f}" for v in mean[side]) + " |")
    return lines


def draw_curve(ax, curve: dict) -> None:
    """One line per model on ``ax``: the ratio to the teacher against the window (the teacher at 1, the
    student's geometric mean bold, each corpus thin)."""
    w = curve["windows"]
    ax.plot(w, [1.0] * len(w), "k--", linewidth=1, label="teacher")
    for i, (corpus, c) in enumerate(curve["corpora"].items()):
        ax.plot(w, c["ratio"], "-", color=f"C{i % 10}", alpha=0.5, linewidth=1, label=f"student, {corpus}")
    ax.plot(w, curve["mean"]["ratio"], "o-", color="k", linewidth=2, label="student, mean")
    ax.set_xscale("log", base=2)
    ax.set_xticks(w, [str(x) for x in w])
    ax.set_xlabel("window (tokens)")
    ax.set_ylabel("perplexity / the teacher's")
    ax.set_title("length curve", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)

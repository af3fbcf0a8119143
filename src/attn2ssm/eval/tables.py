"""An evaluation's tables and plot: one teacher-vs-student row (``table_row``: scores, recovered),
the markdown table of rows (a score with a standard error in % ± points), the recovered-fraction bar
plot, and the suite's own views of its rows: the anchors' table, a scoreboard summary and the
markdown of ``suite.md``. ``bench`` formats its grid with these too."""

from __future__ import annotations

from pathlib import Path

from attn2ssm.eval.stats import mean as _mean
from attn2ssm.eval.stats import recovered as _recovered
from attn2ssm.eval.suite_settings import IN_DOMAIN, SuiteSettings, settings_from_dict
from attn2ssm.eval.targets import format_targets


def table_row(
    group: str,
    metric: str,
    teacher: float | None,
    student: float | None,
    higher_is_better: bool = True,
    **extra,
) -> dict:
    """One table row. ``extra`` (the suite's rows): ``teacher_se`` / ``student_se`` (the standard error
    of a score that is a mean over items), ``n`` (items, or scored tokens), ``cpu_seconds``
    ({"teacher", "student"}: process CPU time each side cost, None where it came from a cache)."""
    return {
        "group": group,
        "metric": metric,
        "teacher": teacher,
        "student": student,
        "recovered": _recovered(teacher, student, higher_is_better),
        "higher_is_better": higher_is_better,
        **extra,
    }


def format_value(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and abs(v) >= 100:
        return f"{v:,.1f}"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def with_se(value, se) -> str:
    """A score with a standard error is a fraction of items: shown in %, ± its SE in points."""
    return format_value(value) if se is None or value is None else f"{100 * value:.1f} ± {100 * se:.1f}"


def _cpu(seconds: dict | None) -> str:
    if not seconds:
        return "–"
    return " / ".join(
        "cached" if seconds.get(side) is None else f"{seconds[side]:,.0f}" for side in ("teacher", "student")
    )


def format_table(rows: list[dict]) -> list[str]:
    """The teacher-vs-student table; with the suite's columns (n, CPU s) where rows have them. A score
    with a standard error (a mean over items) is written in % ± its SE in points."""
    full = any("n" in r for r in rows)
    head = ["group", "metric", "teacher", "student", "recovered"] + (
        ["n", "CPU s (teacher / student)"] if full else []
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rec = "–" if r["recovered"] is None else f"{100 * r['recovered']:.1f} %"
        if r.get("ratio") is not None:  # perplexity: also the papers' student / teacher ratio
            rec += f" ({r['ratio']:.2f}×)"
        cells = [
            r["group"],
            r["metric"],
            with_se(r["teacher"], r.get("teacher_se")),
            with_se(r["student"], r.get("student_se")),
            rec,
        ]
        if full:
            cells += ["–" if r.get("n") is None else f"{r['n']:,}", _cpu(r.get("cpu_seconds"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot_recovered(rows: list[dict], path: Path, title: str, curve: dict | None = None) -> None:
    """The recovered fraction, one bar per row; with a length ``curve`` (eval.length_curve) a second
    panel beside the bars."""
    import matplotlib  # heavy: matplotlib, and the Agg backend is chosen only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: as above, once the backend is set

    shown = [r for r in rows if r["recovered"] is not None]
    if not shown:
        return
    height = 0.35 * len(shown) + 1.4
    if curve:
        from attn2ssm.eval.length_curve import draw_curve

        fig, (ax, side) = plt.subplots(
            1, 2, figsize=(12, max(height, 4.0)), gridspec_kw={"width_ratios": [7, 5]}
        )
        draw_curve(side, curve)
    else:
        fig, ax = plt.subplots(figsize=(7, height))
    labels = [f"{r['group']}: {r['metric']}"[:60] for r in shown]
    values = [100 * r["recovered"] for r in shown]
    ax.barh(range(len(shown)), values, color=[f"C{i % 10}" for i in range(len(shown))])
    for i, v in enumerate(values):
        ax.annotate(f"{v:.1f} %", (v, i), va="center", fontsize=7, xytext=(2, 0), textcoords="offset points")
    ax.axvline(100, color="gray", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("recovered (% of teacher)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def anchors_table(rows: list[dict], settings: SuiteSettings) -> list[str]:
    """The tasks in the anchors' format: task columns; teacher, student and recovered rows."""
    by_id = {r["id"]: r for r in rows}
    cols = [
        (t.label or t.name, f"task/{t.task}/{t.shots}")
        for t in settings.tasks
        if t.shots == 0 and t.task != "mmlu"
    ]
    core = [rid for _, rid in cols if rid in by_id]
    cols.append(("avg (core)", None))
    cols += [
        (t.label or t.name, f"task/{t.task}/{t.shots}") for t in settings.tasks if t.task == "mmlu" or t.shots
    ]
    if settings.generation is not None:
        cols.append(
            (
                settings.generation.label or settings.generation.name,
                f"task/{settings.generation.task}/{settings.generation.shots}",
            )
        )
    longest = max(settings.niah_lengths) if settings.niah_lengths else None
    cols += [
        (f"{f.replace('niah_single_', 'NIAH-')} @{longest}", f"niah/{f}/{longest}")
        for f in settings.niah_forms
    ]

    def cell(side: str, rid: str | None) -> float | None:
        if rid is None:  # the core average, over the core tasks scored
            values = [by_id[r][side] for r in core if by_id[r][side] is not None]
            return sum(values) / len(values) if values and len(values) == len(core) else None
        return by_id[rid][side] if rid in by_id else None

    def pct(v) -> str:
        return "–" if v is None else f"{100 * v:.1f}"

    lines = ["| model | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---|" * len(cols)]
    lines.append("| teacher | " + " | ".join(pct(cell("teacher", rid)) for _, rid in cols) + " |")
    lines.append("| student | " + " | ".join(pct(cell("student", rid)) for _, rid in cols) + " |")
    rec = []
    for _, rid in cols:
        t, s = cell("teacher", rid), cell("student", rid)
        rec.append("–" if t is None or s is None or t <= 0 else f"{100 * s / t:.0f} %")
    lines.append("| recovered | " + " | ".join(rec) + " |")
    return lines


def summary(rows: list[dict], settings: SuiteSettings) -> list[tuple[str, float | None, float | None]]:
    """A few numbers per model for a scoreboard: (label, teacher, student) of the core-task mean
    accuracy, MMLU 0/5-shot, the generation task, the needles' mean greedy match at the longest
    length, and the perplexity ratio (student / teacher, geometric mean) on the corpora of other
    domains at the longest window."""
    by_id = {r["id"]: r for r in rows}

    def mean(ids, side, geometric=False):
        values = [by_id[i][side] for i in ids if i in by_id and by_id[i][side] is not None]
        if not values or len(values) < len(ids):
            return None
        return _mean(values, geometric)

    core = [f"task/{t.task}/0" for t in settings.tasks if t.shots == 0 and t.task != "mmlu"]
    out = [("core avg", mean(core, "teacher"), mean(core, "student"))]
    for t in settings.tasks:
        if t.task == "mmlu":
            rid = f"task/mmlu/{t.shots}"
            out.append((t.label or t.name, mean([rid], "teacher"), mean([rid], "student")))
    if settings.generation is not None:
        rid = f"task/{settings.generation.task}/{settings.generation.shots}"
        out.append(
            (
                settings.generation.label or settings.generation.name,
                mean([rid], "teacher"),
                mean([rid], "student"),
            )
        )
    if settings.niah_lengths:
        longest = max(settings.niah_lengths)
        ids = [f"niah/{f}/{longest}" for f in settings.niah_forms]
        out.append((f"NIAH @{longest}", mean(ids, "teacher"), mean(ids, "student")))
    other = [c for c in settings.corpora if c not in IN_DOMAIN]
    if other and settings.windows:
        w = max(settings.windows)
        ids = [f"ppl/{c}/{w}" for c in other]
        t, st = mean(ids, "teacher", True), mean(ids, "student", True)
        out.append(
            (
                f"ppl ratio, other domains @{w}",
                1.0 if t else None,
                None if t is None or st is None else st / t,
            )
        )
    return out


def format_suite_markdown(report: dict) -> str:
    settings = settings_from_dict(report["settings"])
    rows = report["rows"]
    cost = report.get("cpu_seconds", {})
    accuracies = (  # the anchors' table, where the run scored anything but perplexity
        [
            "Accuracies in %, teacher / student / recovered (student / teacher):",
            "",
            *anchors_table(rows, settings),
            "",
        ]
        if settings.tasks or settings.generation is not None or settings.niah_forms
        else []
    )
    lines = [
        f"# {report['student']}{_branch_label(report.get('branch', 'both'))} vs teacher {report['teacher']}: suite {settings.name}",
        "",
        *accuracies,
        (
            "Every row: the score, and where it is a mean over items (an accuracy, in %) ± its standard error in points (binomial: sqrt(p (1 - p) / n)); "
            "n = items (documents, trials), or scored tokens for perplexity; recovered = student / teacher (teacher / student for "
            'perplexity); CPU s = process CPU seconds each side cost on this machine ("cached": the teacher\'s unit came from the cache; '
            "a needle's recall is computed with its greedy run)."
        ),
        "",
        *format_table(rows),
        "",
        *_length_curve_lines(report.get("length_curve")),
        *_kv_lines(report.get("kv_cache")),
        *format_targets(report.get("targets")),
        (
            f"CPU seconds in all: teacher {cost.get('teacher', 0):,.0f} (of units computed now), student {cost.get('student', 0):,.0f}; "
            f"{report['environment'].get('cpu_count')} CPUs, torch threads {report.get('threads')}."
        ),
        "",
        "![recovered fraction](suite.png)",
        "",
    ]
    return "\n".join(lines)


def _length_curve_lines(curve: dict | None) -> list[str]:
    from attn2ssm.eval.length_curve import format_curve

    if not curve:
        return []
    return [
        f"Length curve: student / teacher perplexity against the window, per corpus and their {curve['average']}:",
        "",
        *format_curve(curve),
        "",
    ]


def _kv_lines(kv: dict | None) -> list[str]:
    """The KV cache at the suite's length, the student's against the teacher's (eval.kv_cache)."""
    if not kv:
        return []
    mb = 2**20
    return [
        f"KV cache at {kv['tokens']:,} tokens (one sequence): student {kv['student_kv_bytes'] / mb:,.1f} MB, "
        f"teacher {kv['teacher_kv_bytes'] / mb:,.1f} MB — **kv_fraction {kv['kv_fraction']:.3f}** "
        f"({100 * kv['kv_fraction']:.1f} %); plus the student's constant mixer state, "
        f"{kv['student_state_bytes'] / mb:,.2f} MB.",
        "",
    ]


def _branch_label(branch: str) -> str:
    return "" if branch == "both" else f" ({branch} branch only)"

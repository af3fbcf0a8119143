"""What ``bench quality`` writes: the grid JSON (every cached cell, plus the cells an earlier
grid JSON holds that this grid directory lacks), its markdown table and its plot; and the plan
``--plan`` prints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from attn2ssm.bench.quality.grid import Cell, EvalSettings, GridSettings, read_cell
from attn2ssm.paths import atomic_write_text

if TYPE_CHECKING:
    from attn2ssm.bench.quality.scoring import TeacherReference


def collect_cells(grid_dir: Path, settings: EvalSettings) -> tuple[list[dict], list[str]]:
    """Every cached cell of the grid scored with ``settings``, and
    the names of cells scored with other settings (left out until they are run again)."""
    records, stale = [], []
    for path in sorted(Path(grid_dir).glob("*/cell.json")):
        rec = read_cell(path.parent)
        if rec is None:
            continue
        if rec.get("eval_settings") != settings.as_dict():
            stale.append(f"{rec['family']}@{rec['tokens']}")
            continue
        records.append(rec)
    return records, stale


def earlier_cells(
    json_path: Path, teacher: str, settings: EvalSettings, have: set[tuple[str, int]]
) -> list[dict]:
    """The cells of the grid JSON at ``json_path`` (written by an earlier invocation, perhaps on
    another machine) that were scored with these settings for this teacher and are not in ``have``
    (family, tokens); each says so in ``"from"``. Nothing from a missing or unreadable file."""
    old = _grid_json(json_path)
    if old.get("teacher") != teacher or old.get("settings") != settings.as_dict():
        return []
    kept = []
    for rec in old.get("cells", []):
        if isinstance(rec, dict) and (rec.get("family"), rec.get("tokens")) not in have:
            kept.append(
                {
                    **rec,
                    "from": rec.get("from")
                    or f"{json_path} (its run directory {rec.get('run_dir')} is not in this grid directory)",
                }
            )
    return kept


def _earlier_suite(json_path: Path, teacher: str) -> dict | None:
    """The suite settings the grid JSON at ``json_path`` was written with for this teacher: an
    invocation with ``--suite none`` scores no cell on the suite but keeps the table of the cells
    scored on it."""
    old = _grid_json(json_path)
    return old.get("suite") if old.get("teacher") == teacher else None


def _grid_json(json_path: Path) -> dict:
    """A grid JSON written earlier (perhaps on another machine); {} when missing or unreadable."""
    try:
        old = json.loads(Path(json_path).read_text())
    except (OSError, ValueError):
        return {}
    return old if isinstance(old, dict) else {}


def write_outputs(
    settings: GridSettings, reference: TeacherReference, command: str, selected: list[str] | None = None
) -> dict:
    from attn2ssm.eval.report import environment

    records, stale = collect_cells(settings.grid_dir, settings.eval)
    records += earlier_cells(
        settings.json_path, settings.teacher, settings.eval, {(r["family"], r["tokens"]) for r in records}
    )
    order = {name: i for i, name in enumerate(settings.families)}  # family-table order, then tokens
    records.sort(key=lambda r: (order.get(r["family"], len(order)), r["family"], r["tokens"]))
    result = {
        "teacher": settings.teacher,
        "grid_dir": str(settings.grid_dir),
        "families": {r["family"]: r["recipe"] for r in records},
        "settings": settings.eval.as_dict(),
        "suite": settings.eval.suite_dict() or _earlier_suite(settings.json_path, settings.teacher),
        "teacher_reference": reference.cached_summary(),
        "cells": [{k: v for k, v in r.items() if k not in ("eval_settings", "recipe_sha")} for r in records],
        "stale_cells": stale,
        "selected": selected or [],
        "command": command,
        "environment": environment(),
    }
    json_path = Path(settings.json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json_path, json.dumps(result, indent=1) + "\n")
    plot_quality(result, json_path.with_suffix(".png"))
    atomic_write_text(json_path.with_suffix(".md"), format_markdown(result) + "\n")
    return result


def _corpus_label(corpus: str) -> str:
    return Path(corpus).name if ("/" in corpus or os.sep in corpus) else corpus


def _tokens_label(n: int) -> str:
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _secs(v) -> str:
    if v is None:
        return "–"
    return f"{v / 3600:.1f} h" if v >= 3600 else f"{v / 60:.1f} min" if v >= 60 else f"{v:.0f} s"


def _passkey_cell(passkey: dict, length: str) -> str:
    """ "accuracy · recall" at one length ("–" where not scored; cells scored before recall show accuracy alone)."""
    acc, recall = passkey.get("accuracy", {}).get(length), passkey.get("recall", {}).get(length)
    if acc is None:
        return "–"
    return f"{acc:.0%}" if recall is None else f"{acc:.0%} · {recall:.0%}"


def _data_cell(data: dict | None) -> str:
    """ "corpus · block length" ("–" for a cell recorded before cells said what they trained on)."""
    return "–" if not data else f"{_corpus_label(data['corpus'])} · {data['block_len']}"


def _markdown_intro(result: dict) -> str:
    """The paragraph above the scoreboard: what each column holds."""
    s = result["settings"]
    return (
        f"Quality scoreboard: students of `{result['teacher']}`; held-out perplexity over {s['eval_tokens']} tokens per corpus "
        f"(stride = window / 2). Perplexity cells: student ppl · ratio to the teacher · teacher-forced top-1 agreement with the "
        f"teacher on the same windows. Greedy agree: share of {s['agreement_new_tokens']} greedy tokens equal to the teacher's, "
        f"{s['agreement_prompts']} held-out prompts of {_corpus_label(s['corpora'][0])}. Passkey: {len(s['passkey_depths'])} depths × {s['passkey_trials']} keys, "
        f"greedy accuracy · recall (the answer teacher-forced: every digit-bearing token is the argmax; recall without accuracy means the "
        f"key was retrieved but the model answers in another form). Data: the training text · its block length in tokens."
    )


def format_markdown(result: dict) -> str:
    s = result["settings"]
    cols = [(c, str(w)) for c in s["corpora"] for w in s["windows"]]
    lengths = [str(L) for L in s["passkey_lengths"]]
    ref = result["teacher_reference"]
    head = [
        "family",
        "tokens",
        "data",
        *[f"{_corpus_label(c)} @{w}" for c, w in cols],
        "greedy agree",
        *[f"passkey {L}" for L in lengths],
        "wall",
        "train tok/s",
        "command",
    ]
    lines = [
        _markdown_intro(result),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    teacher_cells = [
        f"{ref['perplexity'][c][w]['ppl']:.2f}" if w in ref["perplexity"].get(c, {}) else "–" for c, w in cols
    ]
    passkey_ref = {"accuracy": ref.get("passkey", {}), "recall": ref.get("passkey_recall", {})}
    lines.append(
        "| "
        + " | ".join(
            [
                "teacher",
                "–",
                "–",
                *teacher_cells,
                "100%",
                *[_passkey_cell(passkey_ref, L) for L in lengths],
                "–",
                "–",
                "–",
            ]
        )
        + " |"
    )
    lines += ["| " + " | ".join(_markdown_row(r, cols, lengths)) + " |" for r in result["cells"]]
    if result["stale_cells"]:
        lines += [
            "",
            f"Not shown (scored with other settings; rerun them with --only): {', '.join(result['stale_cells'])}.",
        ]
    if result.get("suite"):
        lines += ["", *format_suite_columns(result)]
    return "\n".join(lines)


def _markdown_row(r: dict, cols: list[tuple[str, str]], lengths: list[str]) -> list[str]:
    """One cell's row of the scoreboard."""
    ppl = []
    for c, w in cols:
        p = r["perplexity"].get(c, {}).get(w)
        ppl.append(f"{p['ppl']:.2f} · {p['ppl_ratio']:.2f}× · {p['top1_agreement']:.0%}" if p else "–")
    agree = r.get("generation_agreement", {}).get("token_agreement")
    passkey = r.get("passkey", {})
    tps = r.get("train_tokens_per_s")
    return [
        r["family"],
        f"{r['tokens']:,}",
        _data_cell(r.get("data")),
        *ppl,
        "–" if agree is None else f"{agree:.0%}",
        *[_passkey_cell(passkey, L) for L in lengths],
        _secs(r.get("wall_seconds")),
        "–" if tps is None else f"{tps:,.0f}",
        "`" + r["command"].replace("|", "\\|") + "`",
    ]


def _suite_cells(result: dict) -> list[dict]:
    """The cells scored with the grid's suite (cells scored before it keep "–")."""
    return [r for r in result["cells"] if (r.get("suite") or {}).get("settings") == result.get("suite")]


def format_suite_columns(result: dict) -> list[str]:
    """The suite's summary per cell: student score · recovered (ppl ratio: student / teacher)."""
    from attn2ssm.eval.suite_settings import settings_from_dict
    from attn2ssm.eval.tables import summary

    suite = settings_from_dict(result["suite"])
    scored = {(r["family"], r["tokens"]): r for r in _suite_cells(result)}
    if not scored:
        return [
            f"Suite {suite.name}: no cell scored with it yet (rerun: cached cells are scored on the suite alone, not retrained)."
        ]
    first = next(iter(scored.values()))
    labels = [label for label, _, _ in summary(first["suite"]["rows"], suite)]
    teacher = {label: t for label, t, _ in summary(first["suite"]["rows"], suite)}
    head = ["family", "tokens", "data", *labels, "suite CPU s"]
    lines = [
        f"Suite {suite.name} ({len(suite.tasks)} tasks, needles {len(suite.niah_forms)} forms × {suite.niah_trials} trials per length; "
        f"rows, SEs and n in each cell's cell.json): accuracies in %, student · recovered (student / teacher); the perplexity ratio is "
        f"student / teacher (geometric mean over {', '.join(c for c in suite.corpora if c not in ('sotu', 'moby-dick'))}).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| teacher | – | – | "
        + " | ".join(
            "–" if teacher[lb] is None else ("1.00×" if lb.startswith("ppl") else f"{100 * teacher[lb]:.1f}")
            for lb in labels
        )
        + " | – |",
    ]
    unscored = []
    for r in result["cells"]:
        rec = scored.get((r["family"], r["tokens"]))
        if rec is None:
            unscored.append(f"{r['family']}@{r['tokens']:,}")
            continue
        cells = []
        for label, t, st in summary(rec["suite"]["rows"], suite):
            if st is None:
                cells.append("–")
            elif label.startswith("ppl"):
                cells.append(f"{st:.2f}×")
            else:
                cells.append(f"{100 * st:.1f} · " + ("–" if not t else f"{100 * st / t:.0f}%"))
        row = [r["family"], f"{r['tokens']:,}", _data_cell(r.get("data")), *cells]
        lines.append("| " + " | ".join([*row, _secs(rec["suite"].get("cpu_seconds"))]) + " |")
    if unscored:
        lines += [
            "",
            f"Not scored on the suite (rerun the grid with their run directories to score them without retraining, "
            f"or retrain them with --only): {', '.join(unscored)}.",
        ]
    return lines


def format_plan(cells: list[Cell], settings: EvalSettings) -> str:
    return "\n".join(
        f"{c.name:<28} {c.status(settings):<8} {_data_cell(c.data):<20} stages {c.stage_tokens}  {c.command}"
        for c in cells
    )


def plot_quality(result: dict, path: Path) -> Path:
    """Student/teacher perplexity against training tokens, one panel per window (first corpus
    solid, the others dashed), one colour per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    windows = [str(w) for w in s["windows"]]
    families = list(dict.fromkeys(r["family"] for r in result["cells"]))
    if len({r["tokens"] for r in result["cells"]}) == 1:  # a sweep at one budget: bars, not a curve
        return _plot_sweep(result, families, windows, Path(path), plt)
    suite_cells = _suite_cells(result) if result.get("suite") else []
    panels = len(windows) + (2 if suite_cells else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.6 * panels, 4.3), squeeze=False)
    if suite_cells:
        _plot_suite_panels(result, suite_cells, families, axes[0][len(windows) :])
    lines = _lines(result["cells"])
    for ax, window in zip(axes[0], windows):
        for ci, corpus in enumerate(s["corpora"]):
            for fi, (label, cells) in enumerate(lines.items()):
                pts = sorted(
                    (r["tokens"], r["perplexity"][corpus][window]["ppl_ratio"])
                    for r in cells
                    if window in r["perplexity"].get(corpus, {})
                )
                if pts:
                    ax.plot(
                        *zip(*pts),
                        marker="o",
                        color=f"C{fi}",
                        linestyle="-" if ci == 0 else "--",
                        alpha=1.0 if ci == 0 else 0.6,
                        label=label if ci == 0 else None,
                    )
        _format_ratio_axis(ax, result, window, bool(families))
    fig.suptitle(f"quality vs budget: students of {result['teacher']}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lines(cells: list[dict]) -> dict[str, list[dict]]:
    """The budget curves: a family's cells, split by what they trained on where that differs (a
    recipe whose data changed is another curve, labelled with its data)."""

    def data(r: dict) -> str:
        d = r.get("data") or {}
        return f"{d.get('corpus', '?')} · {d.get('block_len', '?')}"

    kinds: dict[str, set] = {}
    for r in cells:
        kinds.setdefault(r["family"], set()).add(data(r))
    lines: dict[str, list[dict]] = {}
    for r in cells:
        label = r["family"] if len(kinds[r["family"]]) == 1 else f"{r['family']} ({data(r)})"
        lines.setdefault(label, []).append(r)
    return lines


def _format_ratio_axis(ax, result: dict, window: str, legend: bool) -> None:
    """One window's panel of ``plot_quality``: log axes, a tick per budget, readable minor ticks,
    the teacher's line at 1, labels and title."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    s = result["settings"]
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    budgets = sorted({r["tokens"] for r in result["cells"]})
    if budgets:
        ax.set_xticks(budgets, [_tokens_label(t) for t in budgets])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    low, high = ax.get_ylim()
    # within a decade label every minor tick, else 2s and 5s
    shown = "123456789" if high / low < 10 else "25"
    ax.yaxis.set_minor_formatter(
        FuncFormatter(lambda v, _, shown=shown: f"{v:.2g}" if f"{v:.2g}".lstrip("0.")[:1] in shown else "")
    )
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out ppl / teacher's")
    others = ", ".join(_corpus_label(c) for c in s["corpora"][1:])
    ax.set_title(
        f"window {window}: {_corpus_label(s['corpora'][0])} (solid)"
        + (f", {others} (dashed)" if others else ""),
        fontsize=9,
    )
    ax.grid(alpha=0.3, which="both")
    if legend:
        ax.legend(fontsize=8)


def _plot_suite_panels(result: dict, cells: list[dict], families: list[str], axes) -> None:
    """Two panels of the suite against training tokens: the core-task mean and MMLU 5-shot as the
    fraction of the teacher recovered; the needles' mean greedy match at the longest length."""
    from attn2ssm.eval.suite_settings import settings_from_dict
    from attn2ssm.eval.tables import summary

    suite = settings_from_dict(result["suite"])
    budgets = sorted({r["tokens"] for r in result["cells"]})
    styles = {"core avg": "-", "MMLU 5-shot": ":", (suite.generation.label if suite.generation else ""): "--"}
    needle_label, teacher_needle = None, None
    for fi, family in enumerate(families):
        points: dict = {}
        for r in sorted((c for c in cells if c["family"] == family), key=lambda c: c["tokens"]):
            for label, t, st in summary(r["suite"]["rows"], suite):
                if label in styles and t and st is not None:
                    points.setdefault(label, []).append((r["tokens"], st / t))
                elif label.startswith("NIAH") and st is not None:
                    needle_label, teacher_needle = label, t
                    points.setdefault(label, []).append((r["tokens"], st))
        for label, pts in points.items():
            ax = axes[1] if label.startswith("NIAH") else axes[0]
            ax.plot(
                *zip(*pts),
                marker="o",
                color=f"C{fi}",
                linestyle=styles.get(label, "-"),
                label=f"{family}: {label}" if not label.startswith("NIAH") else family,
            )
    axes[0].axhline(1.0, color="gray", linewidth=1)
    axes[0].set_ylabel("student / teacher")
    axes[0].set_title(
        "tasks recovered: " + ", ".join(f"{k} ({v})" for k, v in styles.items() if k), fontsize=8
    )
    if teacher_needle is not None:
        axes[1].axhline(teacher_needle, color="gray", linestyle="--", linewidth=1, label="teacher")
    axes[1].set_ylim(-0.05, 1.05)
    axes[1].set_ylabel("greedy match")
    axes[1].set_title(f"{needle_label or 'NIAH'}: mean of {', '.join(suite.niah_forms)}", fontsize=8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        if budgets:
            ax.set_xticks(budgets, [_tokens_label(t) for t in budgets])
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def _plot_sweep(result: dict, families: list[str], windows: list[str], path: Path, plt) -> Path:
    """One budget, several recipe variants: a horizontal bar per family and corpus, one panel per window."""
    s = result["settings"]
    corpora = s["corpora"]
    height = 0.8 / len(corpora)
    fig, axes = plt.subplots(
        1,
        len(windows),
        figsize=(5.6 * len(windows), 1.2 + 0.45 * len(families) * len(corpora)),
        squeeze=False,
    )
    for ax, window in zip(axes[0], windows):
        for ci, corpus in enumerate(corpora):
            ratios = [
                next(
                    (
                        r["perplexity"][corpus][window]["ppl_ratio"]
                        for r in result["cells"]
                        if r["family"] == f and window in r["perplexity"].get(corpus, {})
                    ),
                    float("nan"),
                )
                for f in families
            ]
            ys = [i + ci * height for i in range(len(families))]
            ax.barh(ys, ratios, height=height, color=f"C{ci}", label=_corpus_label(corpus))
            for y, v in zip(ys, ratios):
                if v == v:
                    ax.text(v, y, f" {v:.2f}×", va="center", fontsize=8)
        ax.set_yticks(
            [i + (len(corpora) - 1) * height / 2 for i in range(len(families))], families, fontsize=8
        )
        ax.invert_yaxis()
        finite = [
            r["perplexity"][c][window]["ppl_ratio"]
            for r in result["cells"]
            for c in corpora
            if window in r["perplexity"].get(c, {})
        ]
        if finite and max(finite) / max(min(finite), 1e-9) > 10:  # one bad variant would flatten the rest
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.axvline(1.0, color="gray", linewidth=1)
        ax.set_xlabel("held-out ppl / teacher's")
        ax.set_title(
            f"window {window}, {_tokens_label(result['cells'][0]['tokens'])} training tokens", fontsize=9
        )
        ax.grid(alpha=0.3, axis="x")
        ax.margins(x=0.15)
        if len(corpora) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"recipe sweep: students of {result['teacher']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

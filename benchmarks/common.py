"""Small helpers shared by the benchmark scripts: run metadata, JSON output, bar-chart PNGs.

Scripts in ``benchmarks/`` are run as ``python benchmarks/<name>.py``, so this module is
imported as plain ``common`` (the script's folder is on ``sys.path``). Keep it generic.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

from attn2ssm.eval.report import environment
from attn2ssm.paths import atomic_write_text


def run_info(script: str, argv: Sequence[str]) -> dict:
    """Machine + library versions, the exact command and a UTC timestamp, for a results file."""
    return {
        "command": shlex.join(["python", script, *argv]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment(),
    }


def _clean(obj):
    """JSON-safe copy: non-finite floats become null (json would write NaN, which is not JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: Path, data: dict) -> Path:
    """Write ``data`` as indented JSON, atomically (a crash leaves the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(_clean(data), indent=2) + "\n")
    return path


def bar_chart(path: Path, labels: Sequence[str], panels: Sequence[dict], title: str = "") -> Path:
    """One PNG with side-by-side bar panels over the same ``labels``.

    Each panel is a dict: ``values`` (None = missing, drawn as an empty slot), ``ylabel``, and
    optionally ``title``, ``fmt`` (bar label format, default "{:.2f}"), ``ylim``, ``log`` (log y axis) and
    ``hline`` = (y, label) for a reference line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.0, 0.75 * len(labels) + 1.5) * len(panels), 4.2))
    axes = [axes] if len(panels) == 1 else list(axes)
    colors = [f"C{i % 10}" for i in range(len(labels))]
    for ax, panel in zip(axes, panels):
        values = [v if v is not None and math.isfinite(v) else 0.0 for v in panel["values"]]
        bars = ax.bar(range(len(labels)), values, color=colors)
        fmt = panel.get("fmt", "{:.2f}")
        for bar, v in zip(bars, panel["values"]):
            text = "n/a" if v is None or not math.isfinite(v) else fmt.format(v)
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        top = max([*values, 0.0])
        if panel.get("hline") is not None:
            y, label = panel["hline"]
            top = max(top, y)
            ax.axhline(y, color="gray", linestyle="--", linewidth=1, label=label)
            ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
        if panel.get("log"):
            ax.set_yscale("log")
            low = min(
                [v for v in values if v > 0] + ([panel["hline"][0]] if panel.get("hline") else []) or [1.0]
            )
            ax.set_ylim(low / 2, 3 * top if top > 0 else 10)
        elif panel.get("ylim") is not None:
            ax.set_ylim(*panel["ylim"])
        elif top > 0:
            ax.set_ylim(0, 1.25 * top)  # headroom for bar labels and the legend
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.set_title(panel.get("title", ""))
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

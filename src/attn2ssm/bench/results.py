"""Where a benchmark's result goes: its JSON, the PNG beside it (``save_figure``), and its table on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from attn2ssm.paths import atomic_write_text


def write_result(
    result: dict, out: str | Path, plot: Callable[[dict, Path], object], fmt: Callable[[dict], str]
) -> None:
    """Write ``result`` to ``out`` (JSON, atomically) and ``plot`` it to the PNG beside it; then
    print ``fmt(result)`` and the two paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    png = plot(result, out.with_suffix(".png"))
    print(fmt(result))
    print(f"wrote {out} and {png}")


def save_figure(fig, path) -> Path:
    """Lay out ``fig``, write it to ``path`` (folders made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

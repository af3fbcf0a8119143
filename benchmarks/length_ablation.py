"""Length ablation: held-out perplexity of a teacher and its students at growing windows.

Each model is scored by ``attn2ssm eval MODEL --corpus C --window W --max-tokens N --json …``
(non-overlapping windows, the same N held-out tokens at every window); the ratio student/teacher
at each window says whether a student holds past its training blocks. A model may run one branch
of a window + linear student (``name=PATH@window``: the sliding-window softmax alone, the linear
branch switched off) — the ablation that says which branch loses the length.

    python benchmarks/length_ablation.py --teacher smollm2-135m \\
        --model base=runs/demo/student --model base_window=runs/demo/student@window \\
        --model decay512=runs/decay512/student --corpus kjv --windows 1024,4096,8192

Per-model, per-window eval JSONs go to ``--cache`` (a rerun skips what is there); the table is
written to benchmarks/results/length_ablation.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# benchmarks/ on sys.path first
from common import run_info, write_json  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def parse_model(spec: str) -> tuple[str, str, str]:
    """``name=PATH[@branch]`` → (name, path, branch); branch is ``both`` unless given."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(
            f"--model {spec!r} is not NAME=PATH[@branch]: write e.g. --model base=runs/demo/student"
        )
    path, _, branch = rest.partition("@")
    if branch not in ("", "both", "window", "linear"):
        raise SystemExit(f"--model {spec!r}: branch {branch!r} is not one of both, window, linear")
    return name, path, branch or "both"


def eval_command(path: str, branch: str, corpus: str, window: int, max_tokens: int, out: Path) -> list[str]:
    """The ``attn2ssm eval`` call that scores one model at one window."""
    cmd = [sys.executable, "-m", "attn2ssm", "eval", path, "--corpus", corpus, "--window", str(window)]
    cmd += ["--max-tokens", str(max_tokens), "--json", str(out)]
    return cmd + (["--branch", branch] if branch != "both" else [])


def score(name, path, branch, corpus, window, max_tokens, cache: Path) -> float:
    """Perplexity of one model at one window (read from ``cache`` when it was scored before)."""
    out = cache / f"ppl-{name}-{window}.json"
    if not out.exists():
        subprocess.run(eval_command(path, branch, corpus, window, max_tokens, out), check=True)
    return json.loads(out.read_text())["model"]["ppl"]


def table(ppl: dict[str, dict[int, float]], teacher: str) -> list[dict]:
    """Rows of (model, window, ppl, ratio to the teacher at that window)."""
    return [
        {"model": m, "window": w, "ppl": p, "ratio": p / ppl[teacher][w]}
        for m, by_window in ppl.items()
        for w, p in sorted(by_window.items())
    ]


def plot(rows: list[dict], teacher: str, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        pts = [(r["window"], r["ratio"]) for r in rows if r["model"] == model]
        style = {"linestyle": "--", "color": "grey"} if model == teacher else {"marker": "o"}
        ax.plot(*zip(*pts), label=model, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window (tokens)")
    ax.set_ylabel("perplexity / teacher's")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", default="smollm2-135m")
    p.add_argument("--model", action="append", default=[], help="NAME=PATH[@branch], repeatable")
    p.add_argument("--corpus", default="kjv")
    p.add_argument("--windows", default="1024,4096,8192")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--cache", type=Path, default=Path("runs/length_ablation"))
    p.add_argument("--out", type=Path, default=RESULTS / "length_ablation.json")
    p.add_argument("--notes", default="", help="what the models are (kept in the JSON)")
    args = p.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    models = [("teacher", args.teacher, "both"), *(parse_model(m) for m in args.model)]
    args.cache.mkdir(parents=True, exist_ok=True)
    ppl = {
        name: {w: score(name, path, branch, args.corpus, w, args.max_tokens, args.cache) for w in windows}
        for name, path, branch in models
    }
    rows = table(ppl, "teacher")
    title = f"{args.corpus}: {args.max_tokens} held-out tokens, non-overlapping windows"
    png = plot(rows, "teacher", args.out.with_suffix(".png"), title)
    result = {
        "corpus": args.corpus,
        "max_tokens": args.max_tokens,
        "models": [{"name": n, "path": pth, "branch": b} for n, pth, b in models],
        "rows": rows,
        "notes": args.notes,
        "png": png.name,
        **run_info("benchmarks/length_ablation.py", argv if argv is not None else sys.argv[1:]),
    }
    write_json(args.out, result)
    for r in rows:
        print(f"{r['model']:>14}  window {r['window']:>5}  ppl {r['ppl']:8.2f}  ratio {r['ratio']:.3f}")
    return result


if __name__ == "__main__":
    main()

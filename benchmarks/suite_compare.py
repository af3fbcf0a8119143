"""Several students' evaluation-suite tables side by side: one JSON, a markdown table and a PNG.

Each student is ``NAME=SUITE_JSON`` (``attn2ssm eval MODEL --suite standard [--quick] --out DIR``
writes ``DIR/suite.json``). A NAME given twice merges its files, the later one's rows winning: a
student whose generation task was rescored alone (``--rows generation``) keeps its other rows. Every
student must have been scored against the same teacher with the same suite settings; the teacher's
column comes from the files (they must agree where they overlap).

    python benchmarks/suite_compare.py mix=runs/a/suite/suite.json sotu=runs/b/suite/suite.json \\
        --title "quickstart at 2^17: SOTU-only vs mix:corpora" --out benchmarks/results/suite_data_mixture.json

Writes ``OUT`` (every row: teacher, each student's score and recovered fraction, n, standard
errors), ``OUT`` with ``.md`` and ``.png`` (recovered fraction per row, one bar per student).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_info, write_json  # noqa: E402  (benchmarks/ on sys.path first)

from attn2ssm.errors import ConfigError  # noqa: E402


def load_students(specs: list[str]) -> dict[str, dict[str, dict]]:
    """NAME=PATH pairs → {name: {row id: row}}, files of one name merged in order."""
    students: dict[str, dict[str, dict]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_file():
            raise ConfigError(
                f"{spec!r} is not NAME=SUITE_JSON of an existing file",
                "write e.g. mix=runs/a/suite/suite.json",
            )
        report = json.loads(Path(path).read_text())
        students.setdefault(name, {}).update({r["id"]: r for r in report["rows"]})
    return students


def merge_rows(students: dict[str, dict[str, dict]]) -> list[dict]:
    """One row per row id (first-seen order): the teacher's score and each student's."""
    order: dict[str, dict] = {}
    for rows in students.values():
        for rid, r in rows.items():
            order.setdefault(
                rid,
                {"id": rid, "group": r["group"], "metric": r["metric"], "teacher": r["teacher"], "n": r["n"]},
            )
            seen = order[rid]["teacher"]
            if (
                seen is not None
                and r["teacher"] is not None
                and abs(seen - r["teacher"]) > 1e-9 * max(1.0, abs(seen))
            ):
                raise ConfigError(
                    f"the teacher's {rid} differs between files ({seen} vs {r['teacher']})",
                    "compare students scored with the same teacher and suite settings",
                )
    for row in order.values():
        for name, rows in students.items():
            r = rows.get(row["id"])
            row[name] = (
                None if r is None else {k: r.get(k) for k in ("student", "recovered", "student_se", "ratio")}
            )
    return list(order.values())


def markdown(rows: list[dict], names: list[str], title: str) -> str:
    def cell(v, rid):
        if v is None or v.get("student") is None:
            return "–"
        s = v["student"]
        text = f"{s:.2f}" if rid.startswith("ppl/") else f"{100 * s:.1f}"
        return text + (f" ({100 * v['recovered']:.0f} %)" if v.get("recovered") is not None else "")

    def teacher(row):
        t = row["teacher"]
        return "–" if t is None else (f"{t:.2f}" if row["id"].startswith("ppl/") else f"{100 * t:.1f}")

    lines = [f"# {title}", "", "Scores (recovered: % of the teacher; perplexity: teacher / student).", ""]
    lines += ["| row | metric | n | teacher | " + " | ".join(names) + " |", "|---" * (4 + len(names)) + "|"]
    for row in rows:
        cells = [cell(row[n], row["id"]) for n in names]
        lines.append(
            f"| {row['group']} | {row['metric']} | {row['n']} | {teacher(row)} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], names: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if any(r[n] and r[n].get("recovered") is not None for n in names)]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(shown) * max(1, len(names)) / 1.5 + 1.6))
    height = 0.8 / len(names)
    for j, name in enumerate(names):
        values = [
            100 * r[name]["recovered"] if r[name] and r[name].get("recovered") is not None else 0.0
            for r in shown
        ]
        ax.barh([i + j * height for i in range(len(shown))], values, height=height, label=name, color=f"C{j}")
    ax.axvline(100, color="gray", linestyle="--", linewidth=1)
    ax.set_yticks(
        [i + 0.4 - height / 2 for i in range(len(shown))],
        [f"{r['group']}: {r['metric']}"[:48] for r in shown],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlabel("recovered (% of teacher)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("students", nargs="+", metavar="NAME=SUITE_JSON")
    p.add_argument("--title", default="evaluation suite, students side by side")
    p.add_argument("--out", required=True, help="JSON path; the .md and .png go beside it")
    args = p.parse_args(argv)
    try:
        students = load_students(args.students)
        rows = merge_rows(students)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = list(students)
    out = Path(args.out)
    write_json(
        out,
        {
            "title": args.title,
            "students": names,
            "rows": rows,
            **run_info("benchmarks/suite_compare.py", argv),
        },
    )
    out.with_suffix(".md").write_text(markdown(rows, names, args.title))
    plot(rows, names, out.with_suffix(".png"), args.title)
    print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

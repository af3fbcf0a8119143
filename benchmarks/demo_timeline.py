"""``make demo`` from a fresh clone with an empty attn2ssm cache, timed line by line.

    python benchmarks/demo_timeline.py --out benchmarks/results/demo_avx2.json --avx2
    python benchmarks/demo_timeline.py --out benchmarks/results/demo_native.json

Clones this checkout's HEAD into a temporary folder, runs ``make demo VENV=<--venv>`` there with
``ATTN2SSM_CACHE`` pointing at an empty folder (so the teacher is converted and every corpus fetched,
as on a new machine) and writes the timeline: every output line with its second, the phases'
durations, the teacher and student figures the demo printed, the machine and versions. ``--avx2``
hides native bf16 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``), as on a CPU without it.
The venv is reused, so the installs are a reinstall of attn2ssm alone (a fresh machine also
installs torch and the rest from the lock: not timed here); the venv's editable install is pointed
back at this checkout afterwards. Run it alone on the machine: its wall time is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import run_info, write_json  # noqa: E402  (benchmarks/ on sys.path first)

ROOT = Path(__file__).resolve().parent.parent

# (phase, the first line that starts it); a phase ends where the next one found starts
PHASES = (
    ("install", "pip install"),
    ("teacher conversion", "converting built-in teacher"),
    ("data", "data:"),
    ("layer selection", "scoring layers"),
    ("stage 1", "[stage 1/"),
    ("stage 2 and the run's held-out score", "[stage 2/"),
    ("the suite's rows", "== teacher vs student on held-out text"),
    ("the two continuations", "== the teacher"),
)


def _editable_pth(venv: Path) -> tuple[Path, str] | None:
    found = sorted(venv.glob("lib/python*/site-packages/__editable__.attn2ssm-*.pth"))
    return (found[0], found[0].read_text()) if found else None


def run_demo(venv: Path, avx2: bool) -> tuple[list[dict], float, Path, Path]:
    """Run ``make demo`` in a fresh clone; returns (events, wall seconds, clone, cache dir)."""
    work = Path(tempfile.mkdtemp(prefix="demo-timeline-"))
    clone, cache = work / "clone", work / "cache"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = dict(os.environ, ATTN2SSM_CACHE=str(cache), PYTHONUNBUFFERED="1")
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if avx2:
        env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    pth = _editable_pth(venv)
    events: list[dict] = []
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            ["make", "demo", f"VENV={venv}"],
            cwd=clone,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert proc.stdout is not None
        pending = ""
        while chunk := os.read(proc.stdout.fileno(), 4096):
            # progress bars redraw with \r: each redraw is a line of its own, timed when it arrives
            parts = re.split(r"[\r\n]", pending + chunk.decode("utf-8", "replace"))
            pending = parts.pop()
            t = round(time.monotonic() - start, 1)
            for part in parts:
                if part.strip():
                    events.append({"t_s": t, "line": part.rstrip()})
                    print(f"{t:7.1f}  {part.rstrip()}", flush=True)
        code = proc.wait()
    finally:
        if pth is not None:
            pth[0].write_text(pth[1])  # the venv's attn2ssm is this checkout again
    wall = time.monotonic() - start
    if code != 0:
        sys.exit(f"make demo failed (exit {code}); its output is above")
    return events, wall, clone, cache


def compressed(events: list[dict]) -> list[dict]:
    """A progress bar's redraws kept as its first and last line (the same label before the first ':')."""
    label = lambda e: e["line"].split(":", 1)[0] if "|" in e["line"] else None  # noqa: E731
    kept = []
    for i, e in enumerate(events):
        first = i == 0 or label(e) is None or label(events[i - 1]) != label(e)
        last = i + 1 == len(events) or label(e) is None or label(events[i + 1]) != label(e)
        if first or last:
            kept.append(e)
    return kept


def phases(events: list[dict], wall: float) -> dict:
    starts = []
    for name, marker in PHASES:
        hit = next((e["t_s"] for e in events if marker in e["line"]), None)
        if hit is not None:
            starts.append((hit, name))
    starts.sort()
    ends = [t for t, _ in starts[1:]] + [wall]
    return {name: round(end - t, 1) for (t, name), end in zip(starts, ends)}


def printed_results(events: list[dict], clone: Path) -> dict:
    out: dict = {}
    for e in events:
        m = re.match(r"^(teacher|student)\s+([0-9.]+)$", e["line"].strip())
        if m:
            out[f"{m.group(1)}_ppl"] = float(m.group(2))
    suite = clone / "runs" / "demo" / "suite" / "suite.json"
    if suite.exists():
        rows = json.loads(suite.read_text())["rows"]
        out["suite_rows"] = [
            {k: r.get(k) for k in ("id", "teacher", "student", "ratio", "n", "cpu_seconds")} for r in rows
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the timeline's JSON")
    p.add_argument("--venv", default=str(ROOT / ".venv"), help="an installed venv (make install)")
    p.add_argument("--avx2", action="store_true", help="hide native bf16, as on an AVX2-only CPU")
    args = p.parse_args(argv)
    venv = Path(args.venv).resolve()
    events, wall, clone, _ = run_demo(venv, args.avx2)
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in ln
        ),
        platform.processor(),
    )
    record = {
        "benchmark": "make demo, fresh clone, empty attn2ssm cache"
        + (", AVX2 simulated (no native bf16)" if args.avx2 else ""),
        **run_info("benchmarks/demo_timeline.py", sys.argv[1:] if argv is None else argv),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "machine": {"cpu": cpu + (" (AVX2 simulated)" if args.avx2 else ""), "cores": os.cpu_count()},
        "mixed_precision": next(
            (e["line"] for e in events if e["line"].startswith("mixed precision:")), None
        ),
        "wall_s": round(wall, 1),
        "phases_s": phases(events, wall),
        **printed_results(events, clone),
        "events": compressed(events),
    }
    print(f"wrote {write_json(Path(args.out), record)}: make demo took {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Forward+backward wall time of the SSM scans (chunked vs per-token loop) and softmax attention.

    python benchmarks/scan_speed.py [--lengths 512,1024,...] [--repeats 3] [--threads 2]

What is timed: the token-mixing core of ONE layer, batch 1, fp32, with the Mamba-in-the-Llama
geometry of SmolLM2-135M (9 heads × head dim 64, i.e. 576 channels); projections, conv and gates
are left out (the same for every method). All inputs require grad; one step = forward + backward
(``out.backward(g)`` with a fixed random g). Methods:

* ``ssd_chunked``        ``attn2ssm.ops.ssd.ssd_chunked`` (Mamba-2, h=9, p=64, n=64, chunk 64);
* ``ssd_loop``           ``ssd_sequential``, the per-token loop over ``ssd_step``;
* ``scan_chunked``       ``attn2ssm.ops.selective_scan.selective_scan_chunked`` (Mamba-1, 576
                         channels as g=36 groups × p=16, n=16, chunk 64);
* ``scan_loop``          ``selective_scan_sequential``, the per-token loop;
* ``sdpa``               causal softmax attention, ``F.scaled_dot_product_attention(is_causal=True)``
                         on q, k, v (1, 9, L, 64).

Time: the median of ``--repeats`` timed steps after one warm-up step (``time.perf_counter``;
``torch.cuda.synchronize`` around each step on CUDA). The per-token loops are slow, so lengths above
``--max-sequential-len`` are not run for them (recorded as null with the reason). The script sets
``OMP_WAIT_POLICY=PASSIVE`` unless already set (see below; recorded in the results).

Output: ``benchmarks/results/scan_speed.json`` — every point, the speedup of SSD chunked over the
SSD loop at ``--speedup-length`` (4096; acceptance target ≥ 10×), chunked vs SDPA per length,
config, machine, versions and the command — and ``scan_speed.png`` (time vs length, log-log).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# On a shared CPU, OpenMP threads that spin while waiting for a descheduled peer make every op
# 10-30x slower (seen here with 2 threads and one other busy process); passive waiting costs
# next to nothing on an idle machine. Must be set before torch loads (``common`` imports it); only
# when run as a script, so importing this module (tests) leaves the environment alone.
if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402  (benchmarks/common.py: run metadata and JSON output shared by the scripts)

DEFAULT_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
METHODS = ("ssd_chunked", "ssd_loop", "scan_chunked", "scan_loop", "sdpa")
SEQUENTIAL = {"ssd_loop", "scan_loop"}
LABELS = {
    "ssd_chunked": "SSD (Mamba-2) chunked",
    "ssd_loop": "SSD per-token loop",
    "scan_chunked": "selective scan (Mamba-1) chunked",
    "scan_loop": "selective scan per-token loop",
    "sdpa": "softmax attention (SDPA, causal)",
}
SPEEDUP_TARGET = 10.0


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build(method: str, length: int, args, device: str):
    """(step, leaves): step runs one forward + backward of ``method`` at ``length``."""
    import torch
    import torch.nn.functional as F

    from attn2ssm.ops.selective_scan import selective_scan_chunked, selective_scan_sequential
    from attn2ssm.ops.ssd import ssd_chunked, ssd_sequential

    gen = torch.Generator().manual_seed(args.seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    if method.startswith("ssd"):
        h, p, n = args.ssd_shape
        x, B, C = (
            randn(1, length, h, p),
            randn(1, length, h, n, scale=n**-0.5),
            randn(1, length, h, n, scale=n**-0.5),
        )
        a = -F.softplus(randn(1, length, h) - 4.0)  # log-decay ≤ 0, mostly slow decay
        D = torch.ones(h, device=device)
        leaves = [x, a, B, C, D]
        out_shape = x.shape
        if method == "ssd_chunked":
            fwd = lambda: ssd_chunked(x, a, B, C, D=D, chunk_size=args.chunk_size)[0]  # noqa: E731
        else:
            fwd = lambda: ssd_sequential(x, a, B, C, D=D)[0]  # noqa: E731
    elif method.startswith("scan"):
        g, p, n = args.scan_shape
        x, B, C = randn(1, length, g, p), randn(1, length, g, n), randn(1, length, g, n)
        dt = F.softplus(randn(1, length, g, p) - 4.0)  # Mamba's dt init range, already softplus'd
        # S4D-real init
        A = -torch.arange(1, n + 1, dtype=torch.float32, device=device).expand(g, p, n).contiguous()
        D = torch.ones(g, p, device=device)
        leaves = [x, dt, A, B, C, D]
        out_shape = x.shape
        if method == "scan_chunked":
            fwd = lambda: selective_scan_chunked(x, dt, A, B, C, D=D, chunk_size=args.chunk_size)[0]  # noqa: E731
        else:
            fwd = lambda: selective_scan_sequential(x, dt, A, B, C, D=D)[0]  # noqa: E731
    elif method == "sdpa":
        heads, head_dim = args.sdpa_shape
        q, k, v = (randn(1, heads, length, head_dim) for _ in range(3))
        leaves = [q, k, v]
        out_shape = q.shape
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        raise ValueError(f"unknown method {method!r}")
    for t in leaves:
        t.requires_grad_(True)
    grad_out = randn(*out_shape)

    def step():
        for t in leaves:
            t.grad = None
        fwd().backward(grad_out)

    return step, leaves


def run_point(method: str, length: int, args, device: str) -> dict:
    import torch

    rec = {"method": method, "device": device, "length": length, "status": "ok"}
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    step, _ = build(method, length, args, device)
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    rec["warmup_s"] = time.perf_counter() - t0
    times = []
    for _ in range(max(1, args.repeats)):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    rec.update(times_s=times, repeats=len(times), time_s=statistics.median(times))
    return rec


def summarize(records: list[dict], speedup_length: int) -> dict:
    """Per device: time table, SSD chunked over loop at ``speedup_length``, chunked forms vs SDPA."""
    out = {}
    for device in sorted({r["device"] for r in records}):
        t = {m: {} for m in METHODS}
        for r in records:
            if r["device"] == device and r["method"] in t:
                t[r["method"]][r["length"]] = r.get("time_s") if r.get("status") == "ok" else None

        def ratio(num, den, length, t=t):
            a, b = t[num].get(length), t[den].get(length)
            return a / b if a and b else None

        lengths = sorted({r["length"] for r in records if r["device"] == device})
        ssd_speedup = ratio("ssd_loop", "ssd_chunked", speedup_length)
        out[device] = {
            "time_s": {m: {str(L): t[m].get(L) for L in lengths} for m in METHODS if t[m]},
            f"speedup_ssd_chunked_vs_loop_at_{speedup_length}": ssd_speedup,
            "speedup_target": SPEEDUP_TARGET,
            "meets_target": None if ssd_speedup is None else ssd_speedup >= SPEEDUP_TARGET,
            f"speedup_scan_chunked_vs_loop_at_{speedup_length}": ratio(
                "scan_loop", "scan_chunked", speedup_length
            ),
            "sdpa_time_over_ssd_chunked": {str(L): ratio("sdpa", "ssd_chunked", L) for L in lengths},
            "sdpa_time_over_scan_chunked": {str(L): ratio("sdpa", "scan_chunked", L) for L in lengths},
        }
    return out


def table(records: list[dict], methods: list[str]) -> str:
    lengths = sorted({r["length"] for r in records})
    devices = sorted({r["device"] for r in records})
    lines = []
    for device in devices:
        lines.append(f"[{device}] forward+backward time, ms (median)")
        lines.append(f"{'length':>8} " + " ".join(f"{m:>13}" for m in methods))
        for L in lengths:
            cells = []
            for m in methods:
                r = next(
                    (r for r in records if r["device"] == device and r["method"] == m and r["length"] == L),
                    None,
                )
                cells.append(f"{r['time_s'] * 1e3:13.1f}" if r and r.get("status") == "ok" else f"{'—':>13}")
            lines.append(f"{L:>8} " + " ".join(cells))
    return "\n".join(lines)


def plot(records: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for d_i, device in enumerate(sorted({r["device"] for r in records})):
        for m_i, method in enumerate(METHODS):
            ok = sorted(
                (
                    r
                    for r in records
                    if r["device"] == device and r["method"] == method and r.get("status") == "ok"
                ),
                key=lambda r: r["length"],
            )
            if ok:
                style = ("--" if method in SEQUENTIAL else "-") if d_i == 0 else ":"
                ax.plot(
                    [r["length"] for r in ok],
                    [r["time_s"] for r in ok],
                    style,
                    marker="o",
                    color=f"C{m_i}",
                    label=f"{LABELS[method]} [{device}]",
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("forward+backward time (s), median")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="comma-separated sequence lengths"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed steps per point after one warm-up (default 3)"
    )
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--devices", default="cpu", help="cpu, cuda or cpu,cuda (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument(
        "--max-sequential-len",
        type=int,
        default=4096,
        help="longest length the per-token loops run at (longer: null)",
    )
    p.add_argument(
        "--speedup-length", type=int, default=4096, help="length at which SSD chunked vs loop is reported"
    )
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--ssd-shape", type=_ints, default=[9, 64, 64], help="h,p,n of the SSD (default 9,64,64)")
    p.add_argument(
        "--scan-shape",
        type=_ints,
        default=[36, 16, 16],
        help="g,p,n of the selective scan (default 36,16,16)",
    )
    p.add_argument("--sdpa-shape", type=_ints, default=[9, 64], help="heads,head_dim of SDPA (default 9,64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=str(HERE / "results" / "scan_speed.json"), help="JSON path; the PNG goes beside it"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = sorted(set(_ints(args.lengths)))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {','.join(METHODS)}")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    out = Path(args.out)

    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    wall0 = time.perf_counter()
    records = []
    for device in devices:
        for method in methods:
            for length in lengths:
                if method in SEQUENTIAL and length > args.max_sequential_len:
                    rec = {
                        "method": method,
                        "device": device,
                        "length": length,
                        "status": "skipped",
                        "time_s": None,
                        "reason": f"per-token loop longer than --max-sequential-len {args.max_sequential_len}",
                    }
                else:
                    try:
                        rec = run_point(method, length, args, device)
                    except torch.OutOfMemoryError as exc:
                        rec = {
                            "method": method,
                            "device": device,
                            "length": length,
                            "status": "skipped",
                            "time_s": None,
                            "reason": f"out of memory: {str(exc).splitlines()[0][:160]}",
                        }
                records.append(rec)
                shown = (
                    f"{rec['time_s'] * 1e3:10.1f} ms"
                    if rec["status"] == "ok"
                    else f"{rec['status']}: {rec['reason']}"
                )
                print(f"{device:>5} {method:>13} L={length:>6}  {shown}", flush=True)

    summary = summarize(records, args.speedup_length)
    info = common.run_info("benchmarks/scan_speed.py", argv)
    result = {
        "benchmark": "scan_speed",
        "description": "forward+backward of one layer's token mixing (no projections/conv/gates), batch 1, fp32",
        "config": {
            "batch": 1,
            "dtype": "float32",
            "lengths": lengths,
            "repeats": args.repeats,
            "warmup_steps": 1,
            "methods": methods,
            "labels": {m: LABELS[m] for m in methods},
            "devices": devices,
            "chunk_size": args.chunk_size,
            "max_sequential_len": args.max_sequential_len,
            "speedup_length": args.speedup_length,
            "ssd": dict(zip(("heads", "head_dim", "state_dim"), args.ssd_shape)),
            "selective_scan": dict(zip(("groups", "channels_per_group", "state_dim"), args.scan_shape)),
            "sdpa": dict(zip(("heads", "head_dim"), args.sdpa_shape)),
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        },
        "timing": "median of the timed steps (time.perf_counter; cuda.synchronize on CUDA) after one warm-up step",
        "load_average_start_end": [load_start, os.getloadavg() if hasattr(os, "getloadavg") else None],
        "wall_time_s": time.perf_counter() - wall0,
        "summary": summary,
        "points": records,
        **info,
    }
    common.write_json(out, result)
    env = info.get("environment", {})
    title = (
        f"one layer's token mixing, fwd+bwd, batch 1, fp32 — {env.get('processor', '')} ({env.get('cpu_count')} CPUs, "
        f"torch threads={torch.get_num_threads()}), torch {env.get('torch')}"
    )
    png = plot(records, out.with_suffix(".png"), title)
    print(table(records, methods))
    for device, s in summary.items():
        sp = s[f"speedup_ssd_chunked_vs_loop_at_{args.speedup_length}"]
        sp_scan = s[f"speedup_scan_chunked_vs_loop_at_{args.speedup_length}"]
        print(
            f"{device}: SSD chunked vs per-token loop at L={args.speedup_length}: "
            + (
                f"{sp:.1f}× (target ≥ {SPEEDUP_TARGET:.0f}×: {'met' if sp >= SPEEDUP_TARGET else 'NOT met'})"
                if sp
                else "n/a"
            )
            + (f"; selective scan chunked vs loop: {sp_scan:.1f}×" if sp_scan else "")
        )
    print(f"wrote {out} and {png}")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)

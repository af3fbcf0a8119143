"""Forward+backward wall time and peak memory of causal attention vs sequence length.

    python benchmarks/linear_attention_speed.py [--lengths 512,1024,...] [--repeats 3] [--quick]

What is timed: the token-mixing core of ONE attention layer, batch 1, 9 heads, head_dim 64, fp32
(SmolLM2-135M's geometry) — q, k, v (1, 9, L, 64) that require grad, one forward and one backward
(``out.backward(g)`` with a fixed random g). The q/k/v/o projections are left out: they are the
same for every method. Methods:

* ``sdpa``     softmax attention, ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
               (PyTorch picks its kernel: flash/memory-efficient where available, so memory is not L²);
* ``hedgehog`` attn2ssm's trainable Hedgehog feature maps (one for q, one for k; f = 2·64) +
               ``linear_attention_chunked`` (chunk 64, as the mixer uses);
* ``taylor``   the 2nd-order Taylor map (f = 1 + 64 + 64² = 4161) + chunked;
* ``elu``      1 + ELU (f = 64) + chunked — the classic linear-attention reference.

Time: the median of ``--repeats`` timed steps after one warm-up step (``time.perf_counter``,
``torch.cuda.synchronize`` around each step on CUDA).

Peak memory (bytes above what was live before the step, i.e. excluding the inputs q, k, v, g and
parameters, including activations, temporaries and the gradients the backward creates):

* CUDA: ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` around one step,
  after ``reset_peak_memory_stats`` — tensors only, the caching allocator's slack excluded.
* CPU: tracemalloc cannot see torch's allocations, so the process' resident set is measured:
  each (method, length) point runs in a fresh subprocess (``--isolation subprocess``, the
  default); after the warm-up step the kernel's peak-RSS counter is reset (``echo 5 >
  /proc/self/clear_refs``), the current RSS is read, one step runs, and peak = VmHWM − VmRSS
  before. glibc's malloc is told to serve every block ≥ 64 KiB with its own mmap (``mallopt
  M_MMAP_THRESHOLD``; the env var ``MALLOC_MMAP_THRESHOLD_`` for the subprocess), so freed
  tensors go back to the OS instead of hiding in the heap, where they would make a later step
  look cheaper. Where /proc/self/clear_refs is not writable the fallback is
  ``resource.getrusage`` ru_maxrss minus the RSS before the step, in the fresh process — then
  peak includes nothing from earlier steps only if the step's peak is the process' highest,
  which the result marks (``memory_method``). ``--isolation none`` runs every point in this
  process (fast, for smoke tests; the mallopt setting still applies, and the heap's free pages
  are handed back with ``malloc_trim(0)`` before each step, or memory freed before the threshold
  was set would be reused unseen and the step would read 0).

Skips: a point whose predicted time (the previous length's step time scaled by (L/L₀)² for SDPA,
L/L₀ for the linear forms, times warm-up + repeats) exceeds ``--point-budget`` seconds, or whose
predicted peak memory (measured peak scaled by L/L₀, or for the first point an analytic
estimate) exceeds ``--max-memory-gb``, is recorded as skipped with the reason, and so is every
longer length of that method; a subprocess that outlives 2 × budget is killed and recorded.
On CUDA an out-of-memory error is recorded as skipped.

Output: ``benchmarks/results/linear_attention_speed.json`` (``..._quick.json`` with --quick):
every point, per device the crossover length from which Hedgehog is faster than SDPA at every
measured length, the speedup at 16k, config, machine, versions and the command; and ``.png``
(time vs length log-log, memory vs length).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402  (benchmarks/common.py: run metadata and JSON output shared by the scripts)

DEFAULT_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]
QUICK_LENGTHS = [128, 256]
METHODS = (
    "sdpa",
    "hedgehog",
    "taylor",
    "elu",
    "hedgehog_fla",
    "lolcats_loop",
    "lolcats",
    "ssd",
    "ssd_fla",
    "gdn",
    "gdn_fla",
)
DEFAULT_METHODS = ("sdpa", "hedgehog", "taylor", "elu")
LABELS = {
    "sdpa": "softmax (SDPA, causal)",
    "hedgehog": "Hedgehog map + chunked",
    "taylor": "Taylor map + chunked",
    "elu": "1+ELU map + chunked",
    "hedgehog_fla": "Hedgehog map + fla chunk_simple_gla",
    "lolcats_loop": "LoLCATs window 64 + linear, block loop",
    "lolcats": "LoLCATs window 64 + linear, loop-free",
    "ssd": "Mamba-2 SSD, chunked",
    "ssd_fla": "Mamba-2 SSD, fla chunk_simple_gla",
    "gdn": "gated delta rule, chunked (WY)",
    "gdn_fla": "gated delta rule, fla chunk_gated_delta_rule",
}
FEATURE_MAP = {
    "hedgehog": "hedgehog",
    "taylor": "taylor",
    "elu": "elu",
    "hedgehog_fla": "hedgehog",
    "lolcats_loop": "hedgehog",
    "lolcats": "hedgehog",
}
TIME_EXPONENT = {m: 2.0 if m == "sdpa" else 1.0 for m in METHODS}
WINDOW = 64
MMAP_THRESHOLD = 64 * 1024
SPEEDUP_LENGTH = 16384
RESULT_TAG = "RESULT "


# ------------------------------------------------------------------------------------ memory probes
def _set_mmap_threshold() -> bool:
    """glibc: serve blocks ≥ 64 KiB by mmap (freed ones leave the RSS). False where not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD))  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


def _release_free_heap() -> bool:
    """glibc: hand the heap's free pages back to the OS (``malloc_trim(0)``), so a step that reuses
    them raises the RSS. A long-lived process (a test session) holds freed memory from before the
    mmap threshold was set, which a step would otherwise reuse unseen. False where not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def _proc_status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.M)
    return int(m.group(1)) if m else None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ------------------------------------------------------------------------------------ one point
def _scan_forward(method: str, q, k, v, heads: int, length: int, device, chunk_size: int, leaves: list):
    """The forward of a state-space / delta-rule method on (1, h, l, d) q, k, v (their layout
    (b, l, h, d) inside), with its decay (and write strength) as extra leaves."""
    import torch
    import torch.nn.functional as F

    from attn2ssm.ops.gated_delta import gated_delta_chunked
    from attn2ssm.ops.ssd import ssd_chunked

    backend = "fla" if method.endswith("_fla") else "torch"
    decay = (-0.1 * torch.rand(1, length, heads, device=device)).requires_grad_()
    leaves.append(decay)
    x, B, C = v.transpose(1, 2), k.transpose(1, 2), q.transpose(1, 2)
    if method.startswith("ssd"):
        return lambda: ssd_chunked(x, decay, B, C, chunk_size=chunk_size, backend=backend)[0].transpose(1, 2)
    beta = torch.rand(1, length, heads, device=device).requires_grad_()
    leaves.append(beta)
    return lambda: gated_delta_chunked(
        F.normalize(C, dim=-1), F.normalize(B, dim=-1), x, decay, beta, chunk_size=chunk_size, backend=backend
    )[0].transpose(1, 2)


def _map_forward(method: str, q, k, v, heads: int, head_dim: int, device, chunk_size: int, leaves: list):
    """The forward of a feature-map method: phi(q), phi(k) through the linear (or window + linear) form."""
    import torch

    from attn2ssm.mixers.feature_maps import build_feature_map
    from attn2ssm.ops.linear_attention import (
        linear_attention_chunked,
        window_linear_attention,
        window_linear_attention_chunked,
    )

    phi_q = build_feature_map(FEATURE_MAP[method], heads, head_dim).to(device, q.dtype)
    phi_k = build_feature_map(FEATURE_MAP[method], heads, head_dim).to(device, q.dtype)
    leaves += [p for p in (*phi_q.parameters(), *phi_k.parameters()) if p.requires_grad]
    if not method.startswith("lolcats"):
        backend = "fla" if method.endswith("_fla") else "torch"
        return lambda: linear_attention_chunked(
            phi_q(q), phi_k(k), v, chunk_size=chunk_size, backend=backend
        )[0]
    opts = {"scaling": head_dim**-0.5, "window": WINDOW, "gamma": torch.full((heads,), 0.5, device=device)}
    if method == "lolcats":
        return lambda: window_linear_attention_chunked(
            q, k, v, phi_q(q), phi_k(k), chunk_size=chunk_size, **opts
        )[0]

    def block_loop():  # what the mixer runs on a CPU: blocks of chunk_size queries against [window cache; block]
        state, outs = None, []
        pieces = [t.split(chunk_size, dim=2) for t in (q, k, v, phi_q(q), phi_k(k))]
        for qc, kc, vc, fqc, fkc in zip(*pieces):
            o, state = window_linear_attention(qc, kc, vc, fqc, fkc, state=state, **opts)
            outs.append(o)
        return torch.cat(outs, 2)

    return block_loop


def _build(
    method: str,
    heads: int,
    head_dim: int,
    length: int,
    device,
    chunk_size: int,
    seed: int,
    dtype: str = "float32",
):
    """(step function, inputs) for one method; the step runs forward + backward once."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    shape = (1, heads, length, head_dim)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(shape, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dt)
    leaves = [q, k, v]
    if method == "sdpa":

        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    elif method.startswith(("ssd", "gdn")):
        forward = _scan_forward(method, q, k, v, heads, length, device, chunk_size, leaves)
    else:
        forward = _map_forward(method, q, k, v, heads, head_dim, device, chunk_size, leaves)

    def step():
        for t in leaves:
            t.grad = None
        forward().to(grad_out.dtype).backward(grad_out)

    return step, leaves


def run_point(spec: dict) -> dict:
    """Measure one (method, length, device) point. ``spec``: method, length, device, heads,
    head_dim, chunk_size, repeats, seed, point_budget, threads. Returns the point's record."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    method, length, device = spec["method"], int(spec["length"]), spec["device"]
    rec = {
        "method": method,
        "device": device,
        "length": length,
        "status": "ok",
        "threads": torch.get_num_threads(),
    }
    mallopt = _set_mmap_threshold() if device == "cpu" else None
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        step, leaves = _build(
            method,
            spec["heads"],
            spec["head_dim"],
            length,
            device,
            spec["chunk_size"],
            spec["seed"],
            spec.get("dtype", "float32"),
        )
    except Exception as exc:  # e.g. a feature map this attn2ssm does not have
        return {**rec, "status": "failed", "reason": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    try:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        rec["warmup_s"] = time.perf_counter() - t0

        # Peak memory of one step; the warm-up's gradients are dropped first so the baseline holds only the inputs.
        for t in leaves:
            t.grad = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            sync()
            rec["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated() - base)
            rec["memory_method"] = "cuda.max_memory_allocated - memory_allocated before the step"
        else:
            _release_free_heap()
            if _reset_peak_rss():
                rss0 = _proc_status_kib("VmRSS")
                step()
                hwm = _proc_status_kib("VmHWM")
                rec["peak_memory_bytes"] = max(0, (hwm - rss0) * 1024)
                rec["memory_method"] = (
                    "VmHWM - VmRSS before the step, peak RSS reset via /proc/self/clear_refs"
                )
            else:
                before_max = _maxrss_bytes()
                rss0 = (_proc_status_kib("VmRSS") or 0) * 1024
                step()
                after_max = _maxrss_bytes()
                rec["peak_memory_bytes"] = max(0, after_max - rss0)
                rec["memory_method"] = "ru_maxrss - RSS before the step" + (
                    ""
                    if after_max > before_max
                    else " (UPPER BOUND: the step did not raise the process' peak)"
                )
            rec["mallopt_mmap_threshold"] = mallopt
        rec["peak_memory_mib"] = rec["peak_memory_bytes"] / 2**20

        # Time: median of the repeats, fewer where one step would blow the budget.
        repeats = max(1, int(spec["repeats"]))
        budget = float(spec.get("point_budget") or math.inf)
        if rec["warmup_s"] * (repeats + 2) > budget:
            repeats = max(1, int(budget // max(rec["warmup_s"], 1e-9)) - 2)
            rec["repeats_reduced_by_budget"] = True
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        rec["times_s"] = times
        rec["repeats"] = len(times)
        rec["time_s"] = statistics.median(times)
    except torch.OutOfMemoryError as exc:
        rec.update(status="skipped", reason=f"out of memory on {device}: {str(exc).splitlines()[0][:160]}")
    return rec


def _worker(spec_json: str) -> int:
    """Subprocess entry: run one point, print it as one JSON line."""
    rec = run_point(json.loads(spec_json))
    print(RESULT_TAG + json.dumps(rec), flush=True)
    return 0


def _run_isolated(spec: dict, timeout: float) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    base = {"method": spec["method"], "device": spec["device"], "length": spec["length"]}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**base, "status": "skipped", "reason": f"killed after {timeout:.0f} s (time limit)"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    if proc.returncode < 0 or proc.returncode == 137:
        return {
            **base,
            "status": "skipped",
            "reason": f"worker killed (signal {-proc.returncode}; out of memory?): {tail}",
        }
    return {**base, "status": "failed", "reason": f"worker exit {proc.returncode}: {tail}"}


# ------------------------------------------------------------------------------------ planning
def feature_dim(method: str, head_dim: int) -> int | None:
    """The state's key width: the feature map's output, or head_dim for SSD / the delta rule (None: softmax)."""
    if method == "sdpa":
        return None
    return {"hedgehog": 2 * head_dim, "taylor": 1 + head_dim + head_dim**2, "elu": head_dim}.get(
        FEATURE_MAP.get(method), head_dim
    )


def estimate_memory_bytes(method: str, length: int, heads: int, head_dim: int, chunk_size: int) -> float:
    """Rough peak (fp32) for a first point, before anything was measured: a safety net only."""
    per_token = heads * head_dim * 4 * 8  # outputs, grads of q/k/v, temporaries
    if method == "sdpa":
        return length * per_token
    f = feature_dim(method, head_dim)
    features = 8 * heads * length * f * 4  # φq, φk, map intermediates and their grads
    states = 2 * math.ceil(length / chunk_size) * heads * f * head_dim * 4  # kv per chunk, kept for backward
    return length * per_token + features + states


def memory_exponent(method: str, measured: list[dict]) -> float:
    """Growth exponent of peak memory in L for the prediction: from the last two measured points
    (clamped to [1, 2]); before that 1 for the linear forms and 2 for SDPA (its kernel may be L²)."""
    pts = [r for r in measured if r.get("peak_memory_bytes")]
    if len(pts) >= 2 and pts[-1]["length"] != pts[-2]["length"]:
        a, b = pts[-2], pts[-1]
        p = math.log(b["peak_memory_bytes"] / a["peak_memory_bytes"]) / math.log(b["length"] / a["length"])
        return min(2.0, max(1.0, p))
    return 2.0 if method == "sdpa" else 1.0


def _available_memory_bytes() -> float:
    kib = None
    try:
        m = re.search(r"^MemAvailable:\s+(\d+)\s+kB", Path("/proc/meminfo").read_text(), re.M)
        kib = int(m.group(1)) if m else None
    except OSError:
        pass
    return kib * 1024 if kib else 8 * 2**30


def crossover(points: dict[int, dict], fast: str = "hedgehog", slow: str = "sdpa") -> dict:
    """First measured length from which ``fast`` beats ``slow`` at every measured longer length."""
    both = sorted(
        L for L in points if points[L].get(fast, {}).get("time_s") and points[L].get(slow, {}).get("time_s")
    )
    if not both:
        return {"length": None, "note": "no length where both were measured"}
    ratio = {L: points[L][fast]["time_s"] / points[L][slow]["time_s"] for L in both}
    first = None
    for L in reversed(both):
        if ratio[L] < 1:
            first = L
        else:
            break
    if first is None:
        return {
            "length": None,
            "note": f"{fast} slower than {slow} at every measured length (up to {both[-1]})",
        }
    out = {"length": first, "ratios": {str(L): ratio[L] for L in both}}
    i = both.index(first)
    if i == 0:
        out["note"] = f"{fast} already faster at the shortest measured length; the crossover is ≤ {first}"
    else:  # log-log interpolation of the time ratio between the bracketing lengths
        a, b = both[i - 1], first
        la, lb, ra, rb = math.log(a), math.log(b), math.log(ratio[a]), math.log(ratio[b])
        out["interpolated"] = round(math.exp(la + (0 - ra) * (lb - la) / (rb - ra))) if rb != ra else first
    return out


def summarize(records: list[dict]) -> dict:
    summary = {}
    for device in sorted({r["device"] for r in records}):
        points: dict[int, dict] = {}
        for r in records:
            if r["device"] == device and r.get("status") == "ok":
                points.setdefault(r["length"], {})[r["method"]] = r
        at = points.get(SPEEDUP_LENGTH, {})
        speedup = None
        if at.get("sdpa", {}).get("time_s") and at.get("hedgehog", {}).get("time_s"):
            speedup = at["sdpa"]["time_s"] / at["hedgehog"]["time_s"]
        summary[device] = {
            "crossover_hedgehog_vs_sdpa": crossover(points),
            f"speedup_hedgehog_vs_sdpa_at_{SPEEDUP_LENGTH}": speedup,
            "speedup_note": None
            if speedup is not None
            else f"needs both sdpa and hedgehog measured at {SPEEDUP_LENGTH}",
        }
    return summary


# ------------------------------------------------------------------------------------ output
def _run_info(argv: list[str]) -> dict:
    return common.run_info("benchmarks/linear_attention_speed.py", argv)


def _write_json(path: Path, data: dict) -> None:
    common.write_json(path, data)


def plot(records: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6))
    devices = sorted({r["device"] for r in records})
    for d_i, device in enumerate(devices):
        style = "-" if d_i == 0 else "--"
        for m_i, method in enumerate(METHODS):
            ok = sorted(
                (
                    r
                    for r in records
                    if r["device"] == device and r["method"] == method and r.get("status") == "ok"
                ),
                key=lambda r: r["length"],
            )
            if not ok:
                continue
            label = f"{LABELS[method]} [{device}]"
            xs = [r["length"] for r in ok]
            ax_t.plot(xs, [r["time_s"] for r in ok], style, marker="o", color=f"C{m_i}", label=label)
            mem = [(r["length"], r["peak_memory_bytes"] / 2**20) for r in ok if r.get("peak_memory_bytes")]
            if mem:
                ax_m.plot(*zip(*mem), style, marker="o", color=f"C{m_i}", label=label)
            skipped = [
                r
                for r in records
                if r["device"] == device and r["method"] == method and r.get("status") != "ok"
            ]
            for r in skipped:
                ax_t.axvline(r["length"], color=f"C{m_i}", alpha=0.08)
    for ax, ylabel in ((ax_t, "forward+backward time (s)"), (ax_m, "peak memory above inputs (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax_t.set_title("time (median), log-log")
    ax_m.set_title("peak memory, log-log")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------ driver
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default=None, help="comma-separated (default 512,1024,2048,4096,8192,16384)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed steps per point after one warm-up (default 3)"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: lengths 128,256, 1 repeat, results to *_quick.json"
    )
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"subset of {','.join(METHODS)} (*_fla: CUDA, attn2ssm[gpu])",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="inputs' dtype (the forms compute their scans in fp32)",
    )
    p.add_argument(
        "--devices", default="auto", help="cpu, cuda or cpu,cuda; auto = cpu plus cuda if available"
    )
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument(
        "--point-budget",
        type=float,
        default=300.0,
        help="seconds one point may take (predicted); longer ones are skipped",
    )
    p.add_argument(
        "--max-memory-gb",
        type=float,
        default=None,
        help="skip points predicted to need more (default: half of MemAvailable, at most 32)",
    )
    p.add_argument(
        "--isolation",
        choices=("subprocess", "none"),
        default="subprocess",
        help="CPU points in a fresh process each (default; honest peak RSS) or in this one",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/linear_attention_speed[_quick].json); the PNG goes beside it",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _over_budget(
    args, method: str, length: int, prev: dict | None, measured: list[dict], repeats: int, max_mem: float
) -> str | None:
    """Why the point at ``length`` is skipped, predicted from the last measured point (time) and
    the analytic estimate (memory); None when it fits the budgets."""
    t_pred, m_pred = 0.0, 0.0
    if prev:
        scale = length / prev["length"]
        t_pred = prev["time_s"] * scale ** TIME_EXPONENT[method] * (repeats + 1)
        m_pred = prev.get("peak_memory_bytes", 0) * scale ** memory_exponent(method, measured)
    # An RSS reading can under-report (memory the allocator reuses, notably without
    # subprocess isolation), so never predict less than the analytic estimate.
    m_pred = max(m_pred, estimate_memory_bytes(method, length, args.heads, args.head_dim, args.chunk_size))
    if t_pred > args.point_budget:
        return f"predicted {t_pred:.0f} s > --point-budget {args.point_budget:.0f} s"
    if m_pred > max_mem:
        return f"predicted peak memory {m_pred / 2**30:.1f} GiB > limit {max_mem / 2**30:.1f} GiB"
    return None


def _measure_method(
    args, device: str, method: str, lengths: list[int], repeats: int, max_mem: float
) -> list[dict]:
    """One method on one device at every length, shortest first; once a point is over budget or
    fails, every longer one is skipped."""
    isolated = device == "cpu" and args.isolation == "subprocess"
    records = []
    prev = None  # last measured point of this method on this device
    measured: list[dict] = []
    stop_reason = None
    for length in lengths:
        base = {"method": method, "device": device, "length": length}
        if stop_reason:
            records.append({**base, "status": "skipped", "reason": stop_reason})
            continue
        reason = _over_budget(args, method, length, prev, measured, repeats, max_mem)
        if reason:
            records.append({**base, "status": "skipped", "reason": reason})
            stop_reason = f"skipped at a shorter length ({reason})"
            continue
        spec = {
            **base,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "chunk_size": args.chunk_size,
            "dtype": args.dtype,
            "repeats": repeats,
            "seed": args.seed,
            "point_budget": args.point_budget,
            "threads": args.threads,
        }
        rec = _run_isolated(spec, timeout=max(2 * args.point_budget, 60)) if isolated else run_point(spec)
        records.append(rec)
        shown = (
            f"{rec['time_s'] * 1e3:10.1f} ms  {rec.get('peak_memory_bytes', 0) / 2**20:9.1f} MiB"
            if rec.get("status") == "ok"
            else f"{rec['status']}: {rec.get('reason')}"
        )
        print(f"{device:>5} {method:>12} L={length:>6}  {shown}", flush=True)
        if rec.get("status") == "ok":
            prev = rec
            measured.append(rec)
        else:
            stop_reason = f"{rec['status']} at a shorter length ({rec.get('reason')})"
        gc.collect()
    return records


def _print_crossovers(summary: dict) -> None:
    for device, s in summary.items():
        c = s["crossover_hedgehog_vs_sdpa"]
        sp = s[f"speedup_hedgehog_vs_sdpa_at_{SPEEDUP_LENGTH}"]
        print(
            f"{device}: Hedgehog faster than SDPA from L = {c.get('length')}"
            + (f" (interpolated {c['interpolated']})" if c.get("interpolated") else "")
            + (f"; {c['note']}" if c.get("note") else "")
            + (f"; speedup at {SPEEDUP_LENGTH}: {sp:.2f}×" if sp else "")
        )


def main(argv: list[str] | None = None) -> dict | int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    import torch

    lengths = (
        [int(x) for x in args.lengths.split(",")]
        if args.lengths
        else (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    )
    lengths = sorted(set(lengths))
    repeats = args.repeats or (1 if args.quick else 3)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {','.join(METHODS)}")
    if args.devices == "auto":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    else:
        devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    max_mem = (
        args.max_memory_gb * 2**30 if args.max_memory_gb else min(0.5 * _available_memory_bytes(), 32 * 2**30)
    )
    out = (
        Path(args.out)
        if args.out
        else HERE / "results" / f"linear_attention_speed{'_quick' if args.quick else ''}.json"
    )

    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    records = [
        rec
        for device in devices
        for method in methods
        for rec in _measure_method(args, device, method, lengths, repeats, max_mem)
    ]

    summary = summarize(records)
    info = _run_info(argv)
    result = {
        "benchmark": "linear_attention_speed",
        "description": "forward+backward of one causal attention layer's token mixing (no projections), batch 1",
        "config": {
            "batch": 1,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "chunk_size": args.chunk_size,
            "lengths": lengths,
            "repeats": repeats,
            "warmup_steps": 1,
            "methods": methods,
            "devices": devices,
            "feature_dims": {m: feature_dim(m, args.head_dim) for m in methods},
            "labels": {m: LABELS[m] for m in methods},
            "isolation": args.isolation,
            "point_budget_s": args.point_budget,
            "max_memory_bytes": max_mem,
            "torch_threads": torch.get_num_threads() if args.threads is None else args.threads,
        },
        "timing": "median of the timed steps (time.perf_counter; cuda.synchronize on CUDA) after one warm-up step",
        "memory": (
            "peak bytes above what was live before one step (inputs excluded). CPU: peak RSS (VmHWM after resetting it "
            "via /proc/self/clear_refs) minus RSS before, in a fresh subprocess per point, glibc mmap threshold 64 KiB so "
            "freed tensors leave the RSS. CUDA: torch.cuda.max_memory_allocated minus memory_allocated before."
        ),
        "load_average_start_end": [load_start, os.getloadavg() if hasattr(os, "getloadavg") else None],
        "summary": summary,
        "points": records,
        **info,
    }
    _write_json(out, result)
    env = info.get("environment", {})
    title = (
        f"causal attention fwd+bwd, batch 1, {args.heads} heads × {args.head_dim}, {args.dtype} — "
        f"{env.get('processor', '')} ({env.get('cpu_count')} CPUs, torch threads={result['config']['torch_threads']})"
        + (f", {env['cuda']}" if env.get("cuda") else "")
        + f", torch {env.get('torch')}"
    )
    png = plot(records, out.with_suffix(".png"), title)
    _print_crossovers(summary)
    print(f"wrote {out} and {png}")
    return result


if __name__ == "__main__":
    r = main()
    sys.exit(r if isinstance(r, int) else 0)

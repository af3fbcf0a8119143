"""The helpers of benchmarks/gpu/train.sh (the first GPU-trained students, issue 36): the recipes it
runs, their token budgets from measured rates, and one results JSON.

    python benchmarks/gpu/train_plan.py recipe BASE OUT.yaml --teacher DIR --sources DIR:W,... --block-len N
                                   --step-tokens S --tokens T1[,T2] [--init-from STUDENT] [--precision bf16]
    python benchmarks/gpu/train_plan.py rates METRICS.jsonl            median tokens/s per stage (steps after the first two)
    python benchmarks/gpu/train_plan.py plan PROBE.json --seconds S --final-seconds F [--safety 0.8] [--long-factor 0.8]
    python benchmarks/gpu/train_plan.py results OUT.json --work DIR ...   device, versions, tokens, wall time, tokens/s, MFU

Budgets: a probe run of a few steps per stage gives each stage's tokens/s (r1 for the first stage,
r2 for the KD stage); the main run's T tokens split as the base recipe splits its two stages (share
f to the first: gdn_hybrid25 3:1, f = 0.75) take T * (f / r1 + (1 - f) / r2) seconds, so
T = safety * S / (f / r1 + (1 - f) / r2); the final KD stage
on 4096-token blocks gets safety * F * r2 * long_factor tokens (long_factor: the 4096-token rate as
a share of the 1024-token one; train.sh plans it after the main run, from that run's own rates,
with LONG_FACTOR = 0.25: the third GPU run measured 0.18).

MFU: model FLOPs per training token of a KD step = 2 N_teacher (the frozen teacher's forward) +
6 N_student (the student's forward and backward, weight gradients counted for every parameter: the
issue's accounting, ~1.1 GFLOP a token for the built-in teacher), N = all parameters that take part in
a matrix product (the tied embedding counted once, as the LM head); attention-score FLOPs are left
out. `mfu_low` counts 4 N_student instead (no weight gradients: LoRA / mixer-only stages compute few).
Peak: 989 TFLOP/s, the H100/H200 SXM datasheet's dense bf16 rate (KINDS.md measured ~790 for an
8192^3 bf16 product on both).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

PEAK_BF16 = 989e12  # H100 / H200 SXM dense bf16, FLOP/s (datasheet)


def _base_recipe(base: str) -> dict:
    from attn2ssm.distill.recipe import builtin_recipes

    recipes = builtin_recipes()
    path = recipes[base] if base in recipes else Path(base)
    return yaml.safe_load(Path(path).read_text())


def _first_share(base: str | None) -> float:
    """The base recipe's own split between its first two trained stages (gdn_hybrid25: 3:1 for the
    hidden alignment; the third GPU run's fixed 1:3 inverted it)."""
    if base is None:
        raise SystemExit("plan needs --recipe BASE (its stages' split) or --first-share")
    first, second = [s["tokens"] for s in _base_recipe(base)["stages"] if s.get("tokens") != 0][:2]
    return first / (first + second)


def cmd_recipe(args) -> None:
    """A base recipe made for the GPU run: the carried / generated shards as a weighted mixture, the
    block length, batch = step tokens / block length, bf16, and the given stage budgets. With
    --init-from: one stage, the base recipe's last (KD) stage, continuing that trained student."""
    raw = _base_recipe(args.base)
    sources = []
    for item in args.sources.split(","):
        folder, _, weight = item.rpartition(":")
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
        # too few tokens for blocks of this length
        if sum(f["tokens"] for f in manifest["sides"]["train"]) < 4 * args.block_len:
            print(f"leaving out {folder}: fewer than 4 blocks of {args.block_len} tokens")
            continue
        sources.append({"corpus": f"shards:{folder}", "weight": float(weight)})
    raw["name"] = Path(args.out).stem
    raw["teacher"] = args.teacher
    raw["mixed_precision"] = args.precision
    raw["device"] = args.device
    raw["data"] = {
        "corpus": None,
        "sources": sources,
        "block_len": args.block_len,
        "max_heldout_tokens": args.heldout_tokens,
    }
    batch = max(1, args.step_tokens // args.block_len)
    tokens = [int(t) for t in args.tokens.split(",")]
    # A base recipe's optional stages (tokens: 0, e.g. the 25 % hybrids' long_kd on 4096-token
    # blocks) are left out of the main run; with --init-from the last stage (that long KD stage where
    # the recipe has one) continues the trained student at --block-len.
    stages = (
        [copy.deepcopy(raw["stages"][-1])]
        if args.init_from
        else [s for s in raw["stages"] if s.get("tokens") != 0]
    )
    for stage in stages:
        stage.pop("block_len", None)  # every stage here runs at --block-len
    if args.init_from:
        raw["student"] = {**raw.get("student", {}), "init_from": args.init_from}
        stages[0]["name"] = f"final_kd_{args.block_len}"
        if stages[0]["kind"] not in ("kd", "kd_ce"):
            raise SystemExit(f"{args.base}'s last stage is {stages[0]['kind']}, not a KD stage")
    if len(tokens) != len(stages):
        raise SystemExit(f"--tokens gives {len(tokens)} budgets for {len(stages)} stages")
    for stage, budget in zip(stages, tokens):
        steps = max(1, math.ceil(budget / (batch * args.block_len)))
        stage.update(
            tokens=steps * batch * args.block_len,
            batch_size=batch,
            eval_every=0,
            keep_checkpoints=1,
            save_every=max(1, steps // args.checkpoints),
        )
        stage.pop("attention_ratio", None) if args.init_from else None
    raw["stages"] = stages
    raw["eval"] = {"max_tokens": args.eval_tokens, "window": args.block_len, "batch_size": 4}
    Path(args.out).write_text(yaml.safe_dump(raw, sort_keys=False))
    described = [
        f"{s['name']} {s['tokens']} tokens ({s['tokens'] // (batch * args.block_len)} steps of {batch} x {args.block_len})"
        for s in stages
    ]
    print(f"{args.out}: {', '.join(described)}")


def stage_rates(metrics: Path, skip: int = 2) -> dict:
    """Per stage: steps, tokens, median tokens/s over the steps after the first ``skip`` (warm-up,
    compilation, autotuning), and the wall seconds the logged steps took."""
    out: dict = {}
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "tokens_per_s" not in row or "event" in row:
            continue
        name = row.get("stage") or row.get("stage_name") or str(row.get("stage_index", "?"))
        out.setdefault(name, []).append(row)
    rates = {}
    for name, rows in out.items():
        tps = [r["tokens_per_s"] for r in rows]
        steady = tps[skip:] or tps
        seen = [r.get("tokens", 0) for r in rows]  # the stage's tokens so far, after each step
        per_step = [b - a for a, b in zip([0, *seen[:-1]], seen)]
        rates[name] = {
            "steps": len(rows),
            "tokens": seen[-1],
            "tokens_per_s": statistics.median(steady),
            "seconds": round(
                sum(t / r["tokens_per_s"] for t, r in zip(per_step, rows) if r["tokens_per_s"] > 0), 3
            ),
        }
    return rates


def cmd_rates(args) -> None:
    print(json.dumps(stage_rates(Path(args.metrics)), indent=1))


def cmd_plan(args) -> None:
    """Budgets (tokens) from the probe's rates: main run stage 1 and 2, and the final 4096-token stage."""
    rates = list(json.loads(Path(args.probe).read_text()).values())
    if len(rates) < 2:
        raise SystemExit(f"the probe measured {len(rates)} stage(s), the plan needs two")
    r1, r2 = rates[0]["tokens_per_s"], rates[-1]["tokens_per_s"]
    share = args.first_share if args.first_share is not None else _first_share(args.recipe)
    total = args.safety * args.seconds / (share / r1 + (1 - share) / r2)
    t1, t2 = int(total * share), int(total * (1 - share))
    t3 = int(args.safety * args.final_seconds * r2 * args.long_factor)
    if args.max_tokens:
        t1, t2, t3 = (min(t, args.max_tokens) for t in (t1, t2, t3))
    print(f"{max(t1, 1)} {max(t2, 1)} {max(t3, 1)}")


def _params(model_dir: Path) -> int:
    """Parameters of a saved model, from its safetensors headers (no tensors loaded)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as fh:
            for key in fh.keys():
                n += math.prod(fh.get_slice(key).get_shape())
    return n


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version({"fla": "fla-core"}.get(name, name))
    except PackageNotFoundError:
        return "?"


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "fla", "gguf"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", None) or _dist_version(name)
        except Exception as exc:  # noqa: BLE001 - a version table, not a check
            out[name] = f"absent ({type(exc).__name__})"
    try:
        import torch

        out["cuda"] = torch.version.cuda
        out["device_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        pass
    return out


def _json_or_none(path: Path):
    """A file's JSON, or None where a failed step left it empty or cut short (the results still get written)."""
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def cmd_results(args) -> None:
    work = Path(args.work)
    result: dict = {
        "issue": 36,
        "versions": _versions(),
        "kernels": args.kernels,
        "precision": args.precision,
        "peak_flops": PEAK_BF16,
        "flops_formula": "2 N_teacher + 6 N_student per token (mfu_low: 2 N_teacher + 4 N_student)",
    }
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if os.path.exists("/usr/bin/nvidia-smi") or os.environ.get("PATH", "").find("nvidia") >= 0
        else None
    )
    result["gpu"] = smi.stdout.strip() if smi is not None and smi.returncode == 0 else None
    for name in ("timeline.json", "generate.json"):
        if (work / name).exists():
            result[name.removesuffix(".json")] = json.loads((work / name).read_text())
    result["probes"] = {
        p.name.removesuffix(".rates.json"): _json_or_none(p) for p in sorted(work.glob("probe-*.rates.json"))
    }
    teacher = Path(args.teacher) if args.teacher else None
    n_teacher = _params(teacher) if teacher and teacher.exists() else None
    result["teacher"] = {"dir": str(teacher), "parameters": n_teacher}
    runs = {}
    for run in sorted(p for p in (work / "runs").glob("*") if p.is_dir()) if (work / "runs").exists() else []:
        entry: dict = {}
        if (run / "metrics.jsonl").exists():
            entry["stages"] = stage_rates(run / "metrics.jsonl")
        if (run / "results.json").exists():
            entry["results"] = json.loads((run / "results.json").read_text())
        n_student = _params(run / "student") if (run / "student").exists() else None
        entry["student_parameters"] = n_student
        if n_teacher and n_student:
            for stage in entry.get("stages", {}).values():
                flops, flops_low = 2 * n_teacher + 6 * n_student, 2 * n_teacher + 4 * n_student
                stage["flops_per_token"] = flops
                stage["mfu"] = round(stage["tokens_per_s"] * flops / PEAK_BF16, 4)
                stage["mfu_low"] = round(stage["tokens_per_s"] * flops_low / PEAK_BF16, 4)
        entry["complete"] = (run / "student").exists()
        runs[run.name] = entry
    result["runs"] = runs
    evals = {}
    for report in sorted((work / "eval").glob("*/report.json")) if (work / "eval").exists() else []:
        evals[report.parent.name] = json.loads(report.read_text())
    result["eval"] = evals
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")
    for name, entry in runs.items():
        for stage, s in entry.get("stages", {}).items():
            print(
                f"  {name:<28} {stage:<22} {s['tokens']:>12,} tokens {s['tokens_per_s']:>12,.0f} tok/s  mfu {s.get('mfu', '-')}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recipe")
    r.add_argument("base")
    r.add_argument("out")
    r.add_argument("--teacher", required=True)
    r.add_argument("--sources", required=True, help="DIR:WEIGHT,... token shard folders and their shares")
    r.add_argument("--block-len", type=int, default=1024)
    r.add_argument("--step-tokens", type=int, default=32768)
    r.add_argument("--tokens", required=True, help="tokens per stage, comma-separated")
    r.add_argument("--init-from", default=None)
    r.add_argument("--precision", default="bf16")
    r.add_argument("--device", default="auto")
    r.add_argument("--heldout-tokens", type=int, default=20000)
    r.add_argument("--eval-tokens", type=int, default=16384)
    r.add_argument(
        "--checkpoints", type=int, default=3, help="checkpoints per stage (save_every = steps // this)"
    )
    r.set_defaults(func=cmd_recipe)
    m = sub.add_parser("rates")
    m.add_argument("metrics")
    m.set_defaults(func=cmd_rates)
    b = sub.add_parser("plan")
    b.add_argument("probe")
    b.add_argument("--seconds", type=float, required=True)
    b.add_argument("--final-seconds", type=float, required=True)
    b.add_argument("--recipe", default=None, help="the base recipe: its first two stages' token split")
    b.add_argument("--first-share", type=float, default=None, help="instead of --recipe's split")
    b.add_argument("--safety", type=float, default=0.8)
    b.add_argument("--long-factor", type=float, default=0.25)
    b.add_argument("--max-tokens", type=int, default=0, help="cap every stage (smoke tests)")
    b.set_defaults(func=cmd_plan)
    s = sub.add_parser("results")
    s.add_argument("out")
    s.add_argument("--work", required=True)
    s.add_argument("--teacher", default=None)
    s.add_argument("--kernels", default=None)
    s.add_argument("--precision", default=None)
    s.set_defaults(func=cmd_results)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()

"""The arithmetic of a GPU run (benchmarks/gpu/distill_on_gpu.py), standard library only, so that it
runs here before a GPU is lent and is tested by hand-computed values: the carry check, the step
size that fits the measured memory, the learning rate for that step, the token budgets that fill
the seconds left, and MFU.

Carry: a device call takes the tracked tree, the untracked files git does not ignore and the
paths it carries, 64 MiB in all (/work/.library/device/README.md); ``check_carry`` adds them up
per call before any GPU call and refuses an oversize call in one line naming its largest parts.

Learning rate for large steps: the square-root scaling rule for adaptive optimizers ("On the SDEs
and Scaling Rules for Adaptive Gradient Algorithms", Malladi, Lyu, Panigrahi and Arora): when the
batch grows by a factor k, Adam's learning rate grows by sqrt(k). Here k = the GPU step's tokens
over the recipe's step tokens (batch_size x block_len), and the factor is capped (``LR_CAP``: the
rule is derived for small learning rates, and the recipes' stage-1 rates are already 1e-2), never
below the rule's value when the step shrinks. The recipe's warm-up fraction stays.

MFU: model FLOPs per training token of a KD step = 2 N_teacher (the frozen teacher's forward) +
6 N_student (the student's forward and backward, weight gradients for every parameter),
N = the parameters that take part in a matrix product; attention-score FLOPs left out. ``mfu_low``
counts 4 N_student (no weight gradients: LoRA / mixer-only stages compute few). Two references:
the H200's dense bf16 peak (989 TFLOP/s, the H100/H200 SXM datasheet; KINDS.md measured about 790
for an 8192^3 bf16 product), and the teacher's own forward measured on the same GPU and length (the
bound a distillation step cannot beat: every KD step runs that forward).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from pathlib import Path

PEAK_BF16 = 989e12  # H100 / H200 SXM dense bf16, FLOP/s (datasheet)
CARRY_LIMIT = 64 << 20  # bytes a device call takes: tracked tree + untracked-not-ignored + carry
LR_CAP = 4.0  # the square-root rule's factor is capped at this
MIB = 1 << 20


# ----------------------------------------------------------------------------------------- carry
def _files_bytes(root: Path, files: list[str]) -> dict[str, int]:
    out = {}
    for name in files:
        p = root / name
        if p.is_file() and not p.is_symlink():
            out[name] = p.stat().st_size
    return out


def travelling_tree(root: Path) -> dict[str, int]:
    """Bytes of each file that travels with every call: tracked, untracked that git does not ignore,
    and a ``shared/`` folder's, ignored or not (the device tool sends it too)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = _files_bytes(root, [f for f in listed.split("\0") if f])
    if (root / "shared").is_dir():
        files.update(path_bytes(root, "shared"))
    return files


def path_bytes(root: Path, path: str) -> dict[str, int]:
    """Bytes of each file under a carried path (a file or a folder)."""
    p = root / path
    if p.is_file():
        return {path: p.stat().st_size}
    return {str(f.relative_to(root)): f.stat().st_size for f in sorted(p.rglob("*")) if f.is_file()}


def carry_report(root: Path, calls: dict[str, list[str]], limit: int = CARRY_LIMIT) -> dict:
    """Per call: MiB of the tree and of each carried path, the total, and whether it fits ``limit``."""
    tree = sum(travelling_tree(root).values())
    report = {}
    for call, paths in calls.items():
        parts = {"tracked tree": tree}
        for path in paths:
            if not (root / path).exists():
                raise SystemExit(
                    f"carry check: call {call} carries {path}, which does not exist: run benchmarks/gpu/prepare.sh first"
                )
            parts[path] = sum(path_bytes(root, path).values())
        total = sum(parts.values())
        report[call] = {"bytes": total, "parts": parts, "fits": total <= limit}
    return report


def check_carry(root: Path, calls: dict[str, list[str]], limit: int = CARRY_LIMIT) -> dict:
    """``carry_report``, or SystemExit with one line naming the first call over ``limit`` and its
    largest parts and files (before any device call: the tool would refuse it, at a cost)."""
    report = carry_report(root, calls, limit)
    for call, entry in report.items():
        if entry["fits"]:
            continue
        parts = sorted(entry["parts"].items(), key=lambda kv: -kv[1])
        files = {}
        for path in calls[call]:
            files.update(path_bytes(root, path))
        files.update(travelling_tree(root))
        big_name, big = max(files.items(), key=lambda kv: kv[1])
        listed = ", ".join(f"{name} {size / MIB:.1f}" for name, size in parts)
        raise SystemExit(
            f"carry check: call {call} takes {entry['bytes'] / MIB:.1f} MiB, over the {limit / MIB:.0f} MiB a device "
            f"call carries ({listed} MiB); largest file {big_name} ({big / MIB:.1f} MiB): shrink it or carry it in another call"
        )
    return report


# ----------------------------------------------------------------------------------- step sizing
def lr_for_step(recipe_lr: float, recipe_step_tokens: int, step_tokens: int, cap: float = LR_CAP) -> float:
    """The square-root rule (module docstring): recipe_lr * min(cap, sqrt(step / recipe step))."""
    return recipe_lr * min(cap, math.sqrt(step_tokens / recipe_step_tokens))


def fit_batch(
    block_len: int,
    base_bytes: float,
    bytes_per_token: float,
    capacity_bytes: float,
    max_step_tokens: int,
    headroom: float = 0.85,
) -> int:
    """Blocks a step can take without activation checkpointing: the most that keep the measured
    memory (``base_bytes`` held before the step: weights, optimizer, teacher; ``bytes_per_token``
    of activations, both from the probe) under ``headroom`` of the capacity, at most
    ``max_step_tokens`` a step. 0: not even one block fits (then the stage keeps checkpointing)."""
    free = headroom * capacity_bytes - base_bytes
    fits = int(free // (bytes_per_token * block_len)) if bytes_per_token > 0 else max_step_tokens // block_len
    return max(0, min(fits, max_step_tokens // block_len))


def stage_budgets(
    weights: list[float], rates: list[float], step_tokens: list[int], seconds: float, safety: float = 0.85
) -> list[int]:
    """Tokens per stage that fill ``safety * seconds`` at the measured ``rates`` (tokens/s), split as
    ``weights`` (the recipe's own stage tokens): T_i = s w_i with s = safety S / sum(w_i / r_i), each
    rounded down to whole steps of ``step_tokens[i]``, at least one."""
    scale = safety * seconds / sum(w / r for w, r in zip(weights, rates))
    return [max(1, int(scale * w // n)) * n for w, n in zip(weights, step_tokens)]


# ---------------------------------------------------------------------------------------- MFU
def flops_per_token(n_teacher: int, n_student: int, weight_grads: bool = True) -> float:
    return 2 * n_teacher + (6 if weight_grads else 4) * n_student


def mfu(
    tokens_per_s: float, n_teacher: int, n_student: int, teacher_forward_tokens_per_s: float | None
) -> dict:
    """MFU against the peak and against the teacher's measured forward (its FLOP/s at the same length)."""
    flops, flops_low = flops_per_token(n_teacher, n_student), flops_per_token(n_teacher, n_student, False)
    out = {
        "flops_per_token": flops,
        "mfu_peak": tokens_per_s * flops / PEAK_BF16,
        "mfu_peak_low": tokens_per_s * flops_low / PEAK_BF16,
    }
    if teacher_forward_tokens_per_s:
        bound = 2 * n_teacher * teacher_forward_tokens_per_s  # the teacher forward's achieved FLOP/s
        out["teacher_forward_flops_per_s"] = bound
        out["mfu_teacher_bound"] = tokens_per_s * flops / bound
        out["share_of_teacher_forward_rate"] = tokens_per_s / teacher_forward_tokens_per_s
    return out


def stage_rates(metrics: Path, skip: int = 2) -> dict:
    """Per stage of a run's metrics.jsonl: steps, tokens, median tokens/s over the steps after the
    first ``skip`` (warm-up, compilation, autotuning), and the seconds the logged steps took."""
    rows: dict = {}
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "tokens_per_s" not in row or "event" in row:
            continue
        name = row.get("stage") or row.get("stage_name") or str(row.get("stage_index", "?"))
        rows.setdefault(name, []).append(row)
    rates = {}
    for name, stage in rows.items():
        tps = [r["tokens_per_s"] for r in stage]
        seen = [r.get("tokens", 0) for r in stage]  # the stage's tokens so far, after each step
        per_step = [b - a for a, b in zip([0, *seen[:-1]], seen)]
        rates[name] = {
            "steps": len(stage),
            "tokens": seen[-1],
            "tokens_per_s": statistics.median(tps[skip:] or tps),
            "seconds": round(
                sum(t / r["tokens_per_s"] for t, r in zip(per_step, stage) if r["tokens_per_s"] > 0), 3
            ),
        }
    return rates

"""The statistics an evaluation reports: the standard error of an accuracy, the items lm-eval scored,
the item-weighted (pooled) accuracy over tasks, the fraction of the teacher a student recovers, and
plain or geometric means. Pure functions of numbers and lm-eval records (no torch)."""

from __future__ import annotations

import math

from attn2ssm.errors import ConfigError


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy ``p`` measured on ``n`` items: sqrt(p (1 - p) / n)."""
    if n < 1 or not 0.0 <= p <= 1.0:
        raise ValueError(f"a binomial standard error needs n >= 1 and 0 <= p <= 1, got p={p}, n={n}")
    return math.sqrt(p * (1.0 - p) / n)


def items_scored(record: dict, task: str) -> int | None:
    """Documents lm-eval scored for ``task`` (a task, or a group: the sum over its subtasks)."""
    counts = record.get("n-samples", {})
    if task in counts:
        return counts[task]["effective"]
    subtasks = record.get("group_subtasks", {}).get(task)
    if subtasks:
        found = [items_scored(record, t) for t in subtasks]
        return sum(n for n in found if n) or None
    return None


def pooled_accuracy(record: dict, metric: str) -> tuple[float, int]:
    """(accuracy, items) over every task lm-eval scored: the item-weighted mean of ``metric``."""
    total, n = 0.0, 0
    for task, counts in record.get("n-samples", {}).items():
        value = record["results"].get(task, {}).get(f"{metric},none")
        if value is None:
            value = next(
                (
                    v
                    for k, v in record["results"].get(task, {}).items()
                    if k.startswith(f"{metric},") and "stderr" not in k
                ),
                None,
            )
        if value is None:
            raise ConfigError(
                f"lm-eval gave no {metric} for {task}",
                f"choose a metric the task reports (it has {', '.join(record['results'].get(task, {}))})",
            )
        total += float(value) * counts["effective"]
        n += counts["effective"]
    if n == 0:
        raise ConfigError("lm-eval scored no documents", "check the task and the number of items")
    return total / n, n


def recovered(teacher: float | None, student: float | None, higher_is_better: bool = True) -> float | None:
    """The fraction of the teacher's level a student reaches: student / teacher where higher is
    better, teacher / student where lower is (perplexity, KL); None where either is missing or not
    finite, or the reference is not positive (a KL of 0 has no ratio)."""
    if teacher is None or student is None or not (math.isfinite(teacher) and math.isfinite(student)):
        return None
    if higher_is_better:
        return student / teacher if teacher > 0 else None
    return teacher / student if student > 0 and teacher > 0 else None


def mean(values: list[float], geometric: bool = False) -> float:
    """The arithmetic (or, with ``geometric``, geometric: for ratios such as perplexities) mean."""
    if geometric:
        return math.exp(sum(map(math.log, values)) / len(values))
    return sum(values) / len(values)

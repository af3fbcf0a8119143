"""Image classification scores: top-1 on a test split, and the report of an image recipe's run."""

from __future__ import annotations

import json
from pathlib import Path

from attn2ssm.eval.report import environment, plot_losses, read_metrics
from attn2ssm.paths import atomic_write_text
from attn2ssm.teachers.vision import evaluate_classifier


def write_vision_report(
    run_dir: Path, recipe, teacher, student, images, *, seconds: float | None = None
) -> dict:
    """Score teacher and student on the full test split; write results.json and report.md."""
    run_dir = Path(run_dir)
    t, s = evaluate_classifier(teacher, images.test), evaluate_classifier(student, images.test)
    metrics = read_metrics(run_dir)
    plot_losses(metrics, run_dir / "loss.png", f"{recipe.name}: {recipe.student.mixer}")
    results = {
        "recipe": recipe.name,
        "task": "image_classification",
        "teacher": recipe.teacher,
        "images": recipe.images.source,
        "fraction": recipe.images.fraction,
        "train_images": len(images.train),
        "test_images": t["images"],
        "teacher_top1": t["top1"],
        "student_top1": s["top1"],
        "student_test_loss": s["loss"],
        "train_seconds": seconds,
        "images_seen": metrics[-1]["total_tokens"] if metrics else 0,
        "student_params": sum(p.numel() for p in student.parameters()),
        "teacher_params": sum(p.numel() for p in teacher.parameters()),
        "stages": [
            {"name": st.name, "kind": st.kind, "images": st.tokens, "epochs": st.epochs, "losses": st.losses}
            for st in recipe.stages
        ],
        "environment": environment(),
    }
    atomic_write_text(run_dir / "results.json", json.dumps(results, indent=1))
    lines = [
        f"# {recipe.name}",
        "",
        recipe.description.strip(),
        "",
        f"Teacher `{recipe.teacher}` → `{recipe.student.mixer}` student; {len(images.train)} training images "
        f"({recipe.images.fraction:g} of `{recipe.images.source}`:{recipe.images.train_split}), top-1 on {t['images']} test images.",
        "",
        "| model | top-1 | params |",
        "|---|---|---|",
        f"| teacher | {t['top1']:.4f} | {results['teacher_params']:,} |",
        f"| student | {s['top1']:.4f} | {results['student_params']:,} |",
        "",
    ]
    atomic_write_text(run_dir / "report.md", "\n".join(lines))
    return results

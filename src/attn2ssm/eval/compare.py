"""Teacher-vs-student report: one table with both models' numbers and the fraction recovered.

``attn2ssm eval STUDENT --against TEACHER --report`` scores both models on the same inputs:
held-out perplexity per corpus, lm-eval tasks from the offline pack (``--tasks``), passkey
retrieval (``--needle``), generation agreement with the teacher, attention fidelity where
the student's mixers expose weights, and with ``--curve-windows`` the length curve (student / teacher
perplexity against the window, :mod:`attn2ssm.eval.length_curve`, clipped to the models' positions). Recovered = student / teacher for higher-is-better metrics
and teacher / student for lower-is-better ones (perplexity), so 100 % means "as good as the
teacher" either way. Writes report.md, report.json and report.png (recovered fraction per row),
plus needle.png when passkey retrieval ran.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from attn2ssm.eval.harness import run_lm_eval
from attn2ssm.eval.length_curve import format_curve
from attn2ssm.eval.stats import binomial_se, items_scored
from attn2ssm.eval.tables import format_table, plot_recovered, table_row
from attn2ssm.paths import atomic_write_text


@dataclass
class ReportSettings:
    corpora: tuple[str, ...] = ("sotu", "moby-dick")
    window: int = 256
    max_tokens: int = 20000
    tasks: tuple[str, ...] = ()
    limit: int | None = None
    needle_lengths: tuple[int, ...] = ()
    needle_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    needle_trials: int = 3
    agreement_prompts: int = 16
    agreement_prompt_len: int = 64
    agreement_new_tokens: int = 32
    fidelity_blocks: int = 2
    curve_windows: tuple[int, ...] = ()  # the length curve's windows; () scores none
    extra: dict = field(default_factory=dict)


def _task_rows(teacher_record: dict, student_record: dict) -> list[dict]:
    """acc / acc_norm / exact_match (higher better, with the binomial SE and n of each side) and
    perplexity (lower better) of every scored task."""
    rows = []
    for task, metrics in sorted(student_record.get("results", {}).items()):
        other = teacher_record.get("results", {}).get(task, {})
        n = items_scored(student_record, task)
        for key, value in metrics.items():
            name, _, _ = key.partition(",")
            if name not in (
                "acc",
                "acc_norm",
                "exact_match",
                "perplexity",
                "word_perplexity",
            ) or not isinstance(value, (int, float)):
                continue
            teacher = other.get(key)
            extra = {"n": n}
            if "perplexity" not in name and n:
                extra.update(
                    teacher_se=None
                    if teacher is None
                    else binomial_se(teacher, items_scored(teacher_record, task)),
                    student_se=binomial_se(float(value), n),
                )
            rows.append(
                table_row(
                    f"lm-eval {task}",
                    name,
                    teacher,
                    float(value),
                    higher_is_better="perplexity" not in name,
                    **extra,
                )
            )
    return rows


@dataclass
class _Scores:
    """What ``compare_report`` has measured so far: table rows and details, written after every part
    (so a killed run keeps its finished parts)."""

    student_path: str
    teacher_spec: str
    settings: ReportSettings
    out_dir: Path
    rows: list = field(default_factory=list)
    details: dict = field(default_factory=dict)
    length_curve: dict | None = None
    started: float = field(default_factory=time.time)

    def save(self) -> dict:
        from attn2ssm.eval.report import environment  # heavy: torch

        report = {
            "student": str(self.student_path),
            "teacher": self.teacher_spec,
            "rows": self.rows,
            "length_curve": self.length_curve,
            "details": self.details,
            "settings": {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in self.settings.__dict__.items()
            },
            "seconds": time.time() - self.started,
            "environment": environment(),
        }
        atomic_write_text(self.out_dir / "report.json", json.dumps(report, indent=1, default=str))
        atomic_write_text(self.out_dir / "report.md", format_markdown(report))
        return report


def compare_report(
    student_path: str,
    teacher_spec: str | None,
    out_dir: Path,
    settings: ReportSettings,
    progress: bool = True,
    device=None,
) -> dict:
    """Score the student and its teacher on the same inputs (see the module docstring), part by part,
    both on ``device`` (None: the CPU)."""
    from attn2ssm.student.loading import load_model_and_tokenizer  # heavy: transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    teacher_spec = teacher_spec or "smollm2-135m"
    student, tokenizer = load_model_and_tokenizer(student_path, device)
    teacher, _ = load_model_and_tokenizer(teacher_spec, device)
    scores = _Scores(student_path, teacher_spec, settings, out_dir)
    corpora = _score_perplexity(scores, teacher, student, tokenizer, progress)
    scores.save()
    if settings.curve_windows:
        _score_curve(scores, teacher, student, corpora, progress)
        scores.save()
    if settings.agreement_prompts:
        _score_agreement(
            scores, teacher, student, tokenizer, corpora[settings.corpora[0]].heldout_ids, progress
        )
    scores.save()
    if settings.needle_lengths:
        _score_passkey(scores, teacher, student, tokenizer, progress)
    scores.save()
    if settings.fidelity_blocks and hasattr(student, "mixers"):
        _score_fidelity(scores, teacher, student, corpora[settings.corpora[0]].heldout_ids)
    scores.save()
    if settings.tasks:
        _score_tasks(scores)
    report = scores.save()
    plot_recovered(
        scores.rows,
        out_dir / "report.png",
        f"{Path(str(student_path)).name} vs {report['teacher']}",
        curve=scores.length_curve,
    )
    return report


def _score_perplexity(scores: _Scores, teacher, student, tokenizer, progress: bool) -> dict:
    """1. Held-out perplexity on each corpus (same windows for both); the prepared corpora by spec."""
    from attn2ssm.data import prepare_corpus  # heavy: torch
    from attn2ssm.eval.perplexity import perplexity  # heavy: torch

    settings, corpora = scores.settings, {}
    for corpus_spec in settings.corpora:
        corpus = corpora[corpus_spec] = prepare_corpus(
            corpus_spec, tokenizer, max_heldout_tokens=settings.max_tokens, max_train_tokens=0
        )
        kw = dict(window=settings.window, max_tokens=settings.max_tokens, progress=progress)
        t = perplexity(teacher, corpus.heldout_ids, desc=f"teacher {corpus_spec}", **kw)
        s = perplexity(student, corpus.heldout_ids, desc=f"student {corpus_spec}", **kw)
        scores.rows.append(
            table_row(
                f"perplexity {corpus_spec}",
                f"ppl ({s['tokens']} tokens, window {settings.window})",
                t["ppl"],
                s["ppl"],
                higher_is_better=False,
            )
        )
    return corpora


def _score_curve(scores: _Scores, teacher, student, corpora: dict, progress: bool) -> None:
    """1b. The length curve at ``curve_windows`` on the same corpora; windows past either model's
    positions, or longer than a corpus's held-out tokens, are skipped with a note on stderr."""
    import sys

    from attn2ssm.eval.length_curve import fit_windows, score_length_curve
    from attn2ssm.student.loading import position_limit  # heavy: transformers

    settings = scores.settings
    windows = settings.curve_windows
    for name, model in ((scores.student_path, student), (scores.teacher_spec, teacher)):
        limit = position_limit(model.config)
        fitted = fit_windows(windows, limit)
        if len(fitted) < len(windows):
            skipped = ",".join(str(w) for w in windows if w not in fitted)
            print(
                f"note: {name} reads at most {limit} positions: curve windows {skipped} skipped",
                file=sys.stderr,
            )
        windows = fitted
    ids = {c: corpus.heldout_ids[: settings.max_tokens] for c, corpus in corpora.items()}
    scores.length_curve = score_length_curve(teacher, student, ids, windows, progress)


def _score_agreement(scores: _Scores, teacher, student, tokenizer, heldout_ids, progress: bool) -> None:
    """2. Generation agreement with the teacher on held-out prompts of the first corpus."""
    from attn2ssm.eval.agreement import generation_agreement, heldout_prompts  # heavy: torch

    settings = scores.settings
    prompts = heldout_prompts(
        heldout_ids, settings.agreement_prompts, settings.agreement_prompt_len, settings.agreement_new_tokens
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    agree = generation_agreement(
        student, teacher, prompts, settings.agreement_new_tokens, pad_id=pad, progress=progress
    )
    scores.details["generation_agreement"] = agree
    for key in ("token_agreement", "rouge_l", "forced_agreement"):
        scores.rows.append(table_row("generation vs teacher", key, 1.0, agree[key]))
    scores.rows.append(
        table_row(
            "generation vs teacher",
            "prefix_match (tokens)",
            float(settings.agreement_new_tokens),
            agree["prefix_match"],
        )
    )


def _score_passkey(scores: _Scores, teacher, student, tokenizer, progress: bool) -> None:
    """3. Passkey retrieval: the same keys and prompts for both; plots needle.png."""
    from attn2ssm.eval.needle import passkey_grid, plot_passkey  # heavy: torch

    settings, grids = scores.settings, {}
    for name, model in (("teacher", teacher), ("student", student)):
        grids[name] = passkey_grid(
            model,
            tokenizer,
            settings.needle_lengths,
            settings.needle_depths,
            settings.needle_trials,
            progress=progress,
            desc=f"passkey {name}",
        )
    scores.details["passkey"] = grids
    plot_passkey(grids, scores.out_dir / "needle.png", "passkey retrieval (greedy, exact digits)")
    scores.rows.append(
        table_row(
            "passkey",
            f"accuracy (lengths {list(settings.needle_lengths)})",
            grids["teacher"]["mean_accuracy"],
            grids["student"]["mean_accuracy"],
        )
    )


def _score_fidelity(scores: _Scores, teacher, student, heldout_ids) -> None:
    """4. Attention fidelity, where the student's mixers expose weights (the teacher is the reference)."""
    from attn2ssm.eval.attention import attention_fidelity  # heavy: torch

    settings = scores.settings
    n = settings.fidelity_blocks * settings.window
    if heldout_ids.numel() >= n and any(
        callable(getattr(m, "attention_weights", None)) for m in student.mixers().values()
    ):
        ids = heldout_ids[:n].view(settings.fidelity_blocks, settings.window)
        fid = attention_fidelity(student, teacher, ids)
        scores.details["attention_fidelity"] = fid["mean"]
        scores.rows.append(
            table_row(
                "attention fidelity",
                "KL(teacher‖student) per query row",
                0.0,
                fid["mean"]["kl"],
                higher_is_better=False,
            )
        )


def _score_tasks(scores: _Scores) -> None:
    """5. lm-eval tasks from the offline pack (each model loaded by lm-eval)."""
    settings, records = scores.settings, {}
    for name, path in (("teacher", scores.teacher_spec), ("student", scores.student_path)):
        records[name] = run_lm_eval(
            path,
            list(settings.tasks),
            limit=settings.limit,
            output_path=scores.out_dir / f"lm_eval_{name}.json",
        )
    scores.rows += _task_rows(records["teacher"], records["student"])
    scores.details["lm_eval_limit"] = settings.limit


def format_markdown(report: dict) -> str:
    lines = [
        f"# {report['student']} vs teacher {report['teacher']}",
        "",
        "Recovered = student / teacher (higher is better) or teacher / student (perplexity, KL): 100 % = the teacher's level.",
        "",
        *format_table(report["rows"]),
    ]
    curve = report.get("length_curve")
    if curve:
        lines += [
            "",
            f"Length curve: student / teacher perplexity against the window (stride = window / 2), per corpus "
            f"and their {curve['average']}:",
            "",
            *format_curve(curve),
        ]
    ex = report["details"].get("generation_agreement", {}).get("examples", [])
    if ex:
        lines += [
            "",
            f"Generation agreement: {report['details']['generation_agreement']['prompts']} held-out prompts, "
            f"{report['details']['generation_agreement']['new_tokens']} greedy tokens each; the teacher's continuation is the reference.",
        ]
    if "passkey" in report["details"]:
        lines += ["", "![passkey retrieval](needle.png)"]
    lines += ["", "![recovered fraction](report.png)", ""]
    return "\n".join(lines)

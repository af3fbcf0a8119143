"""What a run measures and writes besides checkpoints: the held-out loss of its metrics lines, the
final student (with the tokenizer, AutoModelForCausalLM-loadable) and the report (results.json,
report.md, loss.png)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from attn2ssm.distill.losses import cross_entropy
from attn2ssm.errors import TrainingError
from attn2ssm.eval.report import write_report
from attn2ssm.paths import replace_dir


@torch.no_grad()
def eval_loss(model, eval_blocks: torch.Tensor, eval_batches: int, device) -> float:
    """The mean cross-entropy of ``model`` on the first ``eval_batches`` batches of 4 held-out blocks."""
    model.eval()
    n = min(len(eval_blocks), eval_batches * 4)
    losses = []
    for i in range(0, n, 4):
        ids = eval_blocks[i : i + 4].to(device)
        losses.append(cross_entropy(model(input_ids=ids, use_cache=False).logits, ids).item())
    model.train()
    return sum(losses) / max(1, len(losses))


def save_student(out: Path, student, tokenizer) -> None:
    """``out/student``: the final student and its tokenizer, built in a hidden folder and renamed into place."""
    tmp = out / ".tmp-student"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        student.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out / "student")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def language_report(
    out: Path, recipe, teacher, student, corpus, caches: list, settings: dict, progress: bool
) -> dict:
    """The language report. The teacher's held-out perplexity is kept beside the run's logit caches
    (keyed by the held-out tokens and eval settings), so a teacherless run (``teacher`` None) reports
    the value an earlier run measured on the same teacher and held-out text, or says it did not
    measure it."""
    e = recipe.eval
    window = e.window or recipe.data.block_len
    h = hashlib.sha256(corpus.heldout_ids.to("cpu", torch.int64).numpy().tobytes())
    h.update(f"|{window}|{e.stride or window // 2}|{e.max_tokens}|{e.batch_size}".encode())
    key = h.hexdigest()
    known = (
        next((p for p in (c.teacher_perplexity(key) for c in caches) if p is not None), None)
        if teacher is None
        else None
    )
    results = write_report(
        out, recipe, teacher, student, corpus, progress=progress, settings=settings, teacher_ppl=known
    )
    if teacher is not None:
        for cache in caches:
            cache.record_perplexity(key, results["teacher_ppl"])
    return results


def step_record(run, state, result, tokens_per_s: float, processes: int, kernels: str) -> dict:
    """One step's metrics line, before its held-out evaluation (``run``: the stage's ``StageRun``,
    ``state``: the ``TrainerState`` after the step, ``result``: its ``StepResult``). A step the
    GradScaler skipped (fp16 overflow) counts like any other — its blocks were drawn, so the data
    order stays a function of the step — and says ``"skipped": true``; its lr is the one the
    schedule still holds (a skipped step does not advance it)."""
    record = {
        "stage": run.cfg.name,
        "stage_index": run.index,
        "step": state.step,
        "tokens": state.tokens,
        "total_tokens": state.total_tokens,
        "loss": result.loss,
        "lr": run.scheduler.get_last_lr()[0],
        "tokens_per_s": tokens_per_s,
        "processes": processes,
        "kernels": kernels,
        **{f"train_{k}": v for k, v in result.metrics.items()},
    }
    if result.grad_norm is not None:
        record["grad_norm"] = result.grad_norm
    if result.skipped:
        record["skipped"] = True
    return record


def non_finite(loss: float, run, step: int, checkpoint) -> TrainingError:
    """The one line a non-finite loss stops the run with, before it reaches the weights."""
    return TrainingError(
        f"non-finite loss ({loss}) at stage '{run.cfg.name}' step {step + 1}",
        f"lower stages.{run.index}.optim.lr or the clip value; the last good checkpoint is {checkpoint or 'none (nothing saved yet)'}",
    )

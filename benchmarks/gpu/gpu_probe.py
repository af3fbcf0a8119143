"""The probe of a GPU run (benchmarks/gpu/distill_on_gpu.py runs it as its own process, with a
timeout): the teacher's forward and the student's training step of a recipe, at each length, timed
on the device with the memory each holds. Written to ``--out`` after every point, so a kill keeps
what was measured.

    python benchmarks/gpu/gpu_probe.py RECIPE --teacher DIR --out probe.json --points STAGE@LEN,...
        [--lengths 1024,2048,4096] [--set KEY=VALUE ...] [--probe-tokens 16384] [--steps 2]

Teacher forward: logits without gradient under the run's autocast, ``probe_tokens`` a batch
(random ids: the time does not depend on the text). Student step: the real trainer's step
(``distill.trainer.train_step``, as ``attn2ssm bench train`` times it) of stage STAGE of the recipe
(with the run's ``--set`` overrides) on LEN-token blocks, a fresh student each point, activation
checkpointing off; one warm-up step, then ``steps`` timed. Memory (CUDA): what is held before the
timed steps (teacher, student, optimizer state: ``base_bytes``) and the peak above it per token of
the step (``bytes_per_token``); gpu_plan.fit_batch sizes the run's steps from the two.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_memory(device) -> int:
    """The bytes allocated now, and the peak counted from here (the cache kept: no new allocations)."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _release(device) -> None:
    """What the last point held (its Distiller, accelerator, student and optimizer) given back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _peak(device) -> int | None:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def teacher_forward(teacher, vocab: int, length: int, probe_tokens: int, steps: int, autocast) -> dict:
    """Tokens/s of the teacher's forward (logits, no gradient) on ``probe_tokens`` a batch."""
    device = next(teacher.parameters()).device
    batch = max(1, probe_tokens // length)
    ids = torch.randint(0, vocab, (batch, length), device=device)
    base = _reset_memory(device)
    times = []
    for i in range(steps + 1):
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad(), autocast():
            teacher(input_ids=ids, use_cache=False)
        _sync(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    peak = _peak(device)
    return {
        "length": length,
        "batch": batch,
        "tokens_per_s": batch * length / statistics.median(times),
        "seconds": [round(t, 4) for t in times],
        "peak_bytes": peak,
        "bytes_per_token": None if peak is None else (peak - base) / (batch * length),
    }


def _probe_recipe(recipe_name: str, sets: list[str], stage_index: int, length: int, batch: int, steps: int):
    """The recipe with the run's overrides, cut to stage ``stage_index`` on ``length``-token blocks."""
    from attn2ssm.distill.recipe import load_recipe

    recipe = load_recipe(recipe_name, sets)
    stage = replace(
        recipe.stages[stage_index],
        block_len=length,
        batch_size=batch,
        grad_accum=1,
        tokens=(steps + 1) * batch * length,
        save_every=0,
        eval_every=0,
        gradient_checkpointing=False,
    )
    recipe.data = replace(recipe.data, block_len=length, max_heldout_tokens=2 * length)
    recipe.stages = [stage]
    return recipe


def student_step(args, teacher, tokenizer, stage_index: int, length: int) -> dict:
    """Tokens/s and memory of stage ``stage_index``'s training step at ``length`` (module docstring)."""
    from attn2ssm.distill.trainer import Distiller, load_for_steps, setup_stage, train_step

    batch = max(1, args.probe_tokens // length)
    recipe = _probe_recipe(args.recipe, args.set or [], stage_index, length, batch, args.steps)
    with tempfile.TemporaryDirectory(prefix="attn2ssm-gpu-probe-") as tmp:
        d = Distiller(recipe, f"{tmp}/run", progress=False, teacher=teacher, tokenizer=tokenizer)
        try:
            load_for_steps(d)
            run = setup_stage(d, 0)
            device = d.acc.device
            times, tokens = [], 0
            for step in range(args.steps + 1):
                if step == 1:  # after the warm-up: weights, optimizer state and teacher are held
                    base = _reset_memory(device)
                _sync(device)
                t0 = time.perf_counter()
                tokens, *_ = train_step(d, run, step)
                _sync(device)
                if step:
                    times.append(time.perf_counter() - t0)
            peak = _peak(device)
            n_student = sum(p.numel() for p in d.acc.unwrap_model(d.student).parameters())
            row = {
                "stage": recipe.stages[0].name,
                "kind": recipe.stages[0].kind,
                "length": length,
                "batch": batch,
                "tokens_per_s": tokens / statistics.median(times),
                "seconds": [round(t, 4) for t in times],
                "base_bytes": base,
                "peak_bytes": peak,
                "bytes_per_token": None if peak is None else (peak - base) / tokens,
                "student_parameters": n_student,
                "trainable_parameters": sum(p.numel() for p in run.params),
                "kernels": d.kernels.to_dict(),
                "precision": d.precision.used,
            }
        finally:
            d.close()
    return row


def _write(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--teacher", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--points", required=True, help="STAGE_INDEX@LENGTH,... student steps to time")
    p.add_argument("--lengths", default="1024,2048,4096", help="the teacher forward's lengths")
    p.add_argument("--set", action="append", help="the run's recipe overrides")
    p.add_argument("--probe-tokens", type=int, default=16384, help="tokens a probe step / forward")
    p.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up)")
    args = p.parse_args(argv)
    from attn2ssm.distill.recipe import load_recipe
    from attn2ssm.teachers import load_teacher

    out = Path(args.out)
    recipe = load_recipe(args.recipe, args.set or [])
    teacher, tokenizer, _ = load_teacher(args.teacher)
    probe = run_setup(recipe)
    teacher.to(device=probe["device"], dtype=probe["teacher_dtype"]).eval().requires_grad_(False)
    result = {
        "device": str(probe["device"]),
        "precision": probe["precision"],
        "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
        "teacher_forward": {},
        "student_step": {},
    }
    _write(out, result)
    for length in [int(n) for n in args.lengths.split(",")]:
        try:
            result["teacher_forward"][str(length)] = teacher_forward(
                teacher, len(tokenizer), length, args.probe_tokens, args.steps, probe["autocast"]
            )
        except RuntimeError as exc:
            result["teacher_forward"][str(length)] = {"error": str(exc).splitlines()[0], "oom": _oom(exc)}
        _write(out, result)
    for point in args.points.split(","):
        index, _, length = point.partition("@")
        try:
            row = student_step(args, teacher, tokenizer, int(index), int(length))
        except RuntimeError as exc:
            row = {"error": str(exc).splitlines()[0][:300], "oom": _oom(exc)}
        _release(probe["device"])
        result["student_step"][point] = row
        _write(out, result)
        print(f"probe {point}: {row.get('tokens_per_s', row.get('error'))}", flush=True)


def run_setup(recipe) -> dict:
    """The device, precision, teacher dtype and autocast a run of ``recipe`` resolves here."""
    from attn2ssm.distill.accelerator import resolve_teacher_dtype, setup_accelerator

    setup = setup_accelerator(recipe, teacher_passed=True)
    device, used = setup.acc.device, setup.precision.used
    return {
        "device": device,
        "precision": used,
        "teacher_dtype": resolve_teacher_dtype(recipe.teacher_dtype, device.type, used),
        "autocast": setup.acc.autocast,
    }


if __name__ == "__main__":
    main()

"""Building the student a run trains: converted from the teacher by the recipe's layer plan (or
reloaded from the checkpoint a resume continues, or a trained student continued), its new mixers
calibrated on the teacher, and grown stepwise between stages.

Stepwise growth is the stepwise conversion of "The Mamba in the Llama: Distilling and Accelerating
Hybrid Models": a stage with its own ``attention_ratio`` converts more of the layers that still keep
attention (chosen by automatic layer selection, or spread evenly over the survivors) before it
trains, and the mixers already trained keep what they learnt (``grow_for_stage``).

``note(message, record)`` is the run's log: a line for the user and, when given, a metrics record
(the trainer passes one that writes on the main process only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import attn2ssm.teachers as teachers  # called through the module: tests replace its functions
from attn2ssm.data import block_indices
from attn2ssm.distill.calibration import calibrate_gated_delta, calibrate_kept_attention
from attn2ssm.distill.layer_selection import auto_plan, select_attention_layers
from attn2ssm.distill.retrieval_probe import describe_kept, head_level_plan_for, keep_probe_record
from attn2ssm.mixers.registry import ATTENTION
from attn2ssm.student.convert import convert, grow_student
from attn2ssm.student.convert_vision import build_vision_student
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from attn2ssm.student.plans import interleaved_keep, make_plan
from attn2ssm.student.vision import Attn2SSMForImageClassification

Note = Callable[..., None]  # note(message, record=None)


def calibration_ids(blocks: torch.Tensor, recipe, device) -> torch.Tensor:
    """The first training blocks in the run's block order: what automatic layer selection and
    calibration score on (``blocks``: the run's blocks at ``data.block_len``)."""
    n = min(recipe.student.auto_calibration_blocks, len(blocks))
    return blocks[block_indices(len(blocks), recipe.seed, 0, n)].to(device)


def build_student(
    recipe,
    teacher,
    teacher_info: dict,
    resume_from,
    images: bool,
    ids,
    note: Note,
    progress: bool,
    tokenizer=None,
):
    """The student in fp32 (on the CPU; the caller moves it): an image classifier or a language
    student, reloaded from ``resume_from``, continued from ``student.init_from``, or converted.
    ``ids()`` gives the calibration blocks; ``tokenizer`` the teacher's (``student.keep_heads``' probe)."""
    s = recipe.student
    if images:
        if resume_from is not None:
            return Attn2SSMForImageClassification.from_pretrained(resume_from, dtype=torch.float32)
        return build_vision_student(
            teacher,
            s.mixer,
            dict(s.mixer_options),
            depth=s.depth,
            layer_map_mode=s.layer_map,
            teacher_info=teacher_info,
        )
    if resume_from is not None:
        return Attn2SSMForCausalLM.from_pretrained(resume_from, dtype=torch.float32)
    if s.init_from:  # a trained student continued (student.init_from): no conversion, no calibration
        teachers.check_weight_files(s.init_from)
        return Attn2SSMForCausalLM.from_pretrained(s.init_from, dtype=torch.float32)
    plan, by_kind, record = _layer_plan(recipe, teacher, ids, note, progress, tokenizer)
    student = convert(
        teacher,
        plan,
        by_kind,
        teacher_info=teacher_info,
        init=s.init,
        depth=s.depth,
        depth_map=s.layer_map,
        kept_attention=s.kept_attention,
    )
    if record is not None:
        keep_probe_record(student, record)
    calibrate(student, teacher, ids(), note)
    calibrate_kept(student, teacher, ids(), note)
    return student


def _layer_plan(recipe, teacher, ids, note: Note, progress: bool, tokenizer):
    """(layer plan, mixer options by kind, retrieval probe record or None) of a converted student:
    attention kept by layer selection or placement, then ``student.keep_heads``' KV groups."""
    s = recipe.student
    if s.keep_attention == "auto":
        plan, scores = auto_plan(
            teacher, ids(), s.mixer, dict(s.mixer_options), s.attention_ratio, batch_size=2, progress=progress
        )
        log_layer_scores(scores, plan, note)
    else:
        plan = make_plan(
            s.depth or teacher.config.num_hidden_layers,
            s.mixer,
            attention_ratio=s.attention_ratio,
            keep_attention=s.keep_attention,
            placement=s.placement,
            align=s.align,
            where=s.where,
        )
    if s.keep_heads is None:
        return plan, {s.mixer: dict(s.mixer_options)}, None
    # a head-level hybrid: the probe's KV groups keep softmax attention
    plan, by_kind, record = head_level_plan_for(
        teacher, tokenizer, plan, dict(s.mixer_options), s.keep_heads, recipe.seed
    )
    note(describe_kept(record), {"event": "retrieval_probe", "kept": record["kept"]})
    return plan, by_kind, record


def calibrate(student, teacher, ids: torch.Tensor, note: Note, layers=None) -> None:
    """A fresh student's (or only ``layers`` of it) gated delta-rule mixers with ``decay_init:
    calibrated``: decays and write strengths per head from the teacher's attention on the
    calibration blocks (logged)."""
    report = calibrate_gated_delta(student, teacher, ids, layers)
    if report:
        alphas = [a for r in report.values() for a in r["alpha"]]
        note(
            f"gated delta-rule decays calibrated on the teacher's attention in {len(report)} layers "
            f"(per-head decay {min(alphas):.3f}..{max(alphas):.3f})",
            {"event": "decay_calibration", "step": 0, "layers": {str(i): r for i, r in report.items()}},
        )


def calibrate_kept(student, teacher, ids: torch.Tensor, note: Note) -> None:
    """A fresh hybrid's kept attention layers in Qwen3.5's form (``student.kept_attention:
    qwen35``): their q/k norm weights from the teacher's q and k on the calibration blocks (logged)."""
    report = calibrate_kept_attention(student, teacher, ids)
    if report:
        note(
            f"q/k norms of {len(report)} kept attention layers (Qwen3.5 form) calibrated on the teacher's q and k",
            {
                "event": "kept_attention_calibration",
                "step": 0,
                "layers": {str(i): r for i, r in report.items()},
            },
        )


def log_layer_scores(scores: list, plan: list[str], note: Note, stage_idx: int = -1) -> None:
    kept = [i for i, k in enumerate(plan) if k == ATTENTION]
    note(
        f"automatic layer selection: keeping attention in layers {kept}",
        {
            "event": "layer_selection",
            "stage_index": stage_idx,
            "step": 0,
            "scores": scores,
            "keep_attention": kept,
        },
    )


def grow_for_stage(student, teacher, recipe, stage_idx: int, cfg, ids, note: Note, progress: bool):
    """Stepwise hybrids: the student with more attention layers converted before a stage with its
    own ``attention_ratio`` (None when it has none, or keeps as many)."""
    if cfg.attention_ratio is None:
        return None
    s = recipe.student
    plan = list(student.config.layer_plan)
    kept = [i for i, k in enumerate(plan) if k == ATTENTION]
    n_keep = round(cfg.attention_ratio * len(plan))
    if n_keep >= len(kept):
        return None
    if s.keep_attention == "auto":
        new_kept, scores = select_attention_layers(
            teacher,
            ids(),
            s.mixer,
            dict(s.mixer_options),
            keep=n_keep,
            batch_size=2,
            progress=progress,
            student=student,
        )
        log_layer_scores(
            scores, [ATTENTION if i in new_kept else s.mixer for i in range(len(plan))], note, stage_idx
        )
    else:  # spread the survivors evenly over the layers that still keep attention (nested schedules)
        new_kept = (
            [kept[r] for r in interleaved_keep(len(kept), n_keep / len(kept), s.align)] if n_keep else []
        )
    new_plan = [k if k != ATTENTION or i in new_kept else s.mixer for i, k in enumerate(plan)]
    note(
        f"[stage {stage_idx + 1}] {cfg.name}: converting layers {[i for i in kept if i not in new_kept]} "
        f"(attention kept in {new_kept}, {n_keep}/{len(plan)})"
    )
    grown = grow_student(student, teacher, new_plan)
    calibrate(grown, teacher, ids(), note, layers={i for i in kept if i not in new_kept})
    return grown

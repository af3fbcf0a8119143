"""The distillation loop: stages in order, checkpoint/resume, metrics, final student and report.

One process or many (``accelerate launch``): every optimizer step consumes the same *global*
batch of ``stage.batch_size`` blocks whatever the number of processes; process r of W takes
its slice of each micro-batch, DDP averages the gradients, so the loss curve does not depend
on W. Block order is a deterministic function of (seed, stage, sample index), which with the
saved optimizer, scheduler and RNG state makes ``--resume`` continue a killed run exactly.

A stage kind may own training-only modules (CAB's bridges: ``kind.stage_modules``): they hang
on the student as ``student.stage_modules`` for the stage, train with it, travel in checkpoints
beside the student (``optimizer.pt``, like LoRA adapters) and are dropped when the stage ends.

Stages with their own ``data`` (``sft``, ``dpo``) draw examples the same way from a dataset that
is tokenized once when the stage starts, and get right-padded batches (``attention_mask``, and
``loss_mask`` for the scored reply tokens). Their per-token losses are normalised over the whole
optimizer step: the trainer passes ``mean_loss_tokens`` (loss tokens of the global batch ÷
micro-batches ÷ processes), computed from the indices alone, so it is the same on every process.

One run uses a run directory at a time: the main process holds an exclusive lock on its ``.lock``
(released by the OS when the process dies) before writing anything, so a second run on the same
``--out`` stops with one line naming the first's pid, and the hidden temporaries a killed run left
there are removed. A write that fails for want of space or permission stops with one line naming
the folder and ``--resume``; the checkpoints already written stay intact. SIGTERM / SIGINT (a
scheduler's notice, Ctrl-C) stop the loop after the current optimizer step: it is checkpointed, one
line names the checkpoint and the resume command, and the process exits 143 / 130 (every process
stops at the same step: they agree after each one).

Run directory::

    .lock                  "pid N on HOST" of the run holding it (the lock itself is the flock)
    recipe.yaml            resolved recipe (what --resume reruns)
    metrics.jsonl          one JSON line per step / eval
    checkpoints/<name>/    HF student + optimizer.pt + state.json, written atomically
    checkpoints/latest     name of the newest complete checkpoint
    student/               the final student + tokenizer (AutoModelForCausalLM-loadable)
    results.json, report.md, loss.png
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

import attn2ssm.teachers as teachers  # called through the module: tests replace its load_teacher
from attn2ssm.config import from_dict
from attn2ssm.data import (
    block_indices,
    check_block_len,
    load_preference_dataset,
    load_sft_dataset,
    load_training_data,
)
from attn2ssm.data.images import load_image_data
from attn2ssm.data.sources import needs_teacher
from attn2ssm.data.teacher_samples import build_teacher_sft_data, is_teacher_source
from attn2ssm.distill.accelerator import resolve_teacher_dtype, setup_accelerator
from attn2ssm.distill.calibration import calibrate_gated_delta, calibrate_kept_attention
from attn2ssm.distill.checkpoints import (
    append_jsonl,
    checkpoint_name,
    checkpoint_root,
    latest_checkpoint,
    publish_checkpoint,
    rng_state,
    set_rng_state,
    truncate_metrics,
)
from attn2ssm.distill.layer_selection import auto_plan, select_attention_layers
from attn2ssm.distill.logit_cache import CacheStats, LogitCache, find_cache_dir, teacher_source_key
from attn2ssm.distill.lora import attach_lora, merge_lora, state_dict_without_lora
from attn2ssm.distill.losses import cross_entropy, resolve_kl_chunk
from attn2ssm.distill.recipe import (
    Recipe,
    validate,
    validate_for_teacher,
)
from attn2ssm.distill.run_dir import (
    check_is_folder,
    check_metrics,
    check_new_run,
    hold_run_dir,
    intact_checkpoint,
    release_run_dir,
    report_resume_changes,
    resume_command,
    resumed_recipe,
    start_writing,
    writing_to,
)
from attn2ssm.distill.schedules import lr_multiplier
from attn2ssm.distill.stages import STAGE_KINDS, select_trainable
from attn2ssm.distill.state import StageRun, StepResult, TrainerState
from attn2ssm.errors import ConfigError, Interrupted, TrainingError
from attn2ssm.eval.classification import evaluate_classifier, write_vision_report
from attn2ssm.eval.report import write_report
from attn2ssm.mixers.registry import ATTENTION
from attn2ssm.ops.kernels import building_with
from attn2ssm.paths import (
    atomic_write_text,
    replace_dir,
)
from attn2ssm.student.convert import convert, grow_student
from attn2ssm.student.convert_vision import build_vision_student
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from attn2ssm.student.plans import interleaved_keep, make_plan
from attn2ssm.student.vision import Attn2SSMForImageClassification
from attn2ssm.teachers.vision import load_vision_teacher

__all__ = [
    "Distiller",
    "StepResult",
    "TrainerState",
    "distill",
    "latest_checkpoint",
    "resolve_kl_chunk",
    "resolve_teacher_dtype",
]


def _index_keyed(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter names (torch.distributed.checkpoint's full form)
    in the usual form, keyed by the parameters' positions: what ``optimizer.pt`` holds in every run."""
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: v for n, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def _name_keyed(state: dict, names: list[str]) -> dict:
    """``_index_keyed`` undone."""
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


@torch.no_grad()
def _fold_lora(model_state: dict, scale: float) -> dict:
    """A full state dict with its LoRA adapters (``lora.<module path with __>.A/B``) folded into the
    adapted weights, W ← W + scale·B·A, as ``merge_lora`` does in a module; the adapters dropped."""
    out = {k: v for k, v in model_state.items() if not k.startswith("lora.")}
    for key in {k[len("lora.") :].rsplit(".", 1)[0] for k in model_state if k.startswith("lora.")}:
        weight = f"{key.replace('__', '.')}.weight"
        A, B = model_state[f"lora.{key}.A"], model_state[f"lora.{key}.B"]
        out[weight] = out[weight] + (B @ A * scale).to(out[weight].dtype)
    return out


def _drop_stage_modules(model) -> None:
    """Remove a finished stage's training-only modules (CAB's bridges) from the student."""
    if hasattr(model, "stage_modules"):
        del model.stage_modules


def _activation_checkpointing(model, enable: bool) -> None:
    """HF activation checkpointing of ``model``'s decoder layers, non-reentrant: each layer's forward
    (the mixer inside it too) is recomputed in the backward instead of keeping its activations."""
    if enable:
        on = getattr(
            model, "activation_checkpointing_enable", None
        )  # transformers >= 5.2x; older: gradient_checkpointing_enable
        if on is not None:
            on(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if (
            getattr(model, "_require_grads_hook", None) is not None
        ):  # for reentrant checkpoints only: not needed here
            model.disable_input_require_grads()
    else:
        off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        off()


def _metric(value, device) -> torch.Tensor:
    """A metric as a float64 0-d tensor on ``device`` (a kind's detached tensor; a Python number from
    an older kind), without a copy that would wait for the device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)


class Distiller:
    """Runs a recipe into a run directory. ``teacher``/``tokenizer`` may be passed in (tests, notebooks)."""

    def __init__(
        self,
        recipe: Recipe,
        out: str | Path,
        *,
        resume: bool = False,
        overrides: list[str] | None = None,
        progress: bool = True,
        teacher=None,
        tokenizer=None,
    ):
        """``resume``: continue the run in ``out`` with the recipe saved there (if any; else ``recipe``),
        with ``overrides`` (a resume's ``--set`` strings) applied where ``resume_recipe`` allows."""
        self.out = Path(out)
        self.progress = progress
        self.resume_from: Path | None = None  # the intact checkpoint a resumed run continues from
        self.resume_command = resume_command(self.out)
        check_is_folder(self.out)
        recipe, changes = self._checked_recipe(recipe, resume, overrides, teacher)
        self.recipe = recipe
        setup = setup_accelerator(recipe, teacher_passed=teacher is not None)
        self.acc, self.kernels, self.precision = setup.acc, setup.kernels, setup.precision
        self.teacher_dtype, self.is_main = setup.teacher_dtype, setup.acc.is_main_process
        self._claim_run_dir(resume)
        if changes and self.is_main:
            report_resume_changes(changes)
        self._init_run_state(teacher, tokenizer)

    def _checked_recipe(self, recipe: Recipe, resume: bool, overrides, teacher) -> tuple[Recipe, list]:
        """``(recipe, changes)``: the recipe to run, validated (on a resume the one saved in the run
        directory, with the ``--set`` changes ``resume_recipe`` allowed)."""
        changes = []
        if resume:
            recipe, changes = resumed_recipe(self.out, recipe, overrides)
        validate(recipe)
        # what needs only the teacher's config.json, before anything loads or is written
        if self.resume_from is None and recipe.images is None:
            config = teacher.config if teacher is not None else teachers.read_teacher_config(recipe.teacher)
            if config is not None:
                validate_for_teacher(recipe, config)
        return recipe, changes

    def _claim_run_dir(self, resume: bool) -> None:
        """Lock the run directory; a resume finds its intact checkpoint and checks its metrics log, a
        new run needs a directory that holds no run."""
        self._lock, self._made_out = hold_run_dir(self.out, self.acc)
        try:
            if resume:
                self.resume_from = intact_checkpoint(self.out)
                if self.resume_from is not None and self.is_main:
                    check_metrics(self.out)
            else:
                check_new_run(self.out)
        except BaseException:
            self.close()
            raise

    def _init_run_state(self, teacher, tokenizer) -> None:
        """What run() fills in, empty until then."""
        self._asked: set[int] = set()  # signals received (SIGTERM / SIGINT): stop after the current step
        self.metrics_path = self.out / "metrics.jsonl"
        # filled by run(): the frozen teacher, the data, the student being trained
        self.teacher, self.tokenizer = teacher, tokenizer
        self.teacher_config = (
            None if teacher is None else teacher.config
        )  # set without the weights by a teacherless run
        self.teacher_info: dict = {}
        # a teacherless run (_plan_teacherless): (top_k, dir) → (cache folder, fingerprint) of each remaining stage's logit cache
        self.cached_teacher: dict[tuple, tuple[Path, str]] | None = None
        self._source_key: str | None = (
            None  # the teacher spec's files, recorded in the logit caches this run fills
        )
        self.corpus = None
        self.blocks: torch.Tensor | None = None  # training blocks (n, block_len)
        self.eval_blocks: torch.Tensor | None = None
        self.block_sets: dict[
            int, tuple
        ] = {}  # block length → (training, held-out) blocks: data.block_len's, and LM stages' own
        self.stage_data: dict[int, object] = {}  # stage index → its own dataset (sft / dpo), loaded up front
        self.student: torch.nn.Module | None = None
        self.images = None  # image recipes (recipe.images): data.images.ImageData, the stages' dataset
        self.started = time.perf_counter()
        self.logit_caches: dict[tuple, object] = {}  # (top_k, dir) → LogitCache, shared by the run's stages

    def close(self) -> None:
        """Release the run directory (``run`` does when it ends, however it ends); a folder this run
        created that holds nothing but its lock file (it failed before writing) is removed."""
        release_run_dir(self.out, self._lock, self._made_out)
        self._lock = None

    def _writing(self, what: str, where: Path | None = None, note: str = ""):
        """A write into the run directory: space or permission failures become one line naming it and the resume command."""
        return writing_to(self.out, what, where, note)

    # -- setup ---------------------------------------------------------------------------------
    def _load_teacher(self, state: TrainerState | None = None):
        """The frozen teacher (and its tokenizer), or — when ``_plan_teacherless`` finds every remaining
        stage served by a complete logit cache — its tokenizer and config only."""
        if self.teacher is None and state is not None and self._plan_teacherless(state):
            source = teachers.resolve_teacher(self.recipe.teacher)
            gguf = {"gguf_file": source.gguf_file} if source.gguf_file else {}
            from transformers import AutoConfig, AutoTokenizer  # heavy: transformers

            with teachers.quiet_loading():
                self.teacher_config = AutoConfig.from_pretrained(source.location, **gguf)
                self.tokenizer = AutoTokenizer.from_pretrained(source.location, **gguf)
            if self.tokenizer.pad_token is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.teacher_info = {"source": source.describe()}
            return
        self.cached_teacher = None
        if (
            self.teacher is None and self.recipe.images is None
        ):  # loaded here from its spec: the caches it fills can say so
            self._source_key = teacher_source_key(self.recipe.teacher, self.teacher_dtype, self._mode())
        if (
            self.teacher is None and self.recipe.images is not None
        ):  # an image classifier and its image processor
            self.teacher, self.tokenizer, self.teacher_info = load_vision_teacher(
                self.recipe.teacher, progress=self.progress and self.is_main
            )
            self.teacher.to(dtype=self.teacher_dtype)
        elif self.teacher is None:
            self.teacher, self.tokenizer, source = teachers.load_teacher(
                self.recipe.teacher, check_supported=True, dtype=self.teacher_dtype
            )
            self.teacher_info = {"source": source.describe()}
        else:
            self.teacher_info = {"source": {"kind": "object", "location": type(self.teacher).__name__}}
        self.teacher.to(self.acc.device).eval().requires_grad_(False)
        self.teacher_config = self.teacher.config

    def _mode(self) -> str:
        """The compute mode a logit cache is keyed by (device type / mixed precision)."""
        return f"{self.acc.device.type}/{self.precision.used}"

    def _remaining(self, state: TrainerState) -> list[int]:
        stages = self.recipe.stages
        return [
            i
            for i in range(state.stage, len(stages))
            if i not in state.finished and not (stages[i].tokens == 0 and stages[i].epochs is None)
        ]

    def _plan_teacherless(self, state: TrainerState) -> bool:
        """Whether this run can go without the teacher's weights: it resumes (the student exists), every
        stage still to run is kd / kd_ce with a logit_cache and no attention_ratio (no layer to
        convert), no data source samples the teacher, and each of those caches records this teacher
        spec's files (same files, dtype and mode: ``logit_cache.teacher_source_key``). Whether the
        caches hold every block is checked once the data is loaded (``_check_teacherless``)."""
        r = self.recipe
        if (
            self.resume_from is None
            or r.images is not None
            or any(needs_teacher(src.corpus) for src in r.data.source_list())
        ):
            return False
        stages = [r.stages[i] for i in self._remaining(state)]
        if not stages or any(
            c.kind not in ("kd", "kd_ce") or c.logit_cache is None or c.attention_ratio is not None
            for c in stages
        ):
            return False
        key = teacher_source_key(r.teacher, self.teacher_dtype, self._mode())
        if key is None:  # a hub id: its files are not on this disk to compare
            return False
        found = {}
        for c in stages:
            hit = find_cache_dir(c.logit_cache.dir, c.logit_cache.top_k, key)
            if hit is None:
                return False
            found[(c.logit_cache.top_k, c.logit_cache.dir)] = hit
        self.cached_teacher = found
        return True

    def _check_teacherless(self, state: TrainerState) -> None:
        """A teacherless run needs every block its remaining steps draw in the caches; when one is
        missing, the teacher loads after all (and fills it), with a line saying why."""
        if self.cached_teacher is None:
            return
        need: dict[tuple, set[int]] = {}
        blocks_of = {}
        for i in self._remaining(state):
            cfg = self.recipe.stages[i]
            blocks, _ = self._stage_blocks(i)
            steps = self._stage_steps(cfg, len(blocks), self._block_len(cfg))
            first = (
                state.step if i == state.stage else 0
            )  # every process's blocks of steps first..steps-1, in one draw
            drawn = block_indices(
                len(blocks),
                self.recipe.seed + 1000 * i,
                first * cfg.batch_size,
                (steps - first) * cfg.batch_size,
            )
            need.setdefault((cfg.logit_cache.top_k, cfg.logit_cache.dir), set()).update(
                (self._block_len(cfg), b) for b in drawn.tolist()
            )
            blocks_of[self._block_len(cfg)] = blocks
        total = sum(len(b) for b in need.values())
        missing = 0
        for key, blocks in need.items():
            folder, fingerprint = self.cached_teacher[key]
            cache = LogitCache(None, key[0], self._mode(), key[1], fingerprint=fingerprint)
            missing += sum(not cache.has(blocks_of[n][b]) for n, b in sorted(blocks))
        if self.is_main:
            folders = ", ".join(str(f) for f, _ in self.cached_teacher.values())
            if missing:
                print(
                    f"teacher-logit cache {folders} lacks {missing} of the {total} blocks the remaining steps draw: loading the teacher"
                )
            else:
                print(
                    f"teacher weights not loaded: every remaining stage reads the teacher's top-k from {folders} "
                    f"(all {total} blocks there); tokenizer and config from {self.recipe.teacher}"
                )
        if missing:
            self._load_teacher()

    def _load_data(self):
        if (
            self.recipe.images is not None
        ):  # a stratified fraction of the training split + the full test split
            self.images = load_image_data(self.recipe.images, self.tokenizer, self.recipe.seed)
            if self.is_main:
                print(self.images.describe())
            return
        data = self._blocks_at(self.recipe.data.block_len)
        self.corpus, self.blocks, self.eval_blocks = data.corpus, data.blocks, data.eval_blocks
        self.block_sets = {self.recipe.data.block_len: (data.blocks, data.eval_blocks)}

    def _block_len(self, cfg) -> int:
        """The block length an LM stage trains on: its own ``block_len``, else ``data.block_len``."""
        return cfg.block_len or self.recipe.data.block_len

    def _blocks_at(self, block_len: int):
        """The recipe's sources as training and held-out blocks of ``block_len`` tokens, sized for the
        LM stages that train at that length (tokenized text and teacher samples come from the caches)."""
        d = self.recipe.data
        check_block_len(block_len, getattr(self.teacher_config, "max_position_embeddings", None))
        # The most blocks one LM stage at this length draws: a mixture's size, and how far a hub source streams (None: epochs budgets only).
        budget = max(
            (
                math.ceil(s.tokens / (s.batch_size * block_len)) * s.batch_size
                for s in self.recipe.stages
                if s.data is None and s.epochs is None and self._block_len(s) == block_len
            ),
            default=None,
        )
        with (
            self.acc.main_process_first()
        ):  # one process tokenizes (or samples the teacher), the others read its cache
            data = load_training_data(
                d.source_list(),
                self.tokenizer,
                block_len,
                seed=self.recipe.seed,
                max_train_tokens=d.max_train_tokens,
                max_heldout_tokens=d.max_heldout_tokens,
                text_field=d.text_field,
                budget_blocks=budget or None,
                teacher=self.teacher,
                progress=self.progress and self.is_main,
                compact=True,
            )
        if self.is_main and len(data.sources) > 1:
            print(data.describe())
        return data

    def _stage_blocks(self, stage_idx: int):
        """(training, held-out) blocks of stage ``stage_idx``: the run's, or its own block length's
        (the sources re-blocked once, on first use)."""
        n = self._block_len(self.recipe.stages[stage_idx])
        if n not in self.block_sets:
            data = self._blocks_at(n)
            self.block_sets[n] = (data.blocks, data.eval_blocks)
        return self.block_sets[n]

    def _build_student(self):
        if self.images is not None:
            s = self.recipe.student
            student = (
                Attn2SSMForImageClassification.from_pretrained(self.resume_from, dtype=torch.float32)
                if self.resume_from is not None
                else build_vision_student(
                    self.teacher,
                    s.mixer,
                    dict(s.mixer_options),
                    depth=s.depth,
                    layer_map_mode=s.layer_map,
                    teacher_info=self.teacher_info,
                )
            )
        elif self.resume_from is not None:
            student = Attn2SSMForCausalLM.from_pretrained(self.resume_from, dtype=torch.float32)
        elif (
            self.recipe.student.init_from
        ):  # a trained student continued (student.init_from): no conversion, no calibration
            teachers.check_weight_files(self.recipe.student.init_from)
            student = Attn2SSMForCausalLM.from_pretrained(self.recipe.student.init_from, dtype=torch.float32)
        else:
            s = self.recipe.student
            n_layers = s.depth or self.teacher.config.num_hidden_layers
            if s.keep_attention == "auto":
                plan, scores = auto_plan(
                    self.teacher,
                    self._calibration_ids(),
                    s.mixer,
                    dict(s.mixer_options),
                    s.attention_ratio,
                    batch_size=2,
                    progress=self.progress,
                )
                self._log_layer_scores(scores, plan)
            else:
                plan = make_plan(
                    n_layers,
                    s.mixer,
                    attention_ratio=s.attention_ratio,
                    keep_attention=s.keep_attention,
                    placement=s.placement,
                    align=s.align,
                    where=s.where,
                )
            student = convert(
                self.teacher,
                plan,
                {s.mixer: dict(s.mixer_options)},
                teacher_info=self.teacher_info,
                init=s.init,
                depth=s.depth,
                depth_map=s.layer_map,
                kept_attention=s.kept_attention,
            )
            self._calibrate(student)
            self._calibrate_kept_attention(student)
        # fp32 master weights whatever the teacher's dtype (convert builds the student in the teacher's)
        self.student = student.to(device=self.acc.device, dtype=torch.float32)

    def _calibrate(self, student, layers=None) -> None:
        """A fresh student's (or only ``layers`` of it) gated delta-rule mixers with ``decay_init:
        calibrated``: decays and write strengths per head from the teacher's attention on the
        calibration blocks (logged)."""
        report = calibrate_gated_delta(student, self.teacher, self._calibration_ids(), layers)
        if report and self.is_main:
            alphas = [a for r in report.values() for a in r["alpha"]]
            print(
                f"gated delta-rule decays calibrated on the teacher's attention in {len(report)} layers "
                f"(per-head decay {min(alphas):.3f}..{max(alphas):.3f})"
            )
            with self._writing("metrics.jsonl"):
                append_jsonl(
                    self.metrics_path,
                    {
                        "event": "decay_calibration",
                        "step": 0,
                        "layers": {str(i): r for i, r in report.items()},
                    },
                )

    def _calibrate_kept_attention(self, student) -> None:
        """A fresh hybrid's kept attention layers in Qwen3.5's form (``student.kept_attention:
        qwen35``): their q/k norm weights from the teacher's q and k on the calibration blocks (logged)."""
        report = calibrate_kept_attention(student, self.teacher, self._calibration_ids())
        if report and self.is_main:
            print(
                f"q/k norms of {len(report)} kept attention layers (Qwen3.5 form) calibrated on the teacher's q and k"
            )
            with self._writing("metrics.jsonl"):
                append_jsonl(
                    self.metrics_path,
                    {
                        "event": "kept_attention_calibration",
                        "step": 0,
                        "layers": {str(i): r for i, r in report.items()},
                    },
                )

    def _calibration_ids(self) -> torch.Tensor:
        """The first training blocks in the run's block order: what automatic layer selection scores on."""
        blocks = self.block_sets[self.recipe.data.block_len][
            0
        ]  # the run's blocks, whichever stage is current
        n = min(self.recipe.student.auto_calibration_blocks, len(blocks))
        return blocks[block_indices(len(blocks), self.recipe.seed, 0, n)].to(self.acc.device)

    def _log_layer_scores(self, scores: list, plan: list[str], stage_idx: int = -1) -> None:
        if self.is_main:
            kept = [i for i, k in enumerate(plan) if k == ATTENTION]
            print(f"automatic layer selection: keeping attention in layers {kept}")
            with self._writing("metrics.jsonl"):
                append_jsonl(
                    self.metrics_path,
                    {
                        "event": "layer_selection",
                        "stage_index": stage_idx,
                        "step": 0,
                        "scores": scores,
                        "keep_attention": kept,
                    },
                )

    def _grow_for_stage(self, stage_idx: int, cfg) -> None:
        """Stepwise hybrids: convert more attention layers before a stage with its own attention_ratio."""
        if cfg.attention_ratio is None:
            return
        s = self.recipe.student
        student = self.acc.unwrap_model(self.student)
        plan = list(student.config.layer_plan)
        kept = [i for i, k in enumerate(plan) if k == ATTENTION]
        n_keep = round(cfg.attention_ratio * len(plan))
        if n_keep >= len(kept):
            return
        if s.keep_attention == "auto":
            new_kept, scores = select_attention_layers(
                self.teacher,
                self._calibration_ids(),
                s.mixer,
                dict(s.mixer_options),
                keep=n_keep,
                batch_size=2,
                progress=self.progress,
                student=student,
            )
            self._log_layer_scores(
                scores, [ATTENTION if i in new_kept else s.mixer for i in range(len(plan))], stage_idx
            )
        else:  # spread the survivors evenly over the layers that still keep attention (nested schedules)
            new_kept = (
                [kept[r] for r in interleaved_keep(len(kept), n_keep / len(kept), s.align)] if n_keep else []
            )
        new_plan = [k if k != ATTENTION or i in new_kept else s.mixer for i, k in enumerate(plan)]
        if self.is_main:
            print(
                f"[stage {stage_idx + 1}] {cfg.name}: converting layers {[i for i in kept if i not in new_kept]} "
                f"(attention kept in {new_kept}, {n_keep}/{len(plan)})"
            )
        grown = grow_student(student, self.teacher, new_plan)
        self._calibrate(grown, layers={i for i in kept if i not in new_kept})
        self.student = grown.to(self.acc.device)

    # -- checkpoints -----------------------------------------------------------------------------
    def _gather(self, run: StageRun, stage_end: bool) -> tuple[dict, dict]:
        """FSDP: the full student and optimizer state on the main process (CPU), every process taking
        part; at the stage end LoRA is folded into the weights. Elsewhere: ({}, {})."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True
        )  # only the main process receives them
        model_state = get_model_state_dict(run.model, options=options)
        optim_state = get_optimizer_state_dict(run.model, run.optimizer.optimizer, options=options)
        if not self.is_main:
            return {}, {}
        if stage_end and run.cfg.lora is not None:
            model_state = _fold_lora(model_state, run.cfg.lora.alpha / run.cfg.lora.r)
        return model_state, _index_keyed(optim_state, run.param_names)

    def _save_checkpoint(self, state: TrainerState, run: StageRun) -> None:
        self.acc.wait_for_everyone()
        if run.sharded:  # a collective: every process, before the main one writes
            full_model, full_optim = self._gather(run, run.index in state.finished)
        if self.is_main:
            student = self.acc.unwrap_model(self.student)
            name = checkpoint_name(state.stage, state.step)
            pointer = checkpoint_root(self.out) / "latest"
            kept = pointer.read_text().strip() if pointer.exists() else None
            note = (
                f" ({kept}, the last complete checkpoint, is intact)"
                if kept
                else " (no checkpoint is complete yet)"
            )

            def write(folder: Path) -> None:
                everything = full_model if run.sharded else state_dict_without_lora(student)
                plain = {k: v for k, v in everything.items() if not k.startswith(("lora.", "stage_modules."))}
                student.save_pretrained(folder, state_dict=plain)
                optim = full_optim if run.sharded else run.optimizer.state_dict()
                payload = {"optimizer": optim, "scheduler": run.scheduler.state_dict(), "rng": rng_state()}
                if (
                    self.acc.scaler is not None
                ):  # fp16: the loss scale and its growth count, for an exact resume
                    payload["scaler"] = self.acc.scaler.state_dict()
                if run.sharded and any(k.startswith("lora.") for k in everything):
                    payload["lora"] = {
                        k[len("lora.") :]: v for k, v in everything.items() if k.startswith("lora.")
                    }
                elif not run.sharded and hasattr(
                    student, "lora"
                ):  # a LoRA stage in progress: adapters travel beside the plain student
                    payload["lora"] = student.lora.state_dict()
                if hasattr(student, "stage_modules"):  # and so do a stage's training-only modules
                    payload["stage_modules"] = student.stage_modules.state_dict()
                with open(
                    folder / "optimizer.pt", "wb"
                ) as fh:  # through a file object, a failed write keeps its OSError
                    torch.save(payload, fh)
                atomic_write_text(folder / "state.json", json.dumps(asdict(state), indent=1))

            with self._writing(f"checkpoint {name}", checkpoint_root(self.out), note):
                publish_checkpoint(self.out, name, write, run.cfg.keep_checkpoints)
        self.acc.wait_for_everyone()

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def _eval_loss(self, stage_cfg) -> float:
        model = self.acc.unwrap_model(self.student)
        model.eval()
        n = min(len(self.eval_blocks), stage_cfg.eval_batches * 4)
        losses = []
        for i in range(0, n, 4):
            ids = self.eval_blocks[i : i + 4].to(self.acc.device)
            losses.append(cross_entropy(model(input_ids=ids, use_cache=False).logits, ids).item())
        model.train()
        return sum(losses) / max(1, len(losses))

    # -- stage data -----------------------------------------------------------------------------------
    def _stage_dataset(self, stage_idx: int, cfg, kind):
        """The stage's own dataset, tokenized once (per process: deterministic, and small next to training)."""
        d = cfg.data
        check_block_len(d.max_len, getattr(self.teacher.config, "max_position_embeddings", None))
        load = load_preference_dataset if "preference" in kind.data_formats else load_sft_dataset
        source = d.source
        if is_teacher_source(source):  # the teacher's own replies to corpus-derived prompts, sampled once
            if load is load_preference_dataset:
                raise ConfigError(
                    f"stage '{cfg.name}': a teacher: source gives chat data, not preference pairs",
                    "use it in an sft stage, and a preference dataset for dpo",
                )
            with self.acc.main_process_first():
                source = str(
                    build_teacher_sft_data(
                        source,
                        self.teacher,
                        self.tokenizer,
                        seed=self.recipe.seed,
                        progress=self.progress and self.is_main,
                    )
                )
        dataset = load(
            source,
            self.tokenizer,
            format=d.format,
            max_len=d.max_len,
            max_examples=d.max_examples,
            stage=cfg.name,
        )
        if self.is_main:
            m = dataset.meta
            print(
                f"[stage {stage_idx + 1}] {cfg.name}: {m['examples']} {m['format']} examples from {m['source']}"
                + (
                    f" ({m['dropped']} dropped: no reply token within max_len={d.max_len})"
                    if m["dropped"]
                    else ""
                )
            )
        return dataset

    def _prepare_stage_data(self, first_stage: int) -> None:
        """Load the datasets of the stages still to run now, so a missing file, a bad record or a
        tokenizer without a chat template stops the run before hours of earlier stages."""
        for i, cfg in enumerate(self.recipe.stages):
            kind = STAGE_KINDS[cfg.kind]
            if i >= first_stage and kind.data_formats is not None:
                self.stage_data[i] = self._stage_dataset(i, cfg, kind)

    def _stage_steps(self, cfg, n_items: int, seq_len: int) -> int:
        if cfg.epochs is not None:
            return max(1, math.ceil(cfg.epochs * n_items / cfg.batch_size))
        return math.ceil(cfg.tokens / (cfg.batch_size * seq_len))

    # -- the loop ------------------------------------------------------------------------------------
    def _batch_indices(
        self, stage_idx: int, step: int, accum_i: int, stage_cfg, n_items: int | None = None
    ) -> torch.Tensor:
        """This process's items (blocks, or dataset examples) for micro-batch ``accum_i`` of step ``step``."""
        world, rank = self.acc.num_processes, self.acc.process_index
        per = stage_cfg.batch_size // (stage_cfg.grad_accum * world)
        start = step * stage_cfg.batch_size + accum_i * world * per + rank * per
        n = len(self.blocks) if n_items is None else n_items
        return block_indices(n, self.recipe.seed + 1000 * stage_idx, start, per)

    def _step_indices(self, stage_idx: int, step: int, stage_cfg, n_items: int) -> torch.Tensor:
        """Every process's items of optimizer step ``step`` (the global batch)."""
        return block_indices(
            n_items, self.recipe.seed + 1000 * stage_idx, step * stage_cfg.batch_size, stage_cfg.batch_size
        )

    def _setup_stage(self, stage_idx: int, resume_payload: dict | None) -> StageRun:
        """The stage's data, adapters / training-only modules, trainable set, optimizer and schedule
        (restored from ``resume_payload`` when the run resumes inside this stage)."""
        cfg = self.recipe.stages[stage_idx]
        kind = STAGE_KINDS[cfg.kind]
        world = self.acc.num_processes
        if cfg.batch_size % (cfg.grad_accum * world):
            raise ConfigError(
                f"stage '{cfg.name}': batch_size {cfg.batch_size} is not divisible by grad_accum × processes = {cfg.grad_accum * world}",
                "make batch_size a multiple of grad_accum × number of processes",
            )
        dataset, seq_len, n_items = self._stage_items(stage_idx, cfg, kind)
        unwrapped = self.acc.unwrap_model(self.student)
        names = self._stage_trainable(unwrapped, cfg, kind, resume_payload)
        params = [p for p in unwrapped.parameters() if p.requires_grad]
        param_names = [
            n for n, p in unwrapped.named_parameters() if p.requires_grad
        ]  # the same order as params
        sharded = kind.through_model_forward and self.acc.distributed_type == DistributedType.FSDP
        optimizer, scheduler, steps = self._stage_optimizer(
            params, cfg, n_items, seq_len, sharded, resume_payload
        )
        cfg = replace(
            cfg, kl_chunk=resolve_kl_chunk(cfg.kl_chunk, self.acc.device.type, self._vocab(unwrapped))
        )
        model, optimizer = self._prepare_stage_model(
            unwrapped, optimizer, cfg, kind, sharded, param_names, resume_payload
        )
        params = [p for group in optimizer.param_groups for p in group["params"]]  # FSDP: the sharded ones
        self.student = model
        model.train()
        return StageRun(
            stage_idx,
            cfg,
            kind,
            dataset,
            seq_len,
            n_items,
            steps,
            model,
            unwrapped,
            params,
            len(names),
            optimizer,
            scheduler,
            self._logit_cache(cfg, self._vocab(unwrapped)),
            param_names,
            sharded,
        )

    def _stage_items(self, stage_idx: int, cfg, kind) -> tuple[object | None, int, int]:
        """``(dataset, seq_len, n_items)``: the stage's own dataset (None for corpus blocks, which it
        puts in ``self.blocks``), its sequence length and how many items it draws from."""
        dataset = self.images.train if self.images is not None else None  # image stages: budgets count images
        if kind.data_formats is not None:
            dataset = (
                self.stage_data.pop(stage_idx)
                if stage_idx in self.stage_data
                else self._stage_dataset(stage_idx, cfg, kind)
            )
        if self.images is None and dataset is None:  # an LM stage: its block length's blocks
            self.blocks, self.eval_blocks = self._stage_blocks(stage_idx)
        seq_len = (
            1
            if self.images is not None
            else cfg.data.max_len
            if dataset is not None
            else self._block_len(cfg)
        )
        n_items = len(dataset) if dataset is not None else len(self.blocks)
        return dataset, seq_len, n_items

    def _stage_trainable(self, unwrapped, cfg, kind, resume_payload: dict | None) -> list:
        """Attach the stage's LoRA adapters and training-only modules (restored on a resume) and set
        the trainable parameters; returns the names ``select_trainable`` picked."""
        if cfg.lora is not None:
            attach_lora(unwrapped, cfg.lora.targets, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout)
            if resume_payload is not None and "lora" in resume_payload:
                unwrapped.lora.load_state_dict(resume_payload["lora"])
        if hasattr(
            kind, "stage_modules"
        ):  # attached before the optimizer so a resume finds the same parameter order
            unwrapped.stage_modules = kind.stage_modules(unwrapped, self.teacher, cfg)
            if resume_payload is not None and "stage_modules" in resume_payload:
                unwrapped.stage_modules.load_state_dict(resume_payload["stage_modules"])
        names = select_trainable(unwrapped, cfg.trainable, cfg.frozen)
        if hasattr(unwrapped, "stage_modules"):  # they exist only to be trained, whatever the patterns say
            unwrapped.stage_modules.requires_grad_(True)
        return names

    def _stage_optimizer(
        self, params: list, cfg, n_items: int, seq_len: int, sharded: bool, resume_payload: dict | None
    ):
        """``(optimizer, scheduler, steps)``: the stage's AdamW and its schedule over its steps, restored
        from ``resume_payload`` (with the RNG and the fp16 loss scale; an FSDP optimizer's state only
        once sharded)."""
        optimizer = torch.optim.AdamW(
            params,
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
        )
        steps = self._stage_steps(cfg, n_items, seq_len)
        lam = lr_multiplier(
            cfg.schedule.kind, steps, cfg.schedule.warmup, cfg.schedule.decay, cfg.schedule.min_lr_ratio
        )
        # On the plain optimizer, stepped by _train_step only when the optimizer stepped (accelerate's
        # scheduler wrapper would also step it once per process under a multi-process launch).
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lam)
        if resume_payload is not None:
            if not sharded:  # FSDP: once the parameters are sharded (_prepare_stage_model)
                optimizer.load_state_dict(resume_payload["optimizer"])
            scheduler.load_state_dict(resume_payload["scheduler"])
            set_rng_state(resume_payload["rng"])
            if (
                self.acc.scaler is not None and "scaler" in resume_payload
            ):  # fp16: the loss scale and its growth count
                self.acc.scaler.load_state_dict(resume_payload["scaler"])
        return optimizer, scheduler, steps

    def _prepare_stage_model(
        self,
        unwrapped,
        optimizer,
        cfg,
        kind,
        sharded: bool,
        param_names: list[str],
        resume_payload: dict | None,
    ):
        """``(model, optimizer)`` prepared by accelerate for the stage (an FSDP resume's optimizer
        state loaded into the shards)."""
        # accelerate holds every model and optimizer it prepared until told otherwise, and its
        # clip_grad_norm_ unscales (fp16) the gradients of each optimizer it holds: the last stage's
        # share parameters with this one's, which would be unscaled twice.
        self.acc.free_memory()
        if kind.through_model_forward:
            # DDP wrap under accelerate launch (identity otherwise), with the optimizer: the GradScaler (fp16)
            # rides on it. Layer-local kinds never call the model's forward, so the model is not wrapped
            # and their gradients are averaged in _train_step.
            _activation_checkpointing(unwrapped, cfg.gradient_checkpointing)
            model, optimizer = self.acc.prepare(
                unwrapped, optimizer
            )  # FSDP2: shards the student in place, remaps the optimizer
        else:
            model, optimizer = unwrapped, self.acc.prepare_optimizer(optimizer)
        if (
            sharded and resume_payload is not None
        ):  # the full (unsharded) state, each process keeping its shards
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(
                model,
                optimizer.optimizer,
                _name_keyed(resume_payload["optimizer"], param_names),
                options=StateDictOptions(full_state_dict=True),
            )
        return model, optimizer

    @staticmethod
    def _vocab(student) -> int:
        """The width of the student's logits (its teacher's vocabulary; classes for an image student)."""
        head = student.get_output_embeddings() if hasattr(student, "get_output_embeddings") else None
        return head.weight.shape[0] if head is not None else getattr(student.config, "num_labels", 1)

    def _logit_cache(self, cfg, vocab: int):
        """The stage's teacher-logit cache, keyed by the teacher and this run's compute mode (one
        fingerprint per run: the teacher is frozen)."""
        if cfg.logit_cache is None:
            return None
        if cfg.logit_cache.top_k > vocab:
            raise ConfigError(
                f"stage '{cfg.name}': logit_cache.top_k={cfg.logit_cache.top_k} exceeds the teacher's vocabulary ({vocab})",
                f"set logit_cache.top_k to at most {vocab} (e.g. 64)",
            )
        key = (cfg.logit_cache.top_k, cfg.logit_cache.dir)
        if key not in self.logit_caches:
            if (
                self.teacher is None
            ):  # a teacherless run: the cache the teacher's spec filled, by its fingerprint
                self.logit_caches[key] = LogitCache(
                    None,
                    cfg.logit_cache.top_k,
                    self._mode(),
                    cfg.logit_cache.dir,
                    chunk_size=cfg.kl_chunk,
                    fingerprint=self.cached_teacher[key][1],
                )
            else:
                source = (
                    {
                        "key": self._source_key,
                        "teacher": self.recipe.teacher,
                        "dtype": str(self.teacher_dtype),
                        "mode": self._mode(),
                    }
                    if self._source_key
                    else None
                )
                self.logit_caches[key] = LogitCache(
                    self.teacher,
                    cfg.logit_cache.top_k,
                    self._mode(),
                    cfg.logit_cache.dir,
                    chunk_size=cfg.kl_chunk,
                    source=source,
                )
        cache = self.logit_caches[key]
        cache.stats = CacheStats()  # counted per stage
        return cache

    def _micro_batches(self, run: StageRun, step: int):
        """(tokens of the global batch, this process's micro-batches of optimizer step ``step``)."""
        cfg, world = run.cfg, self.acc.num_processes
        if run.dataset is None:
            batches = (
                {"input_ids": self.blocks[self._batch_indices(run.index, step, a, cfg)].to(self.acc.device)}
                for a in range(cfg.grad_accum)
            )
            return cfg.batch_size * run.seq_len, batches
        global_idx = self._step_indices(run.index, step, cfg, run.n_items).tolist()
        mean_loss_tokens = run.dataset.loss_tokens(global_idx) / (cfg.grad_accum * world)

        def collate(a: int) -> dict:
            idx = self._batch_indices(run.index, step, a, cfg, run.n_items).tolist()
            batch = {k: v.to(self.acc.device) for k, v in run.dataset.collate(idx).items()}
            batch["mean_loss_tokens"] = mean_loss_tokens
            if self.images is not None:  # for losses with a schedule of their own (vision_cab's align_until)
                batch["step"], batch["steps"] = step, run.steps
            return batch

        return run.dataset.tokens(global_idx), (collate(a) for a in range(cfg.grad_accum))

    def _train_step(self, run: StageRun, step: int) -> StepResult:
        """One optimizer step. What it reads back from the device — loss and metrics summed over
        micro-batches (and processes), the grad norm, the processes' stop signals — travels in one
        tensor: one host sync per step, after the backward and before the optimizer steps, so a
        non-finite loss stops the run before it reaches the weights."""
        cfg, model = run.cfg, run.model
        tokens, batches = self._micro_batches(run, step)
        device, world = self.acc.device, self.acc.num_processes
        step_loss = torch.zeros((), device=device)
        sums: dict[str, torch.Tensor] = {}
        for a, batch in enumerate(batches):
            if run.logit_cache is not None:
                batch["logit_cache"] = run.logit_cache
            wrapped = model is not run.unwrapped or run.sharded  # FSDP2 shards in place
            sync = self.acc.no_sync(model) if wrapped and a < cfg.grad_accum - 1 else contextlib.nullcontext()
            with sync, self.acc.autocast():
                loss, metrics = run.kind.loss(model, self.teacher, batch, cfg)
                self.acc.backward(loss / cfg.grad_accum)  # fp16: scaled by the GradScaler
            step_loss += loss.detach() / cfg.grad_accum
            for k, v in metrics.items():  # float64, as the Python floats they were summed in before
                sums[k] = sums.get(k, 0.0) + _metric(v, device) / cfg.grad_accum
        if world > 1 and not run.kind.through_model_forward:
            for p in run.params:
                if p.grad is not None:
                    p.grad = self.acc.reduce(p.grad, "mean")
        grad_norm = (
            self.acc.clip_grad_norm_(run.params, cfg.clip) if cfg.clip else None
        )  # fp16: unscales first
        names = list(sums)
        values = torch.stack([step_loss.double(), *(sums[k] for k in names)])
        if (
            world > 1
        ):  # summed over processes, with the signals each was sent (so all stop after the same step)
            asked = [
                torch.full((), float(signum in self._asked), dtype=torch.float64, device=device)
                for signum in (signal.SIGTERM, signal.SIGINT)
            ]
            values = self.acc.reduce(torch.cat([values, torch.stack(asked)]), "sum")
        if grad_norm is not None:
            full = (
                grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            )  # a DTensor under FSDP2
            values = torch.cat([values, full.detach().double().reshape(1)])
        host = values.tolist()  # the step's one host sync
        loss_value = host[0] / world
        if not math.isfinite(loss_value):
            ckpt = latest_checkpoint(self.out)
            raise TrainingError(
                f"non-finite loss ({loss_value}) at stage '{cfg.name}' step {step + 1}",
                f"lower stages.{run.index}.optim.lr or the clip value; the last good checkpoint is {ckpt or 'none (nothing saved yet)'}",
            )
        run.optimizer.step()  # fp16: skipped by the GradScaler when a gradient overflowed
        skipped = run.optimizer.step_was_skipped
        if not skipped:
            run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        metrics = {k: host[1 + i] / world for i, k in enumerate(names)}
        stop = None
        if world > 1:
            term, interrupt = host[1 + len(names)], host[2 + len(names)]
            stop = signal.SIGTERM if term else signal.SIGINT if interrupt else 0
        return StepResult(
            tokens, loss_value, metrics, host[-1] if grad_norm is not None else None, skipped, stop
        )

    def _log_step(self, run: StageRun, state: TrainerState, result: StepResult, tokens_per_s: float) -> None:
        """One metrics line (with a held-out evaluation every ``eval_every`` steps and at the end). A
        step the GradScaler skipped (fp16 overflow) counts like any other — its blocks were drawn, so
        the data order stays a function of the step — and says ``"skipped": true``; its lr is the
        one the schedule still holds (a skipped step does not advance it)."""
        cfg = run.cfg
        record = {
            "stage": cfg.name,
            "stage_index": run.index,
            "step": state.step,
            "tokens": state.tokens,
            "total_tokens": state.total_tokens,
            "loss": result.loss,
            "lr": run.scheduler.get_last_lr()[0],
            "tokens_per_s": tokens_per_s,
            "processes": self.acc.num_processes,
            "kernels": self.kernels.used,
            **{f"train_{k}": v for k, v in result.metrics.items()},
        }
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm
        if result.skipped:
            record["skipped"] = True
        due = (cfg.eval_every and state.step % cfg.eval_every == 0) or state.step == run.steps
        if self.is_main and due and self.images is not None:
            scores = evaluate_classifier(
                self.acc.unwrap_model(self.student),
                self.images.test,
                max_images=self.recipe.images.eval_images,
            )
            record["eval_loss"], record["eval_top1"] = scores["loss"], scores["top1"]
        elif (
            (self.is_main or run.sharded) and due and len(self.eval_blocks)
        ):  # FSDP: every process takes part in the forward
            record["eval_loss"] = self._eval_loss(cfg)
            record["eval_ppl"] = math.exp(min(record["eval_loss"], 50))
        if self.is_main:
            with self._writing("metrics.jsonl"):
                append_jsonl(self.metrics_path, record)

    def _finish_stage(self, run: StageRun, state: TrainerState) -> None:
        """The stage's last step: LoRA merged and training-only modules dropped, so the stage-end
        checkpoint (and the next stage) hold the plain student."""
        state.finished.append(run.index)
        if run.cfg.gradient_checkpointing:
            _activation_checkpointing(run.unwrapped, False)
        if (
            run.sharded
        ):  # the stage-end checkpoint folds LoRA into its full state dict, and every process reloads it
            return
        merge_lora(self.acc.unwrap_model(run.model))
        _drop_stage_modules(self.acc.unwrap_model(run.model))

    def _run_stage(self, stage_idx: int, state: TrainerState, resume_payload: dict | None) -> None:
        run = self._setup_stage(stage_idx, resume_payload)
        cfg = run.cfg
        if self.is_main:
            if self.images is not None:
                shape = f"{cfg.batch_size} images"
            elif run.dataset is not None:
                shape = f"{cfg.batch_size} examples (≤ {run.seq_len} tokens)"
            else:
                shape = f"{cfg.batch_size} × {run.seq_len} tokens"
            n_train = sum(p.numel() for p in run.params)
            print(
                f"[stage {stage_idx + 1}/{len(self.recipe.stages)}] {cfg.name} ({cfg.kind}): {run.steps} steps × {shape}, "
                f"{n_train / 1e6:.2f}M trainable params in {run.n_trainable_tensors} tensors"
            )
        bar = tqdm(
            total=run.steps,
            initial=state.step,
            desc=f"{cfg.name}",
            disable=not (self.progress and self.is_main),
            dynamic_ncols=True,
        )
        clock, unsaved = time.perf_counter(), False  # unsaved: steps taken since the last checkpoint
        agreed = None  # several processes: the stop signal they agreed on in the last step's reduction
        try:
            while state.step < run.steps:
                if signum := self._stop_asked() if agreed is None else agreed:
                    self._stop(signum, state, run if unsaved else None)
                result = self._train_step(run, state.step)
                agreed = result.stop
                state.advance(result.tokens)
                now = time.perf_counter()
                tokens_per_s = result.tokens / max(now - clock, 1e-9)
                clock = now
                self._log_step(run, state, result, tokens_per_s)
                bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{tokens_per_s:.0f}")
                bar.update(1)
                last, unsaved = state.step == run.steps, True
                if last:
                    self._finish_stage(run, state)
                if last or (cfg.save_every and state.step % cfg.save_every == 0):
                    self._save_checkpoint(state, run)
                    unsaved = False
        finally:
            bar.close()
        if run.logit_cache is not None and self.is_main:
            st = run.logit_cache.stats
            print(
                f"[stage {stage_idx + 1}] teacher-logit cache: {st.hits} blocks read, {st.misses} computed and stored ({run.logit_cache.dir})"
            )
        if run.sharded:  # every process goes on from the stage-end checkpoint's full student, unsharded
            self.student = self._plain_student(latest_checkpoint(self.out))
            return
        self.student = self.acc.unwrap_model(run.model)
        merge_lora(self.student)
        _drop_stage_modules(self.student)

    def _plain_student(self, folder: Path):
        with building_with(self.kernels.used):
            return Attn2SSMForCausalLM.from_pretrained(folder, dtype=torch.float32).to(self.acc.device)

    # -- stopping on a signal ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _signal_handlers(self):
        """While the run runs, SIGTERM / SIGINT only ask it to stop (``_stop_asked``). Ctrl-C twice
        interrupts at once (KeyboardInterrupt); a repeated SIGTERM is not hurried (torchrun sends
        its workers more than one), the scheduler's SIGKILL is what ends a grace period."""
        previous = {}

        def ask(signum, frame):
            if signum == signal.SIGINT and signum in self._asked:
                signal.signal(signum, previous[signum])
                signal.raise_signal(signum)
            self._asked.add(signum)

        try:
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.getsignal(signum) or signal.SIG_DFL
                signal.signal(signum, ask)
        except ValueError:  # not the main thread: signals cannot be caught here
            pass
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _stop_asked(self) -> int:
        """The signal to stop on (0: none). Processes agree on it, so they all stop at the same step."""
        signum = max(self._asked, default=0)
        if self.acc.num_processes > 1:
            signum = int(self.acc.gather(torch.tensor([signum], device=self.acc.device)).max())
        return signum

    def _stop(self, signum: int, state: TrainerState, run: StageRun | None = None) -> None:
        """Checkpoint the steps not saved yet (``run`` given) and raise Interrupted naming the checkpoint."""
        if run is not None:
            self._save_checkpoint(state, run)
        ckpt = latest_checkpoint(self.out)
        saved = f"checkpoint {ckpt}" if ckpt else "nothing trained yet, no checkpoint"
        raise Interrupted(
            f"stopped by {signal.Signals(signum).name} at stage {state.stage + 1}/{len(self.recipe.stages)} step {state.step}: {saved}",
            f"resume with: {self.resume_command}",
            exit_code=128 + signum,
        )

    def run(self) -> dict:
        """Train every stage still to run, write the student and the report; the run directory is released at the end."""
        try:
            with self._signal_handlers():
                return self._run()
        finally:
            self.close()

    def _run(self) -> dict:
        torch.manual_seed(self.recipe.seed)
        random.seed(self.recipe.seed)
        if self.is_main:
            print(self.precision.describe())
            print(self.kernels.describe())
        state = TrainerState()
        if self.resume_from is not None:
            state = from_dict(
                TrainerState, json.loads((self.resume_from / "state.json").read_text()), "state"
            )
        self._load_teacher(state)
        self._load_data()
        self._check_teacherless(state)
        # Only now (a teacher or corpus that fails to load leaves --out as it was; close() removes a
        # folder that holds nothing but the lock it made): a killed run's leftovers, the recipe, the metrics.
        if self.is_main:
            start_writing(self.out, self.recipe, resumed=self.resume_from is not None)
        payload = None
        if self.resume_from is not None:
            payload = torch.load(self.resume_from / "optimizer.pt", weights_only=False)
        self._prepare_stage_data(state.stage)
        with building_with(self.kernels.used):  # conversion, layer selection, calibration
            self._build_student()
        if self.resume_from is not None and self.is_main:  # only now that the checkpoint has loaded
            print(f"resuming from {self.resume_from.name}: stage {state.stage + 1}, step {state.step}")
            with self._writing("metrics.jsonl"):
                truncate_metrics(self.metrics_path, state.stage, state.step)
        for stage_idx in range(len(self.recipe.stages)):
            if stage_idx < state.stage:
                continue
            if stage_idx > state.stage or stage_idx in state.finished:  # a new stage starts from scratch
                if stage_idx in state.finished:
                    continue
                state = TrainerState(
                    stage=stage_idx, total_tokens=state.total_tokens, finished=state.finished
                )
                payload = None
            cfg = self.recipe.stages[stage_idx]
            if cfg.tokens == 0 and cfg.epochs is None:  # an optional stage, switched off
                if self.is_main:
                    print(
                        f"[stage {stage_idx + 1}] {cfg.name}: skipped (tokens: 0; --set stages.{stage_idx}.tokens=N runs it)"
                    )
                state.finished.append(stage_idx)
                continue
            if state.step == 0 and payload is None:  # a fresh stage (a resumed one already has its plan)
                # Whatever a stage draws at its start (new mixers' Δ/A, LoRA adapters) must not depend
                # on whether the run was resumed at this boundary: seed it from (seed, stage).
                torch.manual_seed(self.recipe.seed + 7919 * (stage_idx + 1))
                random.seed(self.recipe.seed + 7919 * (stage_idx + 1))
                with building_with(self.kernels.used):
                    self._grow_for_stage(stage_idx, self.recipe.stages[stage_idx])
            self._run_stage(stage_idx, state, payload)
            payload = None
        if signum := self._stop_asked():  # every stage is checkpointed: only the student and report are left
            self._stop(signum, state)
        return self._finish()

    def run_settings(self) -> dict:
        """How this run computed, as results.json and the metrics log record it."""
        return {
            "device": str(self.acc.device),
            "mixed_precision": self.precision.to_dict(),
            "kernels": self.kernels.to_dict(),
            "processes": self.acc.num_processes,
        }

    def _finish(self) -> dict:
        self.acc.wait_for_everyone()
        results = {}
        if self.is_main:
            student = self.acc.unwrap_model(self.student)
            student.eval()
            tmp = self.out / ".tmp-student"
            with self._writing("the final student"):
                try:
                    shutil.rmtree(tmp, ignore_errors=True)
                    student.save_pretrained(tmp)
                    if self.tokenizer is not None:
                        self.tokenizer.save_pretrained(tmp)
                    replace_dir(tmp, self.out / "student")
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            with self._writing("the report"):
                if self.images is not None:
                    results = write_vision_report(
                        self.out,
                        self.recipe,
                        self.teacher,
                        student,
                        self.images,
                        seconds=round(time.perf_counter() - self.started, 1),
                    )
                else:
                    results = self._write_report(student)
        self.acc.wait_for_everyone()
        return results

    def _write_report(self, student) -> dict:
        """The language report. The teacher's held-out perplexity is kept beside the run's logit caches
        (keyed by the held-out tokens and eval settings), so a teacherless run reports the value an
        earlier run measured on the same teacher and held-out text, or says it did not measure it."""
        caches = list(self.logit_caches.values())
        e = self.recipe.eval
        window = e.window or self.recipe.data.block_len
        h = hashlib.sha256(self.corpus.heldout_ids.to("cpu", torch.int64).numpy().tobytes())
        h.update(f"|{window}|{e.stride or window // 2}|{e.max_tokens}|{e.batch_size}".encode())
        key = h.hexdigest()
        known = (
            next((p for p in (c.teacher_perplexity(key) for c in caches) if p is not None), None)
            if self.teacher is None
            else None
        )
        results = write_report(
            self.out,
            self.recipe,
            self.teacher,
            student,
            self.corpus,
            progress=self.progress,
            settings=self.run_settings(),
            teacher_ppl=known,
        )
        if self.teacher is not None:
            for cache in caches:
                cache.record_perplexity(key, results["teacher_ppl"])
        return results


def distill(
    recipe: Recipe,
    out: str | Path,
    *,
    resume: bool = False,
    overrides: list[str] | None = None,
    progress: bool = True,
    teacher=None,
    tokenizer=None,
) -> dict:
    return Distiller(
        recipe,
        out,
        resume=resume,
        overrides=overrides,
        progress=progress,
        teacher=teacher,
        tokenizer=tokenizer,
    ).run()

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

One run uses a run directory at a time (its lock, and what a resume checks before any work:
``run_dir``). A write that fails for want of space or permission stops with one line naming the
folder and ``--resume``; the checkpoints already written stay intact. SIGTERM / SIGINT stop the loop
after the current optimizer step with a checkpoint and one line (``signals``).

This module keeps the loop; each other job has its file beside it: the state it carries
(``state``), the compute setup (``accelerator``), the teacher or its logit caches
(``teacher_source``), the data (``run_data``), the student's build, calibration and stepwise growth
(``build_student``), a stage's setup (``stage_setup``), the batches (``batches``), checkpoints
(``checkpoints``), and what it measures and writes at the end (``results``).

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
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

import attn2ssm.teachers as teachers  # called through the module: tests replace its load_teacher
from attn2ssm.config import from_dict
from attn2ssm.data.images import load_image_data
from attn2ssm.distill.accelerator import resolve_teacher_dtype, setup_accelerator
from attn2ssm.distill.batches import metric, micro_batches
from attn2ssm.distill.build_student import build_student, calibration_ids, grow_for_stage
from attn2ssm.distill.checkpoints import (
    append_jsonl,
    checkpoint_name,
    checkpoint_root,
    gather_sharded,
    intact_note,
    latest_checkpoint,
    publish_checkpoint,
    truncate_metrics,
    write_checkpoint,
)
from attn2ssm.distill.delta import start_delta
from attn2ssm.distill.logit_cache import teacher_source_key
from attn2ssm.distill.lora import merge_lora
from attn2ssm.distill.losses import resolve_kl_chunk
from attn2ssm.distill.recipe import (
    Recipe,
    validate,
    validate_for_teacher,
)
from attn2ssm.distill.results import eval_loss, language_report, non_finite, save_student, step_record
from attn2ssm.distill.run_data import block_len, load_blocks, stage_dataset
from attn2ssm.distill.run_dir import (
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
from attn2ssm.distill.signals import (
    agreed_signal,
    asked_flags,
    asking_to_stop,
    interrupted,
    signal_from_flags,
    stopping_at_once,
)
from attn2ssm.distill.stage_setup import (
    check_batch_split,
    describe_stage,
    drop_stage_modules,
    prepare_stage,
    undo_layer_settings,
    vocab,
)
from attn2ssm.distill.stages import STAGE_KINDS
from attn2ssm.distill.state import StageRun, StepResult, TrainerState
from attn2ssm.distill.teacher_source import (
    load_teacher_files,
    load_teacher_weights,
    missing_blocks,
    plan_teacherless,
    remaining_stages,
    stage_logit_cache,
    teacherless_notice,
)
from attn2ssm.eval.classification import evaluate_classifier, write_vision_report
from attn2ssm.ops.kernels import building_with
from attn2ssm.paths import check_writable
from attn2ssm.student.modeling import Attn2SSMForCausalLM

__all__ = [
    "Distiller",
    "StepResult",
    "TrainerState",
    "distill",
    "latest_checkpoint",
    "load_for_steps",
    "resolve_kl_chunk",
    "resolve_teacher_dtype",
    "setup_stage",
    "train_step",
]


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
        check_writable(self.out, folder=True)  # a file there, or a folder it cannot write: one line
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
        # set without the weights by a teacherless run
        self.teacher_config = None if teacher is None else teacher.config
        self.teacher_info: dict = {}
        # a teacherless run (teacher_source.plan_teacherless): (top_k, dir) → (cache folder,
        # fingerprint) of each remaining stage's logit cache
        self.cached_teacher: dict[tuple, tuple[Path, str]] | None = None
        # the teacher spec's files, recorded in the logit caches this run fills
        self._source_key: str | None = None
        self.corpus = None
        self.blocks: torch.Tensor | None = None  # training blocks (n, block_len)
        self.eval_blocks: torch.Tensor | None = None
        # block length → (training, held-out) blocks: data.block_len's, and LM stages' own
        self.block_sets: dict[int, tuple] = {}
        self.stage_data: dict[int, object] = {}  # stage index → its own dataset (sft / dpo), loaded up front
        self.student: torch.nn.Module | None = None
        self.delta = None  # the run's delta checkpoint writer (distill/delta.py), main process
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
        """The frozen teacher (and its tokenizer), or — when every remaining stage of a resume is
        served by a complete logit cache (``teacher_source.plan_teacherless``) — its tokenizer and
        config only."""
        if self.teacher is None and state is not None and self.resume_from is not None:
            remaining = remaining_stages(self.recipe, state)
            self.cached_teacher = plan_teacherless(self.recipe, remaining, self.teacher_dtype, self._mode())
            if self.cached_teacher is not None:
                self.teacher_config, self.tokenizer, self.teacher_info = load_teacher_files(self.recipe)
                return
        self.cached_teacher = None
        if self.teacher is None:
            if self.recipe.images is None:  # loaded here from its spec: the caches it fills can say so
                self._source_key = teacher_source_key(self.recipe.teacher, self.teacher_dtype, self._mode())
            self.teacher, self.tokenizer, self.teacher_info = load_teacher_weights(
                self.recipe, self.teacher_dtype, self.acc.device, self.progress and self.is_main
            )
        else:
            self.teacher_info = {"source": {"kind": "object", "location": type(self.teacher).__name__}}
            self.teacher.to(self.acc.device).eval().requires_grad_(False)
        self.teacher_config = self.teacher.config

    def _mode(self) -> str:
        """The compute mode a logit cache is keyed by (device type / mixed precision)."""
        return f"{self.acc.device.type}/{self.precision.used}"

    def _check_teacherless(self, state: TrainerState) -> None:
        """A teacherless run needs every block its remaining steps draw in the caches; when one is
        missing, the teacher loads after all (and fills it), with a line saying why."""
        if self.cached_teacher is None:
            return
        args = (self.recipe, state, self.cached_teacher, self._stage_blocks, self._block_len, self._mode())
        missing, total = missing_blocks(*args)
        if self.is_main:
            print(teacherless_notice(self.cached_teacher, missing, total, self.recipe.teacher))
        if missing:
            self._load_teacher()

    def _load_data(self):
        # image recipes: a stratified fraction of the training split + the full test split
        if self.recipe.images is not None:
            self.images = load_image_data(self.recipe.images, self.tokenizer, self.recipe.seed)
            if self.is_main:
                print(self.images.describe())
            return
        data = self._blocks_at(self.recipe.data.block_len)
        self.corpus, self.blocks, self.eval_blocks = data.corpus, data.blocks, data.eval_blocks
        self.block_sets = {self.recipe.data.block_len: (data.blocks, data.eval_blocks)}

    def _block_len(self, cfg) -> int:
        """The block length an LM stage trains on (``run_data.block_len``)."""
        return block_len(cfg, self.recipe)

    def _blocks_at(self, length: int):
        """The training and held-out blocks of ``length`` tokens (``run_data.load_blocks``)."""
        progress = self.progress and self.is_main
        return load_blocks(
            self.recipe, length, self.tokenizer, self.teacher, self.teacher_config, self.acc, progress
        )

    def _stage_blocks(self, stage_idx: int):
        """(training, held-out) blocks of stage ``stage_idx``: the run's, or its own block length's
        (the sources re-blocked once, on first use)."""
        n = self._block_len(self.recipe.stages[stage_idx])
        if n not in self.block_sets:
            data = self._blocks_at(n)
            self.block_sets[n] = (data.blocks, data.eval_blocks)
        return self.block_sets[n]

    def _note(self, message: str, record: dict | None = None) -> None:
        """A line for the user and, when given, a metrics record (main process only)."""
        if self.is_main:
            print(message)
            if record is not None:
                with self._writing("metrics.jsonl"):
                    append_jsonl(self.metrics_path, record)

    def _calibration_ids(self) -> torch.Tensor:
        """The run's calibration blocks (``build_student.calibration_ids``), whichever stage is current."""
        return calibration_ids(self.block_sets[self.recipe.data.block_len][0], self.recipe, self.acc.device)

    def _build_student(self):
        """The student (``build_student``), fp32 master weights on the run's device whatever the
        teacher's dtype (convert builds the student in the teacher's)."""
        student = build_student(
            self.recipe,
            self.teacher,
            self.teacher_info,
            self.resume_from,
            self.images is not None,
            self._calibration_ids,
            self._note,
            self.progress,
            tokenizer=self.tokenizer,
        )
        self.student = student.to(device=self.acc.device, dtype=torch.float32)
        self.delta = start_delta(
            self.out, self.recipe, self.student, self.resume_from is not None, self.is_main
        )

    def _grow_for_stage(self, stage_idx: int, cfg) -> None:
        """Stepwise hybrids: convert more attention layers before a stage with its own attention_ratio."""
        student = self.acc.unwrap_model(self.student)
        grown = grow_for_stage(
            student,
            self.teacher,
            self.recipe,
            stage_idx,
            cfg,
            self._calibration_ids,
            self._note,
            self.progress,
        )
        if grown is not None:
            self.student = grown.to(self.acc.device)

    # -- checkpoints -----------------------------------------------------------------------------
    def _save_checkpoint(self, state: TrainerState, run: StageRun) -> None:
        """Checkpoint the run's position (every process takes part; the main one writes)."""
        self.acc.wait_for_everyone()
        full_model = None
        if run.sharded:  # a collective: every process, before the main one writes
            lora = run.cfg.lora if run.index in state.finished else None
            full_model, full_optim = gather_sharded(
                run.model,
                run.optimizer.optimizer,
                run.param_names,
                self.is_main,
                lora and lora.alpha / lora.r,
            )
        if self.is_main:
            student = self.acc.unwrap_model(self.student)
            training = {
                "optimizer": full_optim if run.sharded else run.optimizer.state_dict(),
                "scheduler": run.scheduler.state_dict(),
            }
            if self.acc.scaler is not None:  # fp16: the loss scale and its growth count, for an exact resume
                training["scaler"] = self.acc.scaler.state_dict()
            name, note = checkpoint_name(state.stage, state.step), intact_note(self.out)

            def write(folder: Path) -> None:
                write_checkpoint(folder, student, asdict(state), training, full_model)

            with self._writing(f"checkpoint {name}", checkpoint_root(self.out), note):
                publish_checkpoint(self.out, name, write, run.cfg.keep_checkpoints)
        self.acc.wait_for_everyone()

    # -- stage data -----------------------------------------------------------------------------------
    def _stage_dataset(self, stage_idx: int, cfg, kind):
        """The stage's own dataset (``run_data.stage_dataset``)."""
        progress = self.progress and self.is_main
        return stage_dataset(
            self.recipe, stage_idx, cfg, kind, self.teacher, self.tokenizer, self.acc, progress
        )

    def _prepare_stage_data(self, first_stage: int) -> None:
        """Load the datasets of the stages still to run now, so a missing file, a bad record or a
        tokenizer without a chat template stops the run before hours of earlier stages."""
        for i, cfg in enumerate(self.recipe.stages):
            kind = STAGE_KINDS[cfg.kind]
            if i >= first_stage and kind.data_formats is not None:
                self.stage_data[i] = self._stage_dataset(i, cfg, kind)

    # -- the loop ------------------------------------------------------------------------------------
    def _setup_stage(self, stage_idx: int, resume_payload: dict | None) -> StageRun:
        """The stage's data, then its trainable set, optimizer and schedule (``stage_setup``; restored
        from ``resume_payload`` when the run resumes inside this stage)."""
        cfg = self.recipe.stages[stage_idx]
        kind = STAGE_KINDS[cfg.kind]
        check_batch_split(cfg, self.acc.num_processes)
        dataset, seq_len, n_items = self._stage_items(stage_idx, cfg, kind)
        unwrapped = self.acc.unwrap_model(self.student)
        p = prepare_stage(self.acc, unwrapped, cfg, kind, self.teacher, n_items, seq_len, resume_payload)
        self.student = p.model
        p.model.train()
        return StageRun(
            stage_idx,
            p.cfg,
            kind,
            dataset,
            seq_len,
            n_items,
            p.steps,
            p.model,
            unwrapped,
            p.params,
            p.n_trainable_tensors,
            p.optimizer,
            p.scheduler,
            self._logit_cache(p.cfg, vocab(unwrapped)),
            p.param_names,
            p.sharded,
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

    def _logit_cache(self, cfg, vocab: int):
        """The stage's teacher-logit cache (``teacher_source.stage_logit_cache``)."""
        source = None
        if self._source_key:  # what the caches this teacher fills record of its spec
            source = {
                "key": self._source_key,
                "teacher": self.recipe.teacher,
                "dtype": str(self.teacher_dtype),
                "mode": self._mode(),
            }
        return stage_logit_cache(
            cfg, vocab, self.logit_caches, self.teacher, self._mode(), self.cached_teacher, source
        )

    def _micro_batches(self, run: StageRun, step: int):
        """(tokens of the global batch, this process's micro-batches of optimizer step ``step``)."""
        return micro_batches(
            run, step, self.blocks, self.recipe.seed, self.acc, with_step=self.images is not None
        )

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
                sums[k] = sums.get(k, 0.0) + metric(v, device) / cfg.grad_accum
        if world > 1 and not run.kind.through_model_forward:
            for p in run.params:
                if p.grad is not None:
                    p.grad = self.acc.reduce(p.grad, "mean")
        # fp16: unscales first
        grad_norm = self.acc.clip_grad_norm_(run.params, cfg.clip) if cfg.clip else None
        names = list(sums)
        values = torch.stack([step_loss.double(), *(sums[k] for k in names)])
        # summed over processes, with the signals each was sent (so all stop after the same step)
        if world > 1:
            asked = asked_flags(self._asked, device)
            values = self.acc.reduce(torch.cat([values, torch.stack(asked)]), "sum")
        if grad_norm is not None:
            # a DTensor under FSDP2
            full = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            values = torch.cat([values, full.detach().double().reshape(1)])
        host = values.tolist()  # the step's one host sync
        loss_value = host[0] / world
        if not math.isfinite(loss_value):
            raise non_finite(loss_value, run, step, latest_checkpoint(self.out))
        run.optimizer.step()  # fp16: skipped by the GradScaler when a gradient overflowed
        skipped = run.optimizer.step_was_skipped
        if not skipped:
            run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        metrics = {k: host[1 + i] / world for i, k in enumerate(names)}
        stop = signal_from_flags(host[1 + len(names)], host[2 + len(names)]) if world > 1 else None
        return StepResult(
            tokens, loss_value, metrics, host[-1] if grad_norm is not None else None, skipped, stop
        )

    def _log_step(self, run: StageRun, state: TrainerState, result: StepResult, tokens_per_s: float) -> None:
        """One metrics line (``results.step_record``), with a held-out evaluation every ``eval_every``
        steps and at the end."""
        cfg = run.cfg
        record = step_record(run, state, result, tokens_per_s, self.acc.num_processes, self.kernels.used)
        due = (cfg.eval_every and state.step % cfg.eval_every == 0) or state.step == run.steps
        if self.is_main and due and self.images is not None:
            scores = evaluate_classifier(
                self.acc.unwrap_model(self.student),
                self.images.test,
                max_images=self.recipe.images.eval_images,
            )
            record["eval_loss"], record["eval_top1"] = scores["loss"], scores["top1"]
        # FSDP: every process takes part in the forward
        elif (self.is_main or run.sharded) and due and len(self.eval_blocks):
            record["eval_loss"] = eval_loss(
                self.acc.unwrap_model(self.student), self.eval_blocks, cfg.eval_batches, self.acc.device
            )
            record["eval_ppl"] = math.exp(min(record["eval_loss"], 50))
        if self.is_main:
            with self._writing("metrics.jsonl"):
                append_jsonl(self.metrics_path, record)

    def _finish_stage(self, run: StageRun, state: TrainerState) -> None:
        """The stage's last step: LoRA merged and training-only modules dropped, so the stage-end
        checkpoint (and the next stage) hold the plain student."""
        state.finished.append(run.index)
        if self.delta is not None:  # the stage's trained tensors, before LoRA merges (distill/delta.py)
            self.delta.add_stage(run, state)
        undo_layer_settings(run.unwrapped, run.cfg)
        # the stage-end checkpoint folds LoRA into its full state dict, and every process reloads it
        if run.sharded:
            return
        merge_lora(self.acc.unwrap_model(run.model))
        drop_stage_modules(self.acc.unwrap_model(run.model))

    def _run_stage(self, stage_idx: int, state: TrainerState, resume_payload: dict | None) -> None:
        run = self._setup_stage(stage_idx, resume_payload)
        cfg = run.cfg
        if self.is_main:
            print(describe_stage(run, len(self.recipe.stages), self.images is not None))
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
        drop_stage_modules(self.student)

    def _plain_student(self, folder: Path):
        """The full student of a checkpoint, on this process's device (after a sharded stage)."""
        with building_with(self.kernels.used):
            return Attn2SSMForCausalLM.from_pretrained(folder, dtype=torch.float32).to(self.acc.device)

    # -- stopping on a signal ---------------------------------------------------------------------
    def _stop_asked(self) -> int:
        """The signal to stop on (0: none), agreed by every process."""
        return agreed_signal(self._asked, self.acc)

    def _stop(self, signum: int, state: TrainerState, run: StageRun | None = None, loading=False) -> None:
        """Checkpoint the steps not saved yet (``run`` given) and raise Interrupted naming the checkpoint
        (``loading``: before the run's first step, where a signal stops at once)."""
        if run is not None:
            self._save_checkpoint(state, run)
        step = "before its first step (loading)" if loading else f"step {state.step}"
        where = f"stage {state.stage + 1}/{len(self.recipe.stages)} {step}"
        raise interrupted(signum, where, latest_checkpoint(self.out), self.resume_command)

    def run(self) -> dict:
        """Train every stage still to run, write the student and the report; the run directory is released at the end."""
        try:
            with asking_to_stop(self._asked):
                return self._run()
        finally:
            self.close()

    def _prepare(self, state: TrainerState):
        """Teacher, data, run directory and student; a resumed run's optimizer payload (or None)."""
        self._load_teacher(state)
        self._load_data()
        self._check_teacherless(state)
        # Only now (a teacher or corpus that fails to load leaves --out as it was; close() removes a
        # folder that holds nothing but the lock it made): a killed run's leftovers, the recipe, the metrics.
        if self.is_main:
            start_writing(self.out, self.recipe, resumed=self.resume_from is not None)
        resumed = self.resume_from is not None
        payload = torch.load(self.resume_from / "optimizer.pt", weights_only=False) if resumed else None
        self._prepare_stage_data(state.stage)
        with building_with(self.kernels.used):  # conversion, layer selection, calibration
            self._build_student()
        if self.resume_from is not None and self.is_main:  # only now that the checkpoint has loaded
            print(f"resuming from {self.resume_from.name}: stage {state.stage + 1}, step {state.step}")
            with self._writing("metrics.jsonl"):
                truncate_metrics(self.metrics_path, state.stage, state.step)
        return payload

    def _run(self) -> dict:
        """Load the teacher, the data and the student, run the stages still to run, then finish."""
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
        with stopping_at_once(self._asked, lambda signum: self._stop(signum, state, loading=True)):
            payload = self._prepare(state)
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
        # every stage is checkpointed: only the student and report are left
        if signum := self._stop_asked():
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
        """The final student and the report, written by the main process."""
        self.acc.wait_for_everyone()
        results = {}
        if self.is_main:
            student = self.acc.unwrap_model(self.student)
            student.eval()
            with self._writing("the final student"):
                save_student(self.out, student, self.tokenizer)
            with self._writing("the report"):
                if self.images is not None:
                    seconds = round(time.perf_counter() - self.started, 1)
                    results = write_vision_report(
                        self.out, self.recipe, self.teacher, student, self.images, seconds=seconds
                    )
                else:
                    caches = list(self.logit_caches.values())
                    results = language_report(
                        self.out,
                        self.recipe,
                        self.teacher,
                        student,
                        self.corpus,
                        caches,
                        self.run_settings(),
                        self.progress,
                    )
        self.acc.wait_for_everyone()
        return results


# -- the run's own steps, one at a time (bench train times them: bench/train.py) -----------------
def load_for_steps(distiller: Distiller) -> None:
    """The teacher, the data and the student, loaded as ``run`` loads them before its first stage."""
    distiller._load_teacher()
    distiller._load_data()
    with building_with(distiller.kernels.used):
        distiller._build_student()


def setup_stage(distiller: Distiller, stage_idx: int) -> StageRun:
    """Stage ``stage_idx`` set up from scratch, as a run starts it: its data, trainable set, optimizer, schedule."""
    return distiller._setup_stage(stage_idx, None)


def train_step(distiller: Distiller, run: StageRun, step: int) -> StepResult:
    """One optimizer step of ``run``, the run's own (``Distiller._train_step``)."""
    return distiller._train_step(run, step)


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

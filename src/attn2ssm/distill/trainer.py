"""The distillation loop: stages in order, checkpoint/resume, metrics, final student and report.

One process or many (``accelerate launch``): every optimizer step consumes the same *global*
batch of ``stage.batch_size`` blocks whatever the number of processes; process r of W takes
its slice of each micro-batch, DDP averages the gradients, so the loss curve does not depend
on W. Block order is a deterministic function of (seed, stage, sample index), which with the
saved optimizer, scheduler and RNG state makes ``--resume`` continue a killed run exactly.

Run directory::

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
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attn2ssm.config import from_dict
from attn2ssm.data import block_indices, check_block_len, pack_blocks, prepare_corpus
from attn2ssm.distill.lora import attach_lora, merge_lora, state_dict_without_lora
from attn2ssm.distill.recipe import Recipe, validate
from attn2ssm.distill.schedules import lr_multiplier
from attn2ssm.distill.stages import STAGE_KINDS, select_trainable
from attn2ssm.errors import CheckpointError, ConfigError, TrainingError
from attn2ssm.paths import atomic_write_text
from attn2ssm.student.plans import make_plan


@dataclass
class TrainerState:
    stage: int = 0  # index of the stage in progress
    step: int = 0  # optimizer steps completed in that stage
    tokens: int = 0  # tokens consumed in that stage
    total_tokens: int = 0  # tokens consumed over all stages
    finished: list[int] = field(default_factory=list)  # indices of completed stages


# --------------------------------------------------------------------------------------------
# run directory helpers


def _checkpoint_root(out: Path) -> Path:
    return out / "checkpoints"


def latest_checkpoint(out: Path) -> Path | None:
    pointer = _checkpoint_root(out) / "latest"
    if not pointer.exists():
        return None
    path = _checkpoint_root(out) / pointer.read_text().strip()
    if not (path / "state.json").exists():
        raise CheckpointError(f"checkpoint pointer names {path}, which is incomplete", f"delete {pointer} to restart from scratch")
    return path


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


def _truncate_metrics(path: Path, state: TrainerState) -> None:
    """On resume, drop metric lines written after the checkpoint we restart from."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if (rec.get("stage_index", -1), rec.get("step", 0)) <= (state.stage, state.step):
            kept.append(line)
    atomic_write_text(path, "".join(k + "\n" for k in kept))


# --------------------------------------------------------------------------------------------


class Distiller:
    """Runs a recipe into a run directory. ``teacher``/``tokenizer`` may be passed in (tests, notebooks)."""

    def __init__(self, recipe: Recipe, out: str | Path, *, resume: bool = False, progress: bool = True, teacher=None, tokenizer=None):
        from accelerate import Accelerator

        self.out = Path(out)
        self.progress = progress
        self.resume_from = None
        if resume:
            saved = self.out / "recipe.yaml"
            if saved.exists():
                import yaml

                recipe = from_dict(Recipe, yaml.safe_load(saved.read_text()), "recipe")
            self.resume_from = latest_checkpoint(self.out) if self.out.exists() else None
        elif self.out.exists() and ((self.out / "checkpoints").exists() or (self.out / "student").exists()):
            raise ConfigError(f"run directory {self.out} already holds a run", "pass --resume to continue it, or choose another --out")
        validate(recipe)
        self.recipe = recipe
        cpu = recipe.device == "cpu" or (recipe.device == "auto" and not torch.cuda.is_available())
        self.acc = Accelerator(cpu=cpu, mixed_precision=recipe.mixed_precision)
        self.is_main = self.acc.is_main_process
        self.teacher, self.tokenizer = teacher, tokenizer
        self.metrics_path = self.out / "metrics.jsonl"

    # -- setup ---------------------------------------------------------------------------------
    def _load_teacher(self):
        from attn2ssm.teachers import load_teacher

        if self.teacher is None:
            self.teacher, self.tokenizer, source = load_teacher(self.recipe.teacher, check_supported=True)
            self.teacher_info = {"source": source.describe()}
        else:
            self.teacher_info = {"source": {"kind": "object", "location": type(self.teacher).__name__}}
        self.teacher.to(self.acc.device).eval().requires_grad_(False)

    def _load_data(self):
        d = self.recipe.data
        check_block_len(d.block_len, getattr(self.teacher.config, "max_position_embeddings", None))
        with self.acc.main_process_first():  # one process tokenizes, the others read its cache
            corpus = prepare_corpus(d.corpus, self.tokenizer, max_train_tokens=d.max_train_tokens, max_heldout_tokens=d.max_heldout_tokens, text_field=d.text_field)
        self.corpus = corpus
        self.blocks = pack_blocks(corpus.train_ids, d.block_len)
        self.eval_blocks = pack_blocks(corpus.heldout_ids, d.block_len)

    def _build_student(self):
        from attn2ssm.student.convert import convert
        from attn2ssm.student.modeling import Attn2SSMForCausalLM

        if self.resume_from is not None:
            student = Attn2SSMForCausalLM.from_pretrained(self.resume_from, dtype=torch.float32)
        else:
            s = self.recipe.student
            plan = make_plan(self.teacher.config.num_hidden_layers, s.mixer, attention_ratio=s.attention_ratio, keep_attention=s.keep_attention)
            student = convert(self.teacher, plan, {s.mixer: dict(s.mixer_options)}, teacher_info=self.teacher_info)
        self.student = student.to(self.acc.device)

    # -- checkpoints -----------------------------------------------------------------------------
    def _save_checkpoint(self, state: TrainerState, optimizer, scheduler, stage_cfg) -> None:
        self.acc.wait_for_everyone()
        if self.is_main:
            root = _checkpoint_root(self.out)
            root.mkdir(parents=True, exist_ok=True)
            name = f"stage{state.stage}-step{state.step:06d}"
            tmp = root / f".tmp-{name}"
            shutil.rmtree(tmp, ignore_errors=True)
            student = self.acc.unwrap_model(self.student)
            student.save_pretrained(tmp, state_dict=state_dict_without_lora(student))
            payload = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": _rng_state()}
            if hasattr(student, "lora"):  # a LoRA stage in progress: adapters travel beside the plain student
                payload["lora"] = student.lora.state_dict()
            torch.save(payload, tmp / "optimizer.pt")
            atomic_write_text(tmp / "state.json", json.dumps(asdict(state), indent=1))
            final = root / name
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            atomic_write_text(root / "latest", name)  # the pointer moves only once the checkpoint is whole
            existing = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
            for old in existing[: -max(1, stage_cfg.keep_checkpoints)]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        self.acc.wait_for_everyone()

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def _eval_loss(self, stage_cfg) -> float:
        from attn2ssm.distill.losses import cross_entropy

        model = self.acc.unwrap_model(self.student)
        model.eval()
        n = min(len(self.eval_blocks), stage_cfg.eval_batches * 4)
        losses = []
        for i in range(0, n, 4):
            ids = self.eval_blocks[i : i + 4].to(self.acc.device)
            losses.append(cross_entropy(model(input_ids=ids, use_cache=False).logits, ids).item())
        model.train()
        return sum(losses) / max(1, len(losses))

    # -- the loop ------------------------------------------------------------------------------------
    def _batch_indices(self, stage_idx: int, step: int, accum_i: int, stage_cfg) -> torch.Tensor:
        """This process's blocks for micro-batch ``accum_i`` of optimizer step ``step``."""
        world, rank = self.acc.num_processes, self.acc.process_index
        per = stage_cfg.batch_size // (stage_cfg.grad_accum * world)
        start = step * stage_cfg.batch_size + accum_i * world * per + rank * per
        return block_indices(len(self.blocks), self.recipe.seed + 1000 * stage_idx, start, per)

    def _run_stage(self, stage_idx: int, state: TrainerState, resume_payload: dict | None) -> None:
        cfg = self.recipe.stages[stage_idx]
        kind = STAGE_KINDS[cfg.kind]
        world = self.acc.num_processes
        if cfg.batch_size % (cfg.grad_accum * world):
            raise ConfigError(
                f"stage '{cfg.name}': batch_size {cfg.batch_size} is not divisible by grad_accum × processes = {cfg.grad_accum * world}",
                "make batch_size a multiple of grad_accum × number of processes",
            )
        block_len = self.recipe.data.block_len
        steps = math.ceil(cfg.tokens / (cfg.batch_size * block_len))
        unwrapped = self.acc.unwrap_model(self.student)
        if cfg.lora is not None:
            attach_lora(unwrapped, cfg.lora.targets, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout)
            if resume_payload is not None and "lora" in resume_payload:
                unwrapped.lora.load_state_dict(resume_payload["lora"])
        names = select_trainable(unwrapped, cfg.trainable)
        params = [p for p in unwrapped.parameters() if p.requires_grad]
        n_train = sum(p.numel() for p in params)
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
        lam = lr_multiplier(cfg.schedule.kind, steps, cfg.schedule.warmup, cfg.schedule.decay, cfg.schedule.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lam)
        if resume_payload is not None:
            optimizer.load_state_dict(resume_payload["optimizer"])
            scheduler.load_state_dict(resume_payload["scheduler"])
            _set_rng_state(resume_payload["rng"])
        # DDP wrap under accelerate launch (identity otherwise); layer-local kinds never call the
        # model's forward, so they are not wrapped and their gradients are averaged below.
        model = self.acc.prepare_model(unwrapped) if kind.through_model_forward else unwrapped
        self.student = model
        model.train()
        if self.is_main:
            print(f"[stage {stage_idx + 1}/{len(self.recipe.stages)}] {cfg.name} ({cfg.kind}): {steps} steps × {cfg.batch_size} × {block_len} tokens, "
                  f"{n_train / 1e6:.2f}M trainable params in {len(names)} tensors")
        bar = tqdm(total=steps, initial=state.step, desc=f"{cfg.name}", disable=not (self.progress and self.is_main), dynamic_ncols=True)
        t_last, tokens_last = time.perf_counter(), 0
        while state.step < steps:
            step_metrics: dict[str, float] = {}
            step_loss = torch.zeros((), device=self.acc.device)
            for a in range(cfg.grad_accum):
                idx = self._batch_indices(stage_idx, state.step, a, cfg)
                batch = {"input_ids": self.blocks[idx].to(self.acc.device)}
                wrapped = model is not unwrapped
                sync = self.acc.no_sync(model) if wrapped and a < cfg.grad_accum - 1 else contextlib.nullcontext()
                with sync, self.acc.autocast():
                    loss, metrics = kind.loss(model, self.teacher, batch, cfg)
                    if not torch.isfinite(loss):
                        ckpt = latest_checkpoint(self.out)
                        raise TrainingError(
                            f"non-finite loss ({loss.item()}) at stage '{cfg.name}' step {state.step + 1}",
                            f"lower stages.{stage_idx}.optim.lr or the clip value; the last good checkpoint is {ckpt or 'none (nothing saved yet)'}",
                        )
                    self.acc.backward(loss / cfg.grad_accum)
                step_loss += loss.detach() / cfg.grad_accum
                for k, v in metrics.items():
                    step_metrics[k] = step_metrics.get(k, 0.0) + v / cfg.grad_accum
            if world > 1 and not kind.through_model_forward:
                for p in params:
                    if p.grad is not None:
                        p.grad = self.acc.reduce(p.grad, "mean")
            grad_norm = self.acc.clip_grad_norm_(params, cfg.clip) if cfg.clip else None
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            tokens = cfg.batch_size * block_len
            state.step += 1
            state.tokens += tokens
            state.total_tokens += tokens
            tokens_last += tokens
            loss_value = self.acc.reduce(step_loss, "mean").item()
            now = time.perf_counter()
            tps = tokens_last / max(now - t_last, 1e-9)
            record = {"stage": cfg.name, "stage_index": stage_idx, "step": state.step, "tokens": state.tokens, "total_tokens": state.total_tokens,
                      "loss": loss_value, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tps, "processes": world, **{f"train_{k}": v for k, v in step_metrics.items()}}
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            last = state.step == steps
            if self.is_main and ((cfg.eval_every and state.step % cfg.eval_every == 0) or last) and len(self.eval_blocks):
                record["eval_loss"] = self._eval_loss(cfg)
                record["eval_ppl"] = math.exp(min(record["eval_loss"], 50))
            if self.is_main:
                _append_jsonl(self.metrics_path, record)
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tps:.0f}")
            bar.update(1)
            t_last, tokens_last = now, 0
            if last:
                state.finished.append(stage_idx)
            if last:
                merge_lora(self.acc.unwrap_model(model))  # the stage-end checkpoint holds the merged weights
            if last or (cfg.save_every and state.step % cfg.save_every == 0):
                self._save_checkpoint(state, optimizer, scheduler, cfg)
        bar.close()
        self.student = self.acc.unwrap_model(model)
        merge_lora(self.student)

    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.recipe.seed)
        random.seed(self.recipe.seed)
        if self.is_main:
            atomic_write_text(self.out / "recipe.yaml", self.recipe.to_yaml())
        self._load_teacher()
        self._load_data()
        state, payload = TrainerState(), None
        if self.resume_from is not None:
            state = from_dict(TrainerState, json.loads((self.resume_from / "state.json").read_text()), "state")
            payload = torch.load(self.resume_from / "optimizer.pt", weights_only=False)
            if self.is_main:
                print(f"resuming from {self.resume_from.name}: stage {state.stage + 1}, step {state.step}")
                _truncate_metrics(self.metrics_path, state)
        self._build_student()
        for stage_idx in range(len(self.recipe.stages)):
            if stage_idx < state.stage:
                continue
            if stage_idx > state.stage or stage_idx in state.finished:  # a new stage starts from scratch
                if stage_idx in state.finished:
                    continue
                state = TrainerState(stage=stage_idx, total_tokens=state.total_tokens, finished=state.finished)
                payload = None
            self._run_stage(stage_idx, state, payload)
            payload = None
        return self._finish()

    def _finish(self) -> dict:
        from attn2ssm.eval.report import write_report

        self.acc.wait_for_everyone()
        results = {}
        if self.is_main:
            student = self.acc.unwrap_model(self.student)
            student.eval()
            final = self.out / "student"
            tmp = self.out / ".tmp-student"
            shutil.rmtree(tmp, ignore_errors=True)
            student.save_pretrained(tmp)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            results = write_report(self.out, self.recipe, self.teacher, student, self.corpus, progress=self.progress)
        self.acc.wait_for_everyone()
        return results


def distill(recipe: Recipe, out: str | Path, *, resume: bool = False, progress: bool = True, teacher=None, tokenizer=None) -> dict:
    return Distiller(recipe, out, resume=resume, progress=progress, teacher=teacher, tokenizer=tokenizer).run()

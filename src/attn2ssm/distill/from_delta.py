"""``attn2ssm distill RECIPE --out NEW --from-delta RUN``: a new run that starts where a delta
checkpoint (distill/delta.py) ends. The student is converted from the teacher again, as the
recipe's run converts it (same seed), checked against the delta's base (one line when it differs),
the delta's stages are replayed on it, and NEW gets a stage-end checkpoint at the delta's last
stage (with the delta, so NEW keeps one too); the run then resumes there — the next stage, or,
when the delta covers every stage, the final student and report. Any device: the delta is
CPU tensors, and the teacher is loaded wherever the recipe runs.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from attn2ssm.distill.checkpoints import checkpoint_name, publish_checkpoint, write_checkpoint
from attn2ssm.distill.delta import DELTA, apply_delta, check_base, read_delta
from attn2ssm.distill.run_dir import start_writing
from attn2ssm.distill.state import TrainerState
from attn2ssm.distill.trainer import Distiller, load_for_steps
from attn2ssm.errors import ConfigError


def _check_stages(delta, recipe) -> None:
    """The delta's stages must be the recipe's first ones, by name, and not stepwise conversions."""
    names = [s.name for s in recipe.stages]
    for record in delta.meta["stages"]:
        i = record["stage"]
        if i >= len(names) or names[i] != record["name"]:
            raise ConfigError(
                f"--from-delta {delta.folder}: its stage {i + 1} is {record['name']!r}, this recipe's "
                f"{names[i] if i < len(names) else 'none'!r}",
                f"use the delta's recipe ({delta.meta['recipe']})",
            )
        if getattr(recipe.stages[i], "attention_ratio", None) is not None:
            raise ConfigError(
                f"--from-delta {delta.folder}: stage {i + 1} converts more layers (a stepwise hybrid)",
                "resume that run from its checkpoint instead (--resume)",
            )


def prepare_from_delta(
    recipe, out: str | Path, source: str | Path, *, progress: bool = True, teacher=None, tokenizer=None
) -> None:
    """Make ``out`` (a new run directory) a run at the delta's last stage end, ready to resume."""
    delta = read_delta(source)
    _check_stages(delta, recipe)
    distiller = Distiller(recipe, out, progress=progress, teacher=teacher, tokenizer=tokenizer)
    try:
        torch.manual_seed(recipe.seed)  # as the run seeds its conversion (Distiller._run)
        random.seed(recipe.seed)
        load_for_steps(distiller)
        student = distiller.student
        check_base(delta, recipe, student)
        apply_delta(student, delta)
        state = TrainerState(**delta.meta["state"])
        out = Path(out)
        start_writing(out, recipe, resumed=False)
        shutil.copytree(delta.folder, out / DELTA, dirs_exist_ok=True)
        training = {"optimizer": {}, "scheduler": {}, "from_delta": str(delta.folder)}

        def write(folder: Path) -> None:
            write_checkpoint(folder, student, asdict(state), training)

        publish_checkpoint(out, checkpoint_name(state.stage, state.step), write, keep=1)
    finally:
        distiller.close()
    print(
        f"from delta {delta.folder}: stages {', '.join(s['name'] for s in delta.meta['stages'])} replayed "
        f"on the converted student; {out} continues at stage {state.stage + 2 if state.stage + 1 < len(recipe.stages) else 'end'}"
    )

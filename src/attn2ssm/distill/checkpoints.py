"""A run directory's checkpoints: written atomically with a manifest, verified before a resume.

Layout (under ``<run>/checkpoints``)::

    <stage{s}-step{n:06d}>/   HF student, optimizer.pt, state.json, manifest.json
    latest                    name of the newest complete checkpoint

A checkpoint is built in a hidden ``.tmp-`` folder and renamed into place; ``latest`` moves only
after that. ``manifest.json`` (written last, before the rename) records every file's size and
SHA-256, so a file damaged afterwards — a full disk, a kill during a copy or a sync — is found
before it is trusted: ``choose_checkpoint`` walks the checkpoints newest first and returns the
first whose files all match, naming the damaged ones it skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from attn2ssm.distill.lora import state_dict_without_lora
from attn2ssm.errors import CheckpointError
from attn2ssm.paths import atomic_write_text

MANIFEST = "manifest.json"
_NAME = re.compile(r"^stage(\d+)-step(\d+)$")


def checkpoint_root(out: Path) -> Path:
    return Path(out) / "checkpoints"


def checkpoint_name(stage: int, step: int) -> str:
    return f"stage{stage}-step{step:06d}"


def _order(path: Path) -> tuple[int, int]:
    """(stage, step) of a checkpoint folder; names that are not checkpoints sort first."""
    m = _NAME.match(path.name)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def checkpoints(out: Path) -> list[Path]:
    """Every complete-looking checkpoint folder, oldest first (by stage, then step)."""
    root = checkpoint_root(out)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)), key=_order)


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint ``latest`` names (None before the first one)."""
    pointer = checkpoint_root(out) / "latest"
    if not pointer.exists():
        return None
    path = checkpoint_root(out) / pointer.read_text().strip()
    if not (path / "state.json").exists():
        raise CheckpointError(
            f"checkpoint pointer names {path}, which is incomplete",
            f"delete {pointer} to restart from scratch",
        )
    return path


def intact_note(out: Path) -> str:
    """What a failed checkpoint write leaves: the last complete checkpoint, intact (or none yet)."""
    pointer = checkpoint_root(out) / "latest"
    kept = pointer.read_text().strip() if pointer.exists() else None
    return (
        f" ({kept}, the last complete checkpoint, is intact)" if kept else " (no checkpoint is complete yet)"
    )


# -- manifest ------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record the size and SHA-256 of every file in ``folder`` (recursively) in manifest.json."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    atomic_write_text(folder / MANIFEST, json.dumps({"files": files}, indent=1))


def damage(folder: Path) -> str | None:
    """None if every file of the checkpoint matches its manifest, else what is wrong (one line).

    A checkpoint written before manifests existed is checked for its state and a readable
    safetensors header instead."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        if not (folder / "state.json").exists():
            return "state.json is missing"
        return _legacy_damage(folder)
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError) as error:
        return f"{MANIFEST} is unreadable ({type(error).__name__})"
    for name, record in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != record["size"]:
            return f"{name} has {size} bytes, {record['size']} were written"
        if _sha256(path) != record["sha256"]:
            return f"{name} does not match the SHA-256 recorded when it was written"
    return None


def _legacy_damage(folder: Path) -> str | None:
    from safetensors import safe_open  # heavy: safetensors, only to diagnose a checkpoint without a manifest

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as fh:
                fh.keys()
        except Exception as error:  # noqa: BLE001 - any failure to read the header is damage
            return f"{path.name} is unreadable ({type(error).__name__})"
    return None


def choose_checkpoint(out: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest intact checkpoint or None, [(damaged checkpoint, reason)] skipped on the way).
    Reads only; nothing on disk changes. The one ``latest`` names is tried first."""
    candidates = checkpoints(out)[::-1]
    pointer = checkpoint_root(out) / "latest"
    if pointer.exists():
        named = checkpoint_root(out) / pointer.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    skipped = []
    for folder in candidates:
        reason = damage(folder)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    return None, skipped


# -- writing -------------------------------------------------------------------------------------
def publish_checkpoint(out: Path, name: str, write, keep: int) -> Path:
    """Build checkpoint ``name`` with ``write(folder)`` in a hidden folder, add its manifest,
    rename it into place, move ``latest`` and prune all but the newest ``keep``. A failed write
    removes the hidden folder and leaves ``latest`` and the checkpoints before it as they were."""
    root = checkpoint_root(out)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    final = root / name
    try:
        write(tmp)
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:  # a full disk, a signal: no half-written folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / "latest", name)  # the pointer moves only once the checkpoint is whole
    for old in checkpoints(out)[: -max(1, keep)]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- metrics -------------------------------------------------------------------------------------
def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


def read_metrics(path: Path) -> tuple[list[str], str | None]:
    """``(lines, cut)``: the metrics log's complete lines, and a last line a kill cut (None if the
    log ends whole). A log that is not text, or a damaged line before the last, is a one-line
    CheckpointError: the resume would lose what it records."""
    if not path.exists():
        return [], None
    fix = f"move {path} aside (the checkpoints are intact) and resume again; its lines are then lost"
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise CheckpointError(f"{path} is damaged: line {line} is not text", fix) from None
    lines = text.split("\n")
    tail = lines.pop()  # "" when the log ends with a newline
    for n, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except json.JSONDecodeError:
            raise CheckpointError(f"{path} is damaged: line {n} is not a JSON record", fix) from None
    if tail:  # the last line, cut before its newline was written (whole: kept)
        try:
            json.loads(tail)
        except json.JSONDecodeError:
            return lines, tail
        lines.append(tail)
    return lines, None


def truncate_metrics(path: Path, stage: int, step: int) -> None:
    """On resume, drop metric lines written after the checkpoint we restart from (and a line cut by the kill)."""
    if not path.exists():
        return
    kept = []
    for line in read_metrics(path)[0]:
        rec = json.loads(line)
        if (rec.get("stage_index", -1), rec.get("step", 0)) <= (stage, step):
            kept.append(line)
    atomic_write_text(path, "".join(k + "\n" for k in kept))


# -- what a checkpoint holds -----------------------------------------------------------------------
def index_keyed(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter names (torch.distributed.checkpoint's full form)
    in the usual form, keyed by the parameters' positions: what ``optimizer.pt`` holds in every run."""
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: v for n, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def name_keyed(state: dict, names: list[str]) -> dict:
    """``index_keyed`` undone."""
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


@torch.no_grad()
def fold_lora(model_state: dict, scale: float) -> dict:
    """A full state dict with its LoRA adapters (``lora.<module path with __>.A/B``) folded into the
    adapted weights, W ← W + scale·B·A, as ``merge_lora`` does in a module; the adapters dropped."""
    out = {k: v for k, v in model_state.items() if not k.startswith("lora.")}
    for key in {k[len("lora.") :].rsplit(".", 1)[0] for k in model_state if k.startswith("lora.")}:
        weight = f"{key.replace('__', '.')}.weight"
        A, B = model_state[f"lora.{key}.A"], model_state[f"lora.{key}.B"]
        out[weight] = out[weight] + (B @ A * scale).to(out[weight].dtype)
    return out


def gather_sharded(model, optimizer, param_names: list[str], is_main: bool, lora_scale: float | None):
    """FSDP: ``(model state, optimizer state)`` of the full student on the main process (CPU), every
    process taking part; with ``lora_scale`` (a LoRA stage's end) LoRA is folded into the weights.
    ({}, {}) on the other processes."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    # only the main process receives them
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not is_main:
        return {}, {}
    if lora_scale is not None:
        model_state = fold_lora(model_state, lora_scale)
    return model_state, index_keyed(optim_state, param_names)


def write_checkpoint(
    folder: Path, student, state: dict, training: dict, full_model: dict | None = None
) -> None:
    """One checkpoint's files: the plain student (HF), ``optimizer.pt`` and ``state.json``.

    ``training`` holds the optimizer state (``optimizer``), the scheduler's and the fp16 scaler's
    (``scaler``, optional); the RNG state is added here. LoRA adapters (in progress) and a stage's
    training-only modules travel in ``optimizer.pt`` beside the plain student. ``full_model``: the
    full state dict FSDP gathered, in place of the student's own."""
    everything = full_model if full_model is not None else state_dict_without_lora(student)
    plain = {k: v for k, v in everything.items() if not k.startswith(("lora.", "stage_modules."))}
    student.save_pretrained(folder, state_dict=plain)
    payload = {**training, "rng": rng_state()}
    if full_model is not None and any(k.startswith("lora.") for k in everything):
        payload["lora"] = {k[len("lora.") :]: v for k, v in everything.items() if k.startswith("lora.")}
    elif full_model is None and hasattr(student, "lora"):
        payload["lora"] = student.lora.state_dict()
    if hasattr(student, "stage_modules"):
        payload["stage_modules"] = student.stage_modules.state_dict()
    # through a file object, a failed write keeps its OSError
    with open(folder / "optimizer.pt", "wb") as fh:
        torch.save(payload, fh)
    atomic_write_text(folder / "state.json", json.dumps(state, indent=1))

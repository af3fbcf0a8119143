"""The teacher-logit cache: each training block's teacher distribution computed once, kept sparse.

A KD step runs the frozen teacher's forward on every batch. When the same block is distilled
again — a second epoch, a later KD stage of the run, another run or scoreboard cell on the same
teacher and blocks — its teacher distribution is read from disk instead: per position, the k most
likely next tokens' log-probabilities at temperature 1 over the full vocabulary and the log of the
rest's mass (:class:`~attn2ssm.distill.losses.TopKTargets`), which ``forward_kl`` turns into the
"top-k + tail bucket" KL (its docstring has the math and the error bound).

Where: ``<attn2ssm cache>/teacher_logits`` (``paths.cache_dir``, or a recipe's ``dir``) rather
than the run directory, because the reuse that pays most crosses runs (sweeps rerun one recipe;
every scoreboard cell sees the same blocks). Layout::

    teacher_logits/<teacher fingerprint>-k<k>/teacher.json        what the fingerprint stands for, and the
                                                                  teacher files that gave it ("sources")
    teacher_logits/<teacher fingerprint>-k<k>/perplexity.json     the teacher's held-out perplexities (reports)
    teacher_logits/<teacher fingerprint>-k<k>/<ab>/<sha256>.safetensors   one block (one row's real tokens)

The fingerprint hashes the teacher's config, every parameter's name, shape, dtype, sum, sum of
squares and a strided sample of its values, and the compute mode (device type, mixed precision),
so another checkpoint, dtype or autocast setting never reads this one's entries. An entry is
named by the SHA-256 of its token ids, written to a temporary file and renamed into place
(``paths.atomic_write_bytes``): a kill leaves the old state or the whole entry, never a torn one,
and an entry that fails to parse or has the wrong shape (disk damage) is recomputed.

Without the teacher: the fingerprint needs the teacher's weights, so a run that loads them records
in ``teacher.json`` a *source key* — the teacher spec's files on disk (config.json's bytes, each
weight file's name, size and modification time), the teacher dtype and the compute mode
(:func:`teacher_source_key`). A later run on the same files finds the folder by that key
(:func:`find_cache_dir`) without loading anything: when every block it will draw is there, it needs
only the teacher's tokenizer and config (distill/teacher_source.py). Any change to the files changes the
key, and the run loads the teacher and computes the fingerprint again. A block that turns out
unreadable in such a run is an error naming it, never a silent load.

Size: per token, k log-probs (4 bytes each), k token ids (2 bytes each for a vocabulary of at
most 65,536, else 4) and the tail (4 bytes): 6k + 4 bytes — 388 B at k = 64, i.e. ~400 MB per
million distinct tokens — plus ~200 bytes of header per block. Nothing is evicted; delete the
folder to reclaim it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from attn2ssm.distill.losses import TopKTargets, topk_targets
from attn2ssm.errors import TrainingError
from attn2ssm.paths import atomic_write_bytes, atomic_write_text, cache_dir

_SAMPLE = 4096  # values per parameter that enter the fingerprint (beside its sum and sum of squares)


def teacher_fingerprint(teacher: torch.nn.Module, mode: str) -> str:
    """A hex digest of the teacher's weights, config and dtypes, and the compute ``mode``."""
    h = hashlib.sha256(mode.encode())
    config = getattr(teacher, "config", None)
    if config is not None:
        cfg = {
            k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")
        }
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in [*teacher.named_parameters(), *teacher.named_buffers()]:
            flat = t.detach().reshape(-1)
            stride = max(1, flat.numel() // _SAMPLE)
            wide = flat.double()
            h.update(
                f"{name}|{tuple(t.shape)}|{t.dtype}|{wide.sum().item()!r}|{wide.square().sum().item()!r}".encode()
            )
            h.update(flat[::stride].float().cpu().numpy().tobytes())
    return h.hexdigest()


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def teacher_source_key(spec: str, dtype: torch.dtype, mode: str) -> str | None:
    """What the teacher ``spec`` is on disk, without loading it: a hex digest of config.json's bytes
    and every weight file's (name, size, mtime), with the teacher ``dtype`` and compute ``mode``.
    None for a hub id (its files are not here to read)."""
    from attn2ssm.teachers import resolve_teacher  # heavy: resolving a built-in converts it once

    source = resolve_teacher(spec)
    if source.kind == "hub":
        return None
    folder = Path(source.location)
    files = (
        [folder / source.gguf_file]
        if source.gguf_file
        else sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    )
    h = hashlib.sha256(f"{dtype}|{mode}".encode())
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in files:
        st = path.stat()
        h.update(f"|{path.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def find_cache_dir(root: str | Path | None, top_k: int, source_key: str) -> tuple[Path, str] | None:
    """(folder, teacher fingerprint) of the cache a run with teacher source ``source_key`` filled, or None."""
    base = Path(root).expanduser() if root else cache_dir() / "teacher_logits"
    for info in sorted(base.glob(f"*-k{int(top_k)}/teacher.json")):
        try:
            record = json.loads(info.read_text())
        except (OSError, ValueError):
            continue
        if source_key in record.get("sources", {}) and record.get("top_k") == int(top_k):
            return info.parent, record["fingerprint"]
    return None


def block_digest(ids: torch.Tensor) -> str:
    """SHA-256 of a row's token ids (as int64)."""
    return hashlib.sha256(ids.detach().to("cpu", torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0


class LogitCache:
    """Top-k teacher targets per block, on disk. ``targets(teacher, ids, mask)`` returns them for a
    (b, l) batch (right-padded rows are keyed by their real tokens), running the teacher only on the
    rows it has not seen and storing those.

    ``fingerprint`` (from :func:`find_cache_dir`) opens a cache without its teacher (``teacher``
    None): every row must then be there. ``source`` ({"key": teacher_source_key(...), ...}) records
    which teacher files filled it, for such runs."""

    def __init__(
        self,
        teacher: torch.nn.Module | None,
        top_k: int,
        mode: str,
        root: str | Path | None = None,
        chunk_size: int | str = 64,
        *,
        fingerprint: str | None = None,
        source: dict | None = None,
    ):
        self.top_k, self.chunk_size = int(top_k), chunk_size if chunk_size == "auto" else int(chunk_size)
        self.fingerprint = fingerprint or teacher_fingerprint(teacher, mode)
        base = Path(root).expanduser() if root else cache_dir() / "teacher_logits"
        self.dir = base / f"{self.fingerprint[:24]}-k{self.top_k}"
        self.dir.mkdir(parents=True, exist_ok=True)
        info = self.dir / "teacher.json"
        try:
            record = json.loads(info.read_text())
        except (OSError, ValueError):  # a new folder (or a damaged record: written again)
            name = getattr(getattr(teacher, "config", None), "_name_or_path", "") or type(teacher).__name__
            record = {"teacher": name, "mode": mode, "top_k": self.top_k, "fingerprint": self.fingerprint}
            atomic_write_text(info, json.dumps(record, indent=1))
        if source is not None and source["key"] not in record.get("sources", {}):
            record.setdefault("sources", {})[source["key"]] = {k: v for k, v in source.items() if k != "key"}
            atomic_write_text(info, json.dumps(record, indent=1))
        self.stats = CacheStats()

    def has(self, ids: torch.Tensor) -> bool:
        """Whether the entry of a row's real tokens ``ids`` (1-D) is on disk."""
        return self.entry_path(block_digest(ids)).is_file()

    def teacher_perplexity(self, key: str) -> float | None:
        """The teacher's held-out perplexity a report recorded under ``key`` (:meth:`record_perplexity`)."""
        try:
            return json.loads((self.dir / "perplexity.json").read_text()).get(key)
        except (OSError, ValueError):
            return None

    def record_perplexity(self, key: str, ppl: float) -> None:
        path = self.dir / "perplexity.json"
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        known[key] = ppl
        atomic_write_text(path, json.dumps(known, indent=1))

    def entry_path(self, digest: str) -> Path:
        return self.dir / digest[:2] / f"{digest}.safetensors"

    def _load(self, digest: str, length: int) -> TopKTargets | None:
        from safetensors.torch import load  # heavy: safetensors, only once the cache is used

        path = self.entry_path(digest)
        try:
            data = load(path.read_bytes())
            idx = data["indices"].long()
            if data["indices"].dtype == torch.int16:  # ids stored as uint16 - 32768
                idx = idx + 32768
            entry = TopKTargets(idx, data["logprobs"], data["log_tail"])
        except FileNotFoundError:
            return None
        except Exception:  # unreadable (damaged on disk): recomputed and overwritten
            return None
        if entry.indices.shape != (length, self.top_k) or entry.log_tail.shape != (length,):
            return None
        return entry

    def _store(self, digest: str, entry: TopKTargets, vocab: int) -> None:
        from safetensors.torch import save  # heavy: safetensors, only once the cache is used

        idx = entry.indices.cpu()
        idx = (idx - 32768).to(torch.int16) if vocab <= 65536 else idx.to(torch.int32)
        path = self.entry_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "indices": idx.contiguous(),
            "logprobs": entry.logprobs.cpu().contiguous(),
            "log_tail": entry.log_tail.cpu().contiguous(),
        }
        atomic_write_bytes(path, save(payload, metadata={"block_sha256": digest, "top_k": str(self.top_k)}))

    def targets(
        self, teacher: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None
    ) -> TopKTargets:
        """(b, l) targets for ``ids``; padded positions (``mask`` 0, right padding) hold a dummy
        distribution with no tail, which the losses weigh by 0."""
        b, l = ids.shape
        lengths = [l] * b if mask is None else mask.sum(-1).tolist()
        if mask is not None and any(not bool(mask[r, : lengths[r]].all()) for r in range(b)):
            raise ValueError("the logit cache keys rows by their real tokens and needs right padding")
        digests = [block_digest(ids[r, : lengths[r]]) for r in range(b)]
        rows = [self._load(d, n) for d, n in zip(digests, lengths)]
        missing = [r for r in range(b) if rows[r] is None]
        self.stats.hits += b - len(missing)
        self.stats.misses += len(missing)
        if missing and teacher is None:
            raise TrainingError(
                f"teacher-logit cache {self.dir}: {len(missing)} of this batch's {b} blocks are missing or unreadable "
                f"(e.g. {digests[missing[0]][:16]}), and this run did not load the teacher (the cache held them when it started)",
                "resume the run again: it loads the teacher when its cache lacks blocks, and stores them",
            )
        if missing:
            sub_ids = ids[missing]
            sub_mask = None if mask is None else mask[missing]
            with torch.no_grad():
                logits = teacher(input_ids=sub_ids, attention_mask=sub_mask, use_cache=False).logits
            logits_vocab = logits.shape[-1]
            fresh = topk_targets(logits, self.top_k, self.chunk_size)
            del logits
            for j, r in enumerate(missing):
                rows[r] = fresh[j, : lengths[r]].to("cpu")
                self._store(digests[r], rows[r], logits_vocab)
        out = TopKTargets(
            torch.arange(self.top_k).expand(b, l, self.top_k).clone(),
            torch.full((b, l, self.top_k), -torch.log(torch.tensor(float(self.top_k))).item()),
            torch.full((b, l), float("-inf")),
        )
        for r, entry in enumerate(rows):
            n = lengths[r]
            out.indices[r, :n], out.logprobs[r, :n], out.log_tail[r, :n] = (
                entry.indices,
                entry.logprobs,
                entry.log_tail,
            )
        return out.to(ids.device)


__all__ = [
    "CacheStats",
    "LogitCache",
    "block_digest",
    "find_cache_dir",
    "teacher_fingerprint",
    "teacher_source_key",
]

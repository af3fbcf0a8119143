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

    teacher_logits/<teacher fingerprint>-k<k>/teacher.json        what the fingerprint stands for
    teacher_logits/<teacher fingerprint>-k<k>/<ab>/<sha256>.safetensors   one block (one row's real tokens)

The fingerprint hashes the teacher's config, every parameter's name, shape, dtype, sum, sum of
squares and a strided sample of its values, and the compute mode (device type, mixed precision),
so another checkpoint, dtype or autocast setting never reads this one's entries. An entry is
named by the SHA-256 of its token ids, written to a temporary file and renamed into place
(``paths.atomic_write_bytes``): a kill leaves the old state or the whole entry, never a torn one,
and an entry that fails to parse or has the wrong shape (disk damage) is recomputed.

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
from attn2ssm.paths import atomic_write_bytes, atomic_write_text, cache_dir

_SAMPLE = 4096  # values per parameter that enter the fingerprint (beside its sum and sum of squares)


def teacher_fingerprint(teacher: torch.nn.Module, mode: str) -> str:
    """A hex digest of the teacher's weights, config and dtypes, and the compute ``mode``."""
    h = hashlib.sha256(mode.encode())
    config = getattr(teacher, "config", None)
    if config is not None:
        cfg = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in [*teacher.named_parameters(), *teacher.named_buffers()]:
            flat = t.detach().reshape(-1)
            stride = max(1, flat.numel() // _SAMPLE)
            wide = flat.double()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{wide.sum().item()!r}|{wide.square().sum().item()!r}".encode())
            h.update(flat[::stride].float().cpu().numpy().tobytes())
    return h.hexdigest()


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
    rows it has not seen and storing those."""

    def __init__(self, teacher: torch.nn.Module, top_k: int, mode: str, root: str | Path | None = None, chunk_size: int | str = 64):
        self.top_k, self.chunk_size = int(top_k), chunk_size if chunk_size == "auto" else int(chunk_size)
        self.fingerprint = teacher_fingerprint(teacher, mode)
        base = Path(root).expanduser() if root else cache_dir() / "teacher_logits"
        self.dir = base / f"{self.fingerprint[:24]}-k{self.top_k}"
        self.dir.mkdir(parents=True, exist_ok=True)
        info = self.dir / "teacher.json"
        if not info.exists():
            name = getattr(getattr(teacher, "config", None), "_name_or_path", "") or type(teacher).__name__
            atomic_write_text(info, json.dumps({"teacher": name, "mode": mode, "top_k": self.top_k, "fingerprint": self.fingerprint}, indent=1))
        self.stats = CacheStats()

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
        payload = {"indices": idx.contiguous(), "logprobs": entry.logprobs.cpu().contiguous(), "log_tail": entry.log_tail.cpu().contiguous()}
        atomic_write_bytes(path, save(payload, metadata={"block_sha256": digest, "top_k": str(self.top_k)}))

    def targets(self, teacher: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> TopKTargets:
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
            out.indices[r, :n], out.logprobs[r, :n], out.log_tail[r, :n] = entry.indices, entry.logprobs, entry.log_tail
        return out.to(ids.device)


__all__ = ["CacheStats", "LogitCache", "block_digest", "teacher_fingerprint"]

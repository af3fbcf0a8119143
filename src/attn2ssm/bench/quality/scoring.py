"""How ``bench quality`` scores a cell: the teacher's references, computed once per grid and cached
in ``GRID/teacher``, and the student's perplexity, greedy agreement, passkey and suite beside them."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from attn2ssm.bench.quality.grid import Cell, EvalSettings, read_cell
from attn2ssm.paths import atomic_write_bytes, atomic_write_text


class TeacherReference:
    """The teacher's side of every comparison, computed once per grid and cached in ``GRID/teacher``
    (perplexity and top-1 predictions per corpus × window, greedy continuations, passkey accuracy).
    The teacher loads only when a reference is missing."""

    def __init__(self, spec: str, grid_dir: Path, settings: EvalSettings, progress: bool = True):
        self.spec, self.dir, self.settings, self.progress = (
            spec,
            Path(grid_dir) / "teacher",
            settings,
            progress,
        )
        self._model = None

    def release(self) -> None:
        """Drop the teacher (the next cell's distill process loads its own)."""
        self._model = None

    def model(self):
        if self._model is None:
            from attn2ssm.student.loading import load_model_and_tokenizer

            self._model, _ = load_model_and_tokenizer(self.spec)
        return self._model

    def _path(self, kind: str, key: dict, suffix: str) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        return self.dir / f"{kind}-{digest}{suffix}"

    def _ppl_path(self, corpus: str, window: int) -> Path:
        return self._path(
            "ppl",
            {
                "teacher": self.spec,
                "corpus": corpus,
                "window": window,
                "eval_tokens": self.settings.eval_tokens,
            },
            ".pt",
        )

    def _passkey_path(self) -> Path:
        s = self.settings
        key = {
            "teacher": self.spec,
            "lengths": list(s.passkey_lengths),
            "depths": list(s.passkey_depths),
            "trials": s.passkey_trials,
            "seed": s.passkey_seed,
        }
        return self._path("passkey", key, ".json")

    def perplexity(self, corpus: str, ids, window: int) -> dict:
        import io

        import torch

        from attn2ssm.eval.perplexity import perplexity

        ids_sha = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]
        path = self._ppl_path(corpus, window)
        if path.exists():
            cached = torch.load(path, weights_only=True)
            if cached.get("ids_sha") == ids_sha:
                return cached
        r = perplexity(
            self.model(),
            ids,
            window=window,
            stride=window // 2,
            batch_size=_batch(window),
            progress=self.progress,
            desc=f"teacher {corpus} @{window}",
            predictions=True,
        )
        record = {
            "ppl": r["ppl"],
            "nll": r["nll"],
            "tokens": r["tokens"],
            "argmax": r["argmax"].to(torch.int32),
            "ids_sha": ids_sha,
        }
        buf = io.BytesIO()
        torch.save(record, buf)
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue())
        return record

    def continuations(self, prompts, pad_id: int) -> list[list[int]]:
        from attn2ssm.eval.agreement import greedy_continuation

        s = self.settings
        key = {
            "teacher": self.spec,
            "prompts": [p.tolist() for p in prompts],
            "new_tokens": s.agreement_new_tokens,
        }
        path = self._path("continuations", key, ".json")
        if path.exists():
            return json.loads(path.read_text())["continuations"]
        from tqdm.auto import tqdm

        refs = [
            greedy_continuation(self.model(), p, s.agreement_new_tokens, pad_id)
            for p in tqdm(prompts, desc="teacher continuations", disable=not self.progress, leave=False)
        ]
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({**key, "continuations": refs}))
        return refs

    def passkey(self, tokenizer) -> dict:
        s = self.settings
        path = self._passkey_path()
        if path.exists():
            cached = json.loads(path.read_text())
            if "recall" in cached:  # a grid cached before recall was scored is redone
                return cached
        from attn2ssm.eval.needle import passkey_grid

        grid = passkey_grid(
            self.model(),
            tokenizer,
            s.passkey_lengths,
            s.passkey_depths,
            s.passkey_trials,
            seed=s.passkey_seed,
            progress=self.progress,
            desc="teacher passkey",
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(grid))
        return grid

    def suite_cache(self):
        from attn2ssm.eval.suite import SideCache, model_identity

        return SideCache(self.dir, model_identity(self.spec))

    def suite_scores(self, tokenizer, inputs: dict) -> dict:
        """The teacher's rows of the suite: each unit from GRID/teacher/suite-*.json, or scored once
        (the teacher loads only then)."""
        from attn2ssm.eval.suite import score_side

        return score_side(
            None, tokenizer, self.settings.suite, inputs, self.suite_cache(), self.progress, loader=self.model
        )

    def cached_summary(self) -> dict:
        """The teacher's numbers for the current settings that are on disk (no model loads)."""
        import torch

        out: dict = {"perplexity": {}}
        for corpus in self.settings.corpora:
            for window in self.settings.windows:
                path = self._ppl_path(corpus, window)
                if path.exists():
                    r = torch.load(path, weights_only=True)
                    out["perplexity"].setdefault(corpus, {})[str(window)] = {
                        "ppl": r["ppl"],
                        "tokens": r["tokens"],
                    }
        path = self._passkey_path()
        if path.exists():
            grid = json.loads(path.read_text())
            out["passkey"] = passkey_by_length(grid)
            if "recall" in grid:
                out["passkey_recall"] = passkey_by_length(grid, "recall")
        return out


def _batch(window: int) -> int:
    return max(1, 4096 // window)  # ~4k tokens a forward: bounded logits memory at 2048 as at 256


def passkey_by_length(grid: dict, metric: str = "accuracy") -> dict:
    return {str(L): sum(row) / len(row) for L, row in zip(grid["lengths"], grid[metric])}


def evaluate_student(student_dir: Path, reference: TeacherReference, progress: bool = True) -> dict:
    """Every metric of one cell; the student is the only model this loads (the teacher only for
    references not cached yet)."""
    from attn2ssm.student.loading import load_model_and_tokenizer

    s = reference.settings
    start = time.time()
    student, tokenizer = load_model_and_tokenizer(str(student_dir))
    heldout = _heldout(s, tokenizer)
    record: dict = {"perplexity": _perplexity_record(student, reference, heldout, progress)}
    if s.agreement_prompts:
        record["generation_agreement"] = _agreement_record(student, tokenizer, reference, heldout, progress)
    if s.passkey_lengths:
        record["passkey"] = _passkey_record(student, tokenizer, reference, progress)
    if s.suite is not None:
        record["suite"] = suite_record(student, tokenizer, reference, progress)
    del student
    record["eval_seconds"] = time.time() - start
    return record


def _heldout(s: EvalSettings, tokenizer) -> dict:
    """Each corpus's held-out ids (up to ``s.eval_tokens``); a ``DataError`` when one is too short for the windows."""
    from attn2ssm.data import prepare_corpus
    from attn2ssm.errors import DataError

    heldout = {}
    for corpus in s.corpora:
        ids = prepare_corpus(
            corpus, tokenizer, max_heldout_tokens=s.eval_tokens, max_train_tokens=0
        ).heldout_ids[: s.eval_tokens]
        if ids.numel() < max(s.windows) // 2 + 2:
            raise DataError(
                f"corpus {corpus!r} has {ids.numel()} held-out tokens, too few for windows up to {max(s.windows)}",
                "use a larger corpus or smaller --windows",
            )
        heldout[corpus] = ids
    return heldout


def _perplexity_record(student, reference: TeacherReference, heldout: dict, progress: bool) -> dict:
    """Per corpus and window: the student's perplexity beside the teacher's, and their top-1 agreement."""
    from attn2ssm.eval.perplexity import perplexity

    ppl: dict = {}
    for corpus, ids in heldout.items():
        for window in reference.settings.windows:
            teacher = reference.perplexity(corpus, ids, window)
            mine = perplexity(
                student,
                ids,
                window=window,
                stride=window // 2,
                batch_size=_batch(window),
                progress=progress,
                desc=f"student {corpus} @{window}",
                predictions=True,
            )
            ppl.setdefault(corpus, {})[str(window)] = {
                "ppl": mine["ppl"],
                "teacher_ppl": teacher["ppl"],
                "ppl_ratio": mine["ppl"] / teacher["ppl"],
                "tokens": mine["tokens"],
                "top1_agreement": (mine["argmax"] == teacher["argmax"].long()).float().mean().item(),
            }
    return ppl


def _agreement_record(student, tokenizer, reference: TeacherReference, heldout: dict, progress: bool) -> dict:
    """The student's greedy continuations of held-out prompts of the first corpus against the teacher's."""
    from attn2ssm.eval.agreement import generation_agreement, heldout_prompts

    s = reference.settings
    prompts = heldout_prompts(
        heldout[s.corpora[0]], s.agreement_prompts, s.agreement_prompt_len, s.agreement_new_tokens
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    refs = reference.continuations(prompts, pad)
    agree = generation_agreement(
        student, None, prompts, s.agreement_new_tokens, pad_id=pad, progress=progress, references=refs
    )
    record = {
        k: agree[k]
        for k in (
            "token_agreement",
            "prefix_match",
            "rouge_l",
            "forced_agreement",
            "prompts",
            "new_tokens",
        )
    }
    record["corpus"] = s.corpora[0]
    return record


def _passkey_record(student, tokenizer, reference: TeacherReference, progress: bool) -> dict:
    """The student's passkey accuracy and recall by length, beside the teacher's."""
    from attn2ssm.eval.needle import passkey_grid

    s = reference.settings
    teacher_grid = reference.passkey(tokenizer)
    grid = passkey_grid(
        student,
        tokenizer,
        s.passkey_lengths,
        s.passkey_depths,
        s.passkey_trials,
        seed=s.passkey_seed,
        progress=progress,
        desc="student passkey",
    )
    return {
        "accuracy": passkey_by_length(grid),
        "teacher_accuracy": passkey_by_length(teacher_grid),
        "mean_accuracy": grid["mean_accuracy"],
        "recall": passkey_by_length(grid, "recall"),
        "teacher_recall": passkey_by_length(teacher_grid, "recall"),
        "depths": list(s.passkey_depths),
        "trials": s.passkey_trials,
    }


def suite_record(student, tokenizer, reference: TeacherReference, progress: bool = True) -> dict:
    """A cell's suite: the student's scores of every unit and the table rows beside the teacher's."""
    from attn2ssm.eval.suite import pair_rows, prepare_inputs, score_side

    suite = reference.settings.suite
    inputs = prepare_inputs(suite, tokenizer)
    teacher = reference.suite_scores(tokenizer, inputs)
    reference.release()
    start = time.process_time()
    mine = score_side(student, tokenizer, suite, inputs, None, progress)
    return {
        "settings": suite.as_dict(),
        "rows": pair_rows(suite, teacher, mine),
        "scores": mine,
        "cpu_seconds": time.process_time() - start,
    }


def rescore_suite(cell: Cell, reference: TeacherReference, progress: bool = True) -> dict:
    """Add (or replace) the suite's rows of a cell already scored on everything else: the student is
    loaded and scored on the suite alone; nothing is retrained, the cell's other numbers are kept."""
    from attn2ssm.student.loading import load_model_and_tokenizer

    record = {**read_cell(cell.run_dir), "data": cell.data}  # the same recipe (status "suite")
    student, tokenizer = load_model_and_tokenizer(str(cell.run_dir / "student"))
    try:
        record["suite"] = suite_record(student, tokenizer, reference, progress)
    finally:
        reference.release()
    atomic_write_text(cell.run_dir / "cell.json", json.dumps(record, indent=1) + "\n")
    return record

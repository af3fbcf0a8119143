"""The evaluation suite: a student judged the way the distillation papers judge one, beside its teacher.

``attn2ssm eval STUDENT --suite standard --against TEACHER [--quick]`` scores both models on the same
inputs and writes one table (``suite.json``, ``suite.md``, ``suite.png``): per row the teacher's and
the student's score, recovered (student / teacher; teacher / student for perplexity), the standard
error of each score that is a mean over items, the number of items, and the CPU seconds each side
cost. The rows (docs/evaluation.md has the settings and the costs):

- **perplexity** at windows 1024 to 8192 (stride = window / 2) on the held-out split of five
  built-in corpora, three of domains no built-in recipe trains on (``emails``, ``kjv``, ``pydoc``)
  and the two training corpora's held-out text as the in-domain reference (``sotu`` addresses from
  2000 on, the last chapters of ``moby-dick``), at most ``max_tokens`` tokens each;
- **0-shot core tasks** (lm-eval, offline pack) and **MMLU 0-shot and 5-shot**, each on a seeded
  random subset of its documents (the same for every model), chosen so that the binomial standard
  error sqrt(p (1 - p) / n) is at most ~2.5 points at p = 0.5;
- the **length curve**: student / teacher perplexity against the window, 512 to 8192 tokens
  (:mod:`attn2ssm.eval.length_curve`; its windows are perplexity units too), and the student's
  **KV cache** at 8192 tokens against the teacher's (``kv_fraction``, :mod:`attn2ssm.eval.kv_cache`);
- **needle in a haystack** in RULER's three single-needle forms at 1k, 2k, 4k and 8k tokens
  (:mod:`attn2ssm.eval.needle`): greedy match and teacher-forced recall;
- one **generation-scored** task: TriviaQA exact match on greedy short answers, 5-shot ("When
  Perplexity Lies": log-likelihood scoring hides what a student loses when it has to generate). The
  shots give the answer format: 0-shot, the built-in instruct teacher ends its turn at once after
  "Answer:" (``<|im_end|>``) and scores 0 of 100.

A *unit* is what one computation yields (a perplexity, a task, a needle form at one length) and is
cached on its own: the teacher's units in a cache directory keyed by the teacher and the unit's
settings (``cache_dir()/suite`` for ``eval``, the grid's ``teacher/`` folder for ``bench quality``),
so a teacher is scored once for every student set against it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from attn2ssm.errors import DataError
from attn2ssm.eval.output import KeptOutput
from attn2ssm.eval.stats import binomial_se, pooled_accuracy
from attn2ssm.eval.suite_settings import DOMAINS, SuiteSettings, TaskSpec, fit_positions
from attn2ssm.eval.tables import format_suite_markdown, plot_recovered, table_row
from attn2ssm.eval.targets import check_targets
from attn2ssm.paths import atomic_write_text

SUITE_VERSION = 1  # part of every cache key: bump when a unit computes differently


# ------------------------------------------------------------------------------------------------ units
@dataclass(frozen=True)
class Unit:
    """One computation of the suite and the rows it yields: ``kind`` ppl | task | niah."""

    kind: str
    params: tuple  # ppl: (corpus, window); task: (TaskSpec,); niah: (form, length)

    @property
    def id(self) -> str:
        if self.kind == "task":
            spec = self.params[0]
            return f"task/{spec.task}/{spec.shots}"
        return "/".join([self.kind, *map(str, self.params)])


def plan_units(settings: SuiteSettings) -> list[Unit]:
    units = [Unit("ppl", (c, w)) for c in settings.corpora for w in settings.perplexity_windows]
    units += [Unit("task", (t,)) for t in settings.tasks]
    if settings.generation is not None:
        units.append(Unit("task", (settings.generation,)))
    units += [Unit("niah", (f, L)) for f in settings.niah_forms for L in settings.niah_lengths]
    return units


def unit_key(unit: Unit, settings: SuiteSettings, inputs: dict) -> dict:
    """Everything a unit's numbers depend on (with the teacher's identity, the cache key)."""
    from attn2ssm.data.sources import corpus_stamp

    key = {"suite_version": SUITE_VERSION, "unit": unit.id}
    if unit.kind == "ppl":
        key.update(
            corpus=corpus_stamp(unit.params[0]), ids=inputs["ids_sha"][unit.params[0]], window=unit.params[1]
        )
    elif unit.kind == "task":
        from importlib.metadata import version

        from attn2ssm.eval.harness import _data_versions

        key.update(
            task=asdict(unit.params[0]),
            seed=settings.seed,
            data=_data_versions(),
            lm_eval=version("lm_eval"),
            max_gen_toks=settings.max_gen_toks,
        )
        key["task"].pop("label")
    else:
        key.update(
            trials=settings.niah_trials,
            seed=settings.seed,
            essay=inputs["essay_sha"] if unit.params[0] != "niah_single_1" else None,
        )
    return key


def task_samples(spec: TaskSpec, seed: int) -> dict[str, list[int]] | None:
    """The documents a task scores: ``spec.items`` of each (sub)task's, a random subset fixed by
    ``seed`` and the task's name (all of them where a task has no more)."""
    if spec.items is None:
        return None
    out = {}
    for task, count in _doc_counts(spec.task).items():
        k = min(spec.items, count)
        out[task] = sorted(random.Random(f"{seed}/{task}").sample(range(count), k))
    return out


@functools.cache
def _doc_counts(name: str) -> dict[str, int]:
    from attn2ssm.eval import harness

    return harness.doc_counts(name)


class SideCache:
    """Units of one model (the teacher) on disk: ``DIR/suite-<model>.json``, {key hash: scores}."""

    def __init__(self, directory: Path, model_id: str):
        self.path = Path(directory) / f"suite-{hashlib.sha256(model_id.encode()).hexdigest()[:12]}.json"
        self.model_id = model_id
        try:
            self.entries = json.loads(self.path.read_text())["units"]
        except (OSError, ValueError, KeyError):
            self.entries = {}

    @staticmethod
    def _hash(key: dict) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def get(self, key: dict) -> dict | None:
        return self.entries.get(self._hash(key))

    def put(self, key: dict, scores: dict) -> None:
        self.entries[self._hash(key)] = scores
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            self.path, json.dumps({"model": self.model_id, "units": self.entries}, indent=1) + "\n"
        )


def teacher_cache(directory: Path, teacher_spec: str, device=None) -> SideCache:
    """The teacher's units scored on ``device``: a GPU's are cached apart from the CPU's (other
    kernels, other last digits; a greedy needle may differ), so a student is always set against a
    teacher scored where it was; the CPU's cache keeps its name."""
    kind = "cpu" if device is None else str(device).split(":")[0]
    return SideCache(directory, model_identity(teacher_spec) + ("" if kind == "cpu" else f"@{kind}"))


def model_identity(spec: str) -> str:
    """What names a model's weights for the cache: a built-in name or hub id as given, a directory
    with the sizes and modification times of its weight and config files (its own files only: an
    ``eval/`` folder beside them does not count)."""
    path = Path(spec).expanduser()
    if not path.exists():
        return spec
    files = sorted(
        p for p in path.glob("*") if p.is_file() and p.suffix in (".safetensors", ".bin", ".gguf", ".json")
    )
    stamp = (
        [f"{p.relative_to(path)}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in files]
        if path.is_dir()
        else [f"{path.stat().st_size}|{path.stat().st_mtime_ns}"]
    )
    return f"{path.resolve()}#" + hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]


def prepare_inputs(settings: SuiteSettings, tokenizer) -> dict:
    """What both models are scored on: each corpus's held-out ids, the needle essay's sentences."""
    import torch

    from attn2ssm.data import load_documents, prepare_corpus, split_documents
    from attn2ssm.eval.needle import essay_sentences

    ids, sha = {}, {}
    for corpus in settings.corpora:
        held = prepare_corpus(
            corpus, tokenizer, max_heldout_tokens=settings.max_tokens, max_train_tokens=0
        ).heldout_ids[: settings.max_tokens]
        need = max(settings.perplexity_windows) // 2 + 2
        if held.numel() < need:
            raise DataError(
                f"corpus {corpus!r} has {held.numel()} held-out tokens, too few for windows up to {max(settings.perplexity_windows)}",
                f"use corpora with at least {need} held-out tokens, or smaller windows",
            )
        ids[corpus] = held
        sha[corpus] = hashlib.sha256(held.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
    essay, essay_sha = None, None
    if any(f != "niah_single_1" for f in settings.niah_forms):
        _, held_docs = split_documents(load_documents(settings.niah_essay), settings.niah_essay)
        essay = essay_sentences(" ".join(d.text for d in held_docs))
        essay_sha = hashlib.sha256("\n".join(essay).encode()).hexdigest()[:16]
    return {"ids": ids, "ids_sha": sha, "essay": essay, "essay_sha": essay_sha}


def _device(model):
    return str(next(model.parameters()).device)


def score_unit(
    unit: Unit, model, tokenizer, settings: SuiteSettings, inputs: dict, progress: bool = True
) -> dict:
    """One model's scores of one unit: {row id: {value, se, n, cpu_seconds, wall_seconds, ...}}."""
    cpu, wall = time.process_time(), time.time()
    scorer = {"ppl": _score_perplexity, "task": _score_task, "niah": _score_needle}[unit.kind]
    out = scorer(unit, model, tokenizer, settings, inputs, progress)
    cost = {"cpu_seconds": time.process_time() - cpu, "wall_seconds": time.time() - wall}
    # the unit's cost goes to its first row (recall comes with the greedy run)
    for i, scores in enumerate(out.values()):
        scores.update(cost if i == 0 else {"cpu_seconds": 0.0, "wall_seconds": 0.0})
    return out


def _score_perplexity(
    unit: Unit, model, tokenizer, settings: SuiteSettings, inputs: dict, progress: bool
) -> dict:
    from attn2ssm.eval.perplexity import perplexity

    corpus, window = unit.params
    r = perplexity(
        model,
        inputs["ids"][corpus],
        window=window,
        stride=window // 2,
        batch_size=max(1, 4096 // window),
        progress=progress,
        desc=f"{corpus} @{window}",
    )
    return {unit.id: {"value": r["ppl"], "se": None, "n": r["tokens"], "nll": r["nll"]}}


def _score_task(unit: Unit, model, tokenizer, settings: SuiteSettings, inputs: dict, progress: bool) -> dict:
    from attn2ssm.eval.harness import run_lm_eval

    spec = unit.params[0]
    record = run_lm_eval(
        model,
        [spec.task],
        samples=task_samples(spec, settings.seed),
        num_fewshot=spec.shots,
        tokenizer=tokenizer,
        batch_size=settings.batch_size,
        device=_device(model),
        bootstrap_iters=0,
        max_gen_toks=settings.max_gen_toks,
    )
    value, n = pooled_accuracy(record, spec.metric)
    return {unit.id: {"value": value, "se": binomial_se(value, n), "n": n}}


def _score_needle(
    unit: Unit, model, tokenizer, settings: SuiteSettings, inputs: dict, progress: bool
) -> dict:
    from attn2ssm.eval.needle import niah_grid

    form, length = unit.params
    g = niah_grid(
        model,
        tokenizer,
        form,
        [length],
        settings.niah_trials,
        seed=settings.seed,
        essay=inputs["essay"],
        progress=progress,
        desc=f"{form} @{length}",
    )
    n, acc, rec = settings.niah_trials, g["accuracy"][str(length)], g["recall"][str(length)]
    return {
        unit.id: {"value": acc, "se": binomial_se(acc, n), "n": n, "example": g["examples"][0]},
        f"{unit.id}/recall": {"value": rec, "se": binomial_se(rec, n), "n": n},
    }


def score_side(
    model,
    tokenizer,
    settings: SuiteSettings,
    inputs: dict,
    cache: SideCache | None = None,
    progress: bool = True,
    on_unit=None,
    loader=None,
) -> dict:
    """Every unit of the suite for one model (from ``cache`` where it holds the unit); ``on_unit``
    is called after each unit with the scores so far (a killed run keeps its finished units).
    ``model`` may be None with a ``loader`` that returns it: it is called only if a unit is not cached."""
    scores: dict = {}
    for unit in plan_units(settings):
        key = unit_key(unit, settings, inputs) if cache is not None else None
        found = cache.get(key) if cache is not None else None
        if found is None:
            if model is None:
                model = loader()
            found = score_unit(unit, model, tokenizer, settings, inputs, progress)
            if cache is not None:
                cache.put(key, found)
        else:
            found = {rid: {**s, "cached": True} for rid, s in found.items()}
        scores.update(found)
        if on_unit is not None:
            on_unit(scores)
    return scores


# ------------------------------------------------------------------------------------------------ rows
def row_labels(settings: SuiteSettings) -> list[tuple[str, str, str, bool]]:
    """(row id, group, metric, higher is better) of every row, in table order."""
    rows = []
    for unit in plan_units(settings):
        if unit.kind == "ppl":
            corpus, window = unit.params
            rows.append((unit.id, f"perplexity {corpus}", f"ppl @{window}", False))
        elif unit.kind == "task":
            spec = unit.params[0]
            kind = f"{spec.shots}-shot"
            if spec == settings.generation:
                kind = "generation, greedy" + (f", {kind}" if spec.shots else "")
            rows.append((unit.id, f"{spec.task} ({kind})", spec.metric, True))
        else:
            form, length = unit.params
            rows.append((unit.id, f"{form} @{length}", "greedy match", True))
            rows.append((f"{unit.id}/recall", f"{form} @{length}", "recall (teacher-forced)", True))
    return rows


def pair_rows(settings: SuiteSettings, teacher: dict, student: dict) -> list[dict]:
    """The table: one row per suite row with both sides' scores, SEs, n and CPU seconds."""
    rows = []
    for rid, group, metric, higher in row_labels(settings):
        t, s = teacher.get(rid), student.get(rid)
        if t is None and s is None:
            continue
        cpu = {
            side: (None if (x is None or x.get("cached")) else x.get("cpu_seconds"))
            for side, x in (("teacher", t), ("student", s))
        }
        extra = {
            "id": rid,
            **(
                {"domain": DOMAINS[rid.split("/")[1]]}
                if rid.startswith("ppl/") and rid.split("/")[1] in DOMAINS
                else {}
            ),
            "teacher_se": (t or {}).get("se"),
            "student_se": (s or {}).get("se"),
            "n": (s or t)["n"],
            "cpu_seconds": cpu,
        }
        row = table_row(
            group,
            metric,
            None if t is None else t["value"],
            None if s is None else s["value"],
            higher,
            **extra,
        )
        if rid.startswith("ppl/") and t and s:
            row["ratio"] = s["value"] / t["value"]  # student / teacher perplexity, the papers' form
        rows.append(row)
    return rows


def suite_report(
    settings: SuiteSettings,
    teacher_spec: str,
    student_path: str,
    teacher_scores: dict,
    student_scores: dict,
    branch: str = "both",
    kv_cache: dict | None = None,
    targets: list | None = None,
) -> dict:
    """suite.json's content: the rows, the length curve built from the perplexity units,
    ``kv_cache`` (:func:`attn2ssm.eval.kv_cache.kv_fraction` as a dict; its fraction is also the
    top-level ``kv_fraction``) and ``targets`` (:mod:`attn2ssm.eval.targets`) checked against the rows
    (None without targets)."""
    import torch

    from attn2ssm.eval.length_curve import curve_from_scores
    from attn2ssm.eval.report import environment

    rows = pair_rows(settings, teacher_scores, student_scores)
    cost = {
        side: sum(s.get("cpu_seconds", 0.0) for s in scores.values() if not s.get("cached"))
        for side, scores in (("teacher", teacher_scores), ("student", student_scores))
    }
    curve_windows = settings.curve_windows or settings.windows
    planned = [rid for rid, *_ in row_labels(settings)]  # a planned row not scored yet: not measured
    checked = None if targets is None else check_targets(targets, rows, planned)
    return {
        "student": str(student_path),
        "teacher": teacher_spec,
        "suite": settings.name,
        "branch": branch,
        "rows": rows,
        "length_curve": curve_from_scores(settings.corpora, curve_windows, teacher_scores, student_scores),
        "kv_fraction": None if kv_cache is None else kv_cache["kv_fraction"],
        "kv_cache": kv_cache,
        "targets": checked,
        "settings": settings.as_dict(),
        "cpu_seconds": cost,
        "threads": torch.get_num_threads(),
        "environment": environment(),
        "teacher_scores": teacher_scores,
        "student_scores": student_scores,
    }


def write_suite_report(report: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "suite.json", json.dumps(report, indent=1, default=str) + "\n")
    atomic_write_text(out_dir / "suite.md", format_suite_markdown(report))
    plot_recovered(
        report["rows"],
        out_dir / "suite.png",
        f"{Path(str(report['student'])).name} vs {report['teacher']} (suite {report['suite']})",
        curve=report.get("length_curve"),
    )


def fit_models(settings: SuiteSettings, models) -> SuiteSettings:
    """``settings`` for every (name, model) of ``models``: the suite's own lengths past a model's
    positions dropped (a note on stderr each), the user's refused with one line
    (:func:`attn2ssm.eval.suite_settings.fit_positions`)."""
    import sys

    from attn2ssm.student.loading import position_limit

    for name, model in models:
        settings, notes = fit_positions(settings, position_limit(model.config), str(name))
        for note in notes:
            print(note, file=sys.stderr)
    return settings


def run_suite(
    student_path: str,
    teacher_spec: str | None,
    out_dir: Path | KeptOutput,
    settings: SuiteSettings,
    cache_dir: Path | None = None,
    progress: bool = True,
    branch: str = "both",
    device=None,
    targets: list | None = None,
) -> dict:
    """Score teacher (cached per unit in ``cache_dir``, default ``<attn2ssm cache>/suite``) and
    student on the suite, both on ``device`` (None: the CPU); write suite.json / suite.md /
    suite.png to ``out_dir`` after every unit (a :class:`KeptOutput`: to a temporary folder once
    ``out_dir`` cannot be written, so no score is lost; its ``path`` says where they went).
    ``branch`` (both | window | linear) runs a LoLCATs-style student's mixers with one branch only
    (:func:`attn2ssm.mixers.linear_attention.set_window_branch`; the student's scores are never cached).
    Lengths past a model's positions: see :func:`fit_models`. ``targets``
    (:func:`attn2ssm.eval.targets.load_targets`) are checked against the rows at every write."""
    from attn2ssm.eval.kv_cache import kv_fraction
    from attn2ssm.mixers.linear_attention import set_window_branch
    from attn2ssm.paths import cache_dir as default_cache
    from attn2ssm.student.loading import load_model_and_tokenizer

    teacher_spec = teacher_spec or "smollm2-135m"
    student, tokenizer = load_model_and_tokenizer(student_path, device)
    # a student without a window branch: one line, before the teacher loads
    set_window_branch(student, branch, str(student_path))
    teacher, _ = load_model_and_tokenizer(teacher_spec, device)
    settings = fit_models(settings, ((student_path, student), (teacher_spec, teacher)))
    kv = kv_fraction(student, teacher).as_dict()
    inputs = prepare_inputs(settings, tokenizer)
    cache = teacher_cache(Path(cache_dir) if cache_dir else default_cache() / "suite", teacher_spec, device)
    teacher_scores = score_side(teacher, tokenizer, settings, inputs, cache, progress)
    del teacher

    out = out_dir if isinstance(out_dir, KeptOutput) else KeptOutput(out_dir)

    def save(student_scores: dict) -> dict:
        report = suite_report(
            settings, teacher_spec, student_path, teacher_scores, student_scores, branch, kv, targets
        )
        out.write(lambda folder: write_suite_report(report, folder))
        return report

    student_scores = score_side(student, tokenizer, settings, inputs, None, progress, on_unit=save)
    return save(student_scores)

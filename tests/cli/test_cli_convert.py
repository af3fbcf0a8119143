"""``attn2ssm convert``, run as a user runs it: teacher paths, flag syntax, an unsupported family or a
truncated GGUF as one line; a loadable hybrid; ``--keep auto``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import assert_one_line_error, result_of, run_cli


def test_missing_teacher_dir(tmp_path):
    r = run_cli("convert", "--teacher", "/nope/dir", "--out", tmp_path / "x")
    assert_one_line_error(r, "teacher path not found", "/nope/dir", "check the path")
    assert not (tmp_path / "x").exists()


def test_missing_gguf_file(tmp_path):
    r = run_cli("convert", "--teacher", tmp_path / "model.gguf", "--out", tmp_path / "x")
    assert_one_line_error(r, "GGUF file not found", str(tmp_path / "model.gguf"), "smollm2-135m")


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--keep", "a,b", "--keep 'a,b'"),
        ("--option", "feature_map", "--option 'feature_map' is not key=value"),
    ],
)
def test_convert_flag_syntax(tmp_path, flag, value, needle):
    r = run_cli("convert", "--teacher", "/nope/dir", flag, value, "--out", tmp_path / "x")
    assert_one_line_error(r, needle)  # checked before the teacher is even looked at


def test_unsupported_architecture_lists_supported_families(slow):
    line = assert_one_line_error(result_of(slow, "unsupported"), "model_type 'bert'", "supported families")
    for family in ("llama", "mistral", "qwen2", "gpt2"):
        assert family in line


def test_truncated_gguf_teacher(slow, ws):
    assert_one_line_error(result_of(slow, "truncated_gguf"), str(ws.truncated_gguf), "complete GGUF")
    assert not (ws.root / "out" / "gguf-student").exists()


def test_convert_writes_a_loadable_hybrid(slow):
    from transformers import AutoModelForCausalLM

    r = result_of(slow, "convert")
    assert r.returncode == 0, r.stderr
    assert "attention kept at [1]" in r.stdout  # the last layer of each group (Mamba in the Llama)
    out = Path(slow["student_dir"])
    plan = json.loads((out / "config.json").read_text())["layer_plan"]
    assert len(plan) == 2 and plan.count("attention") == 1 and plan.count("linear_attention") == 1
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.layer_plan == plan


def test_convert_keep_auto_scores_layers_and_writes_the_plan(ws, tmp_path, capsys):
    """`convert --keep auto` (in-process): converts each layer alone on corpus blocks, keeps the most damaging."""
    from attn2ssm.cli import main

    out = tmp_path / "auto"
    assert (
        main(
            [
                "convert",
                "--teacher",
                str(ws.llama),
                "--mixer",
                "mamba2",
                "--attention-ratio",
                "0.5",
                "--keep",
                "auto",
                "--calibration",
                str(ws.corpus),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    scores = [
        float(item.split(":")[1])
        for item in printed.split("converted alone): ")[1].splitlines()[0].split(", ")
    ]
    plan = json.loads((out / "config.json").read_text())["layer_plan"]
    assert len(scores) == 2 and plan.count("attention") == 1
    assert plan.index("attention") == max(range(2), key=lambda i: (scores[i], -i))

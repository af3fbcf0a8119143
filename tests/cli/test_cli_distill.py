"""``attn2ssm distill``, run as a user runs it: a bad recipe, override or teacher is one line before
the teacher loads, and what is found after loading (block length, kept layers, an empty corpus)
leaves no run directory.
"""

from __future__ import annotations

import pytest
from cli_run import assert_one_line_error, result_of, run_cli


def test_distill_with_missing_teacher_fails_fast(tmp_path):
    r = run_cli("distill", "--teacher", "/nope/dir", "--out", tmp_path / "run")
    assert_one_line_error(r, "teacher path not found", "/nope/dir")


def test_unknown_stage_key_lists_valid_keys():
    r = run_cli("distill", "--set", "stages.0.nonsense=1")
    line = assert_one_line_error(r, "unknown key 'nonsense'", "recipe.stages[0]", "valid keys:")
    for key in ("tokens", "batch_size", "optim", "schedule"):
        assert key in line


def test_misspelt_data_key_lists_valid_keys():
    r = run_cli("distill", "--set", "data.blokc_len=5")
    assert_one_line_error(r, "unknown key 'blokc_len'", "recipe.data", "valid keys:", "block_len", "corpus")


@pytest.mark.parametrize(
    ("override", "needle"),
    [("data.block_len", "has no '='"), ("stages.9.tokens=1", "is not an index of a list of")],
)
def test_malformed_overrides(override, needle):
    assert_one_line_error(run_cli("distill", "--set", override), needle)


def test_negative_learning_rate_fails_before_the_teacher_loads(tmp_path):
    r = run_cli("distill", "mamba2_pure", "--out", tmp_path / "run", "--set", "stages.0.optim.lr=-1")
    assert_one_line_error(r, "optim.lr=-1.0 is out of range", "stages.0.optim.lr")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("student.mixer=mamba3", "student.mixer='mamba3' is not a mixer"),
        ("student.attention_ratio=1.5", "student.attention_ratio=1.5 is outside [0, 1]"),
    ],
)
def test_student_plan_errors_fail_before_the_teacher_loads(tmp_path, override, needle):
    r = run_cli("distill", "mamba2_pure", "--out", tmp_path / "run", "--set", override)
    assert_one_line_error(r, needle)
    assert not (tmp_path / "run").exists()


def test_unknown_recipe_name():
    r = run_cli("distill", "quikstart")
    assert_one_line_error(r, "no recipe 'quikstart'", "quickstart")


def test_missing_recipe_yaml(tmp_path):
    path = tmp_path / "nope.yaml"
    r = run_cli("distill", path)
    assert_one_line_error(r, "config file not found", str(path), "attn2ssm recipes")


def test_malformed_recipe_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nstages: [\n")
    r = run_cli("distill", path, "--out", tmp_path / "run")
    assert_one_line_error(r, str(path), "not valid YAML", "line 3")
    assert not (tmp_path / "run").exists()


def test_block_len_above_the_models_maximum(slow, ws):
    """Found from the teacher's config.json before the teacher or the corpus loads: no run directory."""
    assert_one_line_error(result_of(slow, "block_len"), "block length 128", "maximum of 64", "data.block_len")
    assert not (ws.root / "out" / "run-block").exists()


def test_keep_attention_beyond_the_teachers_layers(slow, ws):
    assert_one_line_error(
        result_of(slow, "keep_attention"), "keep_attention has layer indices [5] outside 0..1"
    )
    assert not (ws.root / "out" / "run-keep").exists()


def test_empty_corpus(slow, ws):
    assert_one_line_error(result_of(slow, "empty_corpus"), "empty corpus", str(ws.empty))
    # a corpus that fails to load leaves no recipe.yaml behind
    assert not (ws.root / "out" / "run-empty").exists()

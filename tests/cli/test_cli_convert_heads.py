"""``attn2ssm convert --kv-budget``: a head-level hybrid whose kept KV groups a retrieval probe of the
teacher chose, the probe's record in its config.json; a bad combination is one line."""

import json

from attn2ssm.cli import main
from tiny_models import one_line_error


def test_convert_with_a_kv_budget(tiny_setup, tmp_path, capsys):
    teacher_dir, _ = tiny_setup
    out = tmp_path / "student"
    argv = ["convert", "--teacher", str(teacher_dir), "--kv-budget", "0.25", "--probe-examples", "2"]
    assert main([*argv, "--probe-pairs", "3", "--option", "window=4", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    probe = config["retrieval_probe"]
    assert probe["kv_groups_total"] == 4 and probe["kv_groups_kept"] == 1  # ⌊0.25 · 2 layers × 2 groups⌋
    ((layer, groups),) = probe["kept"].items()
    assert config["layer_plan"][int(layer)] == "linear_attention_heads"
    assert config["mixer_options"]["linear_attention_heads"]["softmax_kv_heads"] == {layer: groups}
    assert "softmax KV groups kept in layers" in capsys.readouterr().out


def test_kv_budget_needs_linear_attention(tmp_path, capsys):
    argv = [
        "convert",
        "--teacher",
        "/nope/dir",
        "--mixer",
        "mamba2",
        "--kv-budget",
        "0.05",
        "--out",
        str(tmp_path / "x"),
    ]
    assert "--kv-budget keeps KV groups inside linear_attention layers" in one_line_error(capsys, argv)
    argv = ["convert", "--teacher", "/nope/dir", "--kv-budget", "5", "--out", str(tmp_path / "x")]
    assert "is not a fraction" in one_line_error(capsys, argv)

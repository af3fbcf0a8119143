"""Delta checkpoints (distill/delta.py, ``distill --from-delta``): a run keeps the tensors its stages
trained (feature maps, LoRA factors) in RUN/delta/; a new run from that delta — the student
converted again, the delta replayed — reaches the same student as the run itself, or trains on
from it to the same student as the run that never stopped; a delta on another base is refused in
one line."""

import json

import pytest
import torch
from safetensors.torch import load_file

from attn2ssm.cli import main
from attn2ssm.distill.delta import DELTA, META, TENSORS, read_delta
from attn2ssm.errors import ConfigError

STAGES = (
    "[{name: at, kind: attention_transfer, tokens: 128, batch_size: 2, trainable: [feature_maps],"
    " losses: {attention: 0.0, output_mse: 1.0}, optim: {lr: 0.01}},"
    " {name: lora, kind: kd, tokens: 128, batch_size: 2, trainable: [lora], lora: {r: 2, alpha: 4}, optim: {lr: 0.01}}]"
)


def _distill(run_overrides, out, *extra, **sets):
    sets = {"stages": STAGES, "mixed_precision": "no", "eval.window": "null", **sets}
    argv = ["distill", "quickstart", "--out", str(out), "--no-progress"]
    for s in run_overrides(**sets):
        argv += ["--set", s]
    assert main([*argv, *extra]) == 0


def _student(run) -> dict:
    return load_file(str(run / "student" / "model.safetensors"))


def _same(a: dict, b: dict) -> None:
    """Bitwise: the replay runs on the device the run trained on (the CPU here)."""
    assert a.keys() == b.keys()
    assert not [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def full_run(run_overrides, tmp_path_factory):
    out = tmp_path_factory.mktemp("delta") / "full"
    _distill(run_overrides, out)
    return out


def test_a_run_keeps_its_trained_tensors_only(full_run):
    meta = json.loads((full_run / DELTA / META).read_text())
    assert [s["name"] for s in meta["stages"]] == ["at", "lora"] and meta["state"]["finished"] == [0, 1]
    tensors = load_file(str(full_run / DELTA / TENSORS))
    assert tensors and all(k.startswith(("0/", "1/")) for k in tensors)
    # the feature-map group: the maps, the window's γ and the linear branch's decay (the recipe's options)
    group = ("feature_map", "window_factor", "decay_log_rate")
    assert all(any(g in k for g in group) for k in tensors if k.startswith("0/"))
    assert any("decay_log_rate" in k for k in tensors)
    assert all(k.startswith("1/lora.") and k.endswith((".A", ".B")) for k in tensors if k.startswith("1/"))
    assert meta["stages"][1]["lora_scale"] == 2.0 and meta["layout"] and meta["base_checksum"]
    delta_bytes = (full_run / DELTA / TENSORS).stat().st_size
    assert delta_bytes < 0.5 * (full_run / "student" / "model.safetensors").stat().st_size


def test_a_run_from_the_delta_reaches_the_same_student(run_overrides, full_run, tmp_path):
    """Every stage in the delta: the new run replays them and only writes the student."""
    _distill(run_overrides, tmp_path / "again", "--from-delta", str(full_run))
    _same(_student(tmp_path / "again"), _student(full_run))


def test_a_run_from_a_first_stage_delta_trains_on_to_the_same_student(run_overrides, full_run, tmp_path):
    """Stage 1 alone (stage 2 switched off), then a run of the whole recipe from its delta: stage 2
    trains on the replayed student, as the run that never stopped trained it."""
    first = tmp_path / "first"
    _distill(run_overrides, first, "--set", "stages.1.tokens=0")
    assert [s["name"] for s in read_delta(first).meta["stages"]] == ["at"]
    _distill(run_overrides, tmp_path / "on", "--from-delta", str(first / DELTA))
    _same(_student(tmp_path / "on"), _student(full_run))
    assert [s["name"] for s in read_delta(tmp_path / "on").meta["stages"]] == ["at", "lora"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (["student.attention_ratio=0.5"], "layout"),  # another converted layout
        # the same layout, other base weights (the teacher's rounded to bf16)
        (["teacher_dtype=bfloat16", "mixed_precision=bf16"], "the base student differs"),
    ],
)
def test_a_delta_on_another_base_is_one_line(run_overrides, full_run, tmp_path, capsys, change, says):
    argv = ["distill", "quickstart", "--out", str(tmp_path / "other"), "--no-progress"]
    for s in run_overrides(stages=STAGES, mixed_precision="no", **{"eval.window": "null"}):
        argv += ["--set", s]
    for c in change:
        argv += ["--set", c]
    assert main([*argv, "--from-delta", str(full_run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--from-delta" in err[0] and says in err[0], err
    assert not (tmp_path / "other" / "checkpoints").exists()
    with pytest.raises(ConfigError, match="no delta/delta.json there"):
        read_delta(tmp_path)

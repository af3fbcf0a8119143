"""``benchmarks/cab_vision.py``'s cell cache: a finished cell is reused only while its saved recipe
still resolves to the planned one (the prose description aside); a finished cell of other settings
is moved aside, never deleted; an interrupted one starts again. ``distill`` is replaced by a stub
that writes what the trainer writes (recipe.yaml, results.json), so no model trains here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench_scripts import load_benchmark


@pytest.fixture
def bench(monkeypatch):
    module = load_benchmark("cab_vision.py")
    calls = []

    def fake_distill(recipe, out, progress=False):
        calls.append(recipe)
        out = Path(out)
        out.mkdir(parents=True)
        (out / "recipe.yaml").write_text(recipe.to_yaml())
        results = {
            "student_top1": 0.5 + 0.01 * len(calls),
            "teacher_top1": 0.9,
            "train_images": 8,
            "test_images": 20,
            "train_seconds": 0.0,
            "images_seen": 16,
        }
        (out / "results.json").write_text(json.dumps(results))
        return results

    import attn2ssm.distill.trainer as trainer

    monkeypatch.setattr(trainer, "distill", fake_distill)
    module.calls = calls
    return module


def test_cached_cell_reused_then_rerun_when_the_recipe_changes(bench, tmp_path):
    first = bench.run_cell("KD", 0.1, 0, None, tmp_path, [])
    again = bench.run_cell("KD", 0.1, 0, None, tmp_path, [])
    assert len(bench.calls) == 1 and again == first  # same settings: not retrained

    # the description is prose: editing it keeps the cell
    saved = tmp_path / "cab_vision_kd_f0.1_s0" / "recipe.yaml"
    raw = yaml.safe_load(saved.read_text())
    raw["description"] = "edited since"
    saved.write_text(yaml.safe_dump(raw))
    assert bench.run_cell("KD", 0.1, 0, None, tmp_path, []) == first and len(bench.calls) == 1

    # another temperature is another cell: retrained, the old one kept beside
    changed = bench.run_cell("KD", 0.1, 0, None, tmp_path, ["stages.0.temperature=3.0"])
    assert len(bench.calls) == 2 and changed["student_top1"] != first["student_top1"]
    assert bench.calls[-1].stages[0].temperature == 3.0
    old = [p for p in tmp_path.iterdir() if p.name.startswith("cab_vision_kd_f0.1_s0.old-")]
    assert len(old) == 1 and json.loads((old[0] / "results.json").read_text()) == first


def test_control_method_has_its_own_folder_and_a_init(bench, tmp_path):
    bench.run_cell("KD", 0.05, 1, None, tmp_path, [])
    bench.run_cell("KD+A0", 0.05, 1, None, tmp_path, [])
    assert {p.name for p in tmp_path.iterdir()} == {"cab_vision_kd_f0.05_s1", "cab_vision_kd_A0_f0.05_s1"}
    plain, control = bench.calls
    assert control.student.mixer_options["A_init"] == -1.0e-4 and "A_init" not in plain.student.mixer_options


def test_interrupted_cell_starts_again(bench, tmp_path):
    partial = tmp_path / "cab_vision_f0.01_s2"
    (partial / "checkpoints").mkdir(parents=True)
    bench.run_cell("CAB", 0.01, 2, 4096, tmp_path, [])
    assert len(bench.calls) == 1 and bench.calls[0].stages[0].tokens == 4096
    assert sorted(p.name for p in partial.iterdir()) == ["recipe.yaml", "results.json"]

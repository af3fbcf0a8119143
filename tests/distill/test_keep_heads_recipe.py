"""The head-level recipe (recipes/retrieval_heads.yaml) end to end at tiny scale: the probe chooses
the kept KV groups under the budget, the student trains, keeps the probe's record, reloads and
resumes to the same student; student.keep_heads' bad settings are one-line errors."""

import json

import pytest
import torch

from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import distill
from attn2ssm.errors import ConfigError
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from tiny_models import Crash, assert_same_student, crash_after

STAGES = (
    "[{name: at, kind: attention_transfer, tokens: 256, batch_size: 4, trainable: [feature_maps], save_every: 1,"
    " losses: {attention: 0.0, output_mse: 1.0}, optim: {lr: 0.01}},"
    " {name: kd, kind: kd, tokens: 256, batch_size: 4, trainable: [lora], lora: {r: 4, alpha: 8}, save_every: 1,"
    " optim: {lr: 0.01}}]"
)
# the tiny teacher: 2 layers × 2 KV groups; a quarter of its cache is one group
KEEP = "{kv_budget: 0.25, probe_examples: 2, probe_pairs: 3, probe_queries: 2}"


def _sets(run_overrides, **extra):
    base = {
        "stages": STAGES,
        "student.keep_heads": KEEP,
        "student.mixer_options": "{feature_map: hedgehog, window: 4}",
        "eval.window": 32,
    }
    return run_overrides(**{**base, **extra})


def test_retrieval_heads_recipe_runs_keeps_its_probe_and_resumes(run_overrides, tmp_path, monkeypatch):
    recipe = load_recipe("retrieval_heads", _sets(run_overrides))
    assert recipe.student.attention_ratio == 0.0
    reference = tmp_path / "reference"
    distill(recipe, reference, progress=False)
    student = Attn2SSMForCausalLM.from_pretrained(reference / "student")
    probe = student.config.retrieval_probe
    assert probe["kv_groups_total"] == 4 and probe["kv_groups_kept"] == 1
    ((layer, groups),) = probe["kept"].items()
    assert student.config.layer_plan[int(layer)] == "linear_attention_heads"
    assert [k for k in student.config.layer_plan if k != "linear_attention_heads"] == ["linear_attention"]
    assert student.mixers()[int(layer)].kept_groups == groups
    assert sum(getattr(m, "kv_heads_kept", 0) for m in student.mixers().values()) == 1
    events = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [e["kept"] for e in events if e.get("event") == "retrieval_probe"] == [probe["kept"]]
    ids = torch.randint(0, 200, (1, 20))
    assert torch.isfinite(student(ids).logits).all()

    crash_after(monkeypatch, 2)  # inside the first stage: its second checkpoint
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        distill(load_recipe("retrieval_heads", _sets(run_overrides)), crashed, progress=False)
    monkeypatch.undo()
    distill(load_recipe("retrieval_heads", _sets(run_overrides)), crashed, resume=True, progress=False)
    assert_same_student(reference, crashed)
    resumed = Attn2SSMForCausalLM.from_pretrained(crashed / "student")
    assert resumed.config.retrieval_probe == probe and resumed.config.layer_plan == student.config.layer_plan


def test_listed_groups_skip_the_probe(run_overrides, tmp_path):
    sets = _sets(
        run_overrides,
        **{"student.keep_heads": '{groups: {"1": [0, 1]}}', "stages": STAGES.split(", {name: kd")[0] + "]"},
    )
    distill(load_recipe("retrieval_heads", sets), tmp_path / "run", progress=False)
    student = Attn2SSMForCausalLM.from_pretrained(tmp_path / "run" / "student")
    assert student.config.layer_plan == ["linear_attention", "linear_attention_heads"]
    assert student.config.retrieval_probe["kept"] == {"1": [0, 1]}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"student.mixer": "mamba2", "student.mixer_options": "{}"}, "inside linear_attention layers"),
        ({"student.keep_heads": "{kv_budget: 1.5}"}, "kv_budget=1.5 is out of range"),
        ({"student.keep_heads": "{probe_pairs: 2, probe_queries: 3}"}, "probe_queries=3 is out of range"),
        ({"student.keep_heads": '{groups: {"0": [1, 1]}}'}, "distinct kv groups"),
        ({"student.depth": 1}, "the teacher's own layers"),
    ],
)
def test_bad_keep_heads_settings_are_one_line(run_overrides, extra, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_recipe("retrieval_heads", _sets(run_overrides, **extra))
    assert "\n" not in str(err.value)

"""student.init_from: a further run of stages continuing a saved student (e.g. a final KD stage on
longer blocks after a run on 1024-token blocks) — its layers and weights as saved, nothing
converted or calibrated; refused where it cannot apply."""

import pytest
import torch
from safetensors.torch import load_file

from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import distill
from attn2ssm.errors import ConfigError
from tiny_models import BASE_RECIPE

KD = "[{name: more, kind: kd, tokens: 256, batch_size: 4, trainable: [lora], lora: {r: 4, alpha: 8}, optim: {lr: 0.01}, save_every: 1}]"
MAPS = "feature_map_"


def _weights(run):
    return load_file(run / "student" / "model.safetensors")


def test_a_run_continues_a_saved_student(run_overrides, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    distill(load_recipe(BASE_RECIPE, run_overrides()), first, progress=False)
    distill(
        load_recipe(
            BASE_RECIPE, run_overrides(**{"stages": KD, "student.init_from": str(first / "student")})
        ),
        second,
        progress=False,
    )
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys()
    maps = [k for k in a if MAPS in k]
    # the feature maps (trained in the first run, frozen in the second) are the first run's, bit for bit
    assert maps and all(torch.equal(a[k], b[k]) for k in maps)
    # and not what a fresh conversion starts from: the first run trained them
    fresh = tmp_path / "fresh"
    distill(load_recipe(BASE_RECIPE, run_overrides(stages=KD)), fresh, progress=False)
    assert any(not torch.equal(a[k], _weights(fresh)[k]) for k in maps)
    # the second run's LoRA KD moved the attention projections it merged
    assert any(not torch.equal(a[k], b[k]) for k in a if "q_proj" in k)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"student.init_from": "/no/such/student"}, "is no student directory"),
        (
            {
                "student.attention_ratio": 0.5,
                "stages": KD.replace("save_every: 1", "save_every: 1, attention_ratio: 0.0"),
            },
            "sets attention_ratio",
        ),
    ],
)
def test_init_from_refusals(run_overrides, tmp_path, extra, message):
    if "student.init_from" not in extra:
        (tmp_path / "s").mkdir()
        (tmp_path / "s" / "config.json").write_text("{}")
        extra = {**extra, "student.init_from": str(tmp_path / "s")}
    with pytest.raises(ConfigError, match=message):
        distill(load_recipe(BASE_RECIPE, run_overrides(**extra)), tmp_path / "run", progress=False)

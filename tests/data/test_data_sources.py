"""Recipes with data.sources (a weighted mixture, teacher-generated text) and a run that trains on them."""

import json

import pytest
import torch
import yaml

from attn2ssm.config import from_dict
from attn2ssm.distill.recipe import Recipe, SourceConfig, load_recipe, validate
from attn2ssm.distill.trainer import distill
from attn2ssm.errors import ConfigError, DataError
from tiny_models import BASE_RECIPE

MIXTURE = "[{corpus: sotu, weight: 0.5}, {corpus: moby-dick, weight: 0.2}, {corpus: 'hf:org/big', weight: 0.3, max_tokens: 1000000}]"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_sources_in_a_recipe():
    r = load_recipe(BASE_RECIPE, ["data.corpus=null", f"data.sources={MIXTURE}"])
    assert r.data.corpus is None and r.data.sources[2] == SourceConfig("hf:org/big", 0.3, 1_000_000)
    assert (
        r.data.source_list() == r.data.sources
        and r.data.describe() == "0.5×sotu + 0.2×moby-dick + 0.3×hf:org/big"
    )
    again = from_dict(Recipe, yaml.safe_load(r.to_yaml()), "recipe")  # what --resume reads back
    validate(again)
    assert again.data == r.data
    plain = load_recipe(BASE_RECIPE)  # one corpus, as every built-in recipe
    assert (
        plain.data.sources == []
        and plain.data.source_list() == [SourceConfig("sotu")]
        and plain.data.describe() == "sotu"
    )
    assert Recipe().data.corpus == "sotu"


@pytest.mark.parametrize(
    "sets, error, match",
    [
        ([f"data.sources={MIXTURE}"], ConfigError, "data.corpus and data.sources are both set"),
        (
            ["data.corpus=null", "data.sources=[{corpus: sotu, wieght: 1}]"],
            ConfigError,
            "valid keys: corpus, weight, max_tokens",
        ),
        (
            ["data.corpus=null", "data.sources=[{corpus: sotu, weight: 0}]"],
            ConfigError,
            r"data.sources\[0\] \(sotu\): weight 0.0",
        ),
        (
            ["data.corpus=null", "data.sources=[{corpus: sotu, max_tokens: 0}]"],
            ConfigError,
            "max_tokens=0 is not positive",
        ),
        (["data.corpus=null", "data.sources=[{weight: 1}]"], ConfigError, "names no corpus"),
        (["data.corpus=generated:many"], DataError, "number of tokens"),
        (["data.max_train_tokens=-5"], ConfigError, "negative"),
    ],
)
def test_bad_data_config_is_one_line(sets, error, match):
    with pytest.raises(error, match=match) as info:
        load_recipe(BASE_RECIPE, sets)
    assert "\n" not in str(info.value)


def test_distill_on_a_mixture_with_teacher_text(run_overrides, tmp_path, capsys):
    """A corpus and the teacher's own samples, 70/30: the run trains, reports the mixture, and a second run
    draws the same batches from the caches (the resume contract) without sampling the teacher again."""
    base = run_overrides()
    corpus = next(o for o in base if o.startswith("data.corpus=")).split("=", 1)[1]
    sources = (
        f"[{{corpus: '{corpus}', weight: 0.7}}, {{corpus: 'generated:3000?length=32&batch=8', weight: 0.3}}]"
    )
    stage = (
        "[{name: kd, kind: kd, tokens: 1024, batch_size: 4, save_every: 4, eval_every: 4, optim: {lr: 0.01}}]"
    )
    sets = run_overrides(**{"data.corpus": "null", "data.sources": sources, "stages": stage})
    results = distill(load_recipe(BASE_RECIPE, sets), tmp_path / "a", progress=False)
    printed = capsys.readouterr().out
    assert (
        "data: 32 training blocks" in printed
        and "70.0% of blocks" in printed
        and "30.0% of blocks" in printed
    )
    assert results["corpus"] == f"0.7×{corpus} + 0.3×generated:3000?length=32&batch=8"
    losses = [
        json.loads(line)["loss"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    distill(load_recipe(BASE_RECIPE, sets), tmp_path / "b", progress=False)
    assert "(cached)" in capsys.readouterr().out
    again = [json.loads(line)["loss"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert again == pytest.approx(losses, rel=1e-6)

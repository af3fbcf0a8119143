"""The alignment comparison's bookkeeping: budgets scale by whole batches, orderings are judged
on held-out perplexity, parts merge, the plot draws (the runs themselves are CLI distillations,
tested elsewhere)."""

import pytest

from attn2ssm.distill.recipe import load_recipe
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def ac():
    return load_benchmark("alignment_comparison.py")


def test_every_variant_names_a_loadable_recipe_and_budgets_scale(ac):
    totals = {}
    for family, recipe_name, extra in ac.VARIANTS.values():
        recipe = load_recipe(recipe_name, extra)
        scaled = load_recipe(recipe_name, extra + ac.scaled_overrides(recipe, 0.5, 3))
        for a, b in zip(recipe.stages, scaled.stages):
            assert (
                b.tokens % (b.batch_size * recipe.data.block_len) == 0
                and abs(b.tokens - a.tokens / 2) <= b.batch_size * recipe.data.block_len / 2
            )
        totals.setdefault(family, set()).add(sum(s.tokens for s in recipe.stages))
    assert all(len(t) == 1 for t in totals.values()), totals  # equal budgets within each comparison


def test_orderings_merge_and_plot(ac, tmp_path):
    def part(variants):
        return {
            "teacher_ppl": 20.0,
            "command": "x",
            "settings": {"teacher": "t", "scale": 1.0},
            "variants": {
                n: {"family": ac.VARIANTS[n][0], "student_ppl": p, "curve": [(100, p * 2), (200, p)]}
                for n, p in variants.items()
            },
        }

    import json

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(part({"HedgeMamba": 50.0, "Hedgehog": 60.0, "CAB": 900.0})))
    b.write_text(
        json.dumps(part({"MOHAWK 1+2+3": 80.0, "MOHAWK 2+3": 70.0, "MOHAWK 3": 90.0, "plain KD": 800.0}))
    )
    data = ac.summarize(ac.merge([str(a), str(b)]))
    o = data["orderings"]
    assert o["HedgeMamba < Hedgehog (HedgeMamba paper)"]["holds"] is True
    assert o["MOHAWK 1+2+3 < 2+3 < 3 (MOHAWK Tab. 3)"]["holds"] is False
    assert o["CAB < plain KD (CAB paper)"]["holds"] is False
    ac.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0

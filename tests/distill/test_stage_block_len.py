"""A stage's own ``block_len`` (the recipe's sources re-blocked for that stage: a final end-to-end KD
stage at long blocks) and ``tokens: 0`` (an optional stage carried switched off)."""

import json

import pytest
import torch

from attn2ssm.data import load_training_data
from attn2ssm.distill.recipe import builtin_recipes, load_recipe, validate_for_teacher
from attn2ssm.distill.trainer import Distiller
from attn2ssm.errors import ConfigError
from tiny_models import BASE_RECIPE, make_tokenizer, tiny_config

STAGES = (
    "[{name: short, kind: kd, tokens: 256, batch_size: 4, save_every: 0},"
    " {name: long, kind: kd, tokens: 512, batch_size: 2, block_len: 64, save_every: 0, eval_batches: 1},"
    " {name: spare, kind: kd, tokens: 0, block_len: 128, batch_size: 1}]"
)


def test_a_stage_trains_on_its_own_block_length_and_a_zero_budget_stage_is_skipped(
    run_overrides, tmp_path, capsys
):
    """Stage 1 at data.block_len 32: 256 / (4 × 32) = 2 steps of 128 tokens; stage 2 at 64: 512 /
    (2 × 64) = 4 steps of 128 tokens, its blocks exactly the sources packed at 64 (load_training_data
    by hand, sized for that stage: 4 steps × 2 = 8 blocks); stage 3 (tokens 0) never runs."""
    torch.set_num_threads(1)
    recipe = load_recipe(BASE_RECIPE, run_overrides(stages=STAGES))
    run = Distiller(recipe, tmp_path / "run", progress=False)
    run.run()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [
        (r["stage"], r["step"], r["tokens"]) for r in records if "step" in r and "stage" in r and "loss" in r
    ]
    assert steps == [
        ("short", 1, 128),
        ("short", 2, 256),
        ("long", 1, 128),
        ("long", 2, 256),
        ("long", 3, 384),
        ("long", 4, 512),
    ]
    assert "[stage 3] spare: skipped (tokens: 0" in capsys.readouterr().out
    assert sorted(run.block_sets) == [32, 64]  # the skipped stage's length was never prepared
    d = recipe.data
    tok = make_tokenizer(300)
    by_hand = load_training_data(
        d.source_list(),
        tok,
        64,
        seed=recipe.seed,
        max_heldout_tokens=d.max_heldout_tokens,
        budget_blocks=8,
        compact=True,
    )
    blocks, eval_blocks = run.block_sets[64]
    assert blocks.shape[1] == 64 and torch.equal(blocks.tensor(), by_hand.blocks.tensor())
    assert torch.equal(eval_blocks.tensor(), by_hand.eval_blocks.tensor())
    assert run.block_sets[32][0].shape[1] == 32
    assert (tmp_path / "run" / "student" / "config.json").is_file()


@pytest.mark.parametrize(
    ("stage", "needle"),
    [
        (
            "{name: s, kind: sft, block_len: 64, data: {source: x.jsonl}}",
            "does not train on the recipe's corpus blocks, so block_len does not apply",
        ),
        ("{name: s, kind: kd, block_len: 1}", "block_len=1 is not a block length"),
        ("{name: s, kind: kd, tokens: -1}", "tokens positive or 0"),
    ],
)
def test_stage_block_len_errors(stage, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_recipe(BASE_RECIPE, [f"stages=[{stage}]"])
    assert "\n" not in str(e.value)


def test_the_25_percent_hybrids_carry_an_optional_long_stage():
    for name in ("linear_hybrid25", "hybrid25", "gdn_hybrid25"):
        r = load_recipe(name)
        last = r.stages[-1]
        assert (last.name, last.kind, last.tokens, last.block_len) == ("long_kd", "kd", 0, 4096), name
        assert last.gradient_checkpointing is True, name  # without it the stage needs ~17 GB on the CPU
        assert load_recipe(name, ["stages.2.tokens=32768"]).stages[2].tokens == 32768
    assert all(s.block_len is None for s in load_recipe("quickstart").stages)  # the demo is unchanged
    assert all(s.tokens > 0 for s in load_recipe("quickstart").stages) and "quickstart" in builtin_recipes()


def test_a_stage_block_len_past_the_teachers_positions_names_the_stages_key():
    config = tiny_config("llama")
    config.max_position_embeddings = 64
    stages = "stages=[{name: short, kind: kd}, {name: long, kind: kd, block_len: 128}]"
    recipe = load_recipe(BASE_RECIPE, ["data.block_len=32", "eval.window=32", stages])
    with pytest.raises(ConfigError) as err:
        validate_for_teacher(recipe, config)
    msg = str(err.value)
    assert "stages[1] (long): block_len 128 exceeds the teacher's maximum of 64 positions" in msg, msg
    assert "set stages.1.block_len to at most 64" in msg and "lower data.block_len" not in msg
    assert "\n" not in msg
    validate_for_teacher(
        load_recipe(BASE_RECIPE, ["data.block_len=32", "eval.window=32", stages.replace("128", "64")]), config
    )

"""The hedgemamba recipe ("Attention to Mamba"): 10/90 Hedgehog transfer → CE finetune; stage 1 moves only
the feature maps of the HedgeMamba mixers, and the whole recipe gives a loadable student."""

import json

import torch
from safetensors.torch import load_file

from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import distill
from attn2ssm.student.convert import convert
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from attn2ssm.teachers import load_teacher


def test_recipe_is_the_papers_two_stages_with_a_10_90_split():
    r = load_recipe("hedgemamba")
    assert r.student.mixer == "hedgemamba" and r.student.mixer_options["feature_map"] == "hedgehog"
    assert r.student.mixer_options["feature_map_options"] == {"activation": "softmax"}
    transfer, finetune = r.stages
    assert transfer.kind == "attention_transfer" and transfer.trainable == ["feature_maps"]
    assert transfer.losses == {"attention": 0.0, "output_cosine": 1.0}
    assert finetune.kind == "ce" and finetune.trainable == ["all"] and finetune.frozen == ["embeddings"]
    share = transfer.tokens / (transfer.tokens + finetune.tokens)
    assert 0.08 <= share <= 0.12, share
    for stage in r.stages:  # whole batches
        assert stage.tokens % (stage.batch_size * r.data.block_len) == 0
    split = load_recipe("hedgemamba", ["stages.0.tokens=16384", "stages.1.tokens=16384"])
    assert [s.tokens for s in split.stages] == [16384, 16384]


def _tiny(run_overrides, stage_tokens, **extra):
    """The recipe's own stages on the tiny setup, ``stage_tokens`` each in batches of 2 blocks."""
    per_stage = {
        f"stages.{i}.{key}": value
        for i, t in enumerate(stage_tokens)
        for key, value in (("tokens", t), ("batch_size", 2), ("save_every", 1))
    }
    base = [s for s in run_overrides() if not s.startswith("stages=")]  # keep the recipe's stages
    return load_recipe("hedgemamba", base + [f"{k}={v}" for k, v in {**per_stage, **extra}.items()])


def test_stage_one_moves_only_the_feature_maps(run_overrides, tiny_setup, tmp_path):
    """Stage 1 alone: against a fresh conversion, every tensor but the feature maps is unchanged
    (HedgeMamba's decay, conv and gate stay at the identity, q/k/v/o at the teacher's)."""
    recipe = _tiny(run_overrides, [256])
    recipe.stages = recipe.stages[:1]
    out = tmp_path / "run"
    distill(recipe, out, progress=False)
    trained = load_file(out / "student" / "model.safetensors")
    teacher, _, _ = load_teacher(str(tiny_setup[0]))
    s = recipe.student
    fresh = convert(
        teacher, [s.mixer] * teacher.config.num_hidden_layers, {s.mixer: dict(s.mixer_options)}
    ).state_dict()
    shared = fresh.keys() & trained.keys()  # tied weights are saved once
    changed = {k for k in shared if not torch.equal(fresh[k], trained[k])}
    maps = {k for k in shared if ".feature_map_" in k}
    assert maps and any(".conv." in k for k in shared) and any(".gate." in k for k in shared)
    assert changed and changed <= maps, sorted(changed - maps)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("train_cos" in r for r in records if r.get("stage") == "hedgehog_transfer")


def test_recipe_end_to_end_gives_a_loadable_hedgemamba_student(run_overrides, tmp_path):
    out = tmp_path / "run"
    distill(_tiny(run_overrides, [128, 256]), out, progress=False)
    student = Attn2SSMForCausalLM.from_pretrained(out / "student")
    assert student.config.layer_plan == ["hedgemamba", "hedgemamba"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stages = {r["stage"] for r in records if "stage" in r}
    assert stages == {"hedgehog_transfer", "finetune"}
    assert all("train_ce" in r for r in records if r.get("stage") == "finetune")
    with torch.no_grad():
        logits = student(input_ids=torch.randint(0, 200, (1, 12))).logits
    assert torch.isfinite(logits).all()

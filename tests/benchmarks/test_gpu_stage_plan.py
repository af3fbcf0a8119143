"""distill_on_gpu.py's plan from a probe as a GPU gives it (memory readings, an OOM point): each stage
of the recipe at its own block length, its step from the measured memory, activation checkpointing
off where a block fits without it, the square-root learning rate, budgets in the recipe's split,
and the ``--set`` overrides that carry it all to ``attn2ssm distill``."""

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import distill_on_gpu as gpu  # noqa: E402

GIB = 1 << 30


def _args(**kw):
    base = dict(
        skip_optional=False,
        optional_share=0.5,
        length_divisor=1,
        max_step_tokens=1 << 17,
        safety=0.8,
        max_tokens=0,
        probe_tokens=1 << 16,
    )
    return argparse.Namespace(**{**base, **kw})


def test_gdn_hybrid25_s_stages_lengths_and_probe_points():
    recipe = gpu.recipe_dict("gdn_hybrid25")
    stages = gpu.trained_stages(recipe, _args())
    # its own lengths; the optional long_kd on with half the others' 65,536 tokens
    assert [(s["name"], s["length"], s["weight"]) for s in stages] == [
        ("hidden_alignment", 1024, 49152),
        ("finetune", 1024, 16384),
        ("long_kd", 4096, 32768),
    ]
    assert gpu.probe_points(stages, [1024, 2048, 4096]) == ["0@1024", "1@1024", "2@4096", "2@2048"]
    assert [s["name"] for s in gpu.trained_stages(recipe, _args(skip_optional=True))] == [
        "hidden_alignment",
        "finetune",
    ]


def test_the_plan_sizes_each_stage_from_the_measured_memory():
    recipe = gpu.recipe_dict("gdn_hybrid25")
    stages = gpu.trained_stages(recipe, _args())
    probe = {
        "student_step": {
            # layer-local: little memory a token -> the largest step, 128 blocks
            "0@1024": {"tokens_per_s": 40000.0, "base_bytes": 2 * GIB, "bytes_per_token": 64 * 1024},
            # 0.85 x 140 GiB - 4 GiB = 115 GiB; 8 MiB a token -> 14,720 tokens -> 14 blocks of 1024
            "1@1024": {"tokens_per_s": 20000.0, "base_bytes": 4 * GIB, "bytes_per_token": 8 << 20},
            # 40 MiB a token: not one 4096-token block fits -> checkpointing kept, one block a step
            "2@4096": {"tokens_per_s": 10000.0, "base_bytes": 4 * GIB, "bytes_per_token": 40 << 20},
            "2@2048": {"error": "CUDA out of memory", "oom": True},
        }
    }
    plan = gpu.make_plan(recipe, stages, probe, _args(), seconds=100, capacity=140 * GIB)
    s0, s1, s2 = plan["stages"]
    assert (s0["batch_size"], s1["batch_size"], s2["batch_size"]) == (128, 14, 1)
    assert s1["gradient_checkpointing"] is False and s2["gradient_checkpointing"] is True
    # lr: the recipe's rate x sqrt(step / recipe step), capped at 4: 64x the recipe's 2 blocks -> x4;
    # 14 blocks against 2 -> x sqrt(7); long_kd one 4096-token block as the recipe -> x1
    assert s0["lr"] == pytest.approx(1e-2 * 4) and s1["lr"] == pytest.approx(3e-4 * 7**0.5)
    assert s2["lr"] == pytest.approx(3e-4)
    # budgets: s = 0.8 x 100 / (49152/40000 + 16384/20000 + 32768/10000) = 80 / 5.3248 = 15.024 tokens a
    # weight token: 738,462 / 246,154 / 492,308 -> whole steps of 131,072 / 14,336 / 4,096
    assert [s["steps"] for s in plan["stages"]] == [5, 17, 120]
    assert [s["tokens"] for s in plan["stages"]] == [5 * 131072, 17 * 14336, 120 * 4096]
    sets = plan["sets"]
    assert (
        "stages.1.batch_size=14" in sets
        and "stages.2.tokens=491520" in sets
        and "stages.1.gradient_checkpointing=false" in sets
    )
    assert "stages.2.gradient_checkpointing=true" in sets and "stages.2.grad_accum=1" in sets
    assert not any(s.startswith("stages.0.gradient_checkpointing") for s in sets)  # layer-local: never set
    assert f"stages.0.optim.lr={4e-2:.6g}" in sets


def test_a_skipped_optional_stage_stays_off_and_a_probe_without_steps_stops_in_one_line():
    recipe = gpu.recipe_dict("linear_hybrid25")
    stages = gpu.trained_stages(recipe, _args(skip_optional=True))
    probe = {"student_step": {"0@2048": {"tokens_per_s": 1000.0}, "1@2048": {"tokens_per_s": 1000.0}}}
    plan = gpu.make_plan(recipe, stages, probe, _args(max_step_tokens=4096), seconds=10, capacity=None)
    assert [s["batch_size"] for s in plan["stages"]] == [2, 2]  # no memory reading: --max-step-tokens
    assert not any(s.startswith("stages.2.") for s in plan["sets"])  # its tokens: 0 stays
    with pytest.raises(SystemExit, match="the probe measured no student step"):
        gpu.make_plan(recipe, stages, {"student_step": {"0@2048": {"error": "x"}}}, _args(), 10, None)


def test_a_stage_whose_probe_ran_out_of_memory_takes_half_the_probe_s_step_as_the_recipe_sets_it():
    recipe = gpu.recipe_dict("gdn_hybrid25")
    long_kd = gpu.trained_stages(recipe, _args())[2]
    row = {"error": "CUDA out of memory", "oom": True}
    sized = gpu.size_stage(long_kd, recipe["stages"][2], row, _args(), capacity=140 * GIB)
    # 2^16 probe tokens = 16 blocks of 4096 ran out: 8 a step, with the recipe's checkpointing (true)
    assert (sized["batch_size"], sized["gradient_checkpointing"]) == (8, True)
    assert sized["lr"] == pytest.approx(3e-4 * 8**0.5)

"""Recipes: strict keys, overrides, built-in recipes, schedules."""

import pytest

from attn2ssm.config import apply_overrides, parse_value
from attn2ssm.distill.recipe import Recipe, builtin_recipes, load_recipe, validate_for_teacher
from attn2ssm.distill.schedules import lr_multiplier
from attn2ssm.errors import ConfigError, DataError, UnsupportedModelError


def test_builtin_recipes_load():
    names = builtin_recipes()
    assert "quickstart" in names
    for name in names:
        r = load_recipe(name)
        assert isinstance(r, Recipe) and r.stages


def test_overrides_reach_nested_fields_and_list_items():
    r = load_recipe(
        "quickstart",
        [
            "data.block_len=128",
            "stages.0.tokens=1e4",
            "stages.0.optim.lr=3e-4",
            "student.keep_attention=[0, 3]",
        ],
    )
    assert r.data.block_len == 128 and r.stages[0].tokens == 10000 and isinstance(r.stages[0].tokens, int)
    assert r.stages[0].optim.lr == 3e-4 and r.student.keep_attention == [0, 3]


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_recipe("quickstart", ["data.blokc_len=5"])
    msg = str(err.value)
    assert "'blokc_len'" in msg and "block_len" in msg and "corpus" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="valid keys"):
        load_recipe("quickstart", ["stages.0.nonsense=1"])


def test_bad_override_syntax_and_index():
    with pytest.raises(ConfigError, match="no '='"):
        apply_overrides({}, ["data.block_len"])
    with pytest.raises(ConfigError, match="index"):
        apply_overrides({"stages": [{}]}, ["stages.3.tokens=1"])


def test_type_errors_are_reported():
    with pytest.raises(ConfigError, match="must be int"):
        load_recipe("quickstart", ["data.block_len=abc"])
    with pytest.raises(ConfigError, match="unknown kind"):
        load_recipe("quickstart", ["stages.0.kind=magic"])


@pytest.mark.parametrize(
    "override",
    [
        "stages.0.optim.lr=-1",
        "stages.0.optim.lr=.nan",
        "stages.0.optim.lr=.inf",
        "stages.0.optim.beta1=1",
        "stages.0.optim.beta2=-0.1",
        "stages.0.optim.eps=0",
        "stages.0.optim.weight_decay=-0.01",
        "stages.0.schedule.warmup=-1",
        "stages.0.schedule.decay=-0.5",
        "stages.0.schedule.min_lr_ratio=1.5",
        "stages.0.clip=-1",
        "stages.0.temperature=0",
        "stages.0.kl_chunk=0",
        "stages.0.eval_every=-1",
        "stages.0.eval_batches=0",
        "stages.0.save_every=-5",
        "stages.0.keep_checkpoints=0",
        "stages.0.lora.r=0",
        "stages.0.lora.dropout=1",
        "eval.window=1",
        "eval.stride=0",
        "eval.batch_size=0",
        "eval.max_tokens=1",
    ],
)
def test_numbers_out_of_range_fail_when_the_recipe_loads(override):
    """What torch would refuse after the teacher has loaded (AdamW's lr, betas, eps), or take and misbehave with."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_recipe("quickstart", [override])
    msg = str(err.value)
    assert "out of range" in msg and f"set {key} to" in msg and "\n" not in msg, msg


def test_numbers_at_the_edges_of_their_ranges_are_fine():
    r = load_recipe(
        "quickstart",
        [
            "stages.0.optim.lr=0",
            "stages.0.optim.beta1=0",
            "stages.0.optim.weight_decay=0",
            "stages.0.schedule.warmup=0",
            "stages.0.schedule.min_lr_ratio=1",
            "stages.0.clip=0",
            "stages.0.save_every=0",
            "eval.window=2",
            "eval.stride=2",
        ],
    )
    assert r.stages[0].clip == 0 and r.eval.stride == 2


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["student.mixer=mamba3"], ("student.mixer='mamba3' is not a mixer", "mamba2")),
        (["student.attention_ratio=1.5"], ("student.attention_ratio=1.5 is outside [0, 1]",)),
        (["student.attention_ratio=-0.25"], ("outside [0, 1]",)),
        (["student.keep_attention=[0, -1]"], ("student.keep_attention has entries [-1]",)),
        (["student.depth=4", "student.keep_attention=[1, 4]"], ("entries [4]", "0..3 (student.depth 4)")),
        (
            ["student.mixer=mamba2", "student.mixer_options={feature_map: elu}"],
            ("unknown option feature_map for mixer 'mamba2'", "d_conv"),
        ),
        (["student.mixer_options=3"], ("student.mixer_options must be a mapping",)),
    ],
)
def test_student_plan_errors_fail_when_the_recipe_loads(overrides, needles):
    with pytest.raises(ConfigError) as err:
        load_recipe("quickstart", overrides)
    msg = str(err.value)
    assert all(needle in msg for needle in needles) and "\n" not in msg, msg


def test_image_recipes_take_encoder_mixers_only():
    with pytest.raises(
        ConfigError, match="student.mixer='mamba2' is not a mixer for an image recipe — use one of: bimamba"
    ):
        load_recipe("cab_vision", ["student.mixer=mamba2"])


@pytest.mark.parametrize(
    ("overrides", "error", "needles"),
    [
        (
            ["data.block_len=100"],
            DataError,
            ("block length 100 exceeds the model's maximum of 64", "data.block_len"),
        ),
        (
            ["data.block_len=32", "eval.window=100"],
            ConfigError,
            ("eval.window 100 exceeds the teacher's maximum of 64",),
        ),
        (
            ["data.block_len=32", "eval.window=32", "student.keep_attention=[1, 2]"],
            ConfigError,
            ("keep_attention has layer indices [2] outside 0..1",),
        ),
        (["data.block_len=32", "eval.window=32", "student.depth=3", "student.keep_attention=[2]"], None, ()),
        (
            ["data.block_len=32", "eval.window=32", "student.mixer_options={feature_map: bogus}"],
            ConfigError,
            ("unknown feature map 'bogus'",),
        ),
        (
            [
                "data.block_len=32",
                "eval.window=32",
                "student.mixer=mamba2",
                "student.mixer_options={norm: true, norm_eps: auto, conv_activation: relu}",
            ],
            ConfigError,
            ("conv_activation='relu' is not supported",),
        ),
    ],
)
def test_checks_against_the_teachers_config(overrides, error, needles):
    """``validate_for_teacher``: the teacher's config alone (no weights) bounds blocks, windows and
    layer indices, and one mixer built on the meta device checks the option values."""
    from tiny_models import tiny_config

    config = tiny_config("llama")  # 2 layers
    config.max_position_embeddings = 64
    recipe = load_recipe("quickstart", overrides)
    if error is None:
        validate_for_teacher(recipe, config)
        return
    with pytest.raises(error) as err:
        validate_for_teacher(recipe, config)
    assert all(needle in str(err.value) for needle in needles) and "\n" not in str(err.value), str(err.value)


def test_an_unsupported_teacher_fails_on_its_config():
    from transformers import BertConfig

    with pytest.raises(UnsupportedModelError, match="'bert'"):
        validate_for_teacher(
            load_recipe("quickstart", ["data.block_len=32", "eval.window=32"]), BertConfig(is_decoder=True)
        )


def test_mixed_precision_values(tmp_path):
    """YAML 1.1 reads a bare `no` as false: it means no mixed precision, in a file and in --set."""
    path = tmp_path / "r.yaml"
    path.write_text("mixed_precision: no\nstages: [{kind: kd, tokens: 8}]\n")
    assert load_recipe(str(path)).mixed_precision == "no"
    assert load_recipe("quickstart", ["mixed_precision=no"]).mixed_precision == "no"
    assert load_recipe("quickstart", ["mixed_precision=bf16"]).mixed_precision == "bf16"
    with pytest.raises(ConfigError) as err:
        load_recipe("quickstart", ["mixed_precision=bf17"])
    assert (
        "unknown precision 'bf17'" in str(err.value)
        and "bf16" in str(err.value)
        and "\n" not in str(err.value)
    )


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("name: x\nstages: [\n", ("not valid YAML", "line 3")),
        ("- a\n- b\n", ("must hold a mapping",)),
        ("a: 1\n\tb: 2\n", ("not valid YAML", "line 2")),
    ],
)
def test_a_malformed_recipe_file_is_one_line(tmp_path, text, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_recipe(str(path))
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg and " — " in msg
    assert all(needle in msg for needle in needles), msg


def test_a_malformed_override_value_is_one_line():
    with pytest.raises(ConfigError, match=r"value '\[' is not valid YAML") as err:
        load_recipe("quickstart", ["data.corpus=["])
    assert "\n" not in str(err.value)


def test_parse_value():
    assert parse_value("1e5") == 100000.0 and parse_value("12") == 12 and parse_value("true") is True
    assert parse_value("[1, 2]") == [1, 2] and parse_value("null") is None and parse_value("elu") == "elu"


def test_schedules():
    f = lr_multiplier("warmup_cosine", 100, 0.1, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)  # halfway through the cosine
    w = lr_multiplier("wsd", 100, 0.1, decay=0.2, min_ratio=0.0)
    assert w(50) == 1.0 and w(79) == 1.0 and w(89) == pytest.approx(0.5) and w(99) == pytest.approx(0.0)
    c = lr_multiplier("constant", 10, 0)
    assert all(c(i) == 1.0 for i in range(10))


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["student.mixer_options.window=abc"], "option window='abc' is not an integer >= 0"),
        (["student.mixer_options.chunk_size=abc"], "option chunk_size='abc' is not a positive integer"),
        (["student.mixer_options.chunk_size=0"], "option chunk_size=0 is not a positive integer"),
        (
            ["student.mixer=mamba", "student.mixer_options={dt_min: abc}"],
            "option dt_min='abc' is not a positive number",
        ),
        (
            ["student.mixer=mamba2", "student.mixer_options={d_conv: -3}"],
            "option d_conv=-3 is not an integer >= 0",
        ),
    ],
)
def test_mixer_option_types_fail_when_the_recipe_loads(overrides, needle):
    """The type check ``convert --option`` makes (mixers/options.py), before any teacher is read."""
    with pytest.raises(ConfigError) as err:
        load_recipe("quickstart", overrides)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_null_corpus_with_no_sources_is_an_error_naming_the_choices():
    with pytest.raises(ConfigError) as err:
        load_recipe("quickstart", ["data.corpus=null"])
    msg = str(err.value)
    assert "data.corpus is null" in msg and "sotu" in msg and "mix:general" in msg and "data.sources" in msg
    assert "\n" not in msg
    mixture = load_recipe("quickstart", ["data.corpus=null", "data.sources=[{corpus: sotu}, {corpus: kjv}]"])
    assert mixture.data.corpus is None and len(mixture.data.sources) == 2
    assert Recipe().data.corpus == "sotu"  # left out, it is still the default


def test_a_type_error_names_the_type_with_its_article():
    with pytest.raises(ConfigError, match="set recipe.data.block_len to an int$"):
        load_recipe("quickstart", ["data.block_len=abc"])
    with pytest.raises(ConfigError, match="set recipe.teacher to a str$"):
        load_recipe("quickstart", ["teacher=[1, 2]"])

"""Mixer options checked against the types each mixer's constructor declares (mixers/options.py):
one check for ``convert --option`` and a recipe's ``student.mixer_options``."""

import pytest

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.options import describe, option_types
from attn2ssm.mixers.registry import ENCODER_MIXERS, MIXERS, build_mixer, check_mixer_options

GEOMETRY = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "head_dim": 16}


@pytest.mark.parametrize(
    ("kind", "options", "needle"),
    [
        ("linear_attention", {"window": "abc"}, "option window='abc' is not an integer >= 0"),
        ("linear_attention", {"chunk_size": "abc"}, "option chunk_size='abc' is not a positive integer"),
        ("linear_attention", {"chunk_size": 0}, "option chunk_size=0 is not a positive integer"),
        ("linear_attention", {"chunk_size": 2.5}, "option chunk_size=2.5 is not a positive integer"),
        ("linear_attention", {"eps": 0.0}, "option eps=0.0 is not a positive number"),
        ("mamba", {"dt_min": "abc"}, "option dt_min='abc' is not a positive number"),
        ("mamba", {"gate": "yes"}, "option gate='yes' is not true or false"),
        ("mamba", {"d_state": True}, "option d_state=True is not a positive integer or null"),
        ("mamba2", {"a_init_range": [1.0]}, "option a_init_range=[1.0] is not a list of 2 numbers"),
        ("mamba2", {"norm_eps": "abc"}, "option norm_eps='abc' is not a number or auto"),
        ("gated_delta", {"rope": 3}, "option rope=3 is not a string"),
        ("hedgemamba", {"A_init": float("nan")}, "option A_init=nan is not a number"),
        ("bimamba", {"expand": -1}, "option expand=-1 is not a positive integer"),
        ("linear_attention", {"dt_min": 1e-3}, "unknown option dt_min for mixer 'linear_attention'"),
        ("bogus", {}, "unknown mixer 'bogus'"),
    ],
)
def test_a_wrong_option_is_one_line_naming_it_and_its_type(kind, options, needle):
    with pytest.raises(ConfigError) as err:
        check_mixer_options(kind, options)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert " — " in str(err.value)
    with pytest.raises(ConfigError):  # building one is the same check
        build_mixer(kind, GEOMETRY, 0, options)


def test_good_values_pass_and_numbers_yaml_read_as_text_become_numbers():
    options = {"dt_min": "1e-3", "norm_eps": "auto", "chunk_size": 32.0, "a_init_range": [-8, -7]}
    checked = check_mixer_options("mamba2", options)
    assert checked == {"dt_min": 1e-3, "norm_eps": "auto", "chunk_size": 32, "a_init_range": [-8, -7]}
    assert type(checked["chunk_size"]) is int
    mixer = build_mixer("mamba2", GEOMETRY, 0, {"dt_min": "1e-3", "chunk_size": 32.0})
    assert mixer.chunk_size == 32
    assert check_mixer_options("mamba", {"d_state": None, "conv_activation": None}) == {
        "d_state": None,
        "conv_activation": None,
    }


@pytest.mark.parametrize("kind", sorted({**MIXERS, **ENCODER_MIXERS}))
def test_every_declared_option_type_is_one_the_checker_knows(kind):
    """A new option with a type the checker cannot read would pass unchecked: each has a description."""
    cls = {**MIXERS, **ENCODER_MIXERS}[kind]
    for name, (tp, _) in option_types(cls).items():
        assert describe(tp) != "a value", (kind, name, tp)
        assert check_mixer_options(kind, {name: option_types(cls)[name][1]}) is not None

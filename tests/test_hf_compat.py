"""The student against transformers' moving parts (attn2ssm/hf_compat.py): the cache reaches
every mixer whatever transformers calls it, ``generate``'s cached steps equal full forwards for
every mixer kind, a mixer that misses its cache in a cached forward is an error (never a
stateless decode), and an untested transformers release is named in one warning line."""

import logging

import pytest
import torch

from attn2ssm import hf_compat
from attn2ssm.mixers.base import MixerContext
from attn2ssm.mixers.registry import MIXERS
from tiny_models import tiny_student

KINDS = sorted(MIXERS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_generate_steps_equal_full_forwards(kind, ratio):
    """Every logit row generate computes from its cache equals a full forward over the same text."""
    model = tiny_student("llama", kind, ratio)
    prompt = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    out = model.generate(
        prompt,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        full = model(input_ids=out.sequences, use_cache=False).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, prompt.shape[1] - 1 + step], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_cache_is_taken_under_either_name(name):
    model = tiny_student("llama", "mamba2")
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{name: cache})
    assert hf_compat.output_cache(out) is cache and cache.get_seq_length() == 5
    with pytest.raises(ValueError, match="not both"):
        model(input_ids=ids, cache=cache, past_key_values=model.new_cache())


class _Deaf(MixerContext):
    """A context that never shows its cache (what a renamed argument did to the old code)."""

    cache = property(lambda self: None, lambda self, value: None)


def test_a_mixer_without_its_cache_in_a_cached_forward_is_an_error(monkeypatch):
    model = tiny_student("llama", "linear_attention")
    deaf = _Deaf()
    for mixer in model.mixers().values():
        mixer.context = deaf
    model.mixer_context = deaf
    monkeypatch.setattr("attn2ssm.mixers.base.explicit_cache", lambda kwargs: None)
    ids = torch.randint(3, 256, (1, 5))
    with pytest.raises(RuntimeError, match="did not update its recurrent state") as info:
        model(input_ids=ids, use_cache=True)
    assert "attn2ssm upgrade" in str(info.value) and "\n" not in str(info.value)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # no cache asked for: nothing to check


def test_a_foreign_cache_is_refused_by_a_mixer():
    from transformers import DynamicCache

    model = tiny_student("llama", "mamba")
    mixer = model.mixers()[0]
    x = torch.randn(1, 3, model.config.hidden_size)
    with pytest.raises(TypeError, match="model.new_cache"):
        mixer(x, cache=DynamicCache())


@pytest.mark.parametrize(
    "version,untested",
    [
        ("5.23.0", False),
        ("5.24.0", False),
        ("5.24.1.dev0", False),
        ("5.22.2", True),
        ("5.25.0", True),
        ("6.0.0", True),
        ("5.25.0.dev0", True),
    ],
)
def test_untested_transformers_is_named_in_one_line(version, untested):
    message = hf_compat.untested_transformers(version)
    assert (message is not None) == untested
    if untested:
        low, high = hf_compat.TESTED_TRANSFORMERS
        assert version in message and f">={low},<{high}" in message and "\n" not in message


def test_the_warning_is_logged_once_at_import(monkeypatch, caplog):
    monkeypatch.setattr(hf_compat.transformers, "__version__", "9.0.0")
    monkeypatch.setattr(
        hf_compat, "untested_transformers", lambda version="9.0.0": f"tested range, this is {version}"
    )
    with caplog.at_level(logging.WARNING, logger="attn2ssm"):
        hf_compat.warn_if_untested()
    assert [r.getMessage() for r in caplog.records] == ["tested range, this is 9.0.0"]


def test_the_tested_range_is_the_one_pyproject_allows():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    spec = next(d for d in project["dependencies"] if d.startswith("transformers"))
    low, high = hf_compat.TESTED_TRANSFORMERS
    assert spec.replace(" ", "") == f"transformers>={low},<{high}"

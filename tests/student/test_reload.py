"""save_pretrained → from_pretrained gives back the same student for every mixer kind and every
option that changes what a mixer holds (parameters, buffers) or computes.

transformers builds a model on the meta device before it loads the weights, so a mixer whose
``__init__`` reads a tensor's value (``.item()``) cannot be loaded at all, and a buffer computed in
``__init__`` but not saved (``persistent=False``) comes back as uninitialised memory. Each case
here is a tiny Llama student (GQA, RoPE) with the mixers' new parameters moved off their init
(``tiny_student``), so a parameter that is re-initialised instead of loaded changes the logits.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers the Auto classes)
from attn2ssm.mixers.feature_maps import FEATURE_MAPS
from tiny_models import tiny_student

LA = "linear_attention"
CASES = (
    # linear attention: every feature map, the options that add parameters or buffers, RoPE off,
    # the sliding softmax window (its per-head γ)
    [(LA, {"feature_map": name}) for name in sorted(FEATURE_MAPS)]
    + [
        (LA, {"feature_map": "taylor", "feature_map_options": {"symmetric": True}}),
        (LA, {"feature_map": "hedgehog", "feature_map_options": {"feature_dim": 24, "activation": "exp"}}),
        (LA, {"feature_map": "t2r", "feature_map_options": {"feature_dim": 24}}),
        (LA, {"feature_map": "performer", "feature_map_options": {"num_features": 12, "seed": 3}}),
        (LA, {"feature_map": "elu", "rope": "none"}),
        (LA, {"feature_map": "hedgehog", "window": 4}),
        (LA, {"feature_map": "elu", "window": 3, "window_gamma": 0.8}),
        # Mamba: groups / copies, the extras off, RoPE on, sanity (no Δ, A), A ≈ 0
        ("mamba", {}),
        ("mamba", {"d_state": None, "expand": 2, "dt_rank": 3}),
        ("mamba", {"gate": False, "D": False, "d_conv": 0, "conv_activation": None}),
        ("mamba", {"rope": "before", "A_init": -1e-4, "D_init": 0.5}),
        ("mamba", {"sanity": True}),
        # Mamba-2 and discrete Mamba-2: gated norm, the extras off, RoPE, sanity
        ("mamba2", {}),
        ("mamba2", {"norm": True, "rope": "before", "A_init": -1e-4}),
        ("mamba2", {"norm": True, "norm_eps": 1e-5}),
        ("mamba2", {"gate": False, "D": False, "d_conv": 0}),
        ("mamba2", {"sanity": True}),
        ("discrete_mamba2", {}),
        ("discrete_mamba2", {"norm": True, "D": False}),
        ("discrete_mamba2", {"sanity": True}),
        # HedgeMamba: the extras off, RoPE placements, another map (with buffers)
        ("hedgemamba", {}),
        ("hedgemamba", {"decay": False, "d_conv": 0, "gate": False}),
        ("hedgemamba", {"rope": "after_map", "A_init": -0.1}),
        ("hedgemamba", {"rope": "none", "feature_map": "taylor", "feature_map_options": {"symmetric": True}}),
        ("hedgemamba", {"feature_map": "performer"}),
    ]
)


def _name(case) -> str:
    kind, options = case
    return kind + "".join(f"-{k}={v}" for k, v in options.items()).replace(" ", "")


@pytest.mark.parametrize("kind, options", CASES, ids=[_name(c) for c in CASES])
def test_saved_student_loads_back_with_the_same_logits(kind, options, tmp_path):
    student = tiny_student("llama", kind, options=options)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = student(input_ids=ids, use_cache=False).logits
    student.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(student)
    mine, theirs = dict(student.named_buffers()), dict(loaded.named_buffers())
    assert mine.keys() == theirs.keys()
    for name, buffer in mine.items():  # saved or not, every buffer is what the student had
        assert torch.equal(theirs[name], buffer), name
    for name, param in student.named_parameters():
        assert torch.equal(loaded.get_parameter(name), param), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, expected, rtol=0, atol=0)

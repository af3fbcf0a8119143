"""``rope: window`` of linear_attention: the softmax window reads rotated q/k, the feature maps the
unrotated ones — its pieces are the other two modes' pieces, and its forms agree."""

import pytest
import torch

from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert
from cache_forms import full_and_pieces
from tiny_models import tiny_model

OPTIONS = {"feature_map": "hedgehog", "window": 4, "decay": True, "decay_horizon": 8.0}


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("gqa_9x3", layers=3)


def _students(teacher, **extra):
    made = {}
    for rope in ("before_map", "none", "window"):
        options = {**OPTIONS, **extra, "rope": rope}
        made[rope] = convert(teacher, ["linear_attention"] * 3, {"linear_attention": options}).eval()
    for other in ("none", "window"):
        made[other].load_state_dict(made["before_map"].state_dict())
    return made


def test_the_window_reads_rotated_keys_and_the_maps_unrotated_ones(teacher):
    made = _students(teacher)
    u = torch.randn(2, 11, teacher.config.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(11)[None].expand(2, -1)
    pe = teacher.model.rotary_emb(u, pos)
    rotated, plain, mine = (
        made[r].mixers()[1]._qkv_features(u, pe) for r in ("before_map", "none", "window")
    )
    for a, b in zip(mine[:3], rotated[:3]):  # q, k, v as the teacher rotates them: the window's scores
        torch.testing.assert_close(a, b)
    for a, b in zip(mine[3:], plain[3:]):  # φq, φk of the unrotated q, k
        torch.testing.assert_close(a, b)
    assert not torch.allclose(mine[3], rotated[3])  # the positions really left the features


def test_rope_window_forms_agree_prefill_pieces_and_decode(teacher):
    student = _students(teacher)["window"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 13), generator=g)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        full, pieces = full_and_pieces(student, ids, mask, [5, 3, 5])
        torch.testing.assert_close(pieces, full, atol=1e-4, rtol=1e-4)
        full, stepped = full_and_pieces(student, ids, mask, [6] + [1] * 7)
        torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("branch", ["both", "window"])
def test_the_one_token_window_step_decodes_as_the_full_forward_in_either_branch(teacher, branch):
    """Past a full window every token takes the window step (``can_step``); with the window branch
    alone (the features zeroed, as the sequence form zeroes them) it steps aside to the block form."""
    from attn2ssm.mixers.linear_attention import set_window_branch

    student = _students(teacher)["window"]
    set_window_branch(student, branch)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(1, 10, dtype=torch.long)
    with torch.no_grad():
        full, stepped = full_and_pieces(student, ids, mask, [4] + [1] * 6)
        torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4)
        cache = student.new_cache()
        student(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
        layer = cache.mixer_layer(1)
        assert student.mixers()[1].can_step(layer) == (branch == "both")
        u = torch.randn(1, 1, teacher.config.hidden_size, generator=torch.Generator().manual_seed(4))
        pe = teacher.model.rotary_emb(u, torch.tensor([[4]]))
        mixer = student.mixers()[1]
        stepped_y, stepped_states = mixer.step(u, pe, dict(layer.states))
        mixed_y = mixer.mix(u, pe, layer)  # the block form over one token (the layer's states advance)
        torch.testing.assert_close(stepped_y, mixed_y, atol=1e-5, rtol=1e-5)
        for name in ("kv", "k_sum", "keys", "values", "fkeys", "valid"):
            torch.testing.assert_close(
                getattr(stepped_states["window"], name),
                getattr(layer.states["window"], name),
                atol=1e-5,
                rtol=1e-5,
            )


def test_rope_window_without_a_window_is_one_line(teacher):
    with pytest.raises(ConfigError, match="rope=window needs a softmax window"):
        convert(teacher, ["linear_attention"] * 3, {"linear_attention": {"rope": "window"}})
    with pytest.raises(ConfigError, match="before_map \\(default\\), window or none"):
        convert(teacher, ["linear_attention"] * 3, {"linear_attention": {"rope": "after"}})

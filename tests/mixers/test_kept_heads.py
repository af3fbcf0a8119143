"""Head-level hybrids (mixers/kept_heads.py): a few KV groups of a linear_attention layer keep exact
softmax attention. Every group kept is the teacher's attention; none kept is the plain mixer; one
full forward = chunked prefill in pieces = prefill then token-by-token decode, with left padding."""

import pytest
import torch

from attn2ssm.adapters.capture import capture_attention_io
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.kept_heads import KIND, KeptHeadsMixer, head_level_plan, parse_kept_heads
from attn2ssm.mixers.registry import check_mixer_options
from attn2ssm.ops.softmax_attention import softmax_attention, softmax_attention_weights
from attn2ssm.student.convert import convert
from cache_forms import full_and_pieces
from tiny_models import tiny_model

WINDOWED = {"feature_map": "hedgehog", "window": 4}


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("gqa_9x3", layers=3)


def _student(teacher, kept, options=WINDOWED):
    plan, by_kind = head_level_plan(["linear_attention"] * 3, options, kept)
    student = convert(teacher, plan, by_kind).eval()
    for m in student.mixers().values():  # the window's γ off its init, so a wrong head shows
        if getattr(m, "window", 0):
            torch.nn.init.normal_(m.window_factor, std=1.0, generator=torch.Generator().manual_seed(3))
    return student


def _ids_and_mask():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 13), generator=g)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0  # left padding in the second row
    return ids, mask


def test_softmax_forms_agree_with_a_cache_and_padding():
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, 6, 5, 8, generator=g),
        torch.randn(2, 2, 9, 8, generator=g),
        torch.randn(2, 2, 9, 8, generator=g),
    )
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    w = softmax_attention_weights(q, k, scaling=0.3, key_mask=mask)
    ref = w @ v.repeat_interleave(3, dim=1)
    torch.testing.assert_close(
        softmax_attention(q, k, v, scaling=0.3, key_mask=mask), ref, atol=1e-5, rtol=1e-5
    )
    assert float(w[1, :, :, :3].abs().max()) == 0.0  # pads get nothing
    assert float(w[:, :, 0, 5:].abs().max()) == 0.0  # query 0 is position 4: keys after it get nothing
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 6, 5))


def test_every_group_kept_is_the_teachers_attention(teacher):
    student = _student(teacher, {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]})
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    io = capture_attention_io(teacher, ids, [1])[1]
    mixer = student.mixers()[1]
    assert mixer.kv_heads_kept == 3
    out = mixer(io.hidden_states, position_embeddings=io.position_embeddings)[0]
    torch.testing.assert_close(out, io.output, atol=1e-5, rtol=1e-5)
    # the whole student is the teacher
    torch.testing.assert_close(student(ids).logits, teacher(ids).logits, atol=1e-4, rtol=1e-4)
    out_q, weights = mixer.forward_quadratic(io.hidden_states, io.position_embeddings)
    torch.testing.assert_close(out_q, io.output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 9, 12))


@pytest.mark.parametrize("options", [WINDOWED, {"feature_map": "hedgehog"}])
def test_no_group_kept_is_the_plain_mixer(teacher, options):
    plain = convert(teacher, ["linear_attention"] * 3, {"linear_attention": options}).eval()
    heads = convert(
        teacher,
        [KIND] * 3,
        {KIND: {**options, "softmax_kv_heads": {"7": [1]}}},  # another layer only
    ).eval()
    heads.load_state_dict(plain.state_dict())
    assert all(m.kv_heads_kept == 0 for m in heads.mixers().values())
    ids, mask = _ids_and_mask()
    torch.testing.assert_close(heads(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)


def test_one_group_changes_only_its_query_heads(teacher):
    plain, heads = _student(teacher, {}), _student(teacher, {1: [2]})
    u = torch.randn(1, 10, 72, generator=torch.Generator().manual_seed(4))
    ref, mine = plain.mixers()[1], heads.mixers()[1]
    _, w_ref = ref.forward_quadratic(u)
    _, w = mine.forward_quadratic(u)
    torch.testing.assert_close(w[:, :6], w_ref[:, :6])  # groups 0 and 1: the linear mixer's rows
    assert not torch.allclose(w[:, 6:], w_ref[:, 6:])  # group 2's three query heads: softmax
    assert mine.kept_query_heads == [6, 7, 8] and mine.kv_heads_kept == 1


@pytest.mark.parametrize(
    "options",
    [
        WINDOWED,
        {"feature_map": "hedgehog"},
        {**WINDOWED, "decay": True, "decay_horizon": 8.0, "rope": "window"},
    ],
    ids=["window", "hedgehog", "window-decay-rope-window"],
)
def test_forms_agree_prefill_pieces_and_decode(teacher, options):
    student = _student(teacher, {0: [1], 2: [0, 2]}, options)
    ids, mask = _ids_and_mask()
    with torch.no_grad():
        full, pieces = full_and_pieces(student, ids, mask, [5, 3, 5])
        torch.testing.assert_close(pieces, full, atol=1e-4, rtol=1e-4)
        full, stepped = full_and_pieces(student, ids, mask, [6] + [1] * 7)
        torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4)
    # the cache holds the kept groups' keys only: layer 2 keeps 2 of 3 groups for 13 tokens
    cache = student.new_cache()
    with torch.no_grad():
        student(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    kv = cache.mixer_layer(2).states["softmax_kv"]
    assert kv.k.shape == (2, 2, 13, 8) and kv.v.shape == (2, 2, 13, 8)
    assert "softmax_kv" not in cache.mixer_layer(1).states


def test_options_are_checked(teacher):
    # the parent's options too
    opts = check_mixer_options(KIND, {"window": 4, "softmax_kv_heads": {"0": [1]}})
    assert opts["window"] == 4
    with pytest.raises(ConfigError, match="unknown option"):
        check_mixer_options(KIND, {"windw": 4})
    with pytest.raises(ConfigError, match="outside 0..2"):
        KeptHeadsMixer(
            convert(teacher, ["attention"] * 3).config.layer_geometry[0], 0, softmax_kv_heads={"0": [3]}
        )
    with pytest.raises(ConfigError, match="distinct"):
        parse_kept_heads({"0": [1, 1]})
    with pytest.raises(ConfigError, match="not linear_attention layers"):
        head_level_plan(["attention", "linear_attention"], {}, {0: [1]})
    assert parse_kept_heads({"3": [2, 0], 1: []}) == {3: [0, 2]}


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma3", "gpt_neox", "phi", "gpt2", "qwen2"])
def test_every_group_kept_is_the_teachers_attention_in_every_family(family):
    """The first global layer (no window, no soft-capping) with all its groups kept is the teacher's
    attention: GQA / MQA, partial RoPE, q/k norms, biases, no RoPE."""
    teacher = tiny_model(family)
    n = teacher.config.num_hidden_layers
    geometry = convert(teacher, ["attention"] * n).config.layer_geometry
    i = next(j for j, g in enumerate(geometry) if not g.get("sliding_window") and not g.get("softcap"))
    kept = {i: list(range(geometry[i]["num_kv_heads"]))}
    plan, by_kind = head_level_plan(["linear_attention"] * n, {"feature_map": "hedgehog"}, kept)
    student = convert(teacher, plan, by_kind).eval()
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(6))
    io = capture_attention_io(teacher, ids, [i])[i]
    out = student.mixers()[i](io.hidden_states, position_embeddings=io.position_embeddings)[0]
    torch.testing.assert_close(out, io.output, atol=1e-5, rtol=1e-5)


def test_a_windowed_layer_cannot_keep_groups():
    teacher = tiny_model("mistral")  # every layer has a sliding window
    plan, by_kind = head_level_plan(["linear_attention"] * 2, {}, {1: [0]})
    with pytest.raises(ConfigError, match="soft-capped or windowed"):
        convert(teacher, plan, by_kind)

"""Mamba / Mamba-2 / discrete Mamba-2 mixers: attention initialisation (GQA, SmolLM2's 9×3 head
layout), sanity mode = linearised attention, and prefill / chunked prefill / decode agreement."""

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from cache_forms import full_and_pieces
from tiny_models import tiny_model

SSM_MIXERS = ["mamba", "mamba2", "discrete_mamba2"]


@pytest.fixture(scope="module")
def gqa_teacher():
    return tiny_model("gqa_9x3")


def _ids(b=2, l=12, vocab=256, seed=0):
    return torch.randint(0, vocab, (b, l), generator=torch.Generator().manual_seed(seed))


def _linearised_attention(attn, x):
    """y_t = W_O Σ_{s≤t} (q_t·k_s / √d) v_s per head, straight from a teacher attention module."""
    b, l, _ = x.shape
    h, d = attn.config.num_attention_heads, attn.head_dim
    kv = attn.config.num_key_value_heads
    q = attn.q_proj(x).view(b, l, h, d).transpose(1, 2)
    k = attn.k_proj(x).view(b, l, kv, d).transpose(1, 2).repeat_interleave(h // kv, 1)
    v = attn.v_proj(x).view(b, l, kv, d).transpose(1, 2).repeat_interleave(h // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    scores = scores * torch.tril(torch.ones(l, l))
    y = (scores @ v).transpose(1, 2).reshape(b, l, h * d)
    return attn.o_proj(y)


@pytest.mark.parametrize(
    "kind,options", [("mamba2", {}), ("discrete_mamba2", {}), ("mamba", {"d_state": None})]
)
def test_sanity_mode_is_linearised_attention(kind, options, gqa_teacher):
    """Mamba in the Llama §1.3: with A = 1, no discretisation and no conv/gate/D, the attention-initialised
    SSM reproduces y_t = q_t · Σ k_s v_sᵀ / √d exactly (GQA: 9 query heads over 3 kv heads)."""
    student = convert(gqa_teacher, [kind] * 2, {kind: {**options, "sanity": True}})
    x = torch.randn(2, 11, gqa_teacher.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for i, mixer in student.mixers().items():
        attn = gqa_teacher.model.layers[i].self_attn
        out, _ = mixer(x)
        torch.testing.assert_close(out, _linearised_attention(attn, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", SSM_MIXERS)
def test_gqa_initialisation_from_attention(kind, gqa_teacher):
    """C ← W_Q (query width), B ← W_K and x ← W_V (kv width, repeated over the 3-head groups), out ← W_O."""
    student = convert(gqa_teacher, [kind] * 2)
    mixer = student.mixers()[0]
    attn = gqa_teacher.model.layers[0].self_attn
    for mine, theirs in (
        (mixer.q_proj, attn.q_proj),
        (mixer.k_proj, attn.k_proj),
        (mixer.v_proj, attn.v_proj),
        (mixer.o_proj, attn.o_proj),
    ):
        assert torch.equal(mine.weight, theirs.weight)
    assert (
        mixer.q_proj.weight.shape == (72, 72)
        and mixer.k_proj.weight.shape == (24, 72)
        and mixer.v_proj.weight.shape == (24, 72)
    )
    x = torch.randn(1, 5, 72)
    q, k, v = mixer.project_heads(x)
    rk, rv = mixer.repeat_kv(k, 2), mixer.repeat_kv(v, 2)
    for head in range(9):  # query head j reads kv head j // 3, like the teacher's repeat_kv
        assert torch.equal(rk[:, :, head], k[:, :, head // 3]) and torch.equal(
            rv[:, :, head], v[:, :, head // 3]
        )


@pytest.mark.parametrize("kind", SSM_MIXERS)
def test_new_parameters_start_where_designed(kind, gqa_teacher):
    student = convert(gqa_teacher, [kind] * 2)
    mixer = student.mixers()[1]
    assert torch.equal(mixer.conv.weight[:, -1], torch.ones(mixer.conv.weight.shape[0]))
    assert not mixer.conv.weight[:, :-1].any() and not mixer.conv.bias.any()
    x = torch.randn(3, 4, 72)
    torch.testing.assert_close(
        F.silu(mixer.gate(x)), torch.ones(3, 4, mixer.gate.out_features), atol=1e-6, rtol=0
    )
    assert not mixer.D.any()  # D_init 0: the skip starts off, so the layer starts as linearised attention
    if kind == "mamba2":
        dt = F.softplus(mixer.dt_proj.bias)
        assert (dt >= 1e-4).all() and (dt <= 0.1 + 1e-6).all()
        assert (-torch.exp(mixer.A_log) <= -1).all() and (-torch.exp(mixer.A_log) >= -16).all()
    elif kind == "mamba":
        dt = F.softplus(mixer.dt_up.bias)
        assert (dt >= 1e-4).all() and (dt <= 0.1 + 1e-6).all()
        torch.testing.assert_close(torch.exp(mixer.A_log[0, 0]), torch.arange(1.0, mixer.d_state + 1))
    else:
        alpha = torch.exp(-F.softplus(mixer.a_proj.bias))
        assert (alpha > 0.999).all() and not mixer.a_proj.weight.any()


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi"])
@pytest.mark.parametrize("kind", SSM_MIXERS)
@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_prefill_chunked_and_decode_agree(kind, family, ratio):
    teacher = tiny_model(family)
    plan = make_plan(teacher.config.num_hidden_layers, kind, attention_ratio=ratio)
    student = convert(teacher, plan, {kind: {"chunk_size": 4}})
    with torch.no_grad():  # move off the init so Δ, A, conv, gate and D all matter
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = _ids(l=14)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    real = mask.bool()
    full, stepped = full_and_pieces(student, ids, mask, [6] + [1] * 8)
    torch.testing.assert_close(stepped[real], full[real], atol=1e-4, rtol=1e-4)
    full, chunked = full_and_pieces(student, ids, mask, [5, 3, 6])
    torch.testing.assert_close(chunked[real], full[real], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mamba2", "discrete_mamba2"])
def test_quadratic_form_matches_forward(kind, gqa_teacher):
    student = convert(gqa_teacher, [kind] * 2)
    mixer = student.mixers()[0]
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(2, 9, 72)
    mask = torch.ones(2, 9)
    mask[0, :3] = 0
    mixer.context.padding_mask = mask
    out_f, _ = mixer(x)
    out_q, M = mixer.forward_quadratic(x, mask=mask)
    mixer.context.padding_mask = None
    real = mask.bool()
    torch.testing.assert_close(out_q[real], out_f[real], atol=1e-5, rtol=1e-5)
    assert M.shape == (2, 9, 9, 9) and torch.equal(M.triu(1), torch.zeros_like(M))


def test_cache_state_is_constant_in_length(gqa_teacher):
    student = convert(gqa_teacher, ["mamba2", "mamba"])
    sizes = []
    for length in (8, 40):
        cache = student.new_cache()
        student(input_ids=_ids(l=length), past_key_values=cache, use_cache=True)
        sizes.append(sum(layer.state_bytes() for layer in cache.layers))
    assert sizes[0] == sizes[1] > 0


def test_bad_options_are_config_errors(gqa_teacher):
    with pytest.raises(ConfigError, match="d_state"):
        convert(gqa_teacher, ["mamba"] * 2, {"mamba": {"d_state": 3}})
    with pytest.raises(ConfigError, match="expand"):
        convert(gqa_teacher, ["mamba"] * 2, {"mamba": {"expand": 2, "sanity": True}})
    with pytest.raises(ConfigError, match="conv_activation"):
        convert(gqa_teacher, ["mamba2"] * 2, {"mamba2": {"conv_activation": "gelu"}})
    with pytest.raises(ConfigError, match="unknown option"):
        convert(gqa_teacher, ["mamba2"] * 2, {"mamba2": {"d_state": 16}})


@pytest.mark.parametrize("kind", ["mamba2", "discrete_mamba2"])
def test_gated_norm_eps_option(kind, gqa_teacher):
    """``norm_eps`` is the gated norm's ε (default 1e-6, as before the option): the norm is
    RMSNorm(y·SiLU(z))·w over each head with that ε, written out here; YAML's ``1e-5`` (a string)
    is read as the number; anything but a positive number is a ConfigError."""
    default = convert(gqa_teacher, [kind] * 2, {kind: {"norm": True}})
    student = convert(gqa_teacher, [kind] * 2, {kind: {"norm": True, "norm_eps": "1e-5"}})
    assert all(m.norm.eps == 1e-6 for m in default.mixers().values())
    norm = student.mixers()[0].norm
    assert norm.eps == 1e-5
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.normal_()
    y, z = 1e-3 * torch.randn(2, 5, norm.weight.numel()), torch.randn(2, 5, norm.weight.numel())
    v = (y * F.silu(z)).view(2, 5, norm.num_heads, -1)
    expected = (v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)).view(2, 5, -1) * norm.weight
    torch.testing.assert_close(norm(y, z), expected, rtol=1e-5, atol=1e-6)
    # ε matters at this scale
    assert (norm(y, z) - default.mixers()[0].norm(y, z) * norm.weight).abs().max() > 1e-3
    for bad in (0, -1e-5, "small", True):
        with pytest.raises(ConfigError, match="norm_eps"):
            convert(gqa_teacher, [kind] * 2, {kind: {"norm": True, "norm_eps": bad}})


def test_mamba_expand_adds_state_copies(gqa_teacher):
    one = convert(gqa_teacher, ["mamba"] * 2, {"mamba": {"expand": 1}})
    two = convert(gqa_teacher, ["mamba"] * 2, {"mamba": {"expand": 2}})
    c1, c2 = one.new_cache(), two.new_cache()
    ids = _ids(l=6)
    one(input_ids=ids, past_key_values=c1, use_cache=True)
    two(input_ids=ids, past_key_values=c2, use_cache=True)
    assert c2.layers[0].states["ssm"].numel() == 2 * c1.layers[0].states["ssm"].numel()


def test_random_init_draws_fresh_projections(gqa_teacher):
    """The ablation baseline: same model, mixers NOT initialised from attention."""
    student = convert(gqa_teacher, ["mamba2", "attention"], init="random")
    mixer, attn = student.mixers()[0], gqa_teacher.model.layers[0].self_attn
    assert not torch.equal(mixer.q_proj.weight, attn.q_proj.weight)
    std = mixer.q_proj.weight.std().item()
    assert (
        abs(std - gqa_teacher.config.initializer_range) < 0.05 * gqa_teacher.config.initializer_range + 0.01
    )
    assert torch.equal(
        student.base.model.layers[1].self_attn.q_proj.weight,
        gqa_teacher.model.layers[1].self_attn.q_proj.weight,
    )
    torch.testing.assert_close(F.silu(mixer.gate.bias), torch.ones_like(mixer.gate.bias))
    with pytest.raises(ConfigError, match="init"):
        convert(gqa_teacher, ["mamba2"] * 2, init="zeros")

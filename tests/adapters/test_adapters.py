"""Adapters reproduce each teacher's own attention, checked against the live HF modules.

Every comparison is against what the teacher itself computes: the attention module's output
(captured with a forward hook during a real forward, then re-run on random inputs with the
exact kwargs the model passed), and the eager attention weights from output_attentions=True.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, PretrainedConfig

from attn2ssm.adapters import (  # noqa: E402
    Adapter,
    apply_rotary,
    get_adapter,
    probs_from_qk,
    register_adapter,
    registry,  # noqa: E402
    supported_families,
)
from attn2ssm.errors import UnsupportedModelError  # noqa: E402
from tiny_models import TINY_CONFIGS, VARIANT_CONFIGS, tiny_config, tiny_model

ALL = list(TINY_CONFIGS) + list(VARIANT_CONFIGS)
FAMILY_OF = {
    **{name: name for name in TINY_CONFIGS},
    "smollm2": "llama",
    "gqa_9x3": "llama",
    "phi_qk_layernorm": "phi",
    "gpt2_layer_scaled": "gpt2",
}
BATCH, LENGTH, TOL = 2, 12, 1e-5
PAD = 3  # left padding of row 0 in the padding tests


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def model_for(name: str):
    return tiny_model(name)


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, LENGTH), generator=torch.Generator().manual_seed(seed))


def left_padding() -> torch.Tensor:
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[0, :PAD] = 0
    return mask


@torch.no_grad()
def run_and_capture(name: str, attention_mask=None, output_attentions=False):
    """Full forward; per layer: (attn module, args, kwargs, output) exactly as the model called it."""
    model = model_for(name)
    adapter = get_adapter(model)
    calls = {}
    handles = []
    for i, path in enumerate(adapter.attention_module_paths(model)):

        def hook(module, args, kwargs, output, i=i):
            calls[i] = (module, args, dict(kwargs), output[0])

        handles.append(model.get_submodule(path).register_forward_hook(hook, with_kwargs=True))
    try:
        out = model(
            ids(), attention_mask=attention_mask, output_attentions=output_attentions, use_cache=False
        )
    finally:
        for handle in handles:
            handle.remove()
    return model, adapter, calls, out


def hidden_and_rope(args, kwargs):
    hidden = args[0] if args else kwargs["hidden_states"]
    return hidden, kwargs.get("position_embeddings")


def call_module(attn, args, kwargs, hidden):
    """Re-run the teacher's attention module on new hidden states with the model's own kwargs."""
    if args:
        return attn(hidden, *args[1:], **kwargs)[0]
    return attn(**{**kwargs, "hidden_states": hidden})[0]


def recompute_output(adapter, attn, hidden, rope, attention_mask=None):
    """probs @ V -> o_proj, from the adapter's probabilities and canonical weights only."""
    geo = adapter.layer_geometry(attn)
    w = adapter.read_weights(attn)
    probs = adapter.attention_probs(attn, hidden, rope, attention_mask)  # (b, h, l, l)
    b, length = hidden.shape[:2]
    v = F.linear(hidden, w.v, w.v_bias).view(b, length, geo.num_kv_heads, geo.head_dim).transpose(1, 2)
    v = v.repeat_interleave(geo.num_groups, dim=1)  # (b, h, l, d)
    ctx = (probs @ v).transpose(1, 2).reshape(b, length, geo.num_heads * geo.head_dim)
    return F.linear(ctx, w.o, w.o_bias)


def outside_window(length: int, window: int) -> torch.Tensor:
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return (j <= i) & (i - j >= window)


# ---- registry ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_get_adapter_dispatches_on_model_type(name):
    model = model_for(name)
    adapter = get_adapter(model)
    assert adapter.family == FAMILY_OF[name]
    assert model.config.model_type in adapter.model_types
    assert type(get_adapter(model.config)) is type(adapter)


def test_supported_families_lists_every_tiny_family():
    assert supported_families() == sorted(TINY_CONFIGS)


@pytest.mark.parametrize(
    "config",
    [
        BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        ),
        PretrainedConfig(),
    ],
    ids=["bert", "made_up"],
)
def test_unsupported_model_type_names_it_and_lists_families(config):
    if config.model_type == "":
        config.model_type = "made_up_arch"
    with pytest.raises(UnsupportedModelError) as info:
        get_adapter(config)
    message = str(info.value)
    assert "\n" not in message
    assert repr(config.model_type) in message
    for family in supported_families():
        assert family in message
    assert info.value.fix


def test_bidirectional_gemma_is_rejected():
    config = tiny_config("gemma3")
    config.use_bidirectional_attention = True
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        get_adapter(config)


def test_register_adapter_refuses_silent_override_and_registers_new_types():
    with pytest.raises(ValueError, match="already has adapter"):
        register_adapter(type("Imposter", (Adapter,), {"family": "x", "model_types": ("llama",)}))
    with pytest.raises(TypeError):
        register_adapter(type("Nameless", (Adapter,), {}))
    cls = type("MadeUp", (Adapter,), {"family": "made_up", "model_types": ("made_up_arch",)})
    try:
        assert register_adapter(cls) is cls
        config = PretrainedConfig()
        config.model_type = "made_up_arch"
        assert isinstance(get_adapter(config), cls)
    finally:
        registry._BY_MODEL_TYPE.pop("made_up_arch", None)
    assert "made_up" not in supported_families()


# ---- where attention lives --------------------------------------------------------------

EXPECTED_PATH = {"gpt2": "transformer.h.{}.attn", "gpt_neox": "gpt_neox.layers.{}.attention"}


@pytest.mark.parametrize("name", ALL)
def test_attention_module_paths_resolve(name):
    model = model_for(name)
    adapter = get_adapter(model)
    paths = adapter.attention_module_paths(model)
    layers = adapter.decoder_layers(model)
    assert len(paths) == len(layers) == model.config.num_hidden_layers
    pattern = EXPECTED_PATH.get(adapter.family, "model.layers.{}.self_attn")
    assert paths == [pattern.format(i) for i in range(len(paths))]
    for path, layer in zip(paths, layers):
        assert model.get_submodule(path) is getattr(layer, adapter.attention_attr())


def test_bare_decoder_stack_is_accepted():
    model = model_for("llama")
    adapter = get_adapter(model)
    base = model.model  # LlamaModel, no LM head
    assert adapter.attention_module_paths(base) == ["layers.0.self_attn", "layers.1.self_attn"]
    hidden = torch.zeros(1, LENGTH, model.config.hidden_size)
    for mine, theirs in zip(
        adapter.rotary_embeddings(base, hidden, None, 0), adapter.rotary_embeddings(model, hidden, None, 0)
    ):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", ALL)
def test_geometry_agrees_with_live_modules(name):
    model = model_for(name)
    adapter = get_adapter(model)
    for i, path in enumerate(adapter.attention_module_paths(model)):
        attn = model.get_submodule(path)
        geo = adapter.geometry(model.config, i)
        assert geo == adapter.layer_geometry(attn)
        assert geo.scaling == pytest.approx(attn.scaling, rel=1e-12)
        assert geo.head_dim == getattr(attn, "head_dim", getattr(attn, "head_size", None))
        if hasattr(attn, "rotary_ndims"):
            assert geo.rotary_dim == attn.rotary_ndims
        if hasattr(attn, "sliding_window"):
            assert geo.sliding_window == attn.sliding_window
        if hasattr(attn, "attn_logit_softcapping") and adapter.family == "gemma2":
            assert geo.softcap == attn.attn_logit_softcapping


# ---- positions --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_rotary_embeddings_are_what_the_model_passes(name):
    model, adapter, calls, _ = run_and_capture(name)
    for i, (attn, args, kwargs, _) in calls.items():
        hidden, rope = hidden_and_rope(args, kwargs)
        ours = adapter.rotary_embeddings(model, hidden, None, i)
        if adapter.layer_geometry(attn).rotary_dim == 0:
            assert ours is None
            continue
        rotary_dim = adapter.layer_geometry(attn).rotary_dim
        assert ours[0].shape == (BATCH, LENGTH, rotary_dim)
        for mine, theirs in zip(ours, rope):
            torch.testing.assert_close(mine, theirs.expand_as(mine), atol=0, rtol=0)


def test_gemma3_local_and_global_layers_use_different_rope():
    model = model_for("gemma3")
    adapter = get_adapter(model)
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    hidden = torch.zeros(1, LENGTH, model.config.hidden_size)
    cos_local, _ = adapter.rotary_embeddings(model, hidden, None, 0)
    cos_global, _ = adapter.rotary_embeddings(model, hidden, None, 1)
    assert (cos_local - cos_global).abs().max() > 1e-2


def test_three_op_full_rotary_equals_apply_rotary():
    from attn2ssm.ops.rope import apply_rotary_full

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 1, 64, generator=g)
    angle = torch.randn(2, 1, 64, generator=g)
    ref = apply_rotary(x, angle.cos(), angle.sin(), 64)
    out = apply_rotary_full(x[:, :, 0], angle.cos(), angle.sin())  # (b, h, d) against (b, 1, d)
    torch.testing.assert_close(out, ref[:, :, 0], atol=1e-6, rtol=1e-6)


def test_apply_rotary_leaves_pass_through_dims_alone():
    x = torch.randn(2, 3, 5, 8)
    cos, sin = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    out = apply_rotary(x, cos, sin, 4)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert not torch.allclose(out[..., :4], x[..., :4])
    assert apply_rotary(x, cos, sin, 0) is x
    with pytest.raises(ValueError):
        apply_rotary(x, cos, sin, 6)


# ---- (a) probabilities reproduce the module output --------------------------------------


@pytest.mark.parametrize("name", ALL)
@torch.no_grad()
def test_probs_times_v_reproduce_attention_output(name):
    model, adapter, calls, _ = run_and_capture(name)
    for i, (attn, args, kwargs, teacher_out) in calls.items():
        hidden, rope = hidden_and_rope(args, kwargs)
        torch.testing.assert_close(
            recompute_output(adapter, attn, hidden, rope), teacher_out, atol=TOL, rtol=TOL
        )
        # Random layer inputs, everything else exactly as the model passed it.
        random_hidden = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(i))
        expected = call_module(attn, args, kwargs, random_hidden)
        got = recompute_output(adapter, attn, random_hidden, rope)
        torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)


# ---- (b) probabilities equal the teacher's own eager weights ----------------------------


@pytest.mark.parametrize("name", ALL)
@torch.no_grad()
def test_probs_equal_output_attentions(name):
    model, adapter, calls, out = run_and_capture(name, output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == len(calls)
    for i, (attn, args, kwargs, _) in calls.items():
        hidden, rope = hidden_and_rope(args, kwargs)
        probs = adapter.attention_probs(attn, hidden, rope)
        assert probs.dtype == torch.float32 and probs.shape == (
            BATCH,
            attn.config.num_attention_heads,
            LENGTH,
            LENGTH,
        )
        torch.testing.assert_close(probs, out.attentions[i].float(), atol=TOL, rtol=0)
        # Causal, and not near-uniform (the tiny teachers must make these checks meaningful).
        assert probs.triu(diagonal=1).abs().max() == 0
        assert probs[..., -1, :].max() > 2.0 / LENGTH


# ---- (c) canonical weights rebuild the teacher's q and k --------------------------------


@pytest.mark.parametrize("name", ALL)
@torch.no_grad()
def test_read_weights_rebuild_q_and_k(name):
    model, adapter, calls, _ = run_and_capture(name)
    for attn, args, kwargs, _ in calls.values():
        geo = adapter.layer_geometry(attn)
        w = adapter.read_weights(attn)
        h, kv, d, hidden_size = geo.num_heads, geo.num_kv_heads, geo.head_dim, geo.hidden_size
        assert w.q.shape == (h * d, hidden_size)
        assert w.k.shape == w.v.shape == (kv * d, hidden_size)
        assert w.o.shape == (hidden_size, h * d)
        for bias, present, size in (
            (w.q_bias, geo.qkv_bias, h * d),
            (w.k_bias, geo.qkv_bias, kv * d),
            (w.v_bias, geo.qkv_bias, kv * d),
            (w.o_bias, geo.o_bias, hidden_size),
        ):
            assert (bias is not None) == present
            if present:
                assert bias.shape == (size,)
        assert (w.q_norm is not None) == (w.k_norm is not None) == geo.has_qk_norm
        live_params = {p.data_ptr() for p in attn.parameters()}
        assert not any(t.data_ptr() in live_params for t in (w.q, w.k, w.v, w.o)), "weights must be copies"
        assert not any(isinstance(t, torch.nn.Parameter) for t in (w.q, w.k, w.v, w.o))

        hidden, rope = hidden_and_rope(args, kwargs)
        b, length = hidden.shape[:2]
        q = F.linear(hidden, w.q, w.q_bias).view(b, length, h, d).transpose(1, 2)
        k = F.linear(hidden, w.k, w.k_bias).view(b, length, kv, d).transpose(1, 2)
        if geo.has_qk_norm:
            assert w.q_norm is not adapter.qk_norms(attn)[0]
            q, k = w.q_norm(q), w.k_norm(k)
        if geo.rotary_dim:
            q, k = (apply_rotary(x, *rope, geo.rotary_dim) for x in (q, k))
        q_teacher, k_teacher = adapter.qk(attn, hidden, rope)
        assert q_teacher.shape == (b, h, length, d) and k_teacher.shape == (b, kv, length, d)
        torch.testing.assert_close(q, q_teacher, atol=TOL, rtol=TOL)
        torch.testing.assert_close(k, k_teacher, atol=TOL, rtol=TOL)


# ---- (d) sliding windows ----------------------------------------------------------------

SLIDING = [
    n
    for n in ALL
    if any(
        get_adapter(tiny_config(n)).geometry(tiny_config(n), i).sliding_window
        for i in range(tiny_config(n).num_hidden_layers)
    )
]


def test_sliding_families_are_the_expected_ones():
    assert set(SLIDING) == {"mistral", "qwen2", "gemma2", "gemma3"}


@pytest.mark.parametrize("name", SLIDING)
@torch.no_grad()
def test_sliding_layers_see_only_their_window(name):
    model, adapter, calls, out = run_and_capture(name, output_attentions=True)
    saw_sliding = saw_global = False
    for i, (attn, args, kwargs, _) in calls.items():
        window = adapter.layer_geometry(attn).sliding_window
        hidden, rope = hidden_and_rope(args, kwargs)
        probs = adapter.attention_probs(attn, hidden, rope)
        if window is None:
            saw_global = True
            assert probs[..., -1, 0].min() > 0  # the last query still sees the first token
            continue
        saw_sliding = True
        assert window < LENGTH
        outside = outside_window(LENGTH, window)
        assert probs[..., outside].abs().max() == 0
        assert out.attentions[i][..., outside].abs().max() == 0  # the teacher agrees
        inside = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() & ~outside
        assert probs[..., inside].min() > 0
    assert saw_sliding
    assert saw_global or adapter.family == "mistral"  # mistral windows every layer


def test_gemma2_softcap_changes_probabilities():
    model, adapter, calls, _ = run_and_capture("gemma2")
    attn, args, kwargs, _ = calls[1]
    hidden, rope = hidden_and_rope(args, kwargs)
    geo = adapter.layer_geometry(attn)
    assert geo.softcap == 2.0
    q, k = adapter.qk(attn, hidden, rope)
    uncapped = probs_from_qk(q, k, geo.__class__(**{**geo.to_dict(), "softcap": None}))
    assert (probs_from_qk(q, k, geo) - uncapped).abs().max() > 1e-2


# ---- (f) padding ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@torch.no_grad()
def test_left_padding_zeroes_padded_keys(name):
    mask = left_padding()
    model, adapter, calls, out = run_and_capture(name, attention_mask=mask, output_attentions=True)
    for i, (attn, args, kwargs, teacher_out) in calls.items():
        hidden, rope = hidden_and_rope(args, kwargs)
        probs = adapter.attention_probs(attn, hidden, rope, attention_mask=mask)
        assert torch.isfinite(probs).all()
        # Real query rows: padded keys get exactly 0 and the real keys still sum to 1. (Padded
        # query rows see no key at all; like the teacher they come out uniform, only finite.)
        assert probs[0, :, PAD:, :PAD].abs().max() == 0
        valid = probs[0, :, PAD:]
        torch.testing.assert_close(valid.sum(-1), torch.ones_like(valid[..., 0]))
        # On real query rows the teacher agrees, probabilities and output alike.
        torch.testing.assert_close(probs[0, :, PAD:], out.attentions[i][0, :, PAD:].float(), atol=TOL, rtol=0)
        torch.testing.assert_close(probs[1], out.attentions[i][1].float(), atol=TOL, rtol=0)
        ours = recompute_output(adapter, attn, hidden, rope, attention_mask=mask)
        torch.testing.assert_close(ours[0, PAD:], teacher_out[0, PAD:], atol=TOL, rtol=TOL)
        torch.testing.assert_close(ours[1], teacher_out[1], atol=TOL, rtol=TOL)


def test_padding_mask_shape_is_checked():
    model, adapter, calls, _ = run_and_capture("llama")
    attn, args, kwargs, _ = calls[0]
    hidden, rope = hidden_and_rope(args, kwargs)
    with pytest.raises(ValueError, match="padding mask"):
        adapter.attention_probs(attn, hidden, rope, attention_mask=torch.ones(BATCH, 1, LENGTH, LENGTH))


def test_probabilities_stay_float32_under_a_bf16_autocast():
    """Attention-weight transfer under `mixed_precision: bf16` once failed here: the masked fill's
    float32 minimum does not fit a bf16 score tensor; the targets must stay float32 regardless."""
    model, adapter, calls, _ = run_and_capture("llama")
    attn, args, kwargs, _ = calls[0]
    hidden, rope = hidden_and_rope(args, kwargs)
    geo = adapter.layer_geometry(attn)
    q, k = adapter.qk(attn, hidden, rope)
    plain = probs_from_qk(q, k, geo)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = probs_from_qk(q, k, geo)
    assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)

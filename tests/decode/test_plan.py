"""The one-token decode plan (CPU decode mode, pure-mixer students): same logits and states as
HF's forward for every mixer kind, built only for the structure it was probed to compute, and
out of the way whenever something could tell the difference."""

import pytest
import torch
from torch import nn

from attn2ssm.decode.layout import cpu_decode_layout, undo_cpu_decode_layout
from attn2ssm.decode.plan import DecodePlan
from attn2ssm.mixers.registry import MIXERS
from attn2ssm.student.cache import _map_state
from tiny_models import tiny_student


@pytest.fixture
def plan_calls(monkeypatch):
    calls = []
    original = DecodePlan.__call__

    def counting(self, *args):
        calls.append(args[0].shape)
        return original(self, *args)

    monkeypatch.setattr(DecodePlan, "__call__", counting)
    return calls


def _tensors(state) -> list:
    found: list = []
    _map_state(state, lambda t: found.append(t) or t)
    return found


def _decode_mode(family: str, kind: str, options: dict | None = None):
    model = tiny_student(family, kind, options=options)
    cpu_decode_layout(model)
    return model


# every mixer kind, and linear attention with the Hedgehog map too (its two maps get stacked)
KINDS = [(kind, None) for kind in sorted(MIXERS)] + [("linear_attention", {"feature_map": "hedgehog"})]


def _prefill(model, ids, mask=None):
    cache = model.new_cache()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1:].argmax(-1)


def _steps(model, cache, token, n, plan):
    """n greedy steps; ``plan`` False runs them through HF's forward."""
    saved = model.__dict__["_decode_plan"]
    model.__dict__["_decode_plan"] = saved if plan else None
    logits = []
    try:
        with torch.no_grad():
            for _ in range(n):
                out = model(token, past_key_values=cache, use_cache=True)
                logits.append(out.logits)
                token = out.logits[:, -1:].argmax(-1)
    finally:
        model.__dict__["_decode_plan"] = saved
    return torch.cat(logits, 1)


@pytest.mark.parametrize("kind, options", KINDS)
def test_plan_steps_equal_hf_forward_steps_for_every_mixer_kind(kind, options, plan_calls):
    model = _decode_mode("gqa_9x3", kind, options)
    assert model.__dict__["_decode_plan"] is not None, model.decode_plan_reason
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    cache_a, token = _prefill(model, ids)
    cache_b, _ = _prefill(model, ids)
    via_plan = _steps(model, cache_a, token, 5, plan=True)
    assert len(plan_calls) == 5
    via_hf = _steps(model, cache_b, token, 5, plan=False)
    torch.testing.assert_close(via_plan, via_hf, rtol=1e-5, atol=1e-5)
    for i in model.mixers():  # the states the plan leaves are the ones HF's forward leaves
        a, b = cache_a.mixer_layer(i), cache_b.mixer_layer(i)
        assert a.seen == b.seen == 12
        assert set(a.states) == set(b.states)
        for key in a.states:
            for x, y in zip(_tensors(a.states[key]), _tensors(b.states[key]), strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_left_padded_generation_is_the_same_with_and_without_the_plan(family, plan_calls):
    model = _decode_mode(family, "linear_attention", {"feature_map": "hedgehog"})
    ids = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: positions come from the mask, not the cache length
    with torch.no_grad():
        planned = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        assert plan_calls
        model.__dict__["_decode_plan"] = None
        plain = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(planned.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(planned.scores), torch.stack(plain.scores), rtol=1e-5, atol=1e-5)


def test_structures_it_was_not_probed_to_compute_get_no_plan():
    phi = _decode_mode("phi", "mamba2")  # parallel residual, final_layernorm
    assert phi.__dict__["_decode_plan"] is None and "layers" in phi.decode_plan_reason
    gpt2 = _decode_mode("gpt2", "mamba2")
    assert gpt2.__dict__["_decode_plan"] is None and "layers" in gpt2.decode_plan_reason
    hybrid = tiny_student("llama", "mamba2", ratio=0.5)
    cpu_decode_layout(hybrid)
    assert hybrid.__dict__["_decode_plan"] is None and "hybrid" in hybrid.decode_plan_reason


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_layer_that_computes_something_else_fails_the_probe(family, monkeypatch):
    """The probe runs HF's layer forward: a residual scaled behind the plan's back is caught."""
    model = tiny_student(family, "linear_attention")
    layer_class = type(model.base.model.layers[0])
    original = layer_class.forward
    monkeypatch.setattr(
        layer_class, "forward", lambda self, hidden_states, **kw: original(self, hidden_states, **kw) * 1.01
    )
    cpu_decode_layout(model)
    assert model.__dict__["_decode_plan"] is None and "does not compute" in model.decode_plan_reason


def test_the_plan_steps_aside_when_something_could_tell(plan_calls):
    model = _decode_mode("llama", "mamba2")
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3))

    def plan_ran(**kwargs) -> bool:
        cache, token = _prefill(model, ids)
        plan_calls.clear()
        with torch.no_grad():
            model(token, past_key_values=cache, use_cache=True, **kwargs)
        return bool(plan_calls)

    assert plan_ran()
    assert not plan_ran(output_hidden_states=True)
    assert plan_ran()  # HF's output-capturing hooks, now installed for good, are inert without it
    layer = model.base.model.layers[0]
    handle = layer.post_attention_layernorm.register_forward_hook(lambda m, a, out: out)
    assert not plan_ran()  # its hook must run: the plan calls forward directly
    handle.remove()
    assert plan_ran()
    mlp = layer.mlp
    layer.mlp = nn.Identity()  # a replaced module (a LoRA wrap, a user's edit)
    assert not plan_ran()
    layer.mlp = mlp
    cache, token = _prefill(model, ids)
    cache.activate_past_recording()  # a speculative draft: the mixers' recording pre-hooks must run
    plan_calls.clear()
    with torch.no_grad():
        model(token, past_key_values=cache, use_cache=True)
    assert not plan_calls
    cache, token = _prefill(model, ids)
    plan_calls.clear()
    model(token, past_key_values=cache, use_cache=True).logits.sum().backward()  # autograd on
    assert not plan_calls
    undo_cpu_decode_layout(model)
    assert model.__dict__.get("_decode_plan") is None and not plan_ran()


# Gemma 2/3: sandwich norms around mixer and MLP; Gemma-3 also gives its sliding-window and global
# layers RoPE of different bases (one rotary module, called once per layer type)
GEMMA_KINDS = [
    ("linear_attention", {"feature_map": "hedgehog"}),
    ("linear_attention", None),
    ("mamba2", {"rope": "before"}),
    ("hedgemamba", None),
]


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@pytest.mark.parametrize("kind, options", GEMMA_KINDS)
def test_gemma_plans_step_as_hf_forward_does(family, kind, options, plan_calls):
    model = _decode_mode(family, kind, options)
    assert model.__dict__["_decode_plan"] is not None, model.decode_plan_reason
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    cache_a, token = _prefill(model, ids)
    cache_b, _ = _prefill(model, ids)
    via_plan = _steps(model, cache_a, token, 5, plan=True)
    assert len(plan_calls) == 5
    via_hf = _steps(model, cache_b, token, 5, plan=False)
    torch.testing.assert_close(via_plan, via_hf, rtol=1e-5, atol=1e-5)


def test_gemma3_layers_get_their_own_layer_types_rope():
    """The two layer types' RoPE differ past position 0; each mixer gets its own layer's."""
    model = _decode_mode("gemma3", "linear_attention")
    plan = model.__dict__["_decode_plan"]
    assert plan is not None, model.decode_plan_reason
    x = torch.zeros(1, 1, 64)
    pes = plan.position_embeddings(x, torch.tensor([[9]]))
    inner = model.base.model
    for step, layer_type in zip(plan.steps, model.base.config.layer_types, strict=True):
        cos, sin = pes[step.rope]
        want_cos, want_sin = inner.rotary_emb(x, torch.tensor([[9]]), layer_type)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert not torch.equal(pes[plan.steps[0].rope][1], pes[plan.steps[1].rope][1])


def test_position_embeddings_the_plan_cannot_reproduce_mean_no_plan(monkeypatch):
    """A rotary module the plan cannot call, or one whose output HF's forward does not hand the
    layers as it is, gives no plan and the reason, never an exception."""
    model = tiny_student("gemma3", "linear_attention")
    rotary = type(model.base.model.rotary_emb)
    original = rotary.forward
    monkeypatch.setattr(
        rotary,
        "forward",
        lambda self, x, position_ids, layer_type, scale: original(self, x, position_ids, layer_type),
    )
    cpu_decode_layout(model)
    assert model.__dict__["_decode_plan"] is None and "position embeddings" in model.decode_plan_reason
    undo_cpu_decode_layout(model)
    monkeypatch.setattr(rotary, "forward", original)
    model = tiny_student("gemma3", "linear_attention")
    config = model.base.config
    # the plan would read these
    monkeypatch.setattr(config, "layer_types", list(reversed(config.layer_types)))
    inner_forward = type(model.base.model).forward

    def hf_with_the_original_types(self, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(config, "layer_types", list(reversed(config.layer_types)))
            return inner_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model.base.model), "forward", hf_with_the_original_types)
    cpu_decode_layout(model)
    assert model.__dict__["_decode_plan"] is None and "position embeddings" in model.decode_plan_reason

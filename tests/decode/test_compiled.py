"""The compiled decode step (opt-in ``cpu_decode_layout(model, compile=True)``): the plan's
layers traced into one function give the logits and states of the eager plan (itself held equal
to HF's forward in test_plan.py), trace once, step aside whenever what the trace assumed
no longer holds, and turn themselves off, losing nothing, when tracing fails.

Most tests trace with a counting dynamo backend that runs the traced graph eagerly (seconds);
one compiles with inductor (the backend users get), marked slow."""

import pytest
import torch
from torch import nn

from attn2ssm.decode.compiled import CompiledStep
from attn2ssm.decode.layout import cpu_decode_layout, undo_cpu_decode_layout
from attn2ssm.decode.mixers import LinearAttentionDecode
from attn2ssm.decode.plan import enable_decode_plan
from attn2ssm.student.cache import _map_state
from tiny_models import tiny_student

KINDS = [
    ("linear_attention", {"feature_map": "hedgehog"}),
    ("linear_attention", None),
    # a softmax window the 7-token prefill fills: the window step, traced
    ("linear_attention", {"feature_map": "hedgehog", "window": 4, "rope": "window", "decay": True}),
    ("mamba", None),
    ("mamba2", None),
    ("hedgemamba", None),
]


class CountingBackend:
    """A dynamo backend that counts traces and runs each traced graph as it is (no inductor)."""

    def __init__(self):
        self.traces = 0

    def __call__(self, graph_module, example_inputs):
        self.traces += 1
        return graph_module.forward


def _tensors(state) -> list:
    found: list = []
    _map_state(state, lambda t: found.append(t) or t)
    return found


def _pair(kind, options, backend, family="gqa_9x3"):
    """(compiled, eager) students with the same weights, both in decode mode."""
    torch.manual_seed(0)
    compiled = tiny_student(family, kind, options=options)
    torch.manual_seed(0)
    eager = tiny_student(family, kind, options=options)
    eager.load_state_dict(compiled.state_dict())
    cpu_decode_layout(eager)
    cpu_decode_layout(compiled)
    plan = compiled.__dict__["_decode_plan"]
    assert plan is not None, compiled.decode_plan_reason
    assert plan.compile_step(backend) == ""
    return compiled, eager


def _prefill(model, ids):
    cache = model.new_cache()
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1:].argmax(-1)


def _steps(model, cache, token, n):
    logits = []
    with torch.no_grad():
        for _ in range(n):
            out = model(token, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            token = out.logits[:, -1:].argmax(-1)
    return torch.cat(logits, 1)


def _ids(rows=2, length=7):
    return torch.randint(3, 256, (rows, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "kind, options, family",
    [(*k, "gqa_9x3") for k in KINDS]  # Gemma 2/3: sandwich norms, soft-capped logits, per-layer-type RoPE
    + [("linear_attention", {"feature_map": "hedgehog"}, "gemma3"), ("linear_attention", None, "gemma2")],
)
def test_compiled_steps_equal_the_eager_plan_and_trace_once(kind, options, family):
    backend = CountingBackend()
    compiled, eager = _pair(kind, options, backend, family)
    ids = _ids()
    cache_c, token = _prefill(compiled, ids)
    cache_e, _ = _prefill(eager, ids)
    got = _steps(compiled, cache_c, token, 6)
    want = _steps(eager, cache_e, token, 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    step = compiled.__dict__["_decode_plan"].compiled
    assert step.failed is None and step.compiled_once
    assert backend.traces == 1  # six steps, one trace: nothing in it changes from token to token
    assert cache_c.get_seq_length() == cache_e.get_seq_length() == 7 + 6
    for i in compiled.mixers():
        a, b = cache_c.mixer_layer(i), cache_e.mixer_layer(i)
        assert a.seen == b.seen
        for x, y in zip(_tensors(a.states), _tensors(b.states), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# a learned per-head decay (tests/mixers/test_linear_attention_decay_mixer.py) rides in the traced step too
DECAYED = [
    {"decay": True, "decay_horizon": 6.0},
    {"decay": True, "decay_horizon": 6.0, "feature_map": "hedgehog"},
]


@pytest.mark.parametrize("kind, options", KINDS + [("linear_attention", o) for o in DECAYED])
def test_a_plan_compiled_without_the_decode_layout_gives_the_eager_tokens(kind, options):
    """``enable_decode_plan(compile=True)`` alone (no fused weights, plain nn.Linear layers, as a
    remote-code checkpoint would have it) traces too."""
    torch.manual_seed(0)
    compiled = tiny_student("gqa_9x3", kind, options=options)
    eager = tiny_student("gqa_9x3", kind, options=options)
    eager.load_state_dict(compiled.state_dict())
    backend = CountingBackend()
    assert enable_decode_plan(compiled, compile=False)
    assert compiled.__dict__["_decode_plan"].compile_step(backend) == ""
    ids = _ids()
    kwargs = dict(
        max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        got, want = compiled.generate(ids, **kwargs), eager.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)
    step = compiled.__dict__["_decode_plan"].compiled
    assert step.failed is None and backend.traces == 1


def test_generate_with_the_compiled_step_gives_the_eager_tokens():
    compiled, eager = _pair("linear_attention", {"feature_map": "hedgehog"}, CountingBackend())
    ids = _ids()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(compiled.generate(ids, **kwargs), eager.generate(ids, **kwargs))
    assert compiled.__dict__["_decode_plan"].compiled.compiled_once


def test_the_compiled_step_steps_aside_when_a_fusion_no_longer_holds():
    backend = CountingBackend()
    compiled, eager = _pair("linear_attention", {"feature_map": "hedgehog"}, backend)
    ids = _ids()
    cache_c, token = _prefill(compiled, ids)
    cache_e, _ = _prefill(eager, ids)
    _steps(compiled, cache_c, token, 1)
    _steps(eager, cache_e, token, 1)
    for model in (compiled, eager):  # new storage for one fused weight: the fused buffer is stale
        mixer = model.mixers()[1]
        mixer.q_proj.weight.data = mixer.q_proj.weight.data * 1.5
    step = compiled.__dict__["_decode_plan"].compiled
    assert not step.ready(cache_c)
    traced = backend.traces
    got = _steps(compiled, cache_c, token, 3)
    want = _steps(eager, cache_e, token, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert backend.traces == traced  # the eager step ran, nothing was re-traced


def test_a_replaced_module_is_retraced_not_reused():
    backend = CountingBackend()
    compiled, eager = _pair("mamba2", None, backend)
    ids = _ids()
    cache_c, token = _prefill(compiled, ids)
    cache_e, _ = _prefill(eager, ids)
    _steps(compiled, cache_c, token, 2)
    _steps(eager, cache_e, token, 2)
    for model in (compiled, eager):  # a different output projection (not fused: nothing stale)
        mixer = model.mixers()[0]
        new = nn.Linear(mixer.o_proj.in_features, mixer.o_proj.out_features, bias=True)
        with torch.no_grad():
            new.weight.copy_(mixer.o_proj.weight * -2.0)
            new.bias.fill_(0.3)
        mixer.o_proj = new
    got = _steps(compiled, cache_c, token, 3)
    want = _steps(eager, cache_e, token, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert backend.traces == 2


def test_a_failing_trace_turns_the_compiled_step_off_and_loses_no_token(monkeypatch):
    compiled, eager = _pair("linear_attention", {"feature_map": "hedgehog"}, CountingBackend())
    ids = _ids()
    cache_c, token = _prefill(compiled, ids)
    cache_e, _ = _prefill(eager, ids)
    original = LinearAttentionDecode.step  # the decode-mode step (decode/mixers.py)

    def untraceable(self, hidden_states, *args, **kwargs):
        if torch.compiler.is_compiling():
            torch._dynamo.graph_break()  # fullgraph=True: a break fails the trace
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(LinearAttentionDecode, "step", untraceable)
    got = _steps(compiled, cache_c, token, 3)
    want = _steps(eager, cache_e, token, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    step = compiled.__dict__["_decode_plan"].compiled
    assert step.failed is not None and "torch.compile failed" in step.failed
    assert compiled.compiled_step_reason == step.failed
    assert cache_c.get_seq_length() == cache_e.get_seq_length()


def test_the_compiled_step_is_not_used_with_another_thread_count():
    compiled, _ = _pair("mamba", None, CountingBackend())
    cache, token = _prefill(compiled, _ids())
    step = compiled.__dict__["_decode_plan"].compiled
    assert step.ready(cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert not step.ready(cache)
    finally:
        torch.set_num_threads(threads)


def test_the_compiled_step_is_refused_while_a_stage_hooks_a_tap():
    """CAB reads B and C through a hook on each mixer's tap: the hook runs outside any graph, so
    the compiled step steps aside while it is there and the eager plan runs it, token by token."""
    compiled, eager = _pair("mamba2", None, CountingBackend())
    cache_c, token = _prefill(compiled, _ids())
    cache_e, _ = _prefill(eager, _ids())
    step = compiled.__dict__["_decode_plan"].compiled
    assert step.ready(cache_c)
    seen = []
    handle = compiled.mixers()[0].bc_tap.register_forward_hook(
        lambda tap, args, out: seen.append(args[0].shape)
    )
    assert not step.ready(cache_c)
    got = _steps(compiled, cache_c, token, 2)
    handle.remove()
    torch.testing.assert_close(got, _steps(eager, cache_e, token, 2), rtol=1e-5, atol=1e-5)
    assert seen == [torch.Size([2, 1, 3, 8])] * 2 and not step.compiled_once and step.ready(cache_c)


def test_compile_option_and_its_reasons():
    model = tiny_student("gqa_9x3", "mamba2")
    cpu_decode_layout(model, compile=True)
    assert (
        isinstance(model.__dict__["_decode_plan"].compiled, CompiledStep) and model.compiled_step_reason == ""
    )
    undo_cpu_decode_layout(model)
    assert model.__dict__.get("_decode_plan") is None
    hybrid = tiny_student("gqa_9x3", "mamba2", ratio=0.5)
    cpu_decode_layout(hybrid, compile=True)
    assert "no decode plan" in hybrid.compiled_step_reason
    cosformer = tiny_student("gqa_9x3", "linear_attention", options={"feature_map": "cosformer"})
    cpu_decode_layout(cosformer, compile=True)
    step = cosformer.__dict__["_decode_plan"].compiled
    cache, _ = _prefill(cosformer, _ids())
    assert not step.ready(cache)  # its map needs the token's position


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"feature_map": "hedgehog"}, KINDS[2][1]], ids=["plain", "window"])
def test_inductor_compiled_steps_equal_the_eager_plan(options):
    compiled, eager = _pair("linear_attention", options, "inductor")
    ids = _ids()
    cache_c, token = _prefill(compiled, ids)
    cache_e, _ = _prefill(eager, ids)
    torch.testing.assert_close(
        _steps(compiled, cache_c, token, 4), _steps(eager, cache_e, token, 4), rtol=1e-4, atol=1e-4
    )
    assert compiled.__dict__["_decode_plan"].compiled.compiled_once

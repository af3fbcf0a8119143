"""CPU decode mode: every Linear a DecodeLinear (few-row products as a batched matmul over row
blocks of the weight), each mixer's input projections fused into one buffer; values, ties,
outputs, generation, saving and training unchanged."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from attn2ssm.decode.fusion import FusedLinears
from attn2ssm.decode.layout import DecodeLinear, cpu_decode_layout, undo_cpu_decode_layout
from attn2ssm.mixers.registry import MIXERS
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from tiny_models import tiny_model


def _student(kind="mamba2"):
    torch.manual_seed(0)
    teacher = tiny_model("llama")
    teacher.config.tie_word_embeddings = True
    teacher.tie_weights()
    return teacher, convert(teacher, make_plan(teacher.config.num_hidden_layers, kind)).eval()


def test_every_linear_becomes_decode_linear_mixer_inputs_fused_and_values_are_kept():
    _, model = _student()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    keys = set(model.state_dict())
    changed = cpu_decode_layout(model)
    assert changed > 0
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert sum(isinstance(m, DecodeLinear) for m in model.modules()) > 0
    for mixer in model.mixers().values():
        linears = [getattr(mixer, n) for n in mixer.input_linears if getattr(mixer, n, None) is not None]
        assert len(linears) >= 4  # q, k, v, gate, Δ
        assert len({lin.weight.untyped_storage().data_ptr() for lin in linears}) == 1  # one buffer, no copy
        assert all(lin.weight.is_contiguous() for lin in linears)
    assert set(model.state_dict()) == keys
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert cpu_decode_layout(model) == 0  # idempotent
    assert undo_cpu_decode_layout(model) > 0
    assert all(type(m) is not DecodeLinear for m in model.modules())
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(storages) == len(set(storages))  # independent again
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_tied_embedding_stays_tied_and_outputs_and_generation_are_unchanged():
    _, model = _student()
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        greedy = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    cpu_decode_layout(model)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), greedy)


def _count_fused_calls(monkeypatch):
    """Shapes of the inputs the mixers' fused projections read (the MLPs' fused gate/up aside)."""
    calls = []
    original = FusedLinears.matmul

    def counting(self, x, *args):
        if self.names[0] != "gate_proj":
            calls.append(x.shape)
        return original(self, x, *args)

    monkeypatch.setattr(FusedLinears, "matmul", counting)
    return calls


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_every_mixer_kind_gives_the_same_logits_and_generation_with_fused_inputs(kind, monkeypatch):
    torch.manual_seed(0)
    teacher = tiny_model("gqa_9x3")
    model = convert(teacher, make_plan(teacher.config.num_hidden_layers, kind)).eval()
    with torch.no_grad():  # biases and gates off zero so every fused slice matters
        for mixer in model.mixers().values():
            for name, p in mixer.named_parameters():
                if not name.startswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj")):
                    p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        greedy = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    cpu_decode_layout(model)
    calls = _count_fused_calls(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(
            model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0),
            greedy,
        )
    assert len(calls) >= 2 * len(model.mixers())  # the fused path ran (prefill and decode)


def test_fused_path_steps_aside_when_weights_move_or_get_hooks(monkeypatch):
    _, model = _student()
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    cpu_decode_layout(model)
    calls = _count_fused_calls(monkeypatch)
    mixer = next(iter(model.mixers().values()))
    with torch.no_grad():
        ref = model(ids).logits
    assert calls
    # a hook on one projection (how LoRA adapts it) must run: the fused matmul would skip it
    handle = mixer.q_proj.register_forward_hook(lambda mod, args, out: out * 0)
    calls.clear()
    with torch.no_grad():
        hooked = model(ids).logits
    handle.remove()
    assert len(calls) == len(model.mixers()) - 1 and not torch.allclose(hooked, ref)
    # a replaced (wrapped) layer is read through its replacement: peft's LoRA swaps the module
    original = mixer.v_proj
    mixer.v_proj = nn.Sequential(original, nn.Tanh())
    calls.clear()
    with torch.no_grad():
        wrapped = model(ids).logits
    mixer.v_proj = original
    assert len(calls) == len(model.mixers()) - 1 and not torch.allclose(wrapped, ref)
    mlp = model.base.model.layers[0].mlp
    mlp.up_proj = nn.Sequential(mlp.up_proj, nn.Tanh())
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, ref)
    mlp.up_proj = mlp.up_proj[0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref)
    # re-assigned data (a load with assign=True, a dtype round trip) is read from the layer itself
    with torch.no_grad():
        mixer.k_proj.weight.data = mixer.k_proj.weight.data.clone() * 2
        calls.clear()
        moved = model(ids).logits
    assert len(calls) == len(model.mixers()) - 1 and not torch.allclose(moved, ref)
    # with gradients on, every layer runs by itself so its parameters get gradients
    calls.clear()
    model(ids).logits.sum().backward()
    assert not calls and mixer.q_proj.weight.grad is not None


def test_models_in_decode_mode_save_load_and_train(tmp_path):
    teacher, model = _student()
    cpu_decode_layout(model)
    cpu_decode_layout(teacher)
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    model.save_pretrained(tmp_path / "student")  # writes independent tensors, stays fused
    assert all(m.__dict__.get("_fused_inputs") is not None for m in model.mixers().values())
    # the decode-mode class keeps the student's name (transformers writes it into the config), and
    # nothing of attn2ssm.decode travels with the checkpoint
    assert json.loads((tmp_path / "student" / "config.json").read_text())["architectures"] == [
        "Attn2SSMForCausalLM"
    ]
    assert not list((tmp_path / "student").glob("attn2ssm_decode*"))
    saved, state = load_file(tmp_path / "student" / "model.safetensors"), model.state_dict()
    assert any(".q_proj." in k for k in saved) and set(saved) <= set(state)  # (a tied head is saved once)
    assert all(torch.equal(saved[k], state[k]) for k in saved)
    teacher.save_pretrained(tmp_path / "teacher")
    from transformers import AutoModelForCausalLM

    import attn2ssm.student  # noqa: F401

    for original, path in ((model.eval(), "student"), (teacher.eval(), "teacher")):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / path).eval()
        assert all(type(m) is not DecodeLinear for m in loaded.modules())
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    # gradients reach every parameter, fused or not
    model.train()
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_norms_and_gated_mlps_take_their_fused_forms_only_where_they_compute_the_same():
    """Llama: RMSNorm → one F.rms_norm, gate/up → one matmul. Gemma's (1 + w) RMSNorm fails the
    probe and keeps its class; its gated GELU MLP is fused. Outputs unchanged; undo restores."""
    for family, norm_fused in (("llama", True), ("gemma", False)):
        torch.manual_seed(0)
        teacher = tiny_model(family).eval()
        with torch.no_grad():
            for name, p in teacher.named_parameters():
                if "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))  # a norm weight of ones would hide a (1 + w)
        ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = teacher(ids).logits
        classes = {n: type(m) for n, m in teacher.named_modules()}
        cpu_decode_layout(teacher)
        layer = teacher.model.layers[0]
        assert ("_decode_base" in type(layer.input_layernorm).__dict__) is norm_fused, family
        assert "_decode_base" in type(layer.mlp).__dict__
        assert (
            layer.mlp.gate_proj.weight.untyped_storage().data_ptr()
            == layer.mlp.up_proj.weight.untyped_storage().data_ptr()
        )
        with torch.no_grad():
            torch.testing.assert_close(teacher(ids).logits, ref, rtol=1e-5, atol=1e-5)
        undo_cpu_decode_layout(teacher)
        assert {n: type(m) for n, m in teacher.named_modules()} == classes
        with torch.no_grad():
            torch.testing.assert_close(teacher(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_a_dtype_move_drops_the_fused_buffers_and_stays_correct():
    _, model = _student("linear_attention")
    cpu_decode_layout(model)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(ids).logits
    model.to(torch.float64)  # the fused float32 buffers must not be read (nor kept alive)
    assert all(m.__dict__.get("_fused_inputs") is None for m in model.modules())
    assert all(m.__dict__.get("_blocks") is None for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.float(), ref, rtol=1e-4, atol=1e-4)


def test_a_hedgehog_students_stacked_maps_decode_save_undo_and_step_aside(tmp_path):
    """The query and key Hedgehog maps become blocks of one buffer; decoding, saving and undoing
    work, and a replaced map is read through its replacement."""
    from tiny_models import tiny_student

    model = tiny_student("gqa_9x3", "linear_attention", options={"feature_map": "hedgehog"})
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    kwargs = dict(
        max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
    cpu_decode_layout(model)
    mixer = model.mixers()[0]
    assert mixer.__dict__.get("_fused_maps") is not None
    assert (
        mixer.feature_map_q.weight.untyped_storage().data_ptr()
        == mixer.feature_map_k.weight.untyped_storage().data_ptr()
    )
    with torch.no_grad():
        got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(ref.scores), rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "student")  # unfuses while writing, fuses again after
    assert mixer.__dict__.get("_fused_maps") is not None

    class Squared(nn.Module):  # a replaced map: prefill and every decode step must use it
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, positions=None):
            return self.inner(x, positions) ** 2

    # same weights, no decode mode
    plain = tiny_student("gqa_9x3", "linear_attention", options={"feature_map": "hedgehog"})
    original = mixer.feature_map_k
    mixer.feature_map_k, plain.mixers()[0].feature_map_k = (
        Squared(original),
        Squared(plain.mixers()[0].feature_map_k),
    )
    with torch.no_grad():
        replaced, expected = model.generate(ids, **kwargs), plain.generate(ids, **kwargs)
    torch.testing.assert_close(
        torch.stack(replaced.scores), torch.stack(expected.scores), rtol=1e-5, atol=1e-5
    )
    assert not torch.allclose(torch.stack(replaced.scores), torch.stack(ref.scores))
    mixer.feature_map_k = original
    assert undo_cpu_decode_layout(model) > 0
    assert mixer.__dict__.get("_fused_maps") is None
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs).sequences, ref.sequences)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_fused_buffer_with_an_odd_row_count_is_padded_and_read_by_row_blocks(threads):
    """q|k|v|gate|Δ of a Mamba-2 mixer add up to an odd row count (1545 on the built-in teacher):
    the buffer gets zero rows to a multiple of lcm(8, threads), so the one-matmul read takes the
    row-block route (it keeps its block view) instead of the one-core fallback, and every layer's
    output is unchanged; the padding's columns never reach a caller."""
    from attn2ssm.decode.fusion import ROW_MULTIPLE
    from attn2ssm.ops.rows import MEMO_KEY

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        owner = nn.Module()
        torch.manual_seed(0)
        owner.a, owner.b, owner.c = nn.Linear(16, 24), nn.Linear(16, 8, bias=False), nn.Linear(16, 9)
        x = torch.randn(3, 16)
        with torch.no_grad():
            refs = [owner.a(x), owner.b(x), owner.c(x)]
            fused = FusedLinears(owner, ["a", "b", "c"], [owner.a, owner.b, owner.c])
            multiple = ROW_MULTIPLE * threads // (2 if threads % 2 == 0 else 1)  # lcm(8, threads)
            assert fused.weight.shape[0] % multiple == 0 and fused.weight.shape[0] - 41 < multiple
            assert torch.count_nonzero(fused.weight[41:]) == 0 and torch.count_nonzero(fused.bias[41:]) == 0
            outs = fused(x)
            assert MEMO_KEY in fused.__dict__  # the row-block route ran
            assert fused.matmul(x).shape == (3, 41)
            for out, ref in zip(outs, refs):
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(owner.c(x), refs[2])  # each layer still reads its own rows
    finally:
        torch.set_num_threads(old)

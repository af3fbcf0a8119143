"""HedgeMamba (Attention-to-Mamba): at init it IS Hedgehog linear attention (GQA 9×3, RoPE, all three
forms), off the init its quadratic / chunked / step forms agree with padding and a carried state,
a converted student decodes and round-trips through save/load, and a hand-computed case."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers Auto classes)
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.hedgemamba import DT_IDENTITY_BIAS, HedgeMambaMixer
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from cache_forms import full_and_pieces, positions
from tiny_models import tiny_model

HM, LA = "hedgemamba", "linear_attention"


@pytest.fixture(scope="module")
def gqa_teacher():
    return tiny_model("gqa_9x3")


def _ids(b=2, l=14, vocab=256, seed=0):
    return torch.randint(0, vocab, (b, l), generator=torch.Generator().manual_seed(seed))


def _left_padded(b, l, pad):
    mask = torch.ones(b, l, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


def _rope(teacher, x, mask):
    return teacher.model.rotary_emb(x, positions(mask))


def _slice_pe(pe, start, end):
    return tuple(t[:, start:end] for t in pe)


@torch.no_grad()
def _perturb_feature_maps(student, scale=0.5, seed=1):
    """Move the Hedgehog maps off their identity init, so 'equal' is not trivially 'both identity'."""
    g = torch.Generator().manual_seed(seed)
    for name, p in student.named_parameters():
        if ".feature_map_" in name:
            p.add_(scale * torch.randn(p.shape, generator=g))


@torch.no_grad()
def _perturb_extras(mixer, seed=2):
    """Non-trivial decay (A < 0, token-dependent Δ), conv taps and gate."""
    g = torch.Generator().manual_seed(seed)
    r = lambda t, s: s * torch.randn(t.shape, generator=g)  # noqa: E731
    mixer.A.copy_(-0.1 - torch.rand(mixer.A.shape, generator=g))
    mixer.dt_proj.weight.add_(r(mixer.dt_proj.weight, 0.2))
    mixer.dt_proj.bias.add_(r(mixer.dt_proj.bias, 0.5))
    mixer.conv.weight.add_(r(mixer.conv.weight, 0.3))
    mixer.conv.bias.add_(r(mixer.conv.bias, 0.1))
    mixer.gate.weight.add_(r(mixer.gate.weight, 0.2))
    mixer.gate.bias.add_(r(mixer.gate.bias, 0.5))
    for p in (*mixer.feature_map_q.parameters(), *mixer.feature_map_k.parameters()):
        p.add_(r(p, 0.3))


def _run_pieces(mixer, cache, x, pe, mask, pieces):
    """The mixer fed ``pieces`` of x through ``cache`` (chunked prefill, then steps), concatenated."""
    outs, start = [], 0
    for size in pieces:
        end = start + size
        mixer.context.padding_mask = mask[:, start:end]
        outs.append(
            mixer(x[:, start:end], position_embeddings=_slice_pe(pe, start, end), past_key_values=cache)[0]
        )
        start = end
    mixer.context.padding_mask = None
    return torch.cat(outs, 1)


def _run_chunked(mixer, x, pe, mask):
    mixer.context.padding_mask = mask
    out = mixer(x, position_embeddings=pe)[0]
    mixer.context.padding_mask = None
    return out


# ------------------------------------------------------------------------------------------------
# 1. at init: exactly Hedgehog linear attention


@pytest.fixture(scope="module")
def hedgehog_pair(gqa_teacher):
    """(linear-attention student with trained-looking Hedgehog maps, hedgemamba student loaded from it)."""
    la = convert(gqa_teacher, [LA, LA], {LA: {"feature_map": "hedgehog", "chunk_size": 4}})
    _perturb_feature_maps(la)
    hm = convert(gqa_teacher, [HM, HM], {HM: {"chunk_size": 4}})
    for i, mixer in hm.mixers().items():
        mixer.load_linear_attention(la.mixers()[i])
    return la, hm


def test_linear_attention_weights_transfer_by_name(hedgehog_pair):
    la, hm = hedgehog_pair
    for i, la_mixer in la.mixers().items():
        mine = hm.mixers()[i].state_dict()
        for name, tensor in la_mixer.state_dict().items():
            assert torch.equal(mine[name], tensor), name
    with pytest.raises(ValueError, match="feature_map_q"):  # an elu mixer has no Hedgehog weights to give
        elu = convert(tiny_model("gqa_9x3"), [LA, LA], {LA: {"feature_map": "elu"}})
        hm.mixers()[0].load_linear_attention(elu.mixers()[0])


def test_equals_hedgehog_at_init_in_every_form(hedgehog_pair, gqa_teacher):
    la, hm = hedgehog_pair
    b, l = 2, 11
    mask = _left_padded(b, l, 3)
    real = mask.bool()
    x = torch.randn(b, l, 72, generator=torch.Generator().manual_seed(3))
    pe = _rope(gqa_teacher, x, mask)
    for i, la_mixer in la.mixers().items():
        hm_mixer = hm.mixers()[i]
        out_la, w_la = la_mixer.forward_quadratic(x, pe, mask)
        out_hm, w_hm = hm_mixer.forward_quadratic(x, pe, mask)
        torch.testing.assert_close(out_hm[real], out_la[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w_hm, w_la, atol=1e-5, rtol=1e-5)
        chunked = _run_chunked(hm_mixer, x, pe, mask)
        torch.testing.assert_close(chunked[real], out_la[real], atol=1e-5, rtol=1e-5)
        stepped = _run_pieces(hm_mixer, hm.new_cache(), x, pe, mask, [4] + [1] * 7)
        torch.testing.assert_close(stepped[real], out_la[real], atol=1e-5, rtol=1e-5)
    # and as whole students: full forward and token-by-token decode give the Hedgehog student's logits
    ids, mask = _ids(), _left_padded(2, 14, 4)
    real = mask.bool()
    full_la, _ = full_and_pieces(la, ids, mask, [14])
    full_hm, stepped_hm = full_and_pieces(hm, ids, mask, [6] + [1] * 8)
    torch.testing.assert_close(full_hm[real], full_la[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stepped_hm[real], full_la[real], atol=1e-5, rtol=1e-5)


def test_new_parameters_start_at_identity(gqa_teacher):
    mixer = convert(gqa_teacher, [HM, HM]).mixers()[1]
    assert (
        torch.equal(mixer.conv.weight[:, -1], torch.ones(72))
        and not mixer.conv.weight[:, :-1].any()
        and not mixer.conv.bias.any()
    )
    u = torch.randn(3, 4, 72)
    torch.testing.assert_close(F.silu(mixer.gate(u)), torch.ones(3, 4, 72), atol=1e-6, rtol=0)
    torch.testing.assert_close(F.softplus(mixer.dt_proj(u)), torch.ones(3, 4, 9), atol=1e-6, rtol=0)
    assert not mixer.A.any() and mixer.A.shape == (9,)
    with torch.no_grad():
        mixer.A.fill_(-1.0)
        mixer.gate.weight.normal_()
    mixer.init_new_parameters()
    assert not mixer.A.any() and not mixer.gate.weight.any()


# ------------------------------------------------------------------------------------------------
# 2. off the init: the three forms agree


def test_forms_agree_with_decay_conv_gate_padding_and_state(gqa_teacher):
    student = convert(gqa_teacher, [HM, HM], {HM: {"chunk_size": 4}})
    mixer = student.mixers()[0]
    _perturb_extras(mixer)
    b, l = 2, 13
    mask = _left_padded(b, l, 4)
    real = mask.bool()
    x = torch.randn(b, l, 72, generator=torch.Generator().manual_seed(5), requires_grad=True)
    pe = _rope(gqa_teacher, x, mask)
    out_q, weights = mixer.forward_quadratic(x, pe, mask)
    out_c = _run_chunked(mixer, x, pe, mask)
    out_p = _run_pieces(mixer, student.new_cache(), x, pe, mask, [5, 3, 1, 1, 3])  # carried state, then steps
    out_s = _run_pieces(mixer, student.new_cache(), x, pe, mask, [1] * l)  # padded tokens as decode steps too
    for out in (out_c, out_p, out_s):
        torch.testing.assert_close(out[real], out_q[real], atol=1e-5, rtol=1e-5)
    rows = weights.sum(-1)  # (b, h, l): den / (den + eps) on real tokens, 0 at padding
    torch.testing.assert_close(rows, real[:, None, :].expand_as(rows).float(), atol=1e-3, rtol=0)
    assert torch.equal(weights.triu(1), torch.zeros_like(weights))
    # the decay really decays: weights differ from the undecayed ones
    with torch.no_grad():
        saved = mixer.A.clone()
        mixer.A.zero_()
        assert not torch.allclose(mixer.forward_quadratic(x, pe, mask)[1], weights, atol=1e-3)
        mixer.A.copy_(saved)
    (out_q[real].pow(2).mean() + out_p[real].pow(2).mean()).backward()
    for name, p in mixer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert mixer.A.grad.abs().sum() > 0 and torch.isfinite(x.grad).all()


def test_positive_A_means_no_decay_but_still_trains(gqa_teacher):
    """The scan needs log-decay ≤ 0: A > 0 acts as A = 0, with a straight-through gradient."""
    mixer = convert(gqa_teacher, [HM, HM]).mixers()[0]
    x = torch.randn(2, 7, 72)
    at_zero, _ = mixer.forward_quadratic(x)
    with torch.no_grad():
        mixer.A.fill_(0.5)
    above, _ = mixer.forward_quadratic(x)
    torch.testing.assert_close(above, at_zero, atol=0, rtol=0)
    above.sum().backward()
    assert (mixer.A.grad != 0).all()


@pytest.mark.parametrize(
    "options",
    [
        {"rope": "after_map"},
        {"decay": False, "d_conv": 0, "gate": False},
        {"feature_map": "elu", "d_conv": 2},
    ],
)
def test_option_variants_keep_forms_equal(options, gqa_teacher):
    student = convert(gqa_teacher, [HM, HM], {HM: {**options, "chunk_size": 4}})
    mixer = student.mixers()[1]
    b, l = 2, 9
    mask = _left_padded(b, l, 2)
    real = mask.bool()
    x = torch.randn(b, l, 72, generator=torch.Generator().manual_seed(6))
    pe = _rope(gqa_teacher, x, mask)
    out_q, _ = mixer.forward_quadratic(x, pe, mask)
    out_p = _run_pieces(mixer, student.new_cache(), x, pe, mask, [3, 1, 4, 1])
    torch.testing.assert_close(out_p[real], out_q[real], atol=1e-5, rtol=1e-5)


def test_bad_options_are_config_errors(gqa_teacher):
    with pytest.raises(ConfigError, match="rope"):
        convert(gqa_teacher, [HM, HM], {HM: {"rope": "after"}})
    with pytest.raises(ConfigError, match="A_init"):
        convert(gqa_teacher, [HM, HM], {HM: {"A_init": 0.5}})
    with pytest.raises(ConfigError, match="unknown option"):
        convert(gqa_teacher, [HM, HM], {HM: {"d_state": 16}})


# ------------------------------------------------------------------------------------------------
# 3. student level: cache forms and save / load


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_student_prefill_chunked_decode_and_save_load(ratio, tmp_path):
    teacher = tiny_model("llama")
    plan = make_plan(teacher.config.num_hidden_layers, HM, attention_ratio=ratio)
    assert plan.count(HM) == (2 if ratio == 0.0 else 1)
    student = convert(teacher, plan, {HM: {"chunk_size": 4}})
    with torch.no_grad():  # move off the init so decay, Δ, conv and gate all matter
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for mixer in student.mixers().values():
            mixer.A.copy_(-torch.rand_like(mixer.A))
    ids, mask = _ids(), _left_padded(2, 14, 4)
    real = mask.bool()
    full, stepped = full_and_pieces(student, ids, mask, [6] + [1] * 8)
    torch.testing.assert_close(stepped[real], full[real], atol=1e-4, rtol=1e-4)
    full, chunked = full_and_pieces(student, ids, mask, [5, 3, 6])
    torch.testing.assert_close(chunked[real], full[real], atol=1e-4, rtol=1e-4)
    student.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.layer_plan == plan
    torch.testing.assert_close(
        loaded(input_ids=ids, attention_mask=mask, use_cache=False).logits,
        student(input_ids=ids, attention_mask=mask, use_cache=False).logits,
        atol=0,
        rtol=0,
    )


REMOTE = r"""
import sys, json, torch
sys.modules["attn2ssm"] = None  # the flattened checkpoint code must not need attn2ssm
from transformers import AutoModelForCausalLM
d = sys.argv[1]
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
print(json.dumps({"max_diff": (m(input_ids=torch.load(d + "/ids.pt"), use_cache=False).logits - torch.load(d + "/logits.pt")).abs().max().item()}))
"""


def test_loads_with_trust_remote_code_without_attn2ssm(tmp_path):
    teacher = tiny_model("llama")
    student = convert(teacher, [HM, "attention"])
    ids = _ids(l=8)
    student.save_pretrained(tmp_path)
    assert (tmp_path / "attn2ssm_mixers_hedgemamba.py").exists()
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(student(input_ids=ids, use_cache=False).logits, tmp_path / "logits.pt")
    run = subprocess.run(
        [sys.executable, "-c", REMOTE, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["max_diff"] == 0.0


# ------------------------------------------------------------------------------------------------
# 4. by hand


def test_hand_computed_decayed_normalised_output():
    """l=3, one head, d=2, φ = ReLU on identity projections (so φq = φk = v = u), decay 1/2.

    u = (1, 2), (2, 1), (1, 1); kernel K_ts = u_t·u_s; w_ts = K_ts·(1/2)^(t−s); y_t = Σ w v / Σ w:
    y_1 = (1, 2);  y_2 = (2·(1,2) + 5·(2,1)) / 7 = (12, 9)/7;
    y_3 = (0.75·(1,2) + 1.5·(2,1) + 2·(1,1)) / 4.25 = (23, 20)/17.
    """
    geometry = {"hidden_size": 2, "num_heads": 1, "num_kv_heads": 1, "head_dim": 2, "rotary_dim": 0}
    mixer = HedgeMambaMixer(geometry, 0, feature_map="relu", d_conv=4, chunk_size=2)
    with torch.no_grad():
        for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj):
            proj.weight.copy_(torch.eye(2))
        mixer.A.fill_(math.log(0.5))  # Δ = 1 at init: Λ = exp(Δ·A) = 1/2
    u = torch.tensor([[[1.0, 2.0], [2.0, 1.0], [1.0, 1.0]]])
    expected = torch.tensor([[[1.0, 2.0], [12 / 7, 9 / 7], [23 / 17, 20 / 17]]])
    weights_expected = torch.tensor([[1.0, 0, 0], [2 / 7, 5 / 7, 0], [0.75 / 4.25, 1.5 / 4.25, 2 / 4.25]])
    out_q, weights = mixer.forward_quadratic(u)
    torch.testing.assert_close(out_q, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights[0, 0], weights_expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixer(u)[0], expected, atol=1e-5, rtol=1e-5)
    # Δ = 2 everywhere with A halved: the same decay, and the constant Δ cancels between the value
    # channels and their ones-channel denominator (Eq. 10)
    with torch.no_grad():
        mixer.dt_proj.bias.fill_(math.log(math.expm1(2.0)))
        mixer.A.fill_(math.log(0.5) / 2)
    torch.testing.assert_close(mixer.forward_quadratic(u)[0], expected, atol=1e-5, rtol=1e-5)
    assert DT_IDENTITY_BIAS == pytest.approx(0.541324, abs=1e-6)

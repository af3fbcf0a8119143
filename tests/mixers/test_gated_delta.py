"""The Gated DeltaNet mixer: initialised from attention (GQA), its decay and write strength set per
head, its forms (chunked forward, materialised map, prefill + one-token steps) in agreement, the
layer against its definition written out by hand, and padding that leaves the state alone."""

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert
from cache_forms import full_and_pieces
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def student():
    teacher = tiny_model("gqa_9x3")
    s = convert(teacher, ["gated_delta"] * 2)
    torch.manual_seed(2)
    with torch.no_grad():  # off the identity init (conv, gate, norm, gates' projections)
        for mixer in s.mixers().values():
            for name, p in mixer.named_parameters():
                if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                    p.add_(0.1 * torch.randn_like(p))
    return teacher, s.eval()


def test_initialised_from_attention_with_gqa(student):
    teacher, s = student
    mixer, attn = s.mixers()[0], teacher.model.layers[0].self_attn
    for mine, theirs in (
        (mixer.q_proj, attn.q_proj),
        (mixer.k_proj, attn.k_proj),
        (mixer.v_proj, attn.v_proj),
        (mixer.o_proj, attn.o_proj),
    ):
        assert torch.equal(mine.weight, theirs.weight)
    # k, v at the 3 KV heads' width
    assert mixer.k_proj.weight.shape == (24, 72) and mixer.q_proj.weight.shape == (72, 72)


def test_plain_start_and_set_head_decays():
    teacher = tiny_model("gqa_9x3")
    mixer = convert(
        teacher, ["gated_delta"] * 2, {"gated_delta": {"alpha_init": 0.9, "beta_init": 0.25}}
    ).mixers()[0]
    u = torch.randn(2, 5, 72)
    g, beta = mixer._gates(u)
    torch.testing.assert_close(g, torch.full_like(g, torch.log(torch.tensor(0.9)).item()))
    torch.testing.assert_close(beta, torch.full_like(beta, 0.25))
    alpha = torch.linspace(0.5, 0.999, 9)
    mixer.set_head_decays(alpha, torch.linspace(0.1, 0.9, 9))
    g, beta = mixer._gates(u)
    torch.testing.assert_close(g[0, 0].exp(), alpha, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(beta[0, 0], torch.linspace(0.1, 0.9, 9), atol=1e-6, rtol=1e-5)


def test_set_head_decays_takes_statistics_from_another_device():
    """Calibration measures α, β where the teacher runs and the mixer may live elsewhere (on a GPU the
    student did, and the measured values came from the CPU): the mixer takes them onto its own
    device. Here the mixer is on the meta device, the values on the CPU."""
    mixer = convert(tiny_model("gqa_9x3"), ["gated_delta"] * 2).mixers()[0].to("meta")
    mixer.set_head_decays(torch.linspace(0.5, 0.999, 9), torch.linspace(0.1, 0.9, 9))
    assert mixer.dt_bias.device.type == "meta" and mixer.b_proj.bias.device.type == "meta"


def test_the_layer_is_its_definition(student):
    """Conv off, written out with the plain loop: S ← S α(I − β k kᵀ) + β v kᵀ, o = S q / √d."""
    teacher = tiny_model("gqa_9x3")
    mixer = convert(
        teacher, ["gated_delta"] * 2, {"gated_delta": {"d_conv": 0, "gate": False, "norm": False}}
    ).mixers()[0]
    with torch.no_grad():
        mixer.a_proj.weight.normal_(std=0.1)
        mixer.b_proj.weight.normal_(std=0.1)
    u = torch.randn(1, 7, 72, generator=torch.Generator().manual_seed(3))
    out, _ = mixer(u)
    h, kv, d = 9, 3, 8
    q = F.normalize(mixer.q_proj(u).view(1, 7, h, d), dim=-1)
    k = F.normalize(mixer.k_proj(u).view(1, 7, kv, d).repeat_interleave(3, 2), dim=-1)
    v = mixer.v_proj(u).view(1, 7, kv, d).repeat_interleave(3, 2)
    alpha = torch.exp(-torch.exp(mixer.A_log) * F.softplus(mixer.a_proj(u) + mixer.dt_bias))
    beta = torch.sigmoid(mixer.b_proj(u))
    S = torch.zeros(h, d, d)
    rows = []
    for t in range(7):
        for j in range(h):
            kt = k[0, t, j]
            S[j] = S[j] @ (alpha[0, t, j] * (torch.eye(d) - beta[0, t, j] * torch.outer(kt, kt))) + beta[
                0, t, j
            ] * torch.outer(v[0, t, j], kt)
        rows.append(torch.stack([S[j] @ q[0, t, j] for j in range(h)]) / d**0.5)
    ref = mixer.o_proj(torch.stack(rows).reshape(1, 7, h * d))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_chunked_forward_equals_the_materialised_map(student):
    _, s = student
    mixer = s.mixers()[1]
    u = torch.randn(2, 23, 72, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 23)
    mask[1, :4] = 0
    mixer.context.padding_mask = mask
    try:
        out, _ = mixer(u)
    finally:
        mixer.context.padding_mask = None
    quad, M = mixer.forward_quadratic(u, mask=mask)
    torch.testing.assert_close(out[1, 4:], quad[1, 4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], quad[0], atol=1e-5, rtol=1e-5)
    assert M.shape == (2, 9, 23, 23) and torch.triu(M, 1).abs().max() == 0


def test_prefill_pieces_and_steps_equal_one_forward(student):
    _, s = student
    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        for pieces in ([13], [5, 8], [6, 1, 1, 1, 1, 1, 1, 1]):
            full, parts = full_and_pieces(s, ids, mask, pieces)
            real = mask.bool()
            torch.testing.assert_close(parts[real], full[real], atol=1e-4, rtol=1e-4)


# what Qwen3.5 / llama.cpp's qwen35 hold (export/native_qwen35.py)
EXPORT_FORM = {"gate_bias": False, "beta_bias": False, "conv_bias": False}


def test_bias_free_form_starts_at_half_beta_and_calibrates_decays_only():
    mixer = convert(
        tiny_model("gqa_9x3"), ["gated_delta"] * 2, {"gated_delta": {**EXPORT_FORM, "alpha_init": 0.9}}
    ).mixers()[0]
    assert mixer.gate.bias is None and mixer.b_proj.bias is None and mixer.conv.bias is None
    assert mixer.gate.weight.abs().max() > 0  # SiLU(0) = 0 would silence it: nn.Linear's init
    u = torch.randn(2, 5, 72)
    g, beta = mixer._gates(u)
    torch.testing.assert_close(beta, torch.full_like(beta, 0.5))
    torch.testing.assert_close(g.exp(), torch.full_like(g, 0.9))
    alpha = torch.linspace(0.5, 0.999, 9)
    mixer.set_head_decays(alpha, torch.linspace(0.1, 0.9, 9))  # β has no place: only the decays move
    g, beta = mixer._gates(u)
    torch.testing.assert_close(g[0, 0].exp(), alpha, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(beta, torch.full_like(beta, 0.5))


def test_bias_free_form_prefill_pieces_and_steps_equal_one_forward():
    s = convert(tiny_model("gqa_9x3"), ["gated_delta"] * 2, {"gated_delta": EXPORT_FORM})
    torch.manual_seed(4)
    with torch.no_grad():
        for mixer in s.mixers().values():
            for name, p in mixer.named_parameters():
                if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                    p.add_(0.1 * torch.randn_like(p))
    s.eval()
    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        for pieces in ([13], [5, 8], [6, 1, 1, 1, 1, 1, 1, 1]):
            full, parts = full_and_pieces(s, ids, mask, pieces)
            torch.testing.assert_close(parts[mask.bool()], full[mask.bool()], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"decay_init": "magic"}, "decay_init"),
        ({"alpha_init": 1.0}, "alpha_init"),
        ({"beta_init": 0}, "beta_init"),
        ({"rope": "after"}, "rope"),
        ({"beta_bias": False, "beta_init": 0.3}, "beta_bias"),
    ],
)
def test_bad_options_are_one_line(options, needle):
    with pytest.raises(ConfigError, match=needle):
        convert(tiny_model("gqa_9x3"), ["gated_delta"] * 2, {"gated_delta": options})

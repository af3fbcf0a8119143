"""The gated delta rule's calibrated start: head statistics against hand-computed cases, their map
to (α, β), and calibration of a tiny student (only calibrated gated_delta mixers change)."""

import torch

from attn2ssm.distill.calibration import calibrate_gated_delta, decays_from, head_statistics
from attn2ssm.student.convert import convert
from tiny_models import tiny_model


def test_statistics_of_hand_made_heads():
    l = 8
    prev = torch.zeros(1, 2, l, l)  # head 0: each query reads the token before it; head 1: the first token
    for i in range(l):
        prev[0, 0, i, max(i - 1, 0)] = 1.0
        prev[0, 1, i, 0] = 1.0
    keys = torch.zeros(1, l, 2, 4)
    keys[0, :, 0, 0] = 1.0  # head 0: every key the same direction → crowding 1
    keys[0, :, 1] = torch.eye(4).repeat(2, 1)  # head 1: cycles through 4 orthogonal keys
    distance, crowding = head_statistics(prev, keys)
    # second half of the queries: i = 4..7
    torch.testing.assert_close(distance, torch.tensor([1.0, sum(range(4, 8)) / 4]))
    # head 1: of the 7 other positions of each key, 1 repeats its direction (cos 1), the rest are orthogonal
    torch.testing.assert_close(crowding, torch.tensor([1.0, 1 / 7]))
    alpha, beta = decays_from(distance, crowding)
    torch.testing.assert_close(alpha, torch.tensor([0.5, 5.5 / 6.5]))
    torch.testing.assert_close(beta, torch.tensor([0.05, 6 / 7]))


def test_calibration_sets_only_calibrated_gated_delta_heads():
    teacher = tiny_model("gqa_9x3")
    student = convert(teacher, ["gated_delta", "gated_delta"], {"gated_delta": {}})
    plain = convert(teacher, ["gated_delta", "gated_delta"], {"gated_delta": {"decay_init": "plain"}})
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    before = {i: m.dt_bias.clone() for i, m in student.mixers().items()}
    report = calibrate_gated_delta(student, teacher, ids)
    assert sorted(report) == [0, 1] and len(report[0]["alpha"]) == 9
    for i, mixer in student.mixers().items():
        assert not torch.equal(mixer.dt_bias, before[i])
        g, beta = mixer._gates(torch.zeros(1, 1, 72))
        torch.testing.assert_close(g[0, 0].exp(), torch.tensor(report[i]["alpha"]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(beta[0, 0], torch.tensor(report[i]["beta"]), atol=1e-5, rtol=1e-5)
    assert calibrate_gated_delta(plain, teacher, ids) == {}  # decay_init: plain is left as it starts


def test_bias_free_beta_gets_the_decays_only():
    """beta_bias: false (the form that exports to Qwen3.5) has no place for a per-head β: the decays
    are calibrated, β stays 1/2 and the report says so."""
    teacher = tiny_model("gqa_9x3")
    student = convert(teacher, ["gated_delta", "gated_delta"], {"gated_delta": {"beta_bias": False}})
    report = calibrate_gated_delta(
        student, teacher, torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    )
    for i, mixer in student.mixers().items():
        g, beta = mixer._gates(torch.zeros(1, 1, 72))
        torch.testing.assert_close(g[0, 0].exp(), torch.tensor(report[i]["alpha"]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(beta, torch.full_like(beta, 0.5))
        assert report[i]["beta_set"] is False

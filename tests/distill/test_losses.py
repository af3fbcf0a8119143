"""Losses against hand computations; per-real-token normalisation; the chunked KL's gradient."""

import math

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.distill.losses import cross_entropy, forward_kl


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def test_forward_kl_hand_computed():
    # two positions, vocabulary 3
    s = [[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]]
    t = [[2.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    expected = 0.0
    for si, ti in zip(s, t):
        ps, pt = _softmax(si), _softmax(ti)
        expected += sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt, ps))
    expected /= 2  # per real token
    got = forward_kl(torch.tensor([s]), torch.tensor([t]))
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_forward_kl_temperature_hand_computed():
    s, t, T = [0.3, -1.0, 2.0, 0.0], [1.0, 0.5, -0.5, 0.0], 2.0
    ps, pt = _softmax([x / T for x in s]), _softmax([x / T for x in t])
    expected = T * T * sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt, ps))
    got = forward_kl(torch.tensor([[s]]), torch.tensor([[t]]), temperature=T)
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_forward_kl_masks_padding_and_normalises_per_real_token():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    per_token = (F.softmax(t, -1) * (F.log_softmax(t, -1) - F.log_softmax(s, -1))).sum(-1)
    expected = per_token[mask.bool()].mean()
    assert forward_kl(s, t, mask).item() == pytest.approx(expected.item(), rel=1e-5)
    # garbage in padded positions changes nothing
    s2 = s.clone()
    s2[1, :2] = 1e4
    assert forward_kl(s2, t, mask).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_forward_kl_gradient_matches_autograd(chunk):
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 4, 7, generator=g, requires_grad=True)
    t = torch.randn(3, 4, 7, generator=g)
    mask = torch.ones(3, 4)
    mask[0, 0] = 0
    T = 1.5
    ref = (
        T * T * (F.softmax(t / T, -1) * (F.log_softmax(t / T, -1) - F.log_softmax(s / T, -1))).sum(-1) * mask
    ).sum() / mask.sum()
    (ref_grad,) = torch.autograd.grad(ref, s)
    loss = forward_kl(s, t, mask, temperature=T, chunk_size=chunk)
    (grad,) = torch.autograd.grad(loss * 2.0, s)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(grad, 2.0 * ref_grad, atol=1e-6, rtol=1e-5)


def test_forward_kl_zero_when_equal():
    x = torch.randn(2, 3, 5)
    assert forward_kl(x, x).abs().item() < 1e-6


def test_cross_entropy_hand_computed():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [5.0, 5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 2]])
    # position 0 predicts token 1, position 1 predicts token 2; the last position predicts nothing
    expected = (-math.log(_softmax([2.0, 0.0, 0.0])[1]) - math.log(_softmax([0.0, 1.0, 0.0])[2])) / 2
    assert cross_entropy(logits, ids).item() == pytest.approx(expected, rel=1e-6)


def test_cross_entropy_mask_counts_real_targets_only():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [5.0, 5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[0, 1, 1]])  # first token is padding: only 1→2 counts
    expected = -math.log(_softmax([0.0, 1.0, 0.0])[2])
    assert cross_entropy(logits, ids, mask).item() == pytest.approx(expected, rel=1e-6)


def test_attention_cross_entropy_hand_computed():
    from attn2ssm.distill.losses import attention_cross_entropy

    # one head, two query rows (causal): row 0 sees key 0; row 1 sees keys 0 and 1
    t = torch.tensor([[[[1.0, 0.0], [0.3, 0.7]]]])
    w = torch.tensor([[[[1.0, 0.0], [0.6, 0.4]]]])
    ce_row1 = -(0.3 * math.log(0.6) + 0.7 * math.log(0.4))
    expected_ce = (0.0 + ce_row1) / 2  # mean over the 2 query rows
    assert attention_cross_entropy(t, w).item() == pytest.approx(expected_ce, rel=1e-6)
    kl_row1 = 0.3 * math.log(0.3 / 0.6) + 0.7 * math.log(0.7 / 0.4)
    assert attention_cross_entropy(t, w, form="kl").item() == pytest.approx(kl_row1 / 2, rel=1e-6)
    # a padded first query row does not count
    mask = torch.tensor([[0, 1]])
    assert attention_cross_entropy(t, w, mask).item() == pytest.approx(ce_row1, rel=1e-6)
    assert attention_cross_entropy(t, t, form="kl").item() == pytest.approx(0.0, abs=1e-7)


def test_output_mse_and_cosine_hand_computed():
    from attn2ssm.distill.losses import output_cosine, output_mse

    s = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
    t = torch.tensor([[[1.0, 1.0], [0.0, 1.0]]])
    # token 0: ((0)^2 + (−1)^2)/2 = 0.5; token 1: (0 + 1)/2 = 0.5
    assert output_mse(s, t).item() == pytest.approx(0.5)
    # token 0: 1 − cos45° ; token 1: 1 − 1 = 0
    assert output_cosine(s, t).item() == pytest.approx((1 - math.sqrt(0.5)) / 2, rel=1e-6)
    assert output_cosine(s, t, torch.tensor([[0, 1]])).item() == pytest.approx(0.0, abs=1e-7)


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_dpo_loss_hand_computed():
    from attn2ssm.distill.losses import dpo_loss

    beta = 0.1
    pc, pr = torch.tensor([-10.0, -5.0]), torch.tensor([-12.0, -4.0])
    rc, rr = torch.tensor([-11.0, -5.0]), torch.tensor([-11.0, -5.0])
    # pair 0: (−10 − −11) − (−12 − −11) = 2 ; pair 1: (−5 − −5) − (−4 − −5) = −1
    expected = -(_log_sigmoid(beta * 2.0) + _log_sigmoid(beta * -1.0)) / 2
    assert dpo_loss(pc, pr, rc, rr, beta).item() == pytest.approx(expected, rel=1e-6)


def test_dpo_loss_is_log2_when_policy_equals_reference():
    from attn2ssm.distill.losses import dpo_loss

    c, r = torch.randn(5) * 30, torch.randn(5) * 30
    assert dpo_loss(c, r, c.clone(), r.clone(), 0.01).item() == pytest.approx(math.log(2), rel=1e-7)


def test_sequence_logps_and_response_cross_entropy_hand_computed():
    from attn2ssm.distill.losses import response_cross_entropy, sequence_logps

    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 3.0], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[0, 1, 2, 0]])
    loss_mask = torch.tensor([[False, False, True, True]])  # the reply is tokens 2 and 3
    # token 2 is predicted at position 1, token 3 (id 0) at position 2
    lp = math.log(_softmax([0.0, 1.0, 0.0])[2]) + math.log(_softmax([1.0, 1.0, 3.0])[0])
    assert sequence_logps(logits, ids, loss_mask).item() == pytest.approx(lp, rel=1e-6)
    total, count = response_cross_entropy(logits, ids, loss_mask)
    assert count.item() == 2 and total.item() == pytest.approx(-lp, rel=1e-6)


def test_token_cross_entropy_has_no_shift():
    from attn2ssm.distill.losses import token_cross_entropy

    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    targets = torch.tensor([[0, 2]])
    expected = (-math.log(_softmax([2.0, 0.0, 0.0])[0]) - math.log(_softmax([0.0, 1.0, 0.0])[2])) / 2
    assert token_cross_entropy(logits, targets).item() == pytest.approx(expected, rel=1e-6)
    mask = torch.tensor([[0, 1]])
    assert token_cross_entropy(logits, targets, mask).item() == pytest.approx(
        -math.log(_softmax([0.0, 1.0, 0.0])[2]), rel=1e-6
    )

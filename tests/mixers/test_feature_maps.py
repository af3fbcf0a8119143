"""Feature maps φ: shapes, non-negativity, stability, and each map's kernel identity (fp32)."""

import math

import pytest
import torch

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.feature_maps import FEATURE_MAPS, build_feature_map
from attn2ssm.ops.linear_attention import linear_attention_quadratic

B, H, L, D = 2, 3, 7, 8

# name → options used for the generic checks (every registered map must appear here)
CASES = {
    "elu": {},
    "relu": {},
    "exp_t": {"t": 2.0},
    "hedgehog": {},
    "hedgehog-exp": {"activation": "exp"},
    "hedgehog-half": {"activation": "softmax_half", "feature_dim": 5},
    "t2r": {},
    "t2r-wide": {"feature_dim": 12},
    "taylor": {},
    "taylor-sym": {"symmetric": True},
    "performer": {"num_features": 16},
    "performer-row": {"stabilizer": "row"},
    "cosformer": {"max_len": 64},
}


def _build(case, h=H, d=D):
    return build_feature_map(case.split("-")[0], h, d, **CASES[case])


def _x(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _kernel(fq, fk):
    return (fq * fk).sum(-1)


def test_every_registered_map_is_covered():
    assert {c.split("-")[0] for c in CASES} == set(FEATURE_MAPS)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scale", [1.0, 50.0])
def test_shape_nonnegative_finite(case, scale):
    fm = _build(case)
    x = _x(B, H, L, D, scale=scale)
    y = fm(x)
    assert y.shape == (B, H, L, fm.feature_dim)
    assert torch.isfinite(y).all()
    if case.startswith("taylor"):  # signed features, positive kernel
        k = _kernel(fm(x)[:, :, :, None], fm(_x(B, H, L, D, seed=1, scale=scale))[:, :, None])
        assert torch.isfinite(k).all() and (k > 0).all()
    else:
        assert (y >= 0).all()
    # positions are accepted by every map
    assert fm(x, positions=torch.arange(L)).shape == y.shape


@pytest.mark.parametrize("case", list(CASES))
def test_only_hedgehog_and_t2r_are_trainable(case):
    n = sum(p.numel() for p in _build(case).parameters())
    assert (n > 0) == (case.split("-")[0] in ("hedgehog", "t2r"))


# ---------------------------------------------------------------------------------------- hedgehog
def test_hedgehog_identity_init_kernel_is_sum_of_cosh():
    fm = build_feature_map("hedgehog", H, D, activation="exp")
    assert fm.feature_dim == 2 * D
    torch.testing.assert_close(fm.weight.detach(), torch.eye(D).expand(H, D, D))
    assert (fm.bias == 0).all()
    q, k = _x(B, H, L, D, seed=0), _x(B, H, L, D, seed=1)
    expected = (2 * torch.cosh(q + k)).sum(-1)
    torch.testing.assert_close(_kernel(fm(q), fm(k)), expected, rtol=1e-5, atol=1e-5)


def test_hedgehog_joint_softmax_is_raw_exp_over_its_token_sum():
    raw = build_feature_map("hedgehog", H, D, activation="exp")
    soft = build_feature_map("hedgehog", H, D)  # default: joint softmax
    assert soft.activation == "softmax"
    with torch.no_grad():  # same non-identity weights in both
        w, b = _x(H, D, D, seed=2) * 0.5, _x(H, D, seed=3)
        for m in (raw, soft):
            m.weight.copy_(w)
            m.bias.copy_(b)
    x = _x(B, H, L, D, seed=4)
    r = raw(x)
    torch.testing.assert_close(soft(x), r / r.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)
    # on queries the per-token scalar cancels in the normalised weights
    k, v = raw(_x(B, H, L, D, seed=5)), _x(B, H, L, D, seed=6)
    torch.testing.assert_close(
        linear_attention_quadratic(soft(x), k, v, eps=0)[1], linear_attention_quadratic(r, k, v, eps=0)[1]
    )


def test_hedgehog_softmax_half_normalises_each_half():
    fm = build_feature_map("hedgehog", H, D, activation="softmax_half", feature_dim=5)
    y = fm(_x(B, H, L, D))
    assert fm.feature_dim == 10 and fm.weight.shape == (H, D, 5) and fm.bias.shape == (H, 5)
    torch.testing.assert_close(y[..., :5].sum(-1), torch.ones(B, H, L))
    torch.testing.assert_close(y[..., 5:].sum(-1), torch.ones(B, H, L))


@pytest.mark.parametrize("name", ["hedgehog", "t2r"])
def test_heads_have_separate_parameters(name):
    fm = build_feature_map(name, H, D)
    x = _x(B, H, L, D)
    before = fm(x).detach()
    with torch.no_grad():
        fm.weight[0] += 0.3 * _x(D, fm.weight.shape[-1], seed=7)
    after = fm(x).detach()
    assert not torch.allclose(after[:, 0], before[:, 0])
    torch.testing.assert_close(after[:, 1:], before[:, 1:], rtol=0, atol=0)
    assert fm.weight.shape[0] == H and fm.bias.shape[0] == H


def test_hedgehog_gradients_reach_parameters():
    fm = build_feature_map("hedgehog", H, D)
    fm(_x(B, H, L, D)).pow(2).sum().backward()
    assert fm.weight.grad.abs().sum() > 0 and fm.bias.grad.abs().sum() > 0


def test_t2r_identity_init_equals_relu():
    x = _x(B, H, L, D)
    torch.testing.assert_close(build_feature_map("t2r", H, D)(x), torch.relu(x))
    wide = build_feature_map("t2r", H, D, feature_dim=12)  # extra columns are random, not dead
    assert wide.feature_dim == 12 and wide.weight[:, :, D:].abs().sum() > 0


def test_exp_t():
    x = _x(B, H, L, D)
    torch.testing.assert_close(build_feature_map("exp_t", H, D, t=2.0)(x), torch.exp(2 * x))


# ------------------------------------------------------------------------------------------- taylor
@pytest.mark.parametrize("symmetric", [False, True])
def test_taylor_kernel_is_second_order_exp(symmetric):
    fm = build_feature_map("taylor", H, D, symmetric=symmetric)
    assert fm.feature_dim == (1 + D + D * (D + 1) // 2 if symmetric else 1 + D + D * D)
    q, k = _x(B, H, L, D, seed=0).double(), _x(B, H, L, D, seed=1).double()
    s = (q[:, :, :, None] * k[:, :, None]).sum(-1) / math.sqrt(D)  # (b, h, l, l)
    got = fm(q) @ fm(k).transpose(-1, -2)
    torch.testing.assert_close(got, 1 + s + s * s / 2, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- performer
def test_performer_approximates_softmax_kernel():
    d = 16
    fm = build_feature_map("performer", 1, d, num_features=4096, seed=0, stabilizer="none")
    # small norms: ‖x/d^¼‖ ≈ 0.6
    q, k = _x(1, 1, 16, d, seed=0, scale=0.3), _x(1, 1, 16, d, seed=1, scale=0.3)
    approx = (fm(q) @ fm(k).transpose(-1, -2)).flatten()
    exact = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(d)).flatten()
    rel = (approx - exact).abs() / exact
    assert rel.max() < 0.05 and rel.mean() < 0.02
    # it tracks the variation, not just the mean
    assert torch.corrcoef(torch.stack([approx, exact]))[0, 1] > 0.95


def test_performer_omega_is_block_orthogonal_and_seeded():
    d = 8
    om = build_feature_map("performer", 1, d, num_features=20, seed=1).omega
    assert om.shape == (20, d)
    for start in (0, 8):
        block = om[start : start + d]
        gram = block @ block.T
        torch.testing.assert_close(gram, torch.diag(torch.diagonal(gram)), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        om, build_feature_map("performer", 1, d, num_features=20, seed=1).omega, rtol=0, atol=0
    )
    assert not torch.equal(om, build_feature_map("performer", 1, d, num_features=20, seed=2).omega)


def test_performer_reloads_identically_from_state_dict():
    a = build_feature_map("performer", H, D, num_features=32, seed=5)
    assert "omega" in a.state_dict()
    b = build_feature_map("performer", H, D, num_features=32, seed=6)
    b.load_state_dict(a.state_dict())
    x = _x(B, H, L, D)
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)


def test_performer_stabilizers_leave_normalised_weights_unchanged():
    opts = {"num_features": 32, "seed": 0}
    raw = build_feature_map("performer", H, D, stabilizer="none", **opts)
    seq = build_feature_map("performer", H, D, stabilizer="sequence", **opts)
    row = build_feature_map("performer", H, D, stabilizer="row", **opts)
    q, k, v = _x(B, H, L, D, seed=0), _x(B, H, L, D, seed=1), _x(B, H, L, D, seed=2)
    ref = linear_attention_quadratic(raw(q), raw(k), v, eps=0)[1]
    for fq, fk in ((seq(q), seq(k)), (row(q), seq(k))):
        torch.testing.assert_close(linear_attention_quadratic(fq, fk, v, eps=0)[1], ref, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------- cosformer
def test_cosformer_depends_on_position_and_reweights_by_distance():
    m = 64
    fm = build_feature_map("cosformer", H, D, max_len=m)
    assert fm.feature_dim == 2 * D
    x = _x(1, H, 1, D).expand(1, H, 2, D)  # the same token at two positions
    y = fm(x, positions=torch.tensor([[3, 40]]))
    assert not torch.allclose(y[:, :, 0], y[:, :, 1])
    torch.testing.assert_close(fm(x[:, :, :1]), fm(x[:, :, :1], positions=torch.tensor([0])))  # None → arange

    q, k = _x(B, H, L, D, seed=0), _x(B, H, L, D, seed=1)
    pos = torch.stack([torch.arange(L), torch.arange(L) * 5 + 2])  # (b, l)
    got = fm(q, pos) @ fm(k, pos).transpose(-1, -2)
    rel = (pos[:, :, None] - pos[:, None, :]).float()  # (b, l, l)
    expected = (torch.relu(q) @ torch.relu(k).transpose(-1, -2)) * torch.cos(math.pi * rel / (2 * m))[:, None]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- errors
def test_unknown_option_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"unknown option actvation for feature map 'hedgehog' — valid options: feature_dim, activation",
    ):
        build_feature_map("hedgehog", H, D, actvation="exp")
    with pytest.raises(ConfigError, match="takes no options"):
        build_feature_map("elu", H, D, t=1.0)
    with pytest.raises(ConfigError, match="valid options: num_features, seed, stabilizer"):
        build_feature_map("performer", H, D, m=4)
    msg = str(pytest.raises(ConfigError, build_feature_map, "taylor", H, D, degree=3).value)
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("hedgehog", {"activation": "relu"}),
        ("hedgehog", {"feature_dim": 0}),
        ("t2r", {"init": "zeros"}),
        ("performer", {"stabilizer": "max"}),
        ("cosformer", {"max_len": -1}),
        ("taylor", {"symmetric": "yes"}),
    ],
)
def test_bad_option_value_is_a_config_error(name, options):
    with pytest.raises(ConfigError, match="is not valid"):
        build_feature_map(name, H, D, **options)


def test_unknown_map_name_lists_the_maps():
    with pytest.raises(
        ConfigError, match="choose one of: cosformer, elu, exp_t, hedgehog, performer, relu, t2r, taylor"
    ):
        build_feature_map("hedgehogg", H, D)

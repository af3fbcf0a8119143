"""The bidirectional Mamba (Vim) mixer: its scan against the quadratic reference, with the class
token scanned in the middle (Vim), first (teacher order), DeiT's two prefix tokens, or none."""

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.bimamba import BiMambaMixer
from attn2ssm.mixers.registry import MIXERS, build_mixer
from attn2ssm.ops.bidirectional import bidirectional_scan_quadratic
from attn2ssm.ops.conv import causal_conv1d


def make(prefix=1, **options):
    torch.manual_seed(0)
    m = build_mixer(
        "bimamba", {"hidden_size": 8, "num_prefix_tokens": prefix}, 0, {"d_state": 4, "d_conv": 3, **options}
    )
    with torch.no_grad():  # a non-trivial conv and decay, so order matters everywhere
        for d in (m.fw, m.bw):
            d.conv.weight.normal_()
            d.A_log.normal_(0, 0.5)
    return m


def reference(m, u, order):
    """The mixer's output from the closed-form quadratic scan, with the scan order given by hand."""
    us = u[:, order]
    x, z = m.in_proj(us).chunk(2, -1)
    dirs = []
    for d, flip in ((m.fw, False), (m.bw, True)):
        xi = x.flip(1) if flip else x
        xi, _ = causal_conv1d(xi, d.conv.weight, d.conv.bias, activation="silu")
        low, B, C = d.x_proj(xi).split([m.dt_rank, m.d_state, m.d_state], -1)
        dt = F.softplus(d.dt_proj(low))
        t = [xi, dt, B, C]
        if flip:
            t = [v.flip(1) for v in t]
        xi, dt, B, C = t
        b, l, _ = xi.shape
        dirs.append(
            (
                xi.view(b, l, 1, -1),
                dt.view(b, l, 1, -1),
                -torch.exp(d.A_log),
                B.view(b, l, 1, -1),
                C.view(b, l, 1, -1),
                d.D,
            )
        )
    y = bidirectional_scan_quadratic(*dirs).reshape(*x.shape)
    out = m.out_proj(0.5 * y * F.silu(z))
    return out[:, torch.argsort(torch.tensor(order))]


@pytest.mark.parametrize(
    "prefix, cls_position, order",
    [
        (1, "middle", [1, 2, 3, 4, 0, 5, 6, 7, 8]),  # ViT: 8 patches, class token after the first 4 (Vim)
        (1, "first", list(range(9))),  # class token scanned where the teacher has it
        (2, "middle", [2, 3, 4, 0, 1, 5, 6, 7, 8]),  # DeiT: class + distillation token, 7 patches
        (0, "middle", list(range(9))),  # no class token: nothing moves
    ],
)
def test_mixer_equals_quadratic_reference(prefix, cls_position, order):
    m = make(prefix, cls_position=cls_position)
    assert (m.scan_order(9) is None) == (order == list(range(9)))
    u = torch.randn(2, 9, 8)
    y, none = m(u)
    assert none is None
    torch.testing.assert_close(y, reference(m, u, order), atol=1e-5, rtol=1e-4)


def test_class_token_position_changes_the_output_and_bc_come_back_in_token_order():
    middle, first = make(1, cls_position="middle"), make(1, cls_position="first")
    u = torch.randn(1, 9, 8)
    assert not torch.allclose(middle(u)[0], first(u)[0])
    got = {}
    handle = middle.bc_tap.register_forward_hook(lambda tap, args, out: got.update(fw=args[:2], bw=args[2:]))
    middle(u)
    handle.remove()
    # B/C are per-token functions of the conv output: token i's value comes from scan position order⁻¹(i)
    x, _ = middle.in_proj(u[:, [1, 2, 3, 4, 0, 5, 6, 7, 8]]).chunk(2, -1)
    xc, _ = causal_conv1d(x, middle.fw.conv.weight, middle.fw.conv.bias, activation="silu")
    B_scan = middle.fw.x_proj(xc)[..., middle.dt_rank : middle.dt_rank + 4]
    torch.testing.assert_close(got["fw"][0][0, 0, 0], B_scan[0, 4])  # the class token sat at scan position 4
    assert got["bw"][1].shape == (1, 9, 1, 4)


def test_A_init_and_defaults():
    m = make(1, A_init=-1e-4)
    m.init_new_parameters()
    torch.testing.assert_close(-torch.exp(m.bw.A_log), torch.full_like(m.bw.A_log, -1e-4))
    s4d = make(1)
    s4d.init_new_parameters()
    torch.testing.assert_close(-torch.exp(s4d.fw.A_log[0, 0]), -torch.arange(1.0, 5.0))
    assert "bimamba" not in MIXERS  # an encoder mixer never enters a causal LM's plan
    with pytest.raises(ConfigError, match="cls_position"):
        make(1, cls_position="last")
    assert isinstance(m, BiMambaMixer)

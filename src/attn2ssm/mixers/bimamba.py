"""Bidirectional Mamba (Vision Mamba, "Vim" v2 block) as a drop-in for a vision transformer's
attention module (ViT / DeiT ``layer.attention``), for CAB's vision half (CAB §3.3).

Per layer, with u the (normed) layer input in the teacher's token order [prefix tokens, patches]:

    x, z = in_proj(u)                                       (shared by both directions, as Vim)
    for dir in (fw, bw):                                    (each its own conv, x_proj, Δ, A, D)
        x_dir = SiLU(conv_dir(x))                           (causal conv along dir's scan order)
        Δ_low, B_dir, C_dir = x_proj_dir(x_dir)             (B, C ∈ R^{d_state} per token, one group)
        Δ_dir = softplus(dt_proj_dir(Δ_low))
    y   = (scan_fw + flip(scan_bw(flip ·))) / 2 · SiLU(z)     (ops/bidirectional.py; Vim's if_divide_out)
    out = out_proj(y)

Class token (CAB §3.3 leaves it open): DeiT keeps its prefix token(s) at
index 0, Vim puts its class token in the middle of the patches. ``cls_position: middle`` moves
the ``num_prefix_tokens`` prefix tokens to the middle of the scan order (Vim) and everything —
output, and the B/C handed to CAB's bridges — back to the teacher's order afterwards, so the
alignment is token to token, class token to class token. ``first`` scans in the teacher's order.

``A_init`` (CAB, Table 5): every A starts at that small negative value (Ā = exp(ΔA) ≈ I);
None is Vim's S4D-real init A = −(1, …, d_state) per channel.

``bc_tap`` (mixers/taps.py): called once per forward with B_fw, C_fw, B_bw, C_bw, each
(b, l, 1, d_state) in the teacher's token order (the backward ones flipped back), continuous-time
(before Δ), as CAB aligns them (CAB, L202); the vision CAB stage hooks it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.options import PositiveFloat, PositiveInt
from attn2ssm.mixers.ssm_common import A_log_identity, CausalConv, dt_bias_init
from attn2ssm.mixers.taps import Tap
from attn2ssm.ops.bidirectional import bidirectional_scan_chunked
from attn2ssm.ops.conv import causal_conv1d

CLS_POSITIONS = ("middle", "first")


class _Direction(nn.Module):
    """One scan direction's own parameters: conv, x_proj (Δ_low | B | C), dt_proj, A_log, D."""

    def __init__(self, d_inner: int, d_state: int, dt_rank: int, d_conv: int):
        super().__init__()
        self.conv = CausalConv(d_inner, d_conv)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(1, d_inner, d_state))  # (groups=1, p, n)
        self.D = nn.Parameter(torch.ones(1, d_inner))


class BiMambaMixer(nn.Module):
    mixer_type = "bimamba"

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        d_state: PositiveInt = 16,
        expand: PositiveInt = 2,
        dt_rank: PositiveInt | None = None,
        d_conv: PositiveInt = 4,
        dt_min: PositiveFloat = 1e-3,
        dt_max: PositiveFloat = 0.1,
        A_init: float | None = None,
        cls_position: str = "middle",
        chunk_size: PositiveInt = 64,
    ):
        super().__init__()
        if cls_position not in CLS_POSITIONS:
            raise ConfigError(
                f"bimamba option cls_position={cls_position!r} is not valid",
                f"use one of: {', '.join(CLS_POSITIONS)}",
            )
        if d_state < 1 or expand < 1:
            raise ConfigError(
                f"bimamba d_state={d_state}, expand={expand} must be positive",
                "use e.g. d_state: 16, expand: 2 (Vim)",
            )
        self.layer_idx = layer_idx
        self.hidden_size = geometry["hidden_size"]
        self.num_prefix_tokens = int(geometry.get("num_prefix_tokens", 0))
        self.d_state, self.d_inner = d_state, expand * self.hidden_size
        self.dt_rank = dt_rank or math.ceil(self.hidden_size / 16)
        self.dt_range = (dt_min, dt_max)
        self.A_log_init = A_log_identity("bimamba", A_init)
        self.cls_position, self.chunk_size = cls_position, chunk_size
        self.in_proj = nn.Linear(self.hidden_size, 2 * self.d_inner, bias=False)
        self.fw = _Direction(self.d_inner, d_state, self.dt_rank, d_conv)
        self.bw = _Direction(self.d_inner, d_state, self.dt_rank, d_conv)
        self.out_proj = nn.Linear(self.d_inner, self.hidden_size, bias=False)
        self.bc_tap = Tap()  # shows B and C of both directions to a stage that hooks it (CAB)
        self.init_new_parameters()

    # the student calls this after the family's weight init (which would reset Δ, A, D, conv)
    @torch.no_grad()
    def init_new_parameters(self) -> None:
        for d in (self.fw, self.bw):
            d.conv.reset_parameters()
            bound = self.dt_rank**-0.5
            d.dt_proj.weight.uniform_(-bound, bound)
            d.dt_proj.bias.copy_(dt_bias_init(self.d_inner, *self.dt_range))
            if self.A_log_init is not None:  # A ≈ 0, Ā ≈ I (as CAB)
                d.A_log.fill_(self.A_log_init)
            else:  # S4D-real: A = −(1, …, N) for every channel (Vim's default)
                d.A_log.copy_(
                    torch.log(torch.arange(1, self.d_state + 1, dtype=torch.float32)).expand_as(d.A_log)
                )
            d.D.fill_(1.0)

    # -- token order ------------------------------------------------------------------------
    def scan_order(self, length: int, device=None) -> torch.Tensor | None:
        """Indices putting the teacher's tokens in scan order (None: the same order). ``middle``:
        patches[:M//2], prefix tokens, patches[M//2:] with M = length − prefix (Vim's middle class token)."""
        k = self.num_prefix_tokens
        if self.cls_position == "first" or k == 0 or length <= k:
            return None
        m = length - k
        idx = list(range(k, k + m // 2)) + list(range(k)) + list(range(k + m // 2, length))
        return torch.tensor(idx, device=device)

    # -- the layer ----------------------------------------------------------------------------
    def _direction(self, d: _Direction, x: torch.Tensor):
        """x (b, l, d_inner) in this direction's scan order → (x, Δ, A, B, C, D) for the scan op."""
        b, l, _ = x.shape
        x, _ = causal_conv1d(x, d.conv.weight, d.conv.bias, activation="silu")
        low, B, C = d.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(d.dt_proj(low).float())
        A = -torch.exp(d.A_log.float())
        return (
            x.view(b, l, 1, self.d_inner),
            dt.view(b, l, 1, self.d_inner),
            A,
            B.view(b, l, 1, -1),
            C.view(b, l, 1, -1),
            d.D,
        )

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """(b, l, hidden) → ((b, l, hidden), None), the attention module's return convention."""
        b, l, _ = hidden_states.shape
        order = self.scan_order(l, hidden_states.device)
        u = hidden_states if order is None else hidden_states.index_select(1, order)
        x, z = self.in_proj(u).chunk(2, dim=-1)
        fw = self._direction(self.fw, x)
        flipped = self._direction(self.bw, x.flip(1))  # the backward branch in its own (flipped) order
        bw = tuple(t.flip(1) if i in (0, 1, 3, 4) else t for i, t in enumerate(flipped))  # back to scan order
        # B_fw, C_fw, B_bw, C_bw
        self.bc_tap(*(self._to_teacher(t, order) for d in (fw, bw) for t in (d[3], d[4])))
        y = bidirectional_scan_chunked(fw, bw, chunk_size=self.chunk_size).reshape(b, l, self.d_inner)
        y = (0.5 * y).to(z.dtype) * F.silu(z)
        out = self.out_proj(y)
        return self._to_teacher(out, order), None

    @staticmethod
    def _to_teacher(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
        """Scan order → the teacher's token order (dim 1)."""
        if order is None:
            return t
        return t.index_select(1, torch.argsort(order))

"""Feature maps φ for linear attention: (b, h, l, d) → (b, h, l, f).

Each map is an ``nn.Module`` built by ``build_feature_map(name, num_heads, head_dim, **options)``
(equivalently ``Cls(num_heads, head_dim, **options)``), exposes ``feature_dim`` (= f) and
``forward(x, positions=None)``. ``positions`` is an optional (b, l) or (l,) LongTensor of absolute
token positions; only cosFormer uses it (the others accept and ignore it).

The linear-attention kernel is K(q, k) = φ(q)·φ(k); the attention weights are
A_ij = K(q_i, k_j) / Σ_m K(q_i, k_m), so only the *kernel* has to be non-negative. Every map here
returns non-negative features except ``taylor``, whose features are signed but whose kernel
1 + s + s²/2 is always > 0.

Maps (Hedgehog, Zhang et al. 2024, and the maps it compares against):

========= ============================================ ============= ===========
name      φ(x)                                         f             trainable
========= ============================================ ============= ===========
elu       1 + ELU(x)                                   d             no
relu      ReLU(x)                                      d             no
exp_t     exp(t·x)                                     d             no
hedgehog  per-head Linear, then exp/softmax of [z, −z] 2·feature_dim yes
t2r       per-head ReLU(Linear(x))                     feature_dim   yes
taylor    [1, x', x'⊗x'/√2], x' = x/d^¼                1 + d + d²    no
performer FAVOR+ positive orthogonal random features   num_features  no (buffer)
cosformer [ReLU(x)cos(πi/2M), ReLU(x)sin(πi/2M)]       2d            no
========= ============================================ ============= ===========

Dtypes: the exp-family maps (``hedgehog``, ``performer``, ``exp_t``) compute in and return
float32 — their values span many orders of magnitude (fp16 overflows at e^11) and the
linear-attention ops compute in float32 anyway. The other maps return the input dtype.

This module is copied flat into every saved student (``student/remote_code.py``): import only
torch, the standard library and ``from attn2ssm.… import …``.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from attn2ssm.errors import ConfigError

# Exponents are clamped to ±_EXP_CLAMP before exp() in the raw-exp maps (hedgehog "exp", exp_t):
# e^30 ≈ 1e13, so a kernel value is at most f·e^60 ≈ 1e28·f and sums over ~1e9 tokens stay finite
# in float32 (max 3.4e38). Inside the clamp the maps are exact; outside it the gradient is zero.
_EXP_CLAMP = 30.0


def _check_positive_int(map_name: str, option: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"feature map '{map_name}' option {option}={value!r} is not valid",
            f"use a positive integer for {option}",
        )
    return value


def _check_choice(map_name: str, option: str, value, choices) -> str:
    if value not in choices:
        raise ConfigError(
            f"feature map '{map_name}' option {option}={value!r} is not valid",
            f"use one of: {', '.join(choices)}",
        )
    return value


def _identity_like(num_heads: int, d_in: int, d_out: int) -> torch.Tensor:
    """(h, d_in, d_out) stacked rectangular identities (W = I when d_in == d_out)."""
    return torch.eye(d_in, d_out).expand(num_heads, d_in, d_out).clone()


def _linear_random_(weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """nn.Linear's default init, per head: U(±1/√d_in) for weight (h, d_in, d_out) and bias."""
    bound = 1.0 / math.sqrt(weight.shape[1])
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


def _per_head_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """z = x W_h + b_h per head: x (b, h, l, d), weight (h, d, f), bias (h, f) → (b, h, l, f)."""
    x = x.to(weight.dtype)
    return torch.einsum("bhld,hdf->bhlf", x, weight) + bias[:, None, :]


# ------------------------------------------------------------------------------------- fixed maps
class EluPlusOne(nn.Module):
    """φ(x) = 1 + ELU(x) (Katharopoulos et al. 2020); f = d. Strictly positive."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.feature_dim = head_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return F.elu(x) + 1.0


class ReLUMap(nn.Module):
    """φ(x) = ReLU(x) (Kasai et al. 2021); f = d. Rows may be all-zero: the op's eps keeps it finite."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.feature_dim = head_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return F.relu(x)


class ExpT(nn.Module):
    """φ(x) = exp(t·x) element-wise; f = d. Option ``t`` (default 1.0).

    The Hedgehog paper's "spiky but not monotone" control (exp(t=1) fails associative recall,
    exp(t=2) solves it). The kernel Σ_i e^{t(q_i + k_i)} is not a function of q·k. For stability
    t·x is clamped to ±30 before exp (exact inside, zero gradient outside); returns float32.
    """

    def __init__(self, num_heads: int, head_dim: int, *, t: float = 1.0):
        super().__init__()
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ConfigError(
                f"feature map 'exp_t' option t={t!r} is not valid", "use a finite number, e.g. t: 1.0 or 2.0"
            )
        self.t = float(t)
        self.feature_dim = head_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return torch.exp((self.t * x.float()).clamp(-_EXP_CLAMP, _EXP_CLAMP))


# --------------------------------------------------------------------------------- trainable maps
class HedgehogMap(nn.Module):
    """Hedgehog (Zhang et al. 2024): per-head trainable Linear(d → feature_dim) with bias, then a
    spiky exponential of [z, −z]; f = 2·feature_dim.

    Options:
      ``feature_dim`` (default head_dim): output size of the per-head Linear; the map's
        ``feature_dim`` attribute (f) is twice this.
      ``activation`` (default ``"softmax"``): how z = W x + b becomes features:

        * ``"softmax"`` — ONE joint softmax over the 2·feature_dim values [z, −z]
          (max-subtracted, so it never overflows). This is Eq. 5 ∘ Eq. 6 of the paper and the
          recommended default (fla's ``HedgehogFeatureMap`` is the same form on [2z, −2z]).
        * ``"exp"`` — raw [e^z, e^−z] as in the paper's Listing (Eq. 6), no normalisation.
          z is clamped to ±30 before exp to guard overflow (exact inside the clamp).
        * ``"softmax_half"`` — [softmax(z), softmax(−z)], one softmax per half (LoLCATs style).

    Why they differ: the joint softmax is exactly the raw-exp features divided by a
    per-token scalar Z(x) = Σe^z + Σe^−z. On *queries* Z cancels in the row normalisation of the
    attention weights (numerics only); on *keys* it reweights key j by 1/Z(k_j), so the attention
    weights change. The per-half softmax additionally rescales the two halves independently, which
    changes their relative weight. All three are non-negative and give the same O(n·d²) cost.

    Init: W = I (rectangular identity if feature_dim ≠ head_dim), b = 0 — the paper's init. With
    ``"exp"`` the untrained kernel is φ(q)·φ(k) = Σ_i 2·cosh(q_i + k_i), not a function of q·k.

    Parameters: ``weight`` (h, head_dim, feature_dim) and ``bias`` (h, feature_dim), one
    independent Linear per head. Returns float32.
    """

    ACTIVATIONS = ("softmax", "exp", "softmax_half")

    def __init__(
        self, num_heads: int, head_dim: int, *, feature_dim: int | None = None, activation: str = "softmax"
    ):
        super().__init__()
        self.proj_dim = _check_positive_int(
            "hedgehog", "feature_dim", head_dim if feature_dim is None else feature_dim
        )
        self.activation = _check_choice("hedgehog", "activation", activation, self.ACTIVATIONS)
        self.feature_dim = 2 * self.proj_dim
        self.weight = nn.Parameter(_identity_like(num_heads, head_dim, self.proj_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads, self.proj_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        z = _per_head_linear(x, self.weight, self.bias).float()
        if self.activation == "softmax":
            return torch.softmax(torch.cat([z, -z], dim=-1), dim=-1)
        if self.activation == "softmax_half":
            return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)
        z = z.clamp(-_EXP_CLAMP, _EXP_CLAMP)
        return torch.cat([torch.exp(z), torch.exp(-z)], dim=-1)


class T2RMap(nn.Module):
    """T2R (Kasai et al. 2021): per-head trainable φ(x) = ReLU(W x + b); f = feature_dim.

    Options:
      ``feature_dim`` (default head_dim).
      ``init`` (default ``"identity"``): W = I, b = 0, so the untrained map equals ``relu`` and the
        swapped model starts from ReLU linear attention; if feature_dim > head_dim the extra
        columns (and their biases) get the random init instead, since an all-zero column would be a
        dead ReLU unit that can never train. ``"random"``: nn.Linear's default U(±1/√d) per head
        (drawn from torch's global RNG).

    Rows can be all-zero (every pre-activation ≤ 0); the linear-attention op's eps keeps that finite
    (the output for such a query is 0). Parameters: ``weight`` (h, head_dim, feature_dim), ``bias``
    (h, feature_dim). Returns the input dtype (the parameters' dtype if they differ).
    """

    INITS = ("identity", "random")

    def __init__(
        self, num_heads: int, head_dim: int, *, feature_dim: int | None = None, init: str = "identity"
    ):
        super().__init__()
        self.feature_dim = _check_positive_int(
            "t2r", "feature_dim", head_dim if feature_dim is None else feature_dim
        )
        _check_choice("t2r", "init", init, self.INITS)
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, self.feature_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads, self.feature_dim))
        if init == "random":
            _linear_random_(self.weight, self.bias)
        else:
            with torch.no_grad():
                self.weight.copy_(_identity_like(num_heads, head_dim, self.feature_dim))
                if self.feature_dim > head_dim:
                    _linear_random_(self.weight[:, :, head_dim:], self.bias[:, head_dim:])

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return F.relu(_per_head_linear(x, self.weight, self.bias))


# ------------------------------------------------------------------------------ kernel approximations
class TaylorMap(nn.Module):
    """Second-order Taylor approximation of exp(q·k/√d) (Hedgehog §4.1, Zhang et al. 2024).

    φ(x) = [1, x', vec(x' ⊗ x')/√2] with x' = x / d^¼, so exactly
    φ(q)·φ(k) = 1 + s + s²/2 with s = q·k/√d; f = 1 + d + d².

    Option ``symmetric`` (default False): keep only the i ≤ j entries of x'⊗x', with weight 1/√2
    on the diagonal and 1 on the off-diagonal — the same kernel with f = 1 + d + d(d+1)/2.

    The features are SIGNED (x' and x'_i x'_j can be negative); only the kernel is positive
    (1 + s + s²/2 ≥ 1/2), which is all normalised linear attention needs. The kernel is monotone in
    s only for s > −1. f grows as d²: 4161 for d = 64, 16513 for d = 128.
    Returns the input dtype.
    """

    def __init__(self, num_heads: int, head_dim: int, *, symmetric: bool = False):
        super().__init__()
        if not isinstance(symmetric, bool):
            raise ConfigError(
                f"feature map 'taylor' option symmetric={symmetric!r} is not valid", "use true or false"
            )
        d = head_dim
        self.head_dim, self.symmetric = d, symmetric
        self.scale = d**-0.25
        self.feature_dim = 1 + d + (d * (d + 1) // 2 if symmetric else d * d)

    def _upper(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, cols, weights) of the kept i ≤ j products, made on first use on each device. Not
        buffers built in ``__init__``: transformers builds a model on the meta device and gives an
        unsaved buffer back as uninitialised memory (and saving them would change the state dict)."""
        cached = self.__dict__.get("_upper_index")
        if cached is None or cached[0].device != torch.device(device):
            rows, cols = torch.triu_indices(self.head_dim, self.head_dim, device=device)
            weights = torch.where(rows == cols, 1.0 / math.sqrt(2.0), 1.0)
            cached = self.__dict__["_upper_index"] = (rows, cols, weights)
        return cached

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        xs = x * self.scale
        if self.symmetric:
            rows, cols, weights = self._upper(xs.device)
            quad = xs[..., rows] * xs[..., cols] * weights.to(xs.dtype)
        else:
            quad = (xs[..., :, None] * xs[..., None, :]).flatten(-2) * (1.0 / math.sqrt(2.0))
        return torch.cat([xs.new_ones(*xs.shape[:-1], 1), xs, quad], dim=-1)


def orthogonal_gaussian(num_features: int, dim: int, seed: int) -> torch.Tensor:
    """(m, d) block-orthogonal Gaussian matrix (Performer): each block of d rows is orthonormal
    (QR of a Gaussian matrix, sign-fixed so it is Haar), and row norms are drawn i.i.d. chi(d) (the
    norm of a d-dim standard Gaussian), so each row is marginally N(0, I_d). Deterministic in seed."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(math.ceil(num_features / dim), dim, dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)  # batched: one (d × d) orthogonal block per d features
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    rows = q.transpose(-1, -2).reshape(-1, dim)[:num_features]  # rows of each block orthonormal
    norms = torch.randn(num_features, dim, generator=g, dtype=torch.float64).norm(dim=1)
    return (rows * norms[:, None]).float()


class PerformerMap(nn.Module):
    """FAVOR+ positive orthogonal random features (Choromanski et al. 2021).

    φ(x) = m^{−1/2} exp(ω x' − ‖x'‖²/2) with x' = x / d^¼, so E[φ(q)·φ(k)] = exp(q·k/√d);
    f = m. ω (m × d) comes from ``orthogonal_gaussian(m, d, seed)``, shared by all heads, and is a
    persistent buffer (saved in the state dict, not trained). q and k must use the same ω: the
    mixer builds both maps with the same options, hence the same seed.

    Options:
      ``num_features`` (m, default head_dim).
      ``seed`` (default 0): RNG seed for ω.
      ``stabilizer`` (default ``"none"``): a constant subtracted from the exponent, detached:

        * ``"sequence"`` — max over all tokens and features per (batch, head): the standard
          Performer *key* trick. One constant per attention problem, so it cancels in normalised
          attention for both queries and keys — but only within one call: keys cached from an
          earlier call (prefill, then decode) carry a different constant, and a query row far below
          the max can sink under the op's absolute eps.
        * ``"row"`` — per-token max over features: the standard Performer *query* trick (each
          query row's scale cancels in its own normalisation). WRONG for keys (it reweights each
          key), so use it only on a query map.
        * ``"none"`` — raw features: exact and consistent across calls. The exponent is bounded by
          ‖ω_r‖²/2 (≈ d/2 for typical rows, more for the longest), which float32 holds for
          d ≤ 64 but can overflow for d = 128.

    The default is ``"none"`` because a student's prefill, chunked prefill and decode must give the
    same result (the recurrent state mixes keys from several calls); choose ``"sequence"`` for
    d = 128 heads trained without a cache. Features are strictly positive unless they underflow. Returns float32.
    """

    STABILIZERS = ("sequence", "row", "none")

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        num_features: int | None = None,
        seed: int = 0,
        stabilizer: str = "none",
    ):
        super().__init__()
        self.feature_dim = _check_positive_int(
            "performer", "num_features", head_dim if num_features is None else num_features
        )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(
                f"feature map 'performer' option seed={seed!r} is not valid", "use an integer seed"
            )
        self.seed, self.head_dim = seed, head_dim
        self.stabilizer = _check_choice("performer", "stabilizer", stabilizer, self.STABILIZERS)
        self.register_buffer("omega", orthogonal_gaussian(self.feature_dim, head_dim, seed), persistent=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        xs = x.float() * self.head_dim**-0.25
        expo = xs @ self.omega.float().T - 0.5 * (xs * xs).sum(-1, keepdim=True)  # (b, h, l, m)
        if self.stabilizer == "row":
            expo = expo - expo.amax(dim=-1, keepdim=True).detach()
        elif self.stabilizer == "sequence" and expo.shape[-2] > 0:
            expo = expo - expo.amax(dim=(-2, -1), keepdim=True).detach()
        return torch.exp(expo) * self.feature_dim**-0.5


class CosFormerMap(nn.Module):
    """cosFormer (Qin et al. 2022): φ(x, i) = [ReLU(x)·cos(πi/2M), ReLU(x)·sin(πi/2M)]; f = 2d.

    Then φ(q_i, i)·φ(k_j, j) = ReLU(q_i)·ReLU(k_j)·cos(π(i − j)/2M), a distance reweighting.
    Option ``max_len`` (M, default 8192). ``positions`` are absolute token positions, (b, l) or
    (l,); when None, arange(l) is used — right only for a whole sequence starting at 0 (a decode
    step or a continued prefill must pass its real positions). Features are non-negative only for
    0 ≤ i ≤ M (cos turns negative past M), so keep positions ≤ max_len. Returns the input dtype.
    """

    uses_positions = True  # a decode step must hand it the token's position

    def __init__(self, num_heads: int, head_dim: int, *, max_len: int = 8192):
        super().__init__()
        self.max_len = _check_positive_int("cosformer", "max_len", max_len)
        self.feature_dim = 2 * head_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        l = x.shape[-2]
        pos = torch.arange(l, device=x.device) if positions is None else positions.to(x.device)
        if pos.shape[-1] != l:
            raise ValueError(f"cosformer positions have length {pos.shape[-1]}, the input has {l} tokens")
        angle = pos.to(torch.float32) * (math.pi / (2 * self.max_len))
        angle = angle.reshape(-1, 1, l, 1)  # (b or 1, 1, l, 1)
        r = F.relu(x)
        return torch.cat([r * torch.cos(angle).to(x.dtype), r * torch.sin(angle).to(x.dtype)], dim=-1)


FEATURE_MAPS: dict[str, type[nn.Module]] = {
    "elu": EluPlusOne,
    "relu": ReLUMap,
    "exp_t": ExpT,
    "hedgehog": HedgehogMap,
    "t2r": T2RMap,
    "taylor": TaylorMap,
    "performer": PerformerMap,
    "cosformer": CosFormerMap,
}


def feature_map_options(name: str) -> list[str]:
    """The option names a feature map accepts (its constructor's parameters after head_dim)."""
    params = inspect.signature(FEATURE_MAPS[name].__init__).parameters
    return [n for n in params if n not in ("self", "num_heads", "head_dim")]


def build_feature_map(name: str, num_heads: int, head_dim: int, **options) -> nn.Module:
    if name not in FEATURE_MAPS:
        raise ConfigError(
            f"unknown feature map '{name}'", f"choose one of: {', '.join(sorted(FEATURE_MAPS))}"
        )
    valid = feature_map_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for feature map '{name}'",
            f"valid options: {', '.join(valid)}" if valid else f"feature map '{name}' takes no options",
        )
    return FEATURE_MAPS[name](num_heads, head_dim, **options)

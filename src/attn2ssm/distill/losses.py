"""Losses as pure functions, normalised per real token (never per batch).

``mask`` marks real tokens (1) and padding (0); a loss is the sum over real tokens divided by
their count. The forward KL to a teacher over a large vocabulary is computed in row chunks with
its gradient formed analytically, so peak extra memory is one (tokens × vocab) tensor instead of
the several that log-softmax autograd keeps. ``chunk_size="auto"`` sizes the chunks by device
(``resolve_kl_chunk``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KL_CHUNK_CPU = 64  # tokens: a CPU's KL chunk, whose (64 × vocabulary) rows stay in its caches
# CUDA: the fp32 (chunk × vocabulary) slab of one chunk. The chunked KL holds about seven such slabs at
# its peak (student and teacher rows in fp32, their log-softmaxes, p, and the gradient's terms), so
# 256 MiB keeps a chunk's working set under 2 GiB while each kernel still fills the GPU (e.g. 512
# tokens × 128k vocabulary is 65M elements an operation; launch costs are then a few percent).
KL_SLAB_BYTES = 256 << 20
KL_CHUNK_MAX = 8192


def resolve_kl_chunk(kl_chunk: int | str, device_type: str, vocab: int) -> int:
    """A stage's ``kl_chunk``: an integer as given; ``auto`` = 64 tokens off CUDA, and on CUDA the
    largest power of two (64..8192) whose fp32 (chunk × vocab) slab fits ``KL_SLAB_BYTES``."""
    if kl_chunk != "auto":
        return int(kl_chunk)
    if device_type != "cuda":
        return KL_CHUNK_CPU
    rows = max(1, KL_SLAB_BYTES // (4 * max(1, vocab)))
    return max(KL_CHUNK_CPU, min(KL_CHUNK_MAX, 1 << (rows.bit_length() - 1)))


def shift_for_next_token(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None = None):
    """Align logits at t with the token at t+1. Returns (logits (n, V), targets (n,), mask (n,))."""
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    if mask is None:
        m = torch.ones_like(targets, dtype=torch.bool)
    else:  # a target counts when both the position and its next token are real
        m = (mask[:, :-1].bool() & mask[:, 1:].bool()).reshape(-1)
    return logits, targets, m


def cross_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token cross-entropy per real token. logits (b, l, V), input_ids (b, l), mask (b, l)."""
    flat, targets, m = shift_for_next_token(logits, input_ids, mask)
    n = m.sum().clamp_min(1)
    losses = F.cross_entropy(flat.float(), targets, reduction="none")
    return (losses * m).sum() / n


def token_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of ``logits`` at each position against ``targets`` at the *same* position
    (no shift: e.g. the teacher's argmax next token), per real token. logits (b, l, V)."""
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none"
    )
    m = torch.ones_like(losses) if mask is None else mask.reshape(-1).to(losses.dtype)
    return (losses * m).sum() / m.sum().clamp_min(1)


def kd_ce_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | TopKTargets,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    ce_weight: float = 1.0,
    kl_weight: float = 0.1,
    labels: str = "data",
    temperature: float = 1.0,
    chunk_size: int | str = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mamba in the Llama's stage-1 loss, Eq. 2: ``ce_weight·CE + kl_weight·KL(teacher ‖ student)``.

    ``labels="data"``: CE on the next token of the data (every real position with a real next
    token). ``labels="teacher"``: CE on the teacher's argmax next token at every real position —
    the cheap per-position stand-in for the paper's sequence-level pseudo-labels (which are the
    teacher's own sampled continuations: generate an SFT dataset with the teacher and train on it
    with the ``sft`` kind and a ``kl_weight``). The KL is over every real position, per real token.
    Returns ``(loss, ce, kl)``.
    """
    kl = forward_kl(student_logits, teacher_logits, mask, temperature=temperature, chunk_size=chunk_size)
    if labels == "data":
        ce = cross_entropy(student_logits, input_ids, mask)
    elif labels == "teacher":
        top1 = (
            teacher_logits.argmax()
            if isinstance(teacher_logits, TopKTargets)
            else teacher_logits.detach().argmax(-1)
        )
        ce = token_cross_entropy(student_logits, top1, mask)
    else:
        raise ValueError(f"unknown labels {labels!r} (data | teacher)")
    return ce_weight * ce + kl_weight * kl, ce, kl


def response_cross_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token CE summed over the tokens that ``loss_mask`` marks (e.g. assistant tokens).

    ``loss_mask`` (b, l) marks *target* tokens: position t is scored when token t+1 is marked.
    Returns ``(sum, count)`` so the caller can normalise over a larger batch than this one.
    """
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    targets = input_ids[:, 1:].reshape(-1)
    m = loss_mask[:, 1:].reshape(-1).float()
    losses = F.cross_entropy(flat, targets, reduction="none")
    return (losses * m).sum(), m.sum()


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """log p(response | prompt) per sequence: Σ over marked target tokens of log p(token). (b,)"""
    b, l, V = logits.shape
    token_logp = -F.cross_entropy(
        logits[:, :-1].reshape(-1, V).float(), input_ids[:, 1:].reshape(-1), reduction="none"
    )
    return (token_logp.view(b, l - 1) * loss_mask[:, 1:].float()).sum(-1)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.01,
) -> torch.Tensor:
    """DPO (Rafailov et al.), mean over pairs; with the teacher as reference it is Mamba in the Llama's Eq. 4:
    −log σ(β·[(log π_θ(y_w|x) − log π_T(y_w|x)) − (log π_θ(y_l|x) − log π_T(y_l|x))]).

    Sequence-level, so normalised per pair rather than per token. All inputs (pairs,) summed
    log-probs; equal policy and reference give log 2 exactly.
    """
    margin = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(beta * margin.float()).mean()


class _ChunkedForwardKL(torch.autograd.Function):
    """Σ_tokens T²·KL(softmax(t/T) ‖ softmax(s/T)) / n with grad T·(softmax(s/T) − softmax(t/T)) / n."""

    @staticmethod
    def forward(ctx, student, teacher, weights, temperature, chunk):
        total = student.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(student) if student.requires_grad else None
        for start in range(0, student.shape[0], chunk):
            s = student[start : start + chunk].float() / temperature
            t = teacher[start : start + chunk].float() / temperature
            w = weights[start : start + chunk]
            log_ps, log_pt = F.log_softmax(s, -1), F.log_softmax(t, -1)
            pt = log_pt.exp()
            total = total + ((pt * (log_pt - log_ps)).sum(-1) * w).sum()
            if grad is not None:
                grad[start : start + chunk] = ((log_ps.exp() - pt) * (w[:, None] * temperature)).to(
                    grad.dtype
                )
        ctx.save_for_backward(grad)
        return total * temperature**2

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None, None, None


@dataclass
class TopKTargets:
    """The teacher's next-token distribution kept sparse: its k most likely tokens and the mass of
    the rest. ``indices`` (..., k) token ids, most likely first; ``logprobs`` (..., k) their
    log-probabilities at temperature 1 over the full vocabulary (fp32); ``log_tail`` (...) the log
    of the remaining mass, log(1 − Σ_k p) (−inf when k = vocabulary). Leading dims are positions,
    (b, l) or (n,); ``targets[:, :-1]`` indexes them."""

    indices: torch.Tensor
    logprobs: torch.Tensor
    log_tail: torch.Tensor

    def __getitem__(self, index) -> "TopKTargets":
        return TopKTargets(self.indices[index], self.logprobs[index], self.log_tail[index])

    def argmax(self) -> torch.Tensor:
        return self.indices[..., 0]

    def to(self, device) -> "TopKTargets":
        return TopKTargets(self.indices.to(device), self.logprobs.to(device), self.log_tail.to(device))


@torch.no_grad()
def topk_targets(logits: torch.Tensor, k: int, chunk_size: int | str = 64) -> TopKTargets:
    """The top-k log-probabilities of ``logits`` (..., V) at temperature 1 and the tail's log-mass,
    in row chunks. The tail is a log-sum-exp over the other V − k log-probabilities (not
    log(1 − Σ top-k), which cancels to 0 or below when the top-k holds nearly all the mass)."""
    V = logits.shape[-1]
    chunk_size = resolve_kl_chunk(chunk_size, logits.device.type, V)
    if not 1 <= k <= V:
        raise ValueError(f"top_k {k} is outside 1..{V} (the vocabulary)")
    flat = logits.reshape(-1, V)
    idx = torch.empty(flat.shape[0], k, dtype=torch.long, device=flat.device)
    lp = torch.empty(flat.shape[0], k, dtype=torch.float32, device=flat.device)
    tail = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        log_p = F.log_softmax(flat[rows].float(), -1)
        lp[rows], idx[rows] = log_p.topk(k, -1)
        tail[rows] = log_p.scatter_(-1, idx[rows], float("-inf")).logsumexp(-1)
    lead = logits.shape[:-1]
    return TopKTargets(idx.view(*lead, k), lp.view(*lead, k), tail.view(lead))


class _ChunkedTopKKL(torch.autograd.Function):
    """Σ_tokens w·KL_k(p ‖ q) with the analytic gradient q − p̃ per token (see ``forward_kl``)."""

    @staticmethod
    def forward(ctx, student, indices, logprobs, log_tail, weights, chunk):
        work = torch.promote_types(student.dtype, torch.float32)  # fp32, or fp64 for gradcheck
        total = student.new_zeros((), dtype=work)
        grad = torch.empty_like(student) if student.requires_grad else None
        for start in range(0, student.shape[0], chunk):
            rows = slice(start, start + chunk)
            idx, lp_t, w = indices[rows], logprobs[rows].to(work), weights[rows].to(work)
            log_tail_t = log_tail[rows].to(work)
            log_q = F.log_softmax(student[rows].to(work), -1)
            tail_q = log_q.scatter(-1, idx, float("-inf"))  # the student's log q outside the teacher's top-k
            log_tail_q = tail_q.logsumexp(-1)
            has_tail = log_tail_t > float("-inf")
            tail_kl = torch.where(has_tail, log_tail_t.exp() * (log_tail_t - log_tail_q), 0.0)
            top_kl = (lp_t.exp() * (lp_t - log_q.gather(-1, idx))).sum(-1)
            total = total + ((top_kl + tail_kl) * w).sum()
            if grad is not None:
                # p̃: the teacher's top-k probabilities, and its tail mass spread like the student's tail
                safe = torch.where(has_tail, log_tail_t - log_tail_q, float("-inf"))
                p_tilde = (tail_q + safe[:, None]).exp().scatter_(-1, idx, lp_t.exp())
                grad[rows] = ((log_q.exp() - p_tilde) * w[:, None]).to(grad.dtype)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None, None, None, None


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | TopKTargets,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int | str = 64,
) -> torch.Tensor:
    """KL(teacher ‖ student) per real token, scaled by T² (Hinton et al.), in row chunks.

    student_logits: (b, l, V) or (n, V); mask: (b, l) or (n,). ``teacher_logits``: the teacher's
    logits at the same positions, or its cached top-k distribution (:class:`TopKTargets`, at
    temperature 1 only). Then, with S the teacher's k most likely tokens at a position, p its
    probabilities, P = 1 − Σ_{i∈S} p_i its tail mass and Q = 1 − Σ_{i∈S} q_i the student's mass
    outside S, the loss is the "top-k + tail bucket" KL

        KL_k(p ‖ q) = Σ_{i∈S} p_i·log(p_i / q_i) + P·log(P / Q),

    the exact KL between the two distributions coarsened to S plus one bucket for the rest. It is
    exact when k = V, and otherwise (chain rule of KL) falls short of the full KL by exactly
    P·KL(p(·|tail) ‖ q(·|tail)) ≥ 0: the tail's mass is matched, not its shape. Its gradient in the
    student's logits is q − p̃, where p̃_i = p_i on S and p̃_j = P·q_j / Q off S (the teacher's tail
    mass spread as the student spreads its own), so it sums to zero like the full KL's q − p.
    """
    V = student_logits.shape[-1]
    chunk_size = resolve_kl_chunk(chunk_size, student_logits.device.type, V)
    s = student_logits.reshape(-1, V)
    m = torch.ones(s.shape[0], device=s.device) if mask is None else mask.reshape(-1).float()
    weights = m / m.sum().clamp_min(1)
    if isinstance(teacher_logits, TopKTargets):
        if temperature != 1.0:
            raise ValueError(
                f"cached teacher top-k targets are at temperature 1; got temperature {temperature}"
            )
        t = teacher_logits
        k = t.indices.shape[-1]
        return _ChunkedTopKKL.apply(
            s,
            t.indices.reshape(-1, k),
            t.logprobs.reshape(-1, k),
            t.log_tail.reshape(-1),
            weights,
            int(chunk_size),
        )
    t = teacher_logits.reshape(-1, V).detach()
    return _ChunkedForwardKL.apply(s, t, weights, float(temperature), int(chunk_size))


def _row_weights(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """(b, 1, l) weights of real query rows, broadcastable over heads."""
    b, _, l, _ = like.shape
    if mask is None:
        return like.new_ones(b, 1, l)
    return mask.to(like.dtype)[:, None, :]


def attention_cross_entropy(
    target: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    form: str = "soft_ce",
    eps: float = 1e-12,
) -> torch.Tensor:
    """Hedgehog's attention distillation loss (Hedgehog Eq. 4, as in its listing).

    target: teacher softmax weights, weights: student weights, both (b, h, l, l) with rows that
    sum to 1 over the visible keys. ``soft_ce`` = −Σ_j t_ij log w_ij; ``kl`` subtracts the
    teacher's entropy (same gradient, 0 at a perfect match). Mean over real query rows and heads.
    """
    log_w = torch.log(weights.float().clamp_min(eps))
    t = target.float()
    per_row = -(t * log_w).sum(-1)  # (b, h, l)
    if form == "kl":
        per_row = per_row + (t * torch.log(t.clamp_min(eps))).sum(-1)
    elif form != "soft_ce":
        raise ValueError(f"unknown attention loss form {form!r} (soft_ce | kl)")
    rows = _row_weights(mask, weights)
    return (per_row * rows).sum() / (rows.sum() * weights.shape[1]).clamp_min(1)


def output_mse(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean squared error between (b, l, hidden) outputs, averaged over hidden and real tokens."""
    per_token = (student.float() - teacher.float()).pow(2).mean(-1)
    m = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp_min(1)


def output_cosine(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """1 − cosine similarity of (b, l, hidden) outputs per token, averaged over real tokens (HedgeMamba's stage 1)."""
    per_token = 1.0 - F.cosine_similarity(student.float(), teacher.float(), dim=-1, eps=1e-8)
    m = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp_min(1)


def _real_token_mean(per_token: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of (b, l) per-token values over the real tokens."""
    m = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp_min(1)


MATRIX_NORMS = ("fro", "fro_squared", "row_squared")


def matrix_distance(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None, *, norm: str = "fro"
) -> torch.Tensor:
    """MOHAWK's matrix-orientation loss (MOHAWK Eq. 3) between (b, h, l, l) mixing matrices,
    e.g. a student mixer's materialised matrix and the teacher's attention probabilities.

    Entries in a padded query row or key column are ignored (the teacher's padded rows hold
    arbitrary probabilities). ``norm``:

    * ``fro``: ‖S − T‖_F per sequence and head, unsquared, averaged over sequences and heads — the
      paper's Eq. 3 as its release computes it (``matrix_norm(·, 'fro')``, mean over batch and
      heads). Not normalised by length: it grows like √l for the same per-row error.
    * ``fro_squared``: ‖S − T‖_F², averaged the same way.
    * ``row_squared``: squared L2 distance of each real query row, averaged over real rows and
      heads (``fro_squared`` per real token, the repo's usual normalisation).
    """
    diff = student.float() - teacher.float()
    b, h, l, _ = diff.shape
    m = diff.new_ones(b, l) if mask is None else mask.to(diff.dtype)
    diff = diff * (m[:, None, :, None] * m[:, None, None, :])
    if norm == "row_squared":
        return diff.pow(2).sum() / (m.sum() * h).clamp_min(1)
    if norm == "fro":
        per_head = torch.linalg.matrix_norm(diff)  # (b, h); its gradient at 0 is 0, not NaN
    elif norm == "fro_squared":
        per_head = diff.pow(2).sum((-2, -1))
    else:
        raise ValueError(f"unknown matrix norm {norm!r} ({' | '.join(MATRIX_NORMS)})")
    real = (m.sum(-1) > 0).to(diff.dtype)  # sequences with at least one real token
    return (per_head * real[:, None]).sum() / (real.sum() * h).clamp_min(1)


HIDDEN_DISTANCES = ("l2", "l2_squared", "mse")


def hidden_distance(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None, *, form: str = "l2"
) -> torch.Tensor:
    """MOHAWK's hidden-state alignment loss (MOHAWK Eq. 4): a per-token distance between
    (b, l, hidden) outputs, averaged over real tokens.

    ``l2``: ‖s − t‖₂, unsquared — the paper's Eq. 4 as its release computes it
    (``torch.norm(diff, p=2, dim=-1).mean()``; not MSE). ``l2_squared``: ‖s − t‖₂².
    ``mse``: ‖s − t‖₂² / hidden (the same as :func:`output_mse`).
    """
    diff = student.float() - teacher.float()
    if form == "l2":
        per_token = torch.linalg.vector_norm(diff, dim=-1)  # gradient 0 (not NaN) at a perfect match
    elif form == "l2_squared":
        per_token = diff.pow(2).sum(-1)
    elif form == "mse":
        per_token = diff.pow(2).mean(-1)
    else:
        raise ValueError(f"unknown hidden distance {form!r} ({' | '.join(HIDDEN_DISTANCES)})")
    return _real_token_mean(per_token, mask)

"""Layer plans: which layers keep attention and which get a mixer.

A plan is a list with one entry per layer: a mixer kind, or ``"attention"`` to keep the
teacher's softmax attention. The kept layers are chosen by

- ``interleaved_keep``: spread evenly over the depth (Mamba in the Llama's hybrids; ``align`` picks the
  first or the last layer of each group),
- ``clustered_keep``: one contiguous block (Mamba in the Llama's "−Interleave" ablation),
- ``nested_keep``: evenly spread *and* nested across a stepwise schedule (50 % → 25 % → …), so
  every later stage only converts more layers (what ``convert.grow_student`` needs),
- measured on the teacher (``distill.layer_selection``: ``select_attention_layers`` /
  ``auto_plan``) — keep the layers whose conversion alone hurts the teacher's next-token
  distribution most; that runs the teacher and a loss, so it is not here.

``layer_map`` pairs each layer of a student of another depth with a teacher layer (which layer it
is built from, and which one CAB aligns it to).
"""

from __future__ import annotations

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.registry import ATTENTION, MIXERS

PLACEMENTS = ("interleaved", "clustered")
LAYER_MAPS = ("endpoints", "paper")
ALIGNS = ("first", "last")
WHERES = ("first", "middle", "last")


def _check_choice(what: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"unknown {what} {value!r}", f"use one of: {', '.join(valid)}")


def keep_count(num_layers: int, ratio: float) -> int:
    """How many of ``num_layers`` layers keep attention at ``ratio``: round(ratio·L), ratio checked."""
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(
            f"attention ratio {ratio} is outside [0, 1]", "use e.g. student.attention_ratio=0.25"
        )
    return round(ratio * num_layers)


def _spread(length: int, n: int, align: str) -> list[int]:
    """``n`` of ``range(length)`` evenly spaced: the first (or last) index of each of n groups."""
    if align == "first":
        return [(i * length) // n for i in range(n)]
    return [((i + 1) * length) // n - 1 for i in range(n)]


def interleaved_keep(num_layers: int, ratio: float, align: str = "first") -> list[int]:
    """Indices of ``round(ratio·L)`` attention layers spread evenly over the depth (0 % → none).

    The depth is cut into n = round(ratio·L) near-equal groups and one layer of each is kept:
    ``align="first"`` keeps index (i·L)//n (0, 2, 4, … at 50 %), ``align="last"`` keeps
    ((i+1)·L)//n − 1 (1, 3, …, L−1 at 50 %; always the top layer). Mamba in the Llama's released configs
    use "last": for 32 layers {1,3,…,31}, {3,7,…,31}, {7,15,23,31}.
    """
    _check_choice("align", align, ALIGNS)
    n_keep = keep_count(num_layers, ratio)
    return _spread(num_layers, n_keep, align) if n_keep else []


def clustered_keep(num_layers: int, ratio: float, where: str = "last") -> list[int]:
    """``round(ratio·L)`` contiguous attention layers at the ``"first"``, ``"middle"`` or ``"last"`` end.

    Mamba in the Llama's "−Interleave" ablation (not defined further there): the same number of kept layers
    as the interleaved layout, but in one block. "middle" centres the block (rounding down).
    """
    _check_choice("where", where, WHERES)
    n = keep_count(num_layers, ratio)
    start = {"first": 0, "middle": (num_layers - n) // 2, "last": num_layers - n}[where]
    return list(range(start, start + n))


def nested_keep(num_layers: int, ratios: list[float], align: str = "first") -> list[list[int]]:
    """Kept attention layers for each stage of a stepwise schedule, each a subset of the one before.

    Stage 0 is ``interleaved_keep(L, ratios[0], align)``; each later stage keeps round(r·L) of
    the previous stage's layers, spread evenly by rank with the same ``align``. When L is a
    multiple of the group sizes this equals ``interleaved_keep`` per stage (32 layers, "last":
    {1,3,…,31} → {3,7,…,31} → {7,15,23,31}, Mamba in the Llama); otherwise plain ``interleaved_keep`` is
    not nested (30 layers, "first": 50 % keeps 0,2,…,28 but 25 % keeps 3) and this is the
    schedule to use with ``grow_student``.
    """
    if not ratios:
        return []
    stages = [interleaved_keep(num_layers, ratios[0], align)]
    for ratio in ratios[1:]:
        prev, n = stages[-1], keep_count(num_layers, ratio)
        if n > len(prev):
            raise ConfigError(
                f"stepwise ratios {list(ratios)} grow the attention layers ({len(prev)} → {n})",
                "list attention ratios from largest to smallest, e.g. [0.5, 0.25, 0.125]",
            )
        stages.append([prev[r] for r in _spread(len(prev), n, align)] if n else [])
    return stages


def make_plan(
    num_layers: int,
    mixer: str,
    *,
    attention_ratio: float = 0.0,
    keep_attention: list[int] | None = None,
    placement: str = "interleaved",
    align: str = "first",
    where: str = "last",
) -> list[str]:
    """One entry per layer: ``mixer`` or ``"attention"``. Explicit ``keep_attention`` wins over the ratio.

    With a ratio, ``placement="interleaved"`` spreads the kept layers (``interleaved_keep`` with
    ``align``) and ``placement="clustered"`` keeps one block (``clustered_keep`` with ``where``).
    To choose the layers from the teacher itself, use ``distill.layer_selection.auto_plan``.
    """
    if mixer not in MIXERS:
        raise ConfigError(f"unknown mixer '{mixer}'", f"use one of: {', '.join(sorted(MIXERS))}")
    _check_choice("placement", placement, PLACEMENTS)
    if isinstance(keep_attention, str):
        raise ConfigError(
            f"keep_attention={keep_attention!r} is not a list of layer indices",
            "list the indices, or call attn2ssm.distill.layer_selection.auto_plan(teacher, calibration_ids, …) to choose them",
        )
    if keep_attention is not None:
        keep = list(keep_attention)
    elif placement == "interleaved":
        keep = interleaved_keep(num_layers, attention_ratio, align)
    else:
        keep = clustered_keep(num_layers, attention_ratio, where)
    bad = [i for i in keep if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"keep_attention has layer indices {bad} outside 0..{num_layers - 1}", "list valid layer indices"
        )
    return [ATTENTION if i in keep else mixer for i in range(num_layers)]


def layer_map(n_student: int, n_teacher: int, mode: str = "endpoints") -> list[int]:
    """The teacher layer (0-based) paired with each student layer, proportional in depth.

    CAB (Eq. 7) writes g(l) = ⌊(l / L)·T⌋ for student layers l = 1..L and T teacher
    layers, and never says whether teacher layers count from 0 or 1. Read 1-based, g(1) = 0 is no
    layer when the student is deeper (L = 24, T = 12); read 0-based, g(L) = T is one past the last
    layer; and the 0-based student form ⌊i·T/L⌋ (i = 0..L−1) never reaches the last teacher layer
    of a shallower student (L = 6, T = 12 gives 0, 2, …, 10). Two fixed forms, both the identity
    when L = T and valid for deeper and shallower students:

    * ``"endpoints"`` (default): g(i) = round(i·(T−1)/(L−1)), halves up — first → first and
      last → last, evenly in between (L = 1: the last layer, as the paper's g(1) = T). 24 ← 12:
      0,0,1,1,…,11,11; 6 ← 12: 0,2,4,7,9,11; 3 ← 6: 0,3,5.
    * ``"paper"``: the paper's formula with the off-by-one fixed, g(l) = ⌈l·T/L⌉ (1-based), i.e.
      g(i) = ⌈(i+1)·T/L⌉ − 1: last → last and groups of equal size, but a shallower student skips
      the first teacher layers (6 ← 12: 1,3,5,7,9,11); 24 ← 12: 0,0,1,1,…,11,11 as above.
    """
    _check_choice("layer map", mode, LAYER_MAPS)
    if n_student < 1 or n_teacher < 1:
        raise ConfigError(
            f"cannot map {n_student} student layers onto {n_teacher} teacher layers",
            "both depths must be at least 1",
        )
    if mode == "paper":
        return [-(-(i + 1) * n_teacher // n_student) - 1 for i in range(n_student)]  # ⌈(i+1)·T/L⌉ − 1
    if n_student == 1:
        return [n_teacher - 1]
    span_s, span_t = n_student - 1, n_teacher - 1
    return [(2 * i * span_t + span_s) // (2 * span_s) for i in range(n_student)]  # round half up, in integers

"""The KV-cache measure (attn2ssm.eval.kv_cache): hand-computed bytes of known layouts, the
``kv_heads_kept`` contract of head-level mixers, and the state reported apart."""

from __future__ import annotations

import pytest

from attn2ssm.eval.kv_cache import kv_bytes, kv_fraction, layer_caches, state_bytes
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from tiny_models import tiny_model


def _teacher(family: str = "llama", layers: int = 4):
    return tiny_model(family, layers=layers)


def test_the_teachers_kv_is_two_times_kv_heads_head_dim_tokens_bytes():
    teacher = _teacher("llama", layers=4)  # 2 KV heads of 16, fp32
    assert kv_bytes(teacher, 1000) == 4 * 2 * 2 * 16 * 1000 * 4
    assert kv_bytes(teacher, 1000, element_size=2) == 4 * 2 * 2 * 16 * 1000 * 2


def test_a_sliding_window_layer_holds_its_window_only():
    teacher = _teacher("mistral", layers=2)  # every layer windowed at 4 tokens
    assert [c.window for c in layer_caches(teacher)] == [4, 4]
    assert kv_bytes(teacher, 1000) == 2 * 2 * 2 * 16 * 4 * 4
    assert kv_bytes(teacher, 3) == 2 * 2 * 2 * 16 * 3 * 4


def test_a_25_percent_whole_layer_hybrid_keeps_kept_over_all_layers():
    teacher = _teacher("llama", layers=4)
    plan = make_plan(4, "linear_attention", keep_attention=[1])
    student = convert(teacher, plan, {"linear_attention": {"window": 8}})
    m = kv_fraction(student, teacher, tokens=8192)
    assert m.kv_fraction == pytest.approx(1 / 4)
    assert m.student_kv_bytes == 2 * 2 * 16 * 8192 * 4 and m.teacher_kv_bytes == 4 * m.student_kv_bytes
    # the three mixers' constant state, fp32: per query head (4) S (f × d) and z (f) (elu: f = d = 16),
    # and the window's last 7 tokens' keys, values and feature-mapped keys, plus 7 valid flags
    per_mixer = 4 * (16 * 16 + 16) * 4 + 3 * (4 * 7 * 16) * 4 + 7 * 4
    assert m.student_state_bytes == 3 * per_mixer


def test_a_pure_mixer_student_has_no_kv_but_a_state():
    teacher = _teacher("llama", layers=2)
    student = convert(teacher, make_plan(2, "mamba2"))
    m = kv_fraction(student, teacher)
    assert m.kv_fraction == 0.0 and m.student_kv_bytes == 0 and m.student_state_bytes > 0
    assert state_bytes(teacher) == 0


def test_a_mixer_with_kv_heads_kept_counts_those_groups():
    """The contract with head-level hybrids: a mixer's ``kv_heads_kept`` groups hold a full KV cache."""
    teacher = _teacher("llama", layers=4)
    student = convert(teacher, make_plan(4, "linear_attention"))
    student.mixers()[2].kv_heads_kept = 1  # one of its layer's 2 KV groups kept
    m = kv_fraction(student, teacher, tokens=100)
    assert m.student_kv_bytes == 2 * 1 * 16 * 100 * 4
    assert m.kv_fraction == pytest.approx(1 / 8)  # 1 group of 4 layers × 2

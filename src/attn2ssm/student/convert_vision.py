"""Build a Vision Mamba student for a ViT/DeiT teacher (CAB's vision half).

The student is the teacher's image classifier architecture (from its config) with every layer's
attention replaced by a ``bimamba`` mixer, all weights drawn afresh (the paper's vision students
train from scratch; the teacher only supervises). ``depth`` ≠ the teacher's gives a deeper or
shallower student; student layer i is aligned to teacher layer ``layer_map(depth, T, mode)[i]``
(plans.layer_map: ``paper`` is CAB's Eq. 7 with its off-by-one fixed, 24 ← 12 pairs (0,1)→0, …).
"""

from __future__ import annotations

import torch

from attn2ssm.adapters import get_adapter
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.registry import ENCODER_MIXERS
from attn2ssm.student.configuration import Attn2SSMConfig
from attn2ssm.student.plans import layer_map
from attn2ssm.student.vision import Attn2SSMForImageClassification


def build_vision_student(
    teacher,
    mixer: str = "bimamba",
    mixer_options: dict | None = None,
    *,
    depth: int | None = None,
    layer_map_mode: str = "paper",
    teacher_info: dict | None = None,
) -> Attn2SSMForImageClassification:
    """A fresh ``Attn2SSMForImageClassification`` shaped after ``teacher`` (a ViT/DeiT classifier or its config holder)."""
    adapter = get_adapter(teacher)
    if not getattr(adapter, "encoder", False):
        raise ConfigError(
            f"teacher family '{adapter.family}' is a causal LM, not an image classifier",
            "use a ViT/DeiT teacher for an image recipe, or drop `images:` for a language recipe",
        )
    if mixer not in ENCODER_MIXERS:
        raise ConfigError(
            f"mixer '{mixer}' is not an encoder mixer",
            f"use student.mixer: {' or '.join(ENCODER_MIXERS)} for an image recipe",
        )
    config = teacher.config
    n_teacher = config.num_hidden_layers
    n = depth or n_teacher
    if n < 1:
        raise ConfigError(
            f"student.depth={depth} is not a number of layers",
            "set student.depth to at least 1, or null for the teacher's depth",
        )
    source = list(range(n)) if n == n_teacher else layer_map(n, n_teacher, layer_map_mode)
    base = config.to_dict()
    base["num_hidden_layers"] = n
    base["architectures"] = [
        type(teacher).__name__
    ]  # DeiT maps to two classifier classes: pick the teacher's
    paths = adapter.attention_module_paths(teacher)
    layer_prefix = paths[0].rsplit(".", 2)[0]  # "vit.layers"
    student_config = Attn2SSMConfig(
        base_config=base,
        layer_plan=[mixer] * n,
        attention_paths=[f"{layer_prefix}.{i}.{adapter.attn_attr}" for i in range(n)],
        layer_geometry=[adapter.student_geometry(config, j) for j in source],
        mixer_options={mixer: dict(mixer_options or {})},
        teacher={"family": adapter.family, "model_type": config.model_type, **(teacher_info or {})},
        base_attn_implementation=None,
        teacher_layers=source,
        id2label=dict(config.id2label),
        label2id=dict(config.label2id),
    )
    param = next(teacher.parameters())
    return Attn2SSMForImageClassification(student_config).to(dtype=torch.float32, device=param.device)

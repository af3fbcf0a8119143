"""Build a student from a teacher: same architecture, attention swapped per the layer plan.

Every non-attention weight is the teacher's; each mixer starts from its layer's q/k/v/o
(read through the family adapter, so fused/transposed layouts and GQA are handled there).
"""

from __future__ import annotations

import torch
from torch import nn

from attn2ssm.adapters import get_adapter
from attn2ssm.student.configuration import Attn2SSMConfig
from attn2ssm.student.modeling import Attn2SSMForCausalLM


def _qk_norm_settings(weights) -> dict:
    norm = weights.q_norm
    if norm is None:
        return {}
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6))
    # Gemma-family RMSNorms scale by (1 + w) with w initialised at 0.
    offset = 1.0 if "gemma" in type(norm).__name__.lower() else 0.0
    return {"qk_norm_eps": float(eps), "qk_norm_offset": offset}


def convert(
    teacher: nn.Module,
    layer_plan: list[str],
    mixer_options: dict | None = None,
    *,
    teacher_info: dict | None = None,
) -> Attn2SSMForCausalLM:
    """Return a student (same dtype/device as the teacher) initialised from the teacher's weights."""
    adapter = get_adapter(teacher)
    config = teacher.config
    paths = adapter.attention_module_paths(teacher)
    if len(layer_plan) != len(paths):
        raise ValueError(f"layer plan has {len(layer_plan)} entries but the teacher has {len(paths)} layers")
    attn_modules = [teacher.get_submodule(p) for p in paths]
    geometry = []
    for i, attn in enumerate(attn_modules):
        g = adapter.geometry(config, i).to_dict()
        if g.get("has_qk_norm"):
            g.update(_qk_norm_settings(adapter.read_weights(attn)))
        geometry.append(g)
    base_config = config.to_dict()
    base_config.pop("quantization_config", None)
    student_config = Attn2SSMConfig(
        base_config=base_config,
        layer_plan=layer_plan,
        attention_paths=paths,
        layer_geometry=geometry,
        mixer_options=mixer_options or {},
        teacher={"family": adapter.family, "model_type": config.model_type, **(teacher_info or {})},
        base_attn_implementation=getattr(config, "_attn_implementation", None),
    )
    param = next(teacher.parameters())
    student = Attn2SSMForCausalLM(student_config).to(dtype=param.dtype, device=param.device)
    result = student.base.load_state_dict(teacher.state_dict(), strict=False)
    mixer_prefixes = tuple(paths[i] + "." for i in student_config.mixer_layers)
    stray = [k for k in result.missing_keys if not k.startswith(mixer_prefixes)]
    if stray:
        raise RuntimeError(f"student weights missing from the teacher: {stray[:5]}")
    for i, mixer in student.mixers().items():
        mixer.load_attention_weights(adapter.read_weights(attn_modules[i]))
    student.eval()
    return student

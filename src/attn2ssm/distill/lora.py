"""Low-rank adapters (LoRA) for a finetune stage, merged into the weights when the stage ends.

Why not peft: its injection renames state-dict keys (``q_proj.base_layer.weight``), so a
checkpoint taken mid-stage would no longer be a plain student. Here each adapter is a side path
added by a forward hook; the adapted ``nn.Linear`` keeps its name and weight, the adapters live
in ``model.lora`` (saved beside the checkpoint, not in it), and ``merge_lora`` folds
W ← W + (α/r)·B·A at the end so the saved student needs nothing extra.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attn2ssm.errors import ConfigError


class LoRAAdapter(nn.Module):
    def __init__(self, linear: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.scale = alpha / r
        self.A = nn.Parameter(
            torch.empty(r, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
        )
        self.B = nn.Parameter(
            torch.zeros(linear.out_features, r, dtype=linear.weight.dtype, device=linear.weight.device)
        )
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # B = 0: the adapted model starts as the model
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return (self.dropout(x) @ self.A.T) @ self.B.T * self.scale


def _key(name: str) -> str:
    return name.replace(".", "__")


def attach_lora(
    model: nn.Module, targets: list[str], r: int = 8, alpha: float = 16.0, dropout: float = 0.0
) -> list[str]:
    """Add adapters to every ``nn.Linear`` whose name ends with one of ``targets``; returns their names."""
    if hasattr(model, "lora"):
        raise RuntimeError("the model already carries LoRA adapters")
    chosen = [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in targets
    ]
    if not chosen:
        raise ConfigError(
            f"LoRA targets {targets} match no linear layer",
            "use module names such as q_proj, k_proj, v_proj, o_proj",
        )
    adapters = nn.ModuleDict()
    model._lora_hooks = []
    for name, linear in chosen:
        adapter = LoRAAdapter(linear, r, alpha, dropout)
        adapters[_key(name)] = adapter
        model._lora_hooks.append(
            linear.register_forward_hook(lambda mod, args, out, a=adapter: out + a.delta(args[0]))
        )
    model.lora = adapters
    return [n for n, _ in chosen]


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its linear weight and remove the adapters."""
    if not hasattr(model, "lora"):
        return
    for key, adapter in model.lora.items():
        linear = model.get_submodule(key.replace("__", "."))
        linear.weight += (adapter.B @ adapter.A * adapter.scale).to(linear.weight.dtype)
    for handle in model._lora_hooks:
        handle.remove()
    del model.lora
    del model._lora_hooks


def state_dict_without_lora(model: nn.Module) -> dict:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("lora.")}

"""Capture what each teacher attention module sees and returns, for layer-local stages.

Layer-local distillation trains a student mixer on the *teacher's* input to that layer
(teacher forcing), so errors never compound across layers and no gradient crosses layers.
One teacher forward with hooks gives every layer's input hidden states, RoPE cos/sin and
attention output; the forward stops after the last layer that is needed, and the LM head
never runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attn2ssm.adapters import get_adapter


@dataclass
class AttentionIO:
    module: nn.Module  # the teacher attention module
    hidden_states: torch.Tensor  # (b, l, hidden): its input (already normed)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None  # RoPE (cos, sin), None without RoPE
    output: torch.Tensor  # (b, l, hidden): its output (after o_proj)


class _Stop(Exception):
    pass


@torch.no_grad()
def capture_attention_io(teacher: nn.Module, input_ids: torch.Tensor, layers: list[int], attention_mask: torch.Tensor | None = None) -> dict[int, AttentionIO]:
    """Run ``teacher`` on ``input_ids`` up to the last of ``layers``; returns layer → AttentionIO."""
    adapter = get_adapter(teacher)
    paths = adapter.attention_module_paths(teacher)
    wanted, last = set(layers), max(layers)
    captured: dict[int, AttentionIO] = {}
    handles = []

    def make_hook(i: int, module: nn.Module):
        def hook(mod, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            out = output[0] if isinstance(output, tuple) else output
            captured[i] = AttentionIO(module, hidden.detach(), kwargs.get("position_embeddings"), out.detach())
            if i == last:
                raise _Stop

        return hook

    for i in wanted:
        module = teacher.get_submodule(paths[i])
        handles.append(module.register_forward_hook(make_hook(i, module), with_kwargs=True))
    try:
        decoder = teacher.base_model  # the decoder stack without the LM head
        decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    missing = wanted - set(captured)
    if missing:
        raise RuntimeError(f"teacher attention modules of layers {sorted(missing)} were not called")
    return captured

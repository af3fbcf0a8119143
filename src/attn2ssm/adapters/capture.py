"""Capture what each teacher attention module sees and returns, in one hooked teacher forward.

Everything that needs the teacher's own per-layer attention inputs reads them here: the
layer-local distillation stages (teacher forcing: each mixer is trained on the teacher's input
to its layer), CAB's bridge stage (the teacher's q/k per layer) and the attention-fidelity
metrics (teacher vs student weights on the same layer input). One forward with hooks on the
wanted layers' attention modules gives each one's input hidden states, RoPE cos/sin and output;
the forward stops after the last wanted layer and the LM head never runs, unless the caller
also wants the teacher's logits.

It lives in adapters/ (which alone looks inside a teacher's attention) so that distill/ and
eval/, which are siblings, both use it without depending on each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attn2ssm.adapters.registry import get_adapter


@dataclass
class AttentionIO:
    module: nn.Module  # the teacher attention module
    hidden_states: torch.Tensor  # (b, l, hidden): its input (already normed)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None  # RoPE (cos, sin), None without RoPE
    output: torch.Tensor  # (b, l, hidden): its output (after o_proj)


class _Stop(Exception):
    pass


def _call_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple | None]:
    """(hidden_states, position_embeddings) from an attention module's call, by keyword or position."""
    hidden = args[0] if args else kwargs["hidden_states"]
    pos = kwargs.get("position_embeddings")
    if pos is None and len(args) > 1 and isinstance(args[1], tuple):
        pos = args[1]
    return hidden, pos


@torch.no_grad()
def capture_teacher_attention(
    teacher: nn.Module,
    input_ids: torch.Tensor,
    layers: list[int],
    attention_mask: torch.Tensor | None = None,
    *,
    logits: bool = False,
) -> tuple[dict[int, AttentionIO], torch.Tensor | None]:
    """Layer → AttentionIO for ``layers``, and the teacher's logits (b, l, vocab) if ``logits``.

    Without ``logits`` only the decoder stack runs, up to the last of ``layers``' attention
    modules (no later layer, no LM head) and the second value is None.
    """
    adapter = get_adapter(teacher)
    paths = adapter.attention_module_paths(teacher)
    wanted = set(layers)
    if not wanted and not logits:
        return {}, None
    last = max(wanted, default=None)
    captured: dict[int, AttentionIO] = {}
    handles = []

    def make_hook(i: int):
        def hook(module, args, kwargs, output):
            hidden, pos = _call_inputs(args, kwargs)
            out = output[0] if isinstance(output, tuple) else output
            captured[i] = AttentionIO(module, hidden.detach(), pos, out.detach())
            if i == last and not logits:
                raise _Stop

        return hook

    for i in wanted:
        handles.append(teacher.get_submodule(paths[i]).register_forward_hook(make_hook(i), with_kwargs=True))
    out = None
    try:
        if logits:
            out = teacher(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        else:
            # the decoder stack
            teacher.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    missing = wanted - set(captured)
    if missing:
        raise RuntimeError(f"teacher attention modules of layers {sorted(missing)} were not called")
    return captured, out


def capture_attention_io(
    teacher: nn.Module, input_ids: torch.Tensor, layers: list[int], attention_mask: torch.Tensor | None = None
) -> dict[int, AttentionIO]:
    """Run ``teacher`` on ``input_ids`` up to the last of ``layers``; returns layer → AttentionIO."""
    return capture_teacher_attention(teacher, input_ids, layers, attention_mask)[0]

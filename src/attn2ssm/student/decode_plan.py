"""One-token decode of a pure-mixer student without HF's per-layer plumbing (CPU decode mode).

Decoding one token of the built-in teacher's students on a 2-core CPU spends about as long in
Python and per-op overhead as in streaming the weights; HF's model and decoder-layer forwards
(kwargs, output capturing, mask and cache bookkeeping, a module call per sub-module) are a part
of it that a recurrent student does not need. ``DecodePlan`` runs the same modules, in the same
order, on the same tensors, for the pre-norm layer structure

    x = x + mixer(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))

between ``embed_tokens`` and ``norm`` → ``lm_head`` (Llama, Mistral, Qwen2 …). The structure is
not assumed from names: building a plan runs each layer and the model's ends on a probe (the
mixer replaced by a stub) and compares with HF's own forward; a family that computes something
else (sandwich norms, parallel residuals, scaled embeddings, capped logits) gets no plan and
decodes through HF's forward as before. Hybrids (kept attention layers) get no plan either.

A plan is used only where nothing could tell the difference: one new token per row, no padding
in it, autograd off, the student's own cache with every layer's state present and no rollback
recording, no hooks on the modules whose ``__call__`` it skips, every module still where it
was (a LoRA wrap or a replaced layer turns it off), no outputs besides logits requested. Tests
hold its logits equal to HF's forward for every mixer kind.

Built by ``cpu_decode_layout`` (``Attn2SSMForCausalLM.enable_decode_plan``); dropped by
``undo_cpu_decode_layout``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from attn2ssm.hf_compat import CACHE_KWARG

_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")
_ALLOWED_KWARGS = {"cache_position", "output_attentions", "output_hidden_states", "return_dict"}


class _Stub(nn.Module):
    """Stands in for a mixer while a layer's structure is probed: a fixed non-linear map."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.tanh(hidden_states) * 0.5 + 0.1, None


def _inert(hook) -> bool:
    """HF's output-capturing hooks (installed on the decoder layers the first time hidden states
    are asked for, then kept) do nothing unless outputs are being collected, which the plan
    never runs for."""
    return getattr(hook, "__name__", "") == "output_capturing_hook"


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-5 * (1 + b.abs().max()))


class DecodePlan:
    """See the module docstring. ``DecodePlan.build(model)`` → (plan or None, reason)."""

    def __init__(self, model, inner, layers, mixer_names):
        self.model, self.base, self.inner = model, model.base, inner
        self.embed = inner.get_input_embeddings()
        self.norm = inner.norm
        self.rotary = getattr(inner, "rotary_emb", None)
        self.head = model.base.get_output_embeddings()
        mixers = model.mixers()
        self.steps = []  # (layer index, input norm, mixer, post norm, mlp)
        self.placed = []  # (parent, attribute, module): where every module the plan calls must still be
        for i, (layer, name) in enumerate(zip(layers, mixer_names)):
            parts = [getattr(layer, p) for p in _LAYER_PARTS]
            self.steps.append((i, parts[0], mixers[i], parts[1], parts[2]))
            self.placed += [(layer, p, m) for p, m in zip(_LAYER_PARTS, parts)] + [(layer, name, mixers[i])]
        self.placed += [(inner, "layers", inner.layers), (inner, "norm", self.norm)]
        for parent, module in ((inner, self.embed), (self.base, self.head), (inner, self.rotary)):
            name = next((n for n, m in parent.named_children() if m is module), None)
            if name is not None:
                self.placed.append((parent, name, module))
        self.stepping = {type(m) for m in mixers.values() if hasattr(m, "decode_math")}  # mixer kinds with a one-token step
        # modules whose __call__ (and so whose hooks) the plan skips: they must have none
        self.skipped = [model, self.base, inner, *layers] + [m for _, _, m in self.placed if not isinstance(m, nn.ModuleList)]
        self.compiled = None  # a CompiledStep (opt-in: ``compile_step``)

    def compile_step(self, backend=None) -> str:
        """Run the layers through one ``torch.compile``d function from the next step on
        (student/compiled_step.py). Returns "" or why not."""
        from attn2ssm.student.compiled_step import CompiledStep

        if self.compiled is None:
            self.compiled, reason = CompiledStep.build(self, backend)
            return reason
        return ""

    # -- building -------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def build(cls, model) -> tuple[DecodePlan | None, str]:
        base = model.base
        inner = base.base_model
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList) or not isinstance(getattr(inner, "norm", None), nn.Module):
            return None, f"{type(inner).__name__} has no `layers` list and `norm`"
        if not isinstance(inner.get_input_embeddings(), nn.Embedding) or not isinstance(base.get_output_embeddings(), nn.Linear):
            return None, "the input embedding or the LM head is not a plain Embedding / Linear"
        mixers = model.mixers()
        if sorted(mixers) != list(range(len(layers))):
            return None, "not every layer is a mixer (a hybrid keeps attention layers)"
        names = []
        for i, layer in enumerate(layers):
            name = next((n for n, m in layer.named_children() if m is mixers[i]), None)
            if name is None or any(not isinstance(getattr(layer, p, None), nn.Module) for p in _LAYER_PARTS):
                return None, f"layer {i} ({type(layer).__name__}) is not input_layernorm → mixer → post_attention_layernorm → mlp"
            names.append(name)
        plan = cls(model, inner, layers, names)
        reason = plan._probe(layers, names)
        return (plan, "") if reason is None else (None, reason)

    def _probe(self, layers, names) -> str | None:
        """None if HF's forward computes what the plan computes (on a random input), else why not."""
        weight = self.embed.weight
        x = torch.randn(1, 1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        pos = torch.zeros(1, 1, dtype=torch.long)
        pe = None if self.rotary is None else self.rotary(x, pos)
        stub = _Stub()
        checked: set = set()
        for (_, norm1, _, norm2, mlp), layer, name in zip(self.steps, layers, names):
            if type(layer) in checked:
                continue
            mixer = layer._modules[name]
            layer._modules[name] = stub
            try:
                ref = _first(layer(x, attention_mask=None, position_ids=pos, use_cache=False, cache_position=pos[0], position_embeddings=pe))
            except Exception as error:  # noqa: BLE001 - any failure means "no plan"
                return f"{type(layer).__name__} could not be probed ({type(error).__name__}: {error})"
            finally:
                layer._modules[name] = mixer
            y = x + stub(norm1(x))[0]
            y = y + mlp(norm2(y))
            if not isinstance(ref, torch.Tensor) or not _close(y, ref):
                return f"{type(layer).__name__} does not compute x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(·))"
            checked.add(type(layer))
        ids = torch.tensor([[1, 2]])
        saved = self.inner.layers
        self.inner.layers = nn.ModuleList()
        try:
            ref = self.base(input_ids=ids, use_cache=False).logits
        except Exception as error:  # noqa: BLE001
            return f"{type(self.base).__name__} could not be probed without layers ({type(error).__name__}: {error})"
        finally:
            self.inner.layers = saved
        if not _close(self.head(self.norm(self.embed(ids))), ref):
            return f"{type(self.base).__name__}'s logits are not lm_head(norm(embed_tokens(ids))) around its layers"
        return None

    # -- running ----------------------------------------------------------------------------
    def usable(self, cache, kwargs: dict) -> bool:
        if any(k not in _ALLOWED_KWARGS for k in kwargs) or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return False
        config = self.base.config
        if kwargs.get("return_dict") is False or torch.is_grad_enabled() or config.output_hidden_states or config.output_attentions:
            return False
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        for parent, name, module in self.placed:
            if parent._modules.get(name) is not module:
                return False
        for module in self.skipped:
            if module._forward_hooks and not all(_inert(hook) for hook in module._forward_hooks.values()):
                return False
            if module._forward_pre_hooks and (len(module._forward_pre_hooks) > 1 or not hasattr(module, "mixer_type")):
                return False  # a mixer's one pre-hook records inputs for rollback, checked below
        for i, *_ in self.steps:
            layer = cache.mixer_layer(i)
            if layer is None or not layer.states or layer.record_past:
                return False
        return True

    def __call__(self, input_ids, position_ids, cache_position, cache) -> CausalLMOutputWithPast:
        x = self.embed(input_ids)
        if position_ids is None:
            if cache_position is None:
                seen = cache.get_seq_length()
                cache_position = torch.arange(seen, seen + 1, device=x.device)
            position_ids = cache_position[None].expand(x.shape[0], -1)
        pe = None if self.rotary is None else self.rotary(x, position_ids)
        compiled = self.compiled
        if compiled is not None and compiled.ready(cache):
            logits = compiled(x, pe, cache)
            if logits is not None:
                return CausalLMOutputWithPast(logits=logits, **{CACHE_KWARG: cache})
        for i, norm1, mixer, norm2, mlp in self.steps:
            layer = cache.mixer_layer(i)
            h = norm1.forward(x)
            if mixer.__class__ in self.stepping and mixer.can_decode_step(layer):
                x = x + mixer.decode_step(h, pe, layer)
            else:
                x = x + mixer.forward(h, position_embeddings=pe, cache=cache)[0]
            x = x + mlp.forward(norm2.forward(x))
        return CausalLMOutputWithPast(logits=self.head(self.norm.forward(x)), **{CACHE_KWARG: cache})

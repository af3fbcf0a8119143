"""One-token decode of a pure-mixer student without HF's per-layer plumbing (CPU decode mode).

Decoding one token of the built-in teacher's students on a 2-core CPU spends about as long in
Python and per-op overhead as in streaming the weights; HF's model and decoder-layer forwards
(kwargs, output capturing, mask and cache bookkeeping, a module call per sub-module) are a part
of it that a recurrent student does not need. ``DecodePlan`` runs the same modules, in the same
order, on the same tensors, for the two layer structures HF decoders use between
``embed_tokens`` and ``norm`` → ``lm_head`` (→ tanh soft-capping where the config asks for it):

    pre-norm (Llama, Mistral, Qwen2, Gemma):
        x = x + mixer(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))
    sandwich norms (Gemma 2, Gemma 3):
        x = x + post_attention_layernorm(mixer(input_layernorm(x)))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

The structure is not assumed from names: building a plan runs each layer and the model's ends on
a probe (the mixer replaced by a stub) and compares with HF's own forward; a family that computes
something else (parallel residuals, no ``layers`` list) gets no plan and decodes through HF's
forward as before. Hybrids (kept attention layers) get no plan either.

Position embeddings: the plan calls the model's rotary module as HF's forward does — once, or,
where the rotary module takes a ``layer_type`` (Gemma 3: its sliding-window layers use RoPE base
10k, its global layers 1M), once per type in ``config.layer_types``, each layer getting its own
type's. The probe checks this too: it captures what HF's forward hands each layer at a non-zero
position (at 0 every RoPE is the identity) and refuses a plan whose embeddings differ, with the
reason; a rotary module the plan cannot call is a reason too, never an exception.

A plan is used only where nothing could tell the difference (``takes``): one new token per row,
no padding in it, autograd off, the student's own cache with every layer's state present and no
rollback recording, no hooks on the modules whose ``__call__`` it skips, every module still where
it was (a LoRA wrap or a replaced layer turns it off), no outputs besides logits requested. Tests
hold its logits equal to HF's forward for every mixer kind.

Each mixer runs its one ``step`` (the same function its forward runs for a one-token call).
Built by ``enable_decode_plan`` below (``cpu_decode_layout`` calls it), which also gives the model
its decode-mode class (model.py), whose ``forward`` asks the plan; dropped by
``disable_decode_plan`` / ``undo_cpu_decode_layout``.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from attn2ssm.decode.fusion import call_linear
from attn2ssm.decode.model import attach_student
from attn2ssm.decode.step import Step, run_layer
from attn2ssm.hf_compat import CACHE_KWARG

_PRE_NORM = ("input_layernorm", "post_attention_layernorm", "mlp")
_SANDWICH = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "mlp",
    "post_feedforward_layernorm",
)
_STRUCTURES = {
    False: "x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(·))",
    True: "x + post_attention_layernorm(mixer(input_layernorm(x))), then + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(·)))",
}
_PROBE_POSITION = 5  # RoPE at position 0 is the identity for every base: probe where they differ
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


def _same_embeddings(a, b) -> bool:
    """Two layers' position embeddings (None or a (cos, sin) pair) hold the same values."""
    if a is None or b is None:
        return a is None and b is None
    return (
        isinstance(a, tuple)
        and isinstance(b, tuple)
        and len(a) == len(b)
        and all(_close(x, y) for x, y in zip(a, b))
    )


def _layer_step(index: int, layer, mixer, rope: int | None) -> tuple[Step, tuple[str, ...]]:
    """Decoder layer ``index``'s ``Step`` (sandwich norms where the layer has all five parts, else
    pre-norm) and the names of the layer's parts it calls."""
    if all(isinstance(getattr(layer, p, None), nn.Module) for p in _SANDWICH):
        norms = (layer.post_attention_layernorm, layer.pre_feedforward_layernorm)
        return (
            Step(
                index, layer.input_layernorm, mixer, *norms, layer.mlp, layer.post_feedforward_layernorm, rope
            ),
            _SANDWICH,
        )
    return (
        Step(
            index, layer.input_layernorm, mixer, None, layer.post_attention_layernorm, layer.mlp, None, rope
        ),
        _PRE_NORM,
    )


class DecodePlan:
    """See the module docstring. ``DecodePlan.build(model)`` → (plan or None, reason)."""

    def __init__(self, model, inner, layers, mixer_names, rope_types: list | None):
        self.model, self.base, self.inner = model, model.base, inner
        self.embed = inner.get_input_embeddings()
        self.norm = inner.norm
        self.rotary = getattr(inner, "rotary_emb", None)
        self.head = model.base.get_output_embeddings()
        cap = getattr(self.base.config, "final_logit_softcapping", None)
        self.softcap = float(cap) if cap else None
        # the rotary module's calls: [None] (one call, every layer gets it) or one layer type per call
        self.rope_calls = (
            [] if self.rotary is None else sorted(set(rope_types)) if rope_types is not None else [None]
        )
        mixers = model.mixers()
        self.steps: list[Step] = []
        self.placed = []  # (parent, attribute, module): where every module the plan calls must still be
        for i, (layer, name) in enumerate(zip(layers, mixer_names)):
            rope = (
                None
                if self.rotary is None
                else self.rope_calls.index(rope_types[i] if rope_types is not None else None)
            )
            step, parts = _layer_step(i, layer, mixers[i], rope)
            self.steps.append(step)
            self.placed += [(layer, p, getattr(layer, p)) for p in parts] + [(layer, name, mixers[i])]
        self.placed += [(inner, "layers", inner.layers), (inner, "norm", self.norm)]
        for parent, module in ((inner, self.embed), (self.base, self.head), (inner, self.rotary)):
            name = next((n for n, m in parent.named_children() if m is module), None)
            if name is not None:
                self.placed.append((parent, name, module))
        # layers whose mixer has a one-token step
        self.stepping = {i for i, m in mixers.items() if callable(getattr(m, "step", None))}
        # the student's own cache (its remote-code copy's, for one)
        self.cache_class = type(model.new_cache())
        self.context = model.mixer_context
        # modules whose __call__ (and so whose hooks) the plan skips: they must have none
        self.skipped = [model, self.base, inner, *layers] + [
            m for _, _, m in self.placed if not isinstance(m, nn.ModuleList)
        ]
        self.compiled = None  # a CompiledStep (opt-in: ``compile_step``)

    def compile_step(self, backend=None) -> str:
        """Run the layers through one ``torch.compile``d function from the next step on
        (decode/compiled.py). Returns "" or why not."""
        from attn2ssm.decode.compiled import CompiledStep

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
        if not isinstance(inner.get_input_embeddings(), nn.Embedding) or not isinstance(
            base.get_output_embeddings(), nn.Linear
        ):
            return None, "the input embedding or the LM head is not a plain Embedding / Linear"
        mixers = model.mixers()
        if sorted(mixers) != list(range(len(layers))):
            return None, "not every layer is a mixer (a hybrid keeps attention layers)"
        names = []
        for i, layer in enumerate(layers):
            name = next((n for n, m in layer.named_children() if m is mixers[i]), None)
            if name is None or any(not isinstance(getattr(layer, p, None), nn.Module) for p in _PRE_NORM):
                return (
                    None,
                    f"layer {i} ({type(layer).__name__}) is not input_layernorm → mixer → (norm →) mlp",
                )
            names.append(name)
        rope_types, reason = cls._rope_types(inner, len(layers))
        if reason:
            return None, reason
        plan = cls(model, inner, layers, names, rope_types)
        reason = plan._probe(layers, names)
        return (plan, "") if reason is None else (None, reason)

    @staticmethod
    def _rope_types(inner, n_layers: int) -> tuple[list | None, str]:
        """(each layer's type for a rotary module that takes ``layer_type``, or None for one
        shared call; why not). Which embeddings HF hands each layer is then checked by the probe."""
        rotary = getattr(inner, "rotary_emb", None)
        if rotary is None:
            return None, ""
        try:
            params = inspect.signature(rotary.forward).parameters
        except (TypeError, ValueError):
            return (
                None,
                f"{type(rotary).__name__}.forward has no readable signature, so its position embeddings cannot be reproduced",
            )
        if "layer_type" not in params:
            return None, ""
        types = getattr(inner.config, "layer_types", None)
        if not isinstance(types, (list, tuple)) or len(types) < n_layers:
            return (
                None,
                f"{type(rotary).__name__} computes position embeddings per layer type, but the config has no layer_types for every layer",
            )
        return list(types[:n_layers]), ""

    def position_embeddings(self, x: torch.Tensor, position_ids: torch.Tensor) -> list:
        """The rotary module's outputs for these positions, one per call in ``rope_calls``
        (``Step.rope`` indexes them); [] without a rotary module."""
        if self.rope_calls == [None]:
            return [self.rotary(x, position_ids)]
        return [self.rotary(x, position_ids, layer_type=t) for t in self.rope_calls]

    def _probe(self, layers, names) -> str | None:
        """None if HF's forward computes what the plan computes (on a random input), else why not:
        the position embeddings each layer is handed, each kind of layer, and the model's ends."""
        weight = self.embed.weight
        x = torch.randn(1, 1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        pos = torch.full((1, 1), _PROBE_POSITION, dtype=torch.long)
        try:
            pes = self.position_embeddings(x, pos)
        except Exception as error:  # noqa: BLE001 - any failure means "no plan"
            return f"the plan could not compute {type(self.rotary).__name__}'s position embeddings ({type(error).__name__}: {error})"
        return (
            self._probe_handed(layers, names, pos, pes)
            or self._probe_layers(layers, names, x, pos, pes)
            or self._probe_ends()
        )

    def _probe_handed(self, layers, names, pos: torch.Tensor, pes: list) -> str | None:
        """Does HF's own forward (mixers stubbed out) hand each layer the position embeddings
        ``pes`` the plan gives it? None if so, else why not."""
        stub = _Stub()
        handed: dict[int, object] = {}

        def capture(index):
            def hook(module, args, kwargs):
                # (passed positionally: not what the plan was written for)
                handed[index] = kwargs.get("position_embeddings")

            return hook

        handles = [
            layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)
        ]
        saved = [layer._modules[name] for layer, name in zip(layers, names)]
        for layer, name in zip(layers, names):
            layer._modules[name] = stub
        try:
            self.inner(input_ids=torch.tensor([[1]]), position_ids=pos, use_cache=False)
        except Exception as error:  # noqa: BLE001
            return f"{type(self.inner).__name__} could not be probed ({type(error).__name__}: {error})"
        finally:
            for handle in handles:
                handle.remove()
            for layer, name, mixer in zip(layers, names, saved):
                layer._modules[name] = mixer
        for step in self.steps:
            mine = None if step.rope is None else pes[step.rope]
            if step.index not in handed or not _same_embeddings(mine, handed[step.index]):
                return f"layer {step.index} gets position embeddings from HF's forward that the plan does not reproduce"
        return None

    def _probe_layers(self, layers, names, x: torch.Tensor, pos: torch.Tensor, pes: list) -> str | None:
        """Does each kind of decoder layer (its mixer stubbed out) compute what its ``Step`` does
        on ``x``? None if so, else why not."""
        stub, checked = _Stub(), set()
        for step, layer, name in zip(self.steps, layers, names):
            if type(layer) in checked:
                continue
            pe = None if step.rope is None else pes[step.rope]
            mixer = layer._modules[name]
            layer._modules[name] = stub
            try:
                ref = _first(
                    layer(
                        x,
                        attention_mask=None,
                        position_ids=pos,
                        use_cache=False,
                        cache_position=pos[0],
                        position_embeddings=pe,
                    )
                )
            except Exception as error:  # noqa: BLE001 - any failure means "no plan"
                return f"{type(layer).__name__} could not be probed ({type(error).__name__}: {error})"
            finally:
                layer._modules[name] = mixer
            y = run_layer(step, x, stub(step.norm_in(x))[0])
            if not isinstance(ref, torch.Tensor) or not _close(y, ref):
                return f"{type(layer).__name__} does not compute {_STRUCTURES[step.mixer_norm is not None]}"
            checked.add(type(layer))
        return None

    def _probe_ends(self) -> str | None:
        """Does the model without its layers compute ``logits(embed(ids))``? None if so, else why not."""
        ids = torch.tensor([[1, 2]])
        saved_layers = self.inner.layers
        self.inner.layers = nn.ModuleList()
        try:
            ref = self.base(input_ids=ids, use_cache=False).logits
        except Exception as error:  # noqa: BLE001
            return f"{type(self.base).__name__} could not be probed without layers ({type(error).__name__}: {error})"
        finally:
            self.inner.layers = saved_layers
        if not _close(self.logits(self.embed(ids)), ref):
            return f"{type(self.base).__name__}'s logits are not lm_head(norm(embed_tokens(ids))) (soft-capped as its config says) around its layers"
        return None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(x)), tanh soft-capped where the config asks for it (Gemma 2)."""
        logits = call_linear(self.head, self.norm.forward(x))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # -- running ----------------------------------------------------------------------------
    def takes(
        self, input_ids, attention_mask, cache, inputs_embeds, labels, use_cache, logits_to_keep, kwargs: dict
    ) -> bool:
        """Can the plan answer this call of the student's forward (its arguments; ``cache`` the
        one it was given under either name, ``kwargs`` the rest)?"""
        if input_ids is None or inputs_embeds is not None or labels is not None or input_ids.shape[1] != 1:
            return False
        if (
            attention_mask is not None
            and attention_mask.dim() == 2
            and not bool(attention_mask[:, -1:].all())
        ):
            return False  # padding in the new token
        if use_cache is None:
            use_cache = getattr(self.base.config, "use_cache", True)
        if not use_cache or not isinstance(logits_to_keep, int) or not isinstance(cache, self.cache_class):
            return False
        return self.usable(cache, kwargs)

    def usable(self, cache, kwargs: dict) -> bool:
        if (
            any(k not in _ALLOWED_KWARGS for k in kwargs)
            or kwargs.get("output_attentions")
            or kwargs.get("output_hidden_states")
        ):
            return False
        config = self.base.config
        if (
            kwargs.get("return_dict") is False
            or torch.is_grad_enabled()
            or config.output_hidden_states
            or config.output_attentions
        ):
            return False
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        for parent, name, module in self.placed:
            if parent._modules.get(name) is not module:
                return False
        for module in self.skipped:
            if module._forward_hooks and not all(_inert(hook) for hook in module._forward_hooks.values()):
                return False
            if module._forward_pre_hooks and (
                len(module._forward_pre_hooks) > 1 or not hasattr(module, "mixer_type")
            ):
                return False  # a mixer's one pre-hook records inputs for rollback, checked below
        for step in self.steps:
            layer = cache.mixer_layer(step.index)
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
        pes = self.position_embeddings(x, position_ids)
        self.context.padding_mask = None  # (what the student's forward publishes for an unpadded token)
        compiled = self.compiled
        if compiled is not None and compiled.ready(cache):
            logits = compiled(x, pes, cache)
            if logits is not None:
                return CausalLMOutputWithPast(logits=logits, **{CACHE_KWARG: cache})
        for step in self.steps:
            layer = cache.mixer_layer(step.index)
            mixer = step.mixer
            h = step.norm_in.forward(x)
            pe = None if step.rope is None else pes[step.rope]
            if step.index in self.stepping and mixer.can_step(layer):
                y = mixer.step_layer(h, pe, layer)
            else:
                y = mixer.forward(h, position_embeddings=pe, cache=cache)[0]
            x = run_layer(step, x, y)
        return CausalLMOutputWithPast(logits=self.logits(x), **{CACHE_KWARG: cache})


def enable_decode_plan(model, compile: bool = False) -> bool:
    """Give ``model`` (an ``Attn2SSMForCausalLM``, or one loaded as remote code) a ``DecodePlan``:
    the plan kept in its ``__dict__`` and the decode-mode class whose forward asks it (model.py).
    The one way to a plan (``cpu_decode_layout`` calls it). No plan, with the reason in
    ``model.decode_plan_reason``, when the model's structure does not allow one. ``compile``: its
    layers also run as one ``torch.compile``d function (decode/compiled.py; the reason it cannot,
    if so, in ``model.compiled_step_reason``). True when something was added."""
    added = attach_student(model, causal_lm=True)
    plan = model.__dict__.get("_decode_plan")
    if plan is None:
        plan, model.decode_plan_reason = DecodePlan.build(model)
        model.__dict__["_decode_plan"] = plan
        added = added or plan is not None
    if compile and plan is None:
        model.compiled_step_reason = f"no decode plan: {model.decode_plan_reason}"
    elif compile and plan.compiled is None:
        model.compiled_step_reason = plan.compile_step()
        added = added or plan.compiled is not None
    return added


def disable_decode_plan(model) -> bool:
    """Drop ``model``'s plan (its class is put back by ``undo_cpu_decode_layout``). True if it had one."""
    return model.__dict__.pop("_decode_plan", None) is not None


def compiled_step_status(model) -> str:
    """The word "compiled" when ``model``'s decode plan runs its layers as one ``torch.compile``d
    function, else why it decodes eagerly (``model.compiled_step_reason``: no plan, compiling not possible,
    or the compiled function failed at a call; or, for a step never run, a mixer it steps aside for);
    "not compiled" when compiling was never asked."""
    plan = model.__dict__.get("_decode_plan")
    if plan is not None and plan.compiled is not None and plan.compiled.failed is None:
        step = plan.compiled
        return (
            f"not compiled: {step.stepped_aside}"
            if step.stepped_aside and not step.compiled_once
            else "compiled"
        )
    return getattr(model, "compiled_step_reason", "") or "not compiled"

"""``Attn2SSMForCausalLM``: the teacher family's own HF model with attention modules swapped.

The wrapped model (``self.base``) is built from ``config.base_config`` by transformers itself,
so embeddings, norms, MLPs, residual wiring and the LM head are the teacher's code. Each layer
whose plan entry is not ``"attention"`` gets a mixer at ``config.attention_paths[i]``.

This file and everything it imports from attn2ssm are copied, flattened, next to every saved
checkpoint (see ``student/export.py``), so ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` works where attn2ssm is not installed. Keep its imports to torch,
transformers and attn2ssm modules of the same kind.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from attn2ssm.hf_compat import CACHE_KWARG, pick_cache
from attn2ssm.mixers.base import MixerContext
from attn2ssm.mixers.registry import build_mixer
from attn2ssm.student.cache import Attn2SSMCache
from attn2ssm.student.configuration import Attn2SSMConfig


def _get_submodule_parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    return (root.get_submodule(parent_path) if parent_path else root), name


class Attn2SSMPreTrainedModel(PreTrainedModel):
    config_class = Attn2SSMConfig
    base_model_prefix = "base"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False

    def _init_weights(self, module):
        base = getattr(self, "base", None)
        if base is not None and hasattr(base, "_init_weights"):
            base._init_weights(module)


class Attn2SSMForCausalLM(Attn2SSMPreTrainedModel, GenerationMixin):
    def __init__(self, config: Attn2SSMConfig):
        super().__init__(config)
        base_config = config.build_base_config()
        # Kept attention layers run the teacher's attention implementation (eager for soft-capped
        # Gemma-2, SDPA for most); None lets transformers pick the family's default.
        self.base = AutoModelForCausalLM.from_config(base_config, attn_implementation=config.base_attn_implementation)
        self.mixer_context = MixerContext()
        for i in config.mixer_layers:
            kind = config.layer_plan[i]
            mixer = build_mixer(kind, config.layer_geometry[i], i, config.mixer_options.get(kind))
            mixer.context = self.mixer_context
            parent, name = _get_submodule_parent(self.base, config.attention_paths[i])
            setattr(parent, name, mixer)
        self.post_init()
        # post_init ran the family's weight init over every module; give the mixers' own
        # parameters (gates, Δ, A, conv …) back their designed initialisation.
        for mixer in self.mixers().values():
            if hasattr(mixer, "init_new_parameters"):
                mixer.init_new_parameters()

    # -- plumbing HF expects ------------------------------------------------------------------
    def get_input_embeddings(self):
        return self.base.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.base.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.base.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.base.set_output_embeddings(value)

    def mixers(self) -> dict[int, nn.Module]:
        """Layer index → mixer module, for every swapped layer."""
        return {i: self.base.get_submodule(self.config.attention_paths[i]) for i in self.config.mixer_layers}

    def save_pretrained(self, save_directory, *args, **kwargs):
        """HF save (safetensors) plus the flattened modeling code and ``auto_map``."""
        from attn2ssm.ops.layout import standard_layout
        from attn2ssm.student.export import auto_map, write_remote_code

        self.config.auto_map = auto_map()
        with standard_layout(self):  # fused input projections written as independent tensors (see cpu_decode_layout)
            super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory)

    def new_cache(self) -> Attn2SSMCache:
        return Attn2SSMCache(self.config)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """``generate`` gets our hybrid cache (KV + recurrent states) instead of a plain DynamicCache,
        under the name this transformers keeps it (``CACHE_KWARG``)."""
        wants_default = generation_config.use_cache is not False and generation_config.cache_implementation in (None, "dynamic")
        if model_kwargs.get(CACHE_KWARG) is None and wants_default:
            model_kwargs[CACHE_KWARG] = self.new_cache()
            if generation_config.is_assistant:  # a draft model gets rolled back after each verification
                model_kwargs[CACHE_KWARG].activate_past_recording()
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    # -- one-token decode plan (CPU decode mode) -------------------------------------------------
    def enable_decode_plan(self, compile: bool = False) -> bool:
        """Build a ``DecodePlan`` (called by ``cpu_decode_layout``). False, with the reason in
        ``decode_plan_reason``, when this student's structure does not allow one. ``compile``:
        its layers also run as one ``torch.compile``d function (student/compiled_step.py; the
        reason it cannot, if so, in ``compiled_step_reason``). True when something was added."""
        from attn2ssm.student.decode_plan import DecodePlan

        plan, added = self.__dict__.get("_decode_plan"), False
        if plan is None:
            plan, self.decode_plan_reason = DecodePlan.build(self)
            self.__dict__["_decode_plan"] = plan
            added = plan is not None
        if compile and plan is None:
            self.compiled_step_reason = f"no decode plan: {self.decode_plan_reason}"
        elif compile and plan.compiled is None:
            self.compiled_step_reason = plan.compile_step()
            added = added or plan.compiled is not None
        return added

    def disable_decode_plan(self) -> bool:
        return self.__dict__.pop("_decode_plan", None) is not None

    # -- forward -----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Attn2SSMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Attn2SSMCache | None = None,
        **kwargs,
    ):
        """As the family's ``ForCausalLM.forward``; the cache is taken as ``cache=`` (transformers
        >= 5.24) or ``past_key_values=`` (earlier), whichever the caller uses."""
        cache = pick_cache(cache, past_key_values)
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        # Mixers need the 2-D padding mask of the current tokens, not HF's 4-D softmax mask.
        pad = None
        if attention_mask is not None and attention_mask.dim() == 2:
            current = attention_mask[:, -length:]
            if not bool(current.all()):
                pad = current
        self.mixer_context.padding_mask = pad
        use_cache = getattr(self.base.config, "use_cache", True) if use_cache is None else use_cache
        plan = self.__dict__.get("_decode_plan")
        if (
            plan is not None
            and length == 1
            and pad is None
            and use_cache
            and input_ids is not None
            and inputs_embeds is None
            and labels is None
            and isinstance(logits_to_keep, int)
            and isinstance(cache, Attn2SSMCache)
            and plan.usable(cache, kwargs)
        ):
            return plan(input_ids, position_ids, kwargs.get("cache_position"), cache)
        if use_cache and (cache is None or not isinstance(cache, Attn2SSMCache)):
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("pass an Attn2SSMCache (model.new_cache()) to a student, not a plain KV cache")
            cache = self.new_cache()
        if not use_cache:
            cache = None
        seen = None if cache is None else [cache.mixer_layer(i).seen for i in self.config.mixer_layers]
        self.mixer_context.cache = cache
        try:
            out = self.base(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **{CACHE_KWARG: cache},
                **kwargs,
            )
        finally:
            self.mixer_context.cache = None
        if seen is not None:
            self._check_states_advanced(cache, seen, length)
        return out

    def _check_states_advanced(self, cache: Attn2SSMCache, seen: list[int], length: int) -> None:
        """Every mixer layer must have consumed this forward's tokens: a mixer that ran without its
        state (as under transformers 5.24 before hf_compat) would otherwise decode wrongly, silently."""
        for i, before in zip(self.config.mixer_layers, seen):
            if cache.mixer_layer(i).seen != before + length:
                raise RuntimeError(
                    f"layer {i}'s mixer did not update its recurrent state in a cached forward "
                    f"(transformers {transformers.__version__} passed it no cache): "
                    "update attn2ssm, or refresh a saved student's code with `attn2ssm upgrade DIR`"
                )

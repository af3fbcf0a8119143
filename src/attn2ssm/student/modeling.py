"""``Attn2SSMForCausalLM``: the teacher family's own HF model with attention modules swapped.

The wrapped model (``self.base``) is built from ``config.base_config`` by transformers itself,
so embeddings, norms, MLPs, residual wiring and the LM head are the teacher's code. Each layer
whose plan entry is not ``"attention"`` gets a mixer at ``config.attention_paths[i]``.
``Attn2SSMModel`` (``AutoModel``) is the same without the LM head: the family's base model under
the same state-dict names, so it loads a saved student's weights and returns hidden states.

Dtypes: the wrapped model is built in the dtype the student is being built in (the one
``from_pretrained(dtype=...)`` asks for, or ``"auto"``'s saved one), never the teacher's recorded
dtype. ``FP32_PARAMETERS`` stay float32 in a bf16/fp16 student, as Mamba keeps ``A_log`` and ``D``
(mamba_ssm's Mamba: "Keep A_log in fp32", "Keep in fp32"): every mixer reads them in float32,
and bf16 keeps 8 significant bits, so rounding A_log (up to ~2.8) would move A = −exp(A_log) by
up to ~1 %, an error every decay exp(Δ·A) compounds along the sequence.
Δ's bias is part of the ``dt_proj`` Linear (fused with the other input projections, a LoRA target)
and follows the model's dtype, as mamba_ssm's ``dt_bias`` (made in the model's dtype) does; Δ
itself is computed in float32.

This file and everything it imports from attn2ssm are copied, flattened, next to every saved
checkpoint (see ``student/remote_code.py``), so ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` works where attn2ssm is not installed. Keep its imports to torch,
transformers and attn2ssm modules of the same kind. CPU decode mode (``attn2ssm.decode``) is
not one of them: it attaches itself to a model (its own subclasses of these classes) and is never
called from here.
"""

from __future__ import annotations

import re

import torch
import transformers
from torch import nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoModel,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedModel,
)

from attn2ssm.hf_compat import CACHE_KWARG, pick_cache
from attn2ssm.mixers.base import MixerContext
from attn2ssm.mixers.registry import build_mixer
from attn2ssm.student.cache import Attn2SSMCache
from attn2ssm.student.configuration import Attn2SSMConfig
from attn2ssm.student.kept_attention import QWEN35, Qwen35FormAttention

# Parameters (state-dict key patterns) kept in float32 when the student is bf16 or fp16: Mamba's
# A_log and D, HedgeMamba's raw decay A. transformers upcasts them on load (from_pretrained);
# ``keep_fp32_parameters`` does it for a student built in memory.
FP32_PARAMETERS = (r"(^|\.)A_log$", r"(^|\.)D$", r"(^|\.)A$")


def _get_submodule_parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    return (root.get_submodule(parent_path) if parent_path else root), name


@torch.no_grad()
def keep_fp32_parameters(model: nn.Module) -> list[str]:
    """Upcast every half-precision parameter matching ``FP32_PARAMETERS`` to float32 (values
    unchanged); returns their names. For students made by ``.to(bfloat16)`` (convert from a bf16
    teacher, a grown stage), so they hold what ``from_pretrained(dtype=torch.bfloat16)`` gives."""
    pattern = re.compile("|".join(FP32_PARAMETERS))
    changed = []
    for name, param in model.named_parameters():
        if param.dtype in (torch.float16, torch.bfloat16) and pattern.search(name):
            param.data = param.data.float()
            changed.append(name)
    return changed


class Attn2SSMPreTrainedModel(PreTrainedModel):
    config_class = Attn2SSMConfig
    base_model_prefix = "base"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False
    _keep_in_fp32_modules_strict = FP32_PARAMETERS

    def _family_model(self) -> PreTrainedModel:
        """The teacher family's model inside this one (ForCausalLM here, its base model in ``Attn2SSMModel``)."""
        return self.base

    def _init_weights(self, module):
        family = self._family_model() if "base" in self._modules else None
        if family is not None and hasattr(family, "_init_weights"):
            family._init_weights(module)

    def _swap_in_mixers(self) -> None:
        """Put a mixer at ``attention_paths[i]`` (relative to ``self.base``) for every mixer layer."""
        config = self.config
        self.mixer_context = MixerContext()
        for i in config.mixer_layers:
            kind = config.layer_plan[i]
            mixer = build_mixer(kind, config.layer_geometry[i], i, config.mixer_options.get(kind))
            mixer.context = self.mixer_context
            parent, name = _get_submodule_parent(self.base, config.attention_paths[i])
            setattr(parent, name, mixer)
        if getattr(config, "kept_attention", "teacher") == QWEN35:
            self._kept_attention_in_qwen35_form()

    def _kept_attention_in_qwen35_form(self) -> None:
        """Every kept attention layer as a ``Qwen35FormAttention`` made from the family's module."""
        config = self.config
        eps = float(config.base_config["rms_norm_eps"])
        for i, kind in enumerate(config.layer_plan):
            if kind != "attention":
                continue
            g, path = config.layer_geometry[i], config.attention_paths[i]
            attention = self.base.get_submodule(path)
            form = Qwen35FormAttention(attention, g["num_heads"], g["head_dim"], g.get("rotary_dim", 0), eps)
            parent, name = _get_submodule_parent(self.base, path)
            setattr(parent, name, form)

    def kept_attention_layers(self) -> dict[int, nn.Module]:
        """Layer index → kept attention module, for every layer that keeps softmax attention."""
        mixers = set(self.config.mixer_layers)
        paths = self.config.attention_paths
        return {i: self.base.get_submodule(p) for i, p in enumerate(paths) if i not in mixers}

    def _finish_init(self) -> None:
        self.post_init()
        # post_init ran the family's weight init over every module; give the mixers' own
        # parameters (gates, Δ, A, conv …) back their designed initialisation.
        for mixer in self.mixers().values():
            if hasattr(mixer, "init_new_parameters"):
                mixer.init_new_parameters()

    # -- plumbing HF expects ------------------------------------------------------------------
    def get_input_embeddings(self):
        return self._family_model().get_input_embeddings()

    def set_input_embeddings(self, value):
        self._family_model().set_input_embeddings(value)

    def mixers(self) -> dict[int, nn.Module]:
        """Layer index → mixer module, for every swapped layer."""
        return {i: self.base.get_submodule(self.config.attention_paths[i]) for i in self.config.mixer_layers}

    def save_pretrained(self, save_directory, *args, **kwargs):
        """HF save (safetensors) plus the flattened modeling code, ``auto_map`` and a model card
        (README.md, see student/card.py)."""
        from attn2ssm.student.card import write_student_card
        from attn2ssm.student.remote_code import auto_map, write_remote_code

        self.config.auto_map = auto_map()
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory)
            write_student_card(save_directory)

    def new_cache(self) -> Attn2SSMCache:
        return Attn2SSMCache(self.config)

    # -- running the family's model with the mixers fed ------------------------------------------
    def _begin_forward(
        self, family_config, cache, past_key_values, input_ids, inputs_embeds, attention_mask, use_cache
    ):
        """What every forward does first: the cache under either name, the sequence length, the
        padding mask published to the mixers, and ``use_cache`` defaulted from the family config.
        Returns (cache, length, use_cache)."""
        cache = pick_cache(cache, past_key_values)
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        self.mixer_context.padding_mask = self._padding_of(attention_mask, length)
        use_cache = getattr(family_config, "use_cache", True) if use_cache is None else use_cache
        return cache, length, use_cache

    @staticmethod
    def _padding_of(attention_mask, length: int):
        """The 2-D padding mask of the current tokens (mixers cannot use HF's 4-D softmax mask), or
        None when nothing is padded."""
        if attention_mask is not None and attention_mask.dim() == 2:
            current = attention_mask[:, -length:]
            if not bool(current.all()):
                return current
        return None

    def _student_cache(self, cache, use_cache: bool):
        if use_cache and (cache is None or not isinstance(cache, Attn2SSMCache)):
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError(
                    "pass an Attn2SSMCache (model.new_cache()) to a student, not a plain KV cache"
                )
            cache = self.new_cache()
        return cache if use_cache else None

    def _run_family(self, module: nn.Module, cache, length: int, **kwargs):
        """``module(**kwargs)`` with this forward's cache in the mixers' context (and passed on under
        ``CACHE_KWARG``); afterwards every mixer state must have advanced by ``length``."""
        seen = None if cache is None else [cache.mixer_layer(i).seen for i in self.config.mixer_layers]
        self.mixer_context.cache = cache
        try:
            out = module(**kwargs, **{CACHE_KWARG: cache})
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


class Attn2SSMModel(Attn2SSMPreTrainedModel):
    """``AutoModel``: the student without its LM head — the family's base model (``LlamaModel`` …)
    with the same mixers, returning hidden states. ``self.base`` holds it under the family's prefix
    (``base.model``, ``base.transformer`` …), so a saved student's keys load as they are and its
    LM head (``base.lm_head``, GPT-NeoX's ``base.embed_out`` …) is skipped."""

    def __init__(self, config: Attn2SSMConfig):
        super().__init__(config)
        base_config = config.build_base_config()
        prefix = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)].base_model_prefix
        outside = [p for p in config.attention_paths if not p.startswith(prefix + ".")]
        if outside:
            raise ValueError(
                f"attention path {outside[0]!r} is not inside the family's base model ({prefix!r}): load with AutoModelForCausalLM"
            )
        self.prefix = prefix
        # a saved student's keys outside the base model (its LM head) are expected to be left over
        self._keys_to_ignore_on_load_unexpected = [rf"^base\.(?!{re.escape(prefix)}\.)"]
        self.base = nn.Module()  # a plain holder: keys read base.<prefix>.… as in the saved student
        family = AutoModel.from_config(
            base_config, attn_implementation=config.base_attn_implementation, dtype=torch.get_default_dtype()
        )
        setattr(self.base, prefix, family)
        self._swap_in_mixers()
        self._finish_init()

    def _family_model(self) -> PreTrainedModel:
        return getattr(self.base, self.prefix)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Attn2SSMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Attn2SSMCache | None = None,
        **kwargs,
    ):
        """As the family's base model's ``forward`` (``last_hidden_state`` after the final norm)."""
        family = self._family_model()
        cache, length, use_cache = self._begin_forward(
            family.config, cache, past_key_values, input_ids, inputs_embeds, attention_mask, use_cache
        )
        cache = self._student_cache(cache, use_cache)
        return self._run_family(
            family,
            cache,
            length,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )


class Attn2SSMForCausalLM(Attn2SSMPreTrainedModel, GenerationMixin):
    def __init__(self, config: Attn2SSMConfig):
        super().__init__(config)
        base_config = config.build_base_config()
        # Kept attention layers run the teacher's attention implementation (eager for soft-capped
        # Gemma-2, SDPA for most); None lets transformers pick the family's default. Built in the
        # dtype this student is being built in (see the module docstring).
        self.base = AutoModelForCausalLM.from_config(
            base_config, attn_implementation=config.base_attn_implementation, dtype=torch.get_default_dtype()
        )
        self._swap_in_mixers()
        self._finish_init()

    # -- plumbing HF expects ------------------------------------------------------------------
    def get_output_embeddings(self):
        return self.base.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.base.set_output_embeddings(value)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """``generate`` gets our hybrid cache (KV + recurrent states) instead of a plain DynamicCache,
        under the name this transformers keeps it (``CACHE_KWARG``)."""
        wants_default = (
            generation_config.use_cache is not False
            and generation_config.cache_implementation in (None, "dynamic")
        )
        if model_kwargs.get(CACHE_KWARG) is None and wants_default:
            model_kwargs[CACHE_KWARG] = self.new_cache()
            if generation_config.is_assistant:  # a draft model gets rolled back after each verification
                model_kwargs[CACHE_KWARG].activate_past_recording()
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

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
        cache, length, use_cache = self._begin_forward(
            self.base.config, cache, past_key_values, input_ids, inputs_embeds, attention_mask, use_cache
        )
        cache = self._student_cache(cache, use_cache)
        return self._run_family(
            self.base,
            cache,
            length,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )

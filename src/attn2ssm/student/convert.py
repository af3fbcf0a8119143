"""Build a student from a teacher: same architecture, attention swapped per the layer plan.

Every non-attention weight is the teacher's; each mixer starts from its layer's q/k/v/o
(read through the family adapter, so fused/transposed layouts and GQA are handled there).
Options that name a teacher setting (``norm_eps: auto``) are made concrete here, so the saved
student records the number (``resolve_options``).
``depth=N`` builds a student with N layers instead: student layer i is a copy of teacher layer
``layer_map(N, T)[i]`` (norms, MLP, attention or the mixer's init) — a proportional subset of the
teacher's layers when shallower, some layers repeated when deeper.

``grow_student`` continues a stepwise schedule (Mamba in the Llama §2.1): a trained student gets more
layers converted, keeping everything it has learnt. ``converted_layer`` swaps one attention
layer for a fresh mixer for the length of a ``with`` block (cheap layer probing).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from attn2ssm.adapters import get_adapter
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.registry import ATTENTION, MIXERS, build_mixer
from attn2ssm.mixers.ssm_common import resolve_norm_eps
from attn2ssm.student.configuration import Attn2SSMConfig
from attn2ssm.student.kept_attention import (
    KEPT_ATTENTION,
    NEW_PARAMETERS,
    QWEN35,
    QWEN35_FORM_FAMILIES,
)
from attn2ssm.student.modeling import (
    Attn2SSMForCausalLM,
    _get_submodule_parent,
    keep_fp32_parameters,
)
from attn2ssm.student.plans import layer_map

# Per-layer fields of transformers configs, remapped when a student changes depth.
_PER_LAYER_VALUES = ("layer_types", "no_rope_layers")  # one entry per layer
_LAYER_INDEX_LISTS = ("mlp_only_layers",)  # lists of layer indices
_LAYER_COUNTS = ("max_window_layers",)  # layers below this index are of one kind, the rest another


def _qk_norm_settings(weights) -> dict:
    norm = weights.q_norm
    if norm is None:
        return {}
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6))
    # Gemma-family RMSNorms scale by (1 + w) with w initialised at 0.
    offset = 1.0 if "gemma" in type(norm).__name__.lower() else 0.0
    return {"qk_norm_eps": float(eps), "qk_norm_offset": offset}


def _config_for_depth(config, source: list[int]) -> dict:
    """The teacher's config as a dict for a student whose layer i is teacher layer ``source[i]``."""
    d = config.to_dict()
    d.pop("quantization_config", None)
    n_teacher, n = config.num_hidden_layers, len(source)
    if source == list(range(n_teacher)):
        return d
    # GPT-2 keeps the count as n_layer (num_hidden_layers is an alias): write the stored name.
    d[config.attribute_map.get("num_hidden_layers", "num_hidden_layers")] = n
    for name in _PER_LAYER_VALUES:
        if isinstance(d.get(name), (list, tuple)):
            d[name] = [d[name][j] for j in source]
    for name in _LAYER_INDEX_LISTS:
        if isinstance(d.get(name), (list, tuple)):
            listed = set(d[name])
            d[name] = [i for i, j in enumerate(source) if j in listed]
    for name in _LAYER_COUNTS:  # the map is non-decreasing, so "first m layers" stays a prefix
        if isinstance(d.get(name), int):
            d[name] = sum(j < d[name] for j in source)
    # GPT-2 scales attention by 1/(layer index + 1): tied to the index
    if d.get("scale_attn_by_inverse_layer_idx"):
        raise ConfigError(
            "the teacher scales attention by its layer index (scale_attn_by_inverse_layer_idx)",
            "convert at the teacher's depth (depth: null)",
        )
    handled = {*_PER_LAYER_VALUES, *_LAYER_INDEX_LISTS}
    unknown = [
        k
        for k, v in d.items()
        if "layer" in k and k not in handled and isinstance(v, (list, tuple)) and len(v) == n_teacher
    ]
    if unknown:
        raise ConfigError(
            f"teacher config field(s) {unknown} look per-layer and cannot be remapped to {n} layers",
            "convert at the teacher's depth (depth: null)",
        )
    return d


def _layer_prefix(attention_path: str) -> str:
    """Key prefix of the decoder layer holding an attention module: model.layers.3.self_attn → model.layers.3."""
    return attention_path.rpartition(".")[0] + "."


def _state_for_depth(
    state: dict, teacher_paths: list[str], student_paths: list[str], source: list[int]
) -> dict:
    """The teacher's state dict with student layer i's tensors taken from teacher layer source[i]."""
    if teacher_paths == student_paths and source == list(range(len(teacher_paths))):
        return state
    t_prefixes = [_layer_prefix(p) for p in teacher_paths]
    # embeddings, final norm, head
    out = {k: v for k, v in state.items() if not k.startswith(tuple(t_prefixes))}
    for i, j in enumerate(source):
        t, s = t_prefixes[j], _layer_prefix(student_paths[i])
        out.update({s + k[len(t) :]: v for k, v in state.items() if k.startswith(t)})
    return out


def resolve_options(mixer_options: dict | None, teacher_config) -> dict:
    """Mixer options by kind with every value that names a teacher setting made concrete
    (``norm_eps: auto`` → the teacher's rms_norm_eps), so a saved student records the number."""
    return {
        kind: resolve_norm_eps(kind, opts, teacher_config) for kind, opts in (mixer_options or {}).items()
    }


def _student_paths(adapter, base_config: dict) -> list[str]:
    """Attention module paths of a model built from ``base_config`` (built on the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(base_config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    return adapter.attention_module_paths(skeleton)


def convert(
    teacher: nn.Module,
    layer_plan: list[str],
    mixer_options: dict | None = None,
    *,
    teacher_info: dict | None = None,
    init: str = "attention",
    depth: int | None = None,
    depth_map: str = "endpoints",
    kept_attention: str = "teacher",
) -> Attn2SSMForCausalLM:
    """Return a student (same dtype/device as the teacher) initialised from the teacher's weights.

    ``init="attention"`` (default) starts each mixer from its layer's q/k/v/o (Mamba in the Llama's
    attention initialisation); ``init="random"`` leaves the mixers' projections at the family's
    default random init (the ablation baseline) — everything else is the teacher's either way.
    ``depth`` (default: the teacher's) sets the student's number of layers; layer i is built from
    teacher layer ``layer_map(depth, T, depth_map)[i]``, recorded in ``config.teacher_layers``.
    ``layer_plan`` has one entry per *student* layer. ``kept_attention``: the form of the layers that
    keep attention, the teacher's (``"teacher"``) or Qwen3.5's (``"qwen35"``, student/kept_attention.py).
    """
    if init not in ("attention", "random"):
        raise ConfigError(f"unknown init {init!r}", "use init: attention (default) or random")
    adapter = get_adapter(teacher)
    config = teacher.config
    paths = adapter.attention_module_paths(teacher)
    if depth is not None and depth < 1:
        raise ConfigError(
            f"student depth {depth} is not a number of layers",
            "use depth >= 1, or null for the teacher's depth",
        )
    source = layer_map(depth, len(paths), depth_map) if depth is not None else list(range(len(paths)))
    if len(layer_plan) != len(source):
        raise ValueError(f"layer plan has {len(layer_plan)} entries but the student has {len(source)} layers")
    attn_modules = [teacher.get_submodule(p) for p in paths]
    _check_kept_attention(kept_attention, adapter.family, config)
    geometry = _layer_geometry(adapter, config, [attn_modules[j] for j in source], source)
    base_config = _config_for_depth(config, source)
    mixer_options = resolve_options(mixer_options, config)
    student_paths = paths if len(source) == len(paths) else _student_paths(adapter, base_config)
    student_config = Attn2SSMConfig(
        base_config=base_config,
        layer_plan=layer_plan,
        attention_paths=student_paths,
        layer_geometry=geometry,
        mixer_options=mixer_options or {},
        teacher={"family": adapter.family, "model_type": config.model_type, **(teacher_info or {})},
        base_attn_implementation=getattr(config, "_attn_implementation", None),
        teacher_layers=None if source == list(range(len(paths))) else source,
        kept_attention=kept_attention,
    )
    param = next(teacher.parameters())
    student = Attn2SSMForCausalLM(student_config).to(dtype=param.dtype, device=param.device)
    # a half-precision teacher: A_log / D stay float32, as from_pretrained keeps them
    keep_fp32_parameters(student)
    state = _state_for_depth(teacher.state_dict(), paths, student_paths, source)
    _load_teacher_state(student, state)
    _init_mixers(student, adapter, [attn_modules[j] for j in source], init)
    student.eval()
    return student


def _layer_geometry(adapter, config, attention: list[nn.Module], source: list[int]) -> list[dict]:
    """Each student layer's attention geometry: teacher layer ``source[i]``'s (``attention[i]`` its
    module, read for its q/k norms' settings)."""
    geometry = []
    for module, j in zip(attention, source):
        g = adapter.geometry(config, j).to_dict()
        if g.get("has_qk_norm"):
            g.update(_qk_norm_settings(adapter.read_weights(module)))
        geometry.append(g)
    return geometry


def _init_mixers(student, adapter, attention: list[nn.Module], init: str) -> None:
    """Each mixer of ``student`` from the teacher's attention module of its layer (``attention[i]``
    for student layer i), or, with ``init="random"``, its projections drawn afresh."""
    for i, mixer in student.mixers().items():
        if init == "attention":
            mixer.load_attention_weights(adapter.read_weights(attention[i]))
        else:  # load_state_dict filled same-named q/k/v/o from the teacher: draw them afresh
            for module in mixer.modules():
                if isinstance(module, nn.Linear):
                    student.base._init_weights(module)
            if hasattr(mixer, "init_new_parameters"):
                mixer.init_new_parameters()


def _load_teacher_state(student, state: dict) -> None:
    """The teacher's tensors into ``student`` (all but the mixers' and a Qwen3.5-form kept layer's
    new ones, which must be all that is left over); then each such kept layer's start from them."""
    config = student.config
    result = student.base.load_state_dict(state, strict=False)
    mixer_prefixes = tuple(config.attention_paths[i] + "." for i in config.mixer_layers)
    new_prefixes = tuple(f"{p}.{n}." for p in config.attention_paths for n in NEW_PARAMETERS)
    stray = [
        k
        for k in (*result.missing_keys, *result.unexpected_keys)
        if not k.startswith(mixer_prefixes)
        and not (config.kept_attention == QWEN35 and k.startswith(new_prefixes))
    ]
    if stray:
        raise RuntimeError(f"student and teacher weights disagree: {stray[:5]}")
    for module in student.kept_attention_layers().values():
        if hasattr(module, "init_from_teacher"):
            module.init_from_teacher()


def _check_kept_attention(kept_attention: str, family: str, config) -> None:
    """``kept_attention`` is a form this teacher's attention layers can take (a ConfigError if not)."""
    if kept_attention not in KEPT_ATTENTION:
        raise ConfigError(
            f"student.kept_attention={kept_attention!r} is not a form of attention layer",
            f"use one of: {', '.join(KEPT_ATTENTION)}",
        )
    if kept_attention != QWEN35:
        return
    if family not in QWEN35_FORM_FAMILIES:
        raise ConfigError(
            f"student.kept_attention=qwen35 rewrites {', '.join(QWEN35_FORM_FAMILIES)} attention layers, not a {family} teacher's",
            "leave student.kept_attention at teacher",
        )
    if getattr(config, "rms_norm_eps", None) is None:
        raise ConfigError(
            "student.kept_attention=qwen35 takes its q/k norms' eps from the teacher's rms_norm_eps, which it has none of",
            "leave student.kept_attention at teacher",
        )


def _first_param(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


@contextmanager
def converted_layer(student: Attn2SSMForCausalLM, layer: int, kind: str, options: dict | None = None):
    """Within the block, ``student``'s attention layer ``layer`` is a fresh ``kind`` mixer.

    The mixer is initialised from the attention module it replaces, exactly as ``convert`` does
    from the teacher, and takes that module's dtype and device; ``options`` are the mixer's own
    options (not keyed by kind). On exit the attention module, plan and options are restored.
    Yields the mixer.
    """
    config = student.config
    if config.layer_plan[layer] != ATTENTION:
        raise ConfigError(
            f"layer {layer} is already a '{config.layer_plan[layer]}' mixer",
            "convert only layers that keep attention",
        )
    path = config.attention_paths[layer]
    attention = student.base.get_submodule(path)
    options = resolve_norm_eps(kind, options, config.base_config)
    mixer = build_mixer(kind, config.layer_geometry[layer], layer, options)
    if hasattr(mixer, "init_new_parameters"):  # the designed init, as Attn2SSMForCausalLM gives its mixers
        mixer.init_new_parameters()
    ref = _first_param(attention)
    mixer.to(dtype=ref.dtype, device=ref.device)
    keep_fp32_parameters(mixer)
    mixer.load_attention_weights(get_adapter(student.base).read_weights(attention))
    mixer.context = student.mixer_context
    mixer.train(student.training)
    parent, name = _get_submodule_parent(student.base, path)
    had_options, old_options = kind in config.mixer_options, config.mixer_options.get(kind)
    setattr(parent, name, mixer)
    config.layer_plan[layer] = kind
    config.mixer_options[kind] = dict(options or {})
    try:
        yield mixer
    finally:
        setattr(parent, name, attention)
        config.layer_plan[layer] = ATTENTION
        if had_options:
            config.mixer_options[kind] = old_options
        else:
            config.mixer_options.pop(kind, None)


def _check_growth(old_plan: list[str], new_plan: list[str]) -> list[int]:
    """Layers that ``new_plan`` newly converts; a ConfigError unless it only adds mixers."""
    if len(new_plan) != len(old_plan):
        raise ConfigError(
            f"new layer plan has {len(new_plan)} entries but the student has {len(old_plan)} layers",
            "give one entry per layer",
        )
    for i, kind in enumerate(new_plan):
        if kind != ATTENTION and kind not in MIXERS:
            raise ConfigError(
                f"unknown mixer '{kind}' at layer {i} of the new plan",
                f"use one of: {', '.join(sorted([*MIXERS, ATTENTION]))}",
            )
    for i, (old, new) in enumerate(zip(old_plan, new_plan)):
        if old != ATTENTION and new == ATTENTION:
            raise ConfigError(
                f"new plan turns trained '{old}' layer {i} back into attention",
                "a grown plan keeps every mixer layer of the student and only converts attention layers",
            )
        if old != ATTENTION and new != old:
            raise ConfigError(
                f"new plan changes layer {i} from '{old}' to '{new}'",
                "keep each trained layer's mixer kind; convert a fresh student for a different mixer",
            )
    return [
        i for i, (old, new) in enumerate(zip(old_plan, new_plan)) if old == ATTENTION and new != ATTENTION
    ]


def _grown_options(old_config, mixer_options: dict | None, teacher_config) -> dict:
    """The student's mixer options by kind with ``mixer_options`` added (resolved against the
    teacher); a ConfigError if they change the options of a kind the student already uses."""
    options = copy.deepcopy(dict(old_config.mixer_options))
    used = {kind for kind in old_config.layer_plan if kind != ATTENTION}
    for kind, opts in resolve_options(mixer_options, teacher_config).items():
        if kind in used and dict(opts or {}) != dict(options.get(kind) or {}):
            raise ConfigError(
                f"mixer_options for '{kind}' differ from the trained student's {options.get(kind) or {}}",
                f"leave '{kind}' out of mixer_options: grown layers reuse the student's options",
            )
        options[kind] = dict(opts or {})
    return options


def _match_dtypes(grown: nn.Module, student: nn.Module, added_paths: list[str]) -> None:
    """Every tensor of ``grown`` takes the dtype/device of its counterpart in ``student`` (a new
    mixer at one of ``added_paths``: of the attention it replaces), so copying the student's state
    is exact even in a mixed-precision student."""
    for path in added_paths:
        mixer, ref = grown.base.get_submodule(path), _first_param(student.base.get_submodule(path))
        mixer.to(dtype=ref.dtype, device=ref.device)
        keep_fp32_parameters(mixer)
    old_tensors = {**dict(student.named_parameters()), **dict(student.named_buffers())}
    for name, tensor in [*grown.named_parameters(), *grown.named_buffers()]:
        src = old_tensors.get(name)
        if src is not None and (tensor.dtype != src.dtype or tensor.device != src.device):
            tensor.data = tensor.data.to(dtype=src.dtype, device=src.device)


def grow_student(
    student: Attn2SSMForCausalLM,
    teacher: nn.Module,
    new_plan: list[str],
    mixer_options: dict | None = None,
) -> Attn2SSMForCausalLM:
    """The next stage of a stepwise schedule: ``student`` with more attention layers converted.

    ``new_plan`` must keep every mixer layer of the student (same kind) and may turn attention
    layers into mixers (e.g. 50 % → 25 % attention). The result has plan ``new_plan``; its
    carried-over tensors — trained mixers, kept attention, MLPs, norms, embeddings — are the
    student's, bit for bit and in their own dtype and device; each newly converted layer is
    initialised from the *teacher's* attention at that layer (at ``config.teacher_layers[i]`` for a
    student of another depth), as ``convert`` does, in the
    dtype/device of the attention module it replaces. ``mixer_options`` (by kind) default to the
    student's; options for a kind the student already uses must equal its own. The student is
    not modified. requires_grad flags are not carried (a new stage chooses its trainable set).
    """
    old_config = student.config
    new_plan = list(new_plan)
    added = _check_growth(list(old_config.layer_plan), new_plan)
    adapter = get_adapter(teacher)
    teacher_paths = adapter.attention_module_paths(teacher)
    paths = list(old_config.attention_paths)
    source = old_config.teacher_layers or list(range(len(paths)))  # teacher layer of each student layer
    same_layout = (
        paths == teacher_paths if old_config.teacher_layers is None else max(source) < len(teacher_paths)
    )
    if not same_layout or teacher.config.model_type != old_config.teacher.get(
        "model_type", teacher.config.model_type
    ):
        raise ConfigError(
            f"teacher ({len(teacher_paths)} attention layers at {teacher_paths[0] if teacher_paths else '-'}…) does not match the student",
            "pass the teacher the student was converted from",
        )
    config = copy.deepcopy(old_config)
    config.layer_plan = new_plan
    config.mixer_options = _grown_options(old_config, mixer_options, teacher.config)
    grown = Attn2SSMForCausalLM(config)
    _match_dtypes(grown, student, [paths[i] for i in added])
    result = grown.load_state_dict(student.state_dict(), strict=False)
    new_prefixes = tuple(f"base.{paths[i]}." for i in added)
    stray = [k for k in (*result.missing_keys, *result.unexpected_keys) if not k.startswith(new_prefixes)]
    if stray:
        raise RuntimeError(f"grown student and student disagree on weights: {stray[:5]}")
    for i in added:
        grown.base.get_submodule(paths[i]).load_attention_weights(
            adapter.read_weights(teacher.get_submodule(teacher_paths[source[i]]))
        )
    grown.train(student.training)
    return grown

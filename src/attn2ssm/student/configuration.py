"""``Attn2SSMConfig``: the teacher's own config plus a layer plan.

The base model's config is kept whole (``base_config``) so the student is rebuilt from the
teacher family's own Hugging Face code. Per layer, ``layer_plan[i]`` names the mixer that
replaces attention (or ``"attention"`` to keep it), ``attention_paths[i]`` says where that
module lives, and ``layer_geometry[i]`` records its shapes (heads, head_dim, RoPE, …).
``kept_attention`` says what form the ``"attention"`` layers take: the teacher's own module
(``"teacher"``) or Qwen3.5's (``"qwen35"``: per-head q/k RMSNorm and a sigmoid output gate, see
student/kept_attention.py).
A student may be shallower or deeper than its teacher (``convert(..., depth=N)``):
``base_config`` then describes N layers and ``teacher_layers[i]`` names the teacher layer that
student layer i was built from (None: layer i from layer i).

A saved config.json is what ``push_to_hub`` publishes, so it holds names, not local paths: the
teacher's ``_name_or_path`` is dropped from ``base_config`` and a local ``teacher.source.location``
becomes its last component in ``name`` (``scrub_local_paths``). Nothing loads from either: the
student is rebuilt from ``base_config`` and its own weights. ``base_config`` carries no dtype
either; the student's own ``dtype`` is the one that counts (see modeling.py).
"""

from __future__ import annotations

import os

from transformers import AutoConfig, PretrainedConfig

# Attributes of the base config mirrored at the top level, where generation and tooling look.
_MIRRORED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


# Keys of the teacher's config that describe the teacher's files or its dtype, not its architecture.
_BASE_DROPPED = ("_name_or_path", "dtype", "torch_dtype")


_LOCAL_SOURCES = ("dir", "gguf", "builtin")  # teachers.TeacherSource kinds whose location is a local path


def _is_local_path(value) -> bool:
    return isinstance(value, str) and (
        os.path.isabs(value) or value.startswith(("~", "./", "../")) or "\\" in value
    )


def scrub_local_paths(teacher: dict) -> dict:
    """``teacher`` provenance without local paths: a ``source.location`` that is a path (a local
    directory, a GGUF's folder, the built-in teacher's cache) is dropped and, when the source has
    no ``name``, its last component is kept as the name. Hub ids stay."""
    teacher = dict(teacher)
    source = teacher.get("source")
    if (
        isinstance(source, dict)
        and source.get("location")
        and (source.get("kind") in _LOCAL_SOURCES or _is_local_path(source["location"]))
    ):
        source = dict(source)
        location = source.pop("location")
        if not source.get("name"):
            source["name"] = os.path.basename(os.path.normpath(os.path.expanduser(location))) or None
        teacher["source"] = source
    return teacher


class Attn2SSMConfig(PretrainedConfig):
    model_type = "attn2ssm"

    def __init__(
        self,
        base_config: dict | None = None,
        layer_plan: list[str] | None = None,
        attention_paths: list[str] | None = None,
        layer_geometry: list[dict] | None = None,
        mixer_options: dict | None = None,
        teacher: dict | None = None,
        base_attn_implementation: str | None = None,
        teacher_layers: list[int] | None = None,
        kept_attention: str = "teacher",
        **kwargs,
    ):
        self.base_attn_implementation = base_attn_implementation
        self.base_config = {k: v for k, v in (base_config or {}).items() if k not in _BASE_DROPPED}
        self.layer_plan = list(layer_plan or [])
        self.attention_paths = list(attention_paths or [])
        self.layer_geometry = list(layer_geometry or [])
        self.mixer_options = dict(mixer_options or {})  # mixer kind → constructor options
        # provenance: source (names, no paths), family, model_type
        self.teacher = scrub_local_paths(teacher or {})
        self.teacher_layers = None if teacher_layers is None else [int(j) for j in teacher_layers]
        # the kept attention layers' form: "teacher" (as they are) or "qwen35" (student/kept_attention.py)
        self.kept_attention = kept_attention
        if self.base_config:  # read through the family's config so aliases (GPT-2's n_layer, …) resolve
            base = self.build_base_config()
            for name in _MIRRORED:
                if name not in kwargs and getattr(base, name, None) is not None:
                    kwargs[name] = getattr(base, name)
            kwargs.setdefault("tie_word_embeddings", getattr(base, "tie_word_embeddings", False))
        super().__init__(**kwargs)

    def build_base_config(self) -> PretrainedConfig:
        """The teacher family's config object, ready for ``AutoModelForCausalLM.from_config``."""
        cfg = dict(self.base_config)
        model_type = cfg.pop("model_type")
        return AutoConfig.for_model(model_type, **cfg)

    @property
    def mixer_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_plan) if kind != "attention"]

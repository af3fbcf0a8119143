"""What every stage kind is (``StageKind``: its options and its ``loss``), the base of the layer-local
(teacher-forced) kinds, and which parameters a stage trains (``select_trainable``)."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from attn2ssm.adapters import get_adapter
from attn2ssm.adapters.capture import capture_attention_io
from attn2ssm.errors import ConfigError
from attn2ssm.student.kept_attention import NEW_PARAMETERS, Qwen35FormAttention


class StageKind:
    name = ""
    uses_teacher = False
    # False for layer-local kinds: they never call the student's forward, so the trainer does not
    # wrap it in DDP and averages gradients across processes itself.
    through_model_forward = True
    loss_defaults: dict = {}
    loss_choices: dict = {}  # losses key → allowed values, for keys that are not numbers
    # None: the kind trains on the corpus blocks. Otherwise the `data.format` values it accepts;
    # the trainer loads the stage's dataset and hands the kind its collated batches.
    data_formats: tuple[str, ...] | None = None
    # True for kinds whose loss is a KL to the teacher's logits, which a logit cache can serve.
    caches_teacher_logits = False
    image_task = False  # True: trains on the recipe's `images` (vision.py), not on corpus blocks

    def options(self, cfg) -> dict:
        unknown = sorted(set(cfg.losses) - set(self.loss_defaults))
        if unknown:
            valid = ", ".join(self.loss_defaults) or "(none)"
            raise ConfigError(
                f"stage '{cfg.name}' ({self.name}): unknown losses key(s) {', '.join(unknown)}",
                f"valid keys: {valid}",
            )
        opts = {**self.loss_defaults, **cfg.losses}
        for key, value in opts.items():
            if key in self.loss_choices:
                if value not in self.loss_choices[key]:
                    raise ConfigError(
                        f"stage '{cfg.name}' ({self.name}): losses.{key} is {value!r}",
                        f"use one of: {', '.join(self.loss_choices[key])}",
                    )
            elif isinstance(self.loss_defaults[key], float) and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise ConfigError(
                    f"stage '{cfg.name}' ({self.name}): losses.{key} must be a number, got {value!r}",
                    f"set losses.{key} to e.g. {self.loss_defaults[key]}",
                )
        return opts

    def loss(self, student, teacher, batch: dict, cfg) -> tuple[torch.Tensor, dict]:
        """(loss, metrics): metrics are detached 0-d tensors (``x.detach()``, never ``x.item()``: the
        trainer sums them over a step's micro-batches and reads them with the loss in one host sync)."""
        raise NotImplementedError


def teacher_forced_output(mixer, io, mask):
    """The mixer's ordinary (chunked) forward on the teacher's input to its layer, with this
    batch's padding handed over the way the student model hands it to its mixers."""
    mixer.context.padding_mask = mask
    try:
        return mixer(io.hidden_states, position_embeddings=io.position_embeddings)[0]
    finally:
        mixer.context.padding_mask = None


def mixing_matrix(mixer, hidden_states, position_embeddings=None, mask=None, *, skip: bool = True):
    """(output (b, l, hidden), materialised mixing matrix (b, h, l, l)) of a mixer with a quadratic form.

    With ``skip``, the mixer's D skip (one per head) is added on the diagonal, so the matrix is the
    whole map from the mixer's (post-conv) values to its pre-gate output, y = (M + D·I) x — what
    MOHAWK's release orients (its ``materialize_mixer`` puts D into T). Padded rows and columns are 0.
    """
    out, M = mixer.forward_quadratic(hidden_states, position_embeddings, mask)
    D = getattr(mixer, "D", None)
    if skip and D is not None:
        eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
        M = M + D.to(M.dtype)[:, None, None] * eye  # D (h,) → (h, l, l), broadcast over the batch
        if mask is not None:  # a padded token's diagonal entry goes too
            M = M * mask[:, None, :, None].to(M.dtype)
    return out, M


class TeacherForcedStage(StageKind):
    """Base of the layer-local kinds. One hooked teacher forward gives every swapped layer's input
    (teacher forcing: errors never compound, no gradient crosses layers); each mixer is scored on
    its own layer's input by ``layer_loss`` and the losses are averaged over layers."""

    uses_teacher = True
    through_model_forward = False

    def check_mixer(self, i: int, mixer, opts: dict, cfg) -> None:
        """Raise a ConfigError, before any compute, if layer ``i``'s mixer cannot take this loss."""

    def layer_loss(
        self, mixer, io, adapter, mask, opts: dict
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        student = getattr(student, "module", student)
        mixers = student.mixers()
        if not mixers:
            raise ConfigError(
                f"stage '{cfg.name}': the student has no mixer layers to transfer to",
                "convert at least one layer",
            )
        for i, mixer in mixers.items():
            self.check_mixer(i, mixer, opts, cfg)
        mask = batch.get("attention_mask")
        io = capture_attention_io(teacher, batch["input_ids"], sorted(mixers), mask)
        adapter = get_adapter(teacher)
        total, sums = 0.0, {}
        for i, mixer in mixers.items():
            layer, metrics = self.layer_loss(mixer, io[i], adapter, mask, opts)
            total = total + layer
            for k, v in metrics.items():  # in float64, as the Python floats of before summed
                sums[k] = sums.get(k, 0.0) + v.double()
        n = len(mixers)
        return total / n, {k: v / n for k, v in sums.items()}


PARAMETER_GROUPS = ("all", "mixers", "feature_maps", "lora", "mlps", "embeddings", "norms", "attention")
_FFN_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")


def _names_of(student: nn.Module, modules) -> set[str]:
    """Parameter names (as ``named_parameters`` spells them; tied weights once) of ``modules``."""
    by_id = {id(p): n for n, p in student.named_parameters()}
    return {by_id[id(p)] for m in modules if m is not None for p in m.parameters() if id(p) in by_id}


def _layer_path(attention_path: str) -> str:
    return attention_path.rpartition(".")[0]


def parameter_groups(student: nn.Module) -> dict[str, set[str]]:
    """Named parameter groups of an ``Attn2SSMForCausalLM``, found by module type and layer layout
    so they hold across HF families:

    * ``mixers``: the swapped layers' mixers; ``feature_maps``: their feature maps / window factors;
    * ``attention``: the kept softmax-attention modules of a hybrid (in Qwen3.5's form, their new
      q/k norms and output gate are ``mixers``, not ``attention``: student/kept_attention.py);
    * ``mlps``: each decoder layer's feed-forward submodule (``mlp``; ``feed_forward``, ``ffn``, …);
    * ``embeddings``: input/output embeddings and any other ``nn.Embedding`` (e.g. GPT-2's positions);
    * ``norms``: every module whose class name contains "Norm", outside the mixers;
    * ``lora``: the stage's adapters; ``all``: everything.
    """
    cfg = student.config
    base = student.base
    names = {n for n, _ in student.named_parameters()}
    mixers = _names_of(student, [base.get_submodule(cfg.attention_paths[i]) for i in cfg.mixer_layers])
    kept = [
        base.get_submodule(p) for i, p in enumerate(cfg.attention_paths) if i not in set(cfg.mixer_layers)
    ]
    # a kept layer in Qwen3.5's form (student.kept_attention: qwen35): its new q/k norms and gate
    # train with the mixers; its q/k/v/o are the teacher's attention
    new = _names_of(
        student, [getattr(m, n) for m in kept if isinstance(m, Qwen35FormAttention) for n in NEW_PARAMETERS]
    )
    mixers |= new
    attention = _names_of(student, kept) - new
    ffns = []
    for path in cfg.attention_paths:
        layer = base.get_submodule(_layer_path(path))
        ffns.extend(getattr(layer, n) for n in _FFN_NAMES if isinstance(getattr(layer, n, None), nn.Module))
    mlps = _names_of(student, ffns) - mixers
    embedding_modules = [student.get_input_embeddings(), student.get_output_embeddings()]
    embedding_modules += [m for m in base.modules() if isinstance(m, nn.Embedding)]
    embeddings = _names_of(student, embedding_modules) - mixers
    norms = _names_of(student, [m for m in base.modules() if "Norm" in type(m).__name__]) - mixers
    return {
        "all": names,
        "mixers": mixers,
        "feature_maps": {
            n for n in mixers if ".feature_map_" in n or n.endswith((".window_factor", ".decay_log_rate"))
        },
        "lora": {n for n in names if n.startswith("lora.")},
        "mlps": mlps,
        "embeddings": embeddings,
        "norms": norms,
        "attention": attention,
    }


def _match(pattern: str, names: list[str], groups: dict[str, set[str]], field_name: str) -> set[str]:
    hits = groups[pattern] if pattern in groups else {n for n in names if fnmatch.fnmatchcase(n, pattern)}
    if not hits:
        example = names[len(names) // 2] if names else "?"
        what = (
            "no kept softmax-attention layer (the student has none)"
            if pattern == "attention"
            else "no parameter"
        )
        raise ConfigError(
            f"{field_name} pattern '{pattern}' matches {what}",
            f"use a group ({', '.join(PARAMETER_GROUPS)}) or a glob like '{example}'",
        )
    return hits


def select_trainable(student: nn.Module, patterns: list[str], frozen: list[str] | tuple = ()) -> list[str]:
    """Freeze everything, unfreeze parameters matching any of ``patterns``, then freeze those
    matching any of ``frozen``; returns the trainable names.

    Patterns are groups (see :func:`parameter_groups`: ``mixers``, ``feature_maps``, ``lora``,
    ``all``, ``mlps``, ``embeddings``, ``norms``, ``attention``) or shell-style globs on parameter
    names such as ``*.mlp.*`` or ``base.model.layers.1?.*``. A pattern that matches nothing is an
    error, and so is a selection that leaves nothing to train.
    """
    names = [n for n, _ in student.named_parameters()]
    groups = parameter_groups(student)
    chosen: set[str] = set()
    for pattern in patterns:
        chosen |= _match(pattern, names, groups, "trainable")
    for pattern in frozen:
        chosen -= _match(pattern, names, groups, "frozen")
    if not chosen:
        raise ConfigError(
            f"trainable {list(patterns)} minus frozen {list(frozen)} leaves no parameter to train",
            "drop a frozen pattern or widen trainable",
        )
    for name, param in student.named_parameters():
        param.requires_grad_(name in chosen)
    return sorted(chosen)

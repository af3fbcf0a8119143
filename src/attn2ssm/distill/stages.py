"""Stage kinds: what a stage trains and the loss it minimises.

A stage kind is a small class: ``loss(student, teacher, batch, cfg) -> (loss, metrics)``.
End-to-end kinds call the student like a language model on the corpus blocks: ``ce``
(next-token cross-entropy on the data), ``kd`` (forward KL to the frozen teacher's logits) and
``kd_ce`` (both, paper 004's stage 1). Layer-local kinds train each mixer on the teacher's own
input to that layer (teacher forcing, no gradient across layers): ``attention_transfer``
(paper 002 / LoLCATs / paper 000's stage 1), ``matrix_orientation`` and ``hidden_alignment``
(paper 001's MOHAWK stages 1 and 2). Dataset kinds read the stage's own ``data``:
``sft`` (cross-entropy on assistant tokens of chat data) and ``dpo`` (preference pairs, the
teacher as the reference policy, paper 004's stage 3). Kind-specific loss settings live in the
stage's ``losses`` mapping; unknown keys are errors.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from attn2ssm.distill.cab import BridgeAlignmentStage
from attn2ssm.distill.cab_vision import VISION_STAGE_KINDS
from attn2ssm.distill.losses import (
    HIDDEN_DISTANCES,
    MATRIX_NORMS,
    attention_cross_entropy,
    cross_entropy,
    dpo_loss,
    forward_kl,
    hidden_distance,
    kd_ce_loss,
    matrix_distance,
    output_cosine,
    output_mse,
    response_cross_entropy,
    sequence_logps,
)
from attn2ssm.errors import ConfigError


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

    def options(self, cfg) -> dict:
        unknown = sorted(set(cfg.losses) - set(self.loss_defaults))
        if unknown:
            valid = ", ".join(self.loss_defaults) or "(none)"
            raise ConfigError(f"stage '{cfg.name}' ({self.name}): unknown losses key(s) {', '.join(unknown)}", f"valid keys: {valid}")
        opts = {**self.loss_defaults, **cfg.losses}
        for key, value in opts.items():
            if key in self.loss_choices:
                if value not in self.loss_choices[key]:
                    raise ConfigError(f"stage '{cfg.name}' ({self.name}): losses.{key} is {value!r}", f"use one of: {', '.join(self.loss_choices[key])}")
            elif isinstance(self.loss_defaults[key], float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"stage '{cfg.name}' ({self.name}): losses.{key} must be a number, got {value!r}", f"set losses.{key} to e.g. {self.loss_defaults[key]}")
        return opts

    def loss(self, student, teacher, batch: dict, cfg) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError


class CrossEntropyStage(StageKind):
    name = "ce"

    def loss(self, student, teacher, batch, cfg):
        logits = student(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
        loss = cross_entropy(logits, batch["input_ids"], batch.get("attention_mask"))
        return loss, {"ce": loss.item()}


def teacher_targets(teacher, ids, mask, batch):
    """The teacher's next-token targets for a batch: its logits (one forward), or, when the trainer
    hands the stage a logit cache (``batch["logit_cache"]``, a stage's ``logit_cache`` option), the
    cached top-k + tail targets, computed by the teacher only for blocks the cache has not seen."""
    cache = batch.get("logit_cache")
    if cache is not None:
        return cache.targets(teacher, ids, mask)
    with torch.no_grad():
        return teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits


class KnowledgeDistillationStage(StageKind):
    name = "kd"
    uses_teacher = True
    caches_teacher_logits = True

    def loss(self, student, teacher, batch, cfg):
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        t_logits = teacher_targets(teacher, ids, mask, batch)
        s_logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss = forward_kl(s_logits, t_logits, mask, temperature=cfg.temperature, chunk_size=cfg.kl_chunk)
        with torch.no_grad():
            ce = cross_entropy(s_logits, ids, mask)
        return loss, {"kl": loss.item(), "ce": ce.item()}


class KDCrossEntropyStage(StageKind):
    """Paper 004's stage 1 (Eq. 2): ``ce_weight·CE + kl_weight·KL(teacher ‖ student)``, α = 1, β = 0.1.

    ``labels: data`` scores the corpus' next tokens; ``labels: teacher`` scores the teacher's
    argmax next token at each position — a cheap per-position stand-in for the paper's
    sequence-level pseudo-labels. Those are the teacher's own sampled replies: generate an SFT
    dataset by sampling the teacher and train on it with kind ``sft`` and ``losses: {kl_weight: 0.1}``.
    """

    name = "kd_ce"
    uses_teacher = True
    caches_teacher_logits = True
    loss_defaults = {"kl_weight": 0.1, "ce_weight": 1.0, "labels": "data"}
    loss_choices = {"labels": ("data", "teacher")}

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        t_logits = teacher_targets(teacher, ids, mask, batch)
        s_logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss, ce, kl = kd_ce_loss(s_logits, t_logits, ids, mask, ce_weight=opts["ce_weight"], kl_weight=opts["kl_weight"],
                                  labels=opts["labels"], temperature=cfg.temperature, chunk_size=cfg.kl_chunk)
        return loss, {"ce": ce.item(), "kl": kl.item()}


def _token_scale(batch: dict, count: torch.Tensor) -> torch.Tensor:
    """Per-real-token normalisation over the whole optimizer step: the trainer passes the mean
    number of loss tokens per micro-batch and process (``mean_loss_tokens``), so
    sum / mean_loss_tokens, averaged over micro-batches and processes, is sum / total tokens."""
    mean = batch.get("mean_loss_tokens")
    return count.clamp_min(1) if mean is None else count.new_tensor(float(mean))


class SFTStage(StageKind):
    """Supervised finetuning on chat data: next-token CE on the assistant tokens only (the stage's
    ``data``, rendered with the teacher's chat template), per assistant token; plus
    ``kl_weight``·KL(teacher ‖ student) on the same positions (paper 004's "with_distill" SFT)."""

    name = "sft"
    uses_teacher = True  # for the optional KL term
    caches_teacher_logits = True
    loss_defaults = {"kl_weight": 0.0}
    data_formats = ("auto", "messages", "prompt_completion")

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        s_logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        ce_sum, count = response_cross_entropy(s_logits, ids, loss_mask)
        norm = _token_scale(batch, count)
        loss = ce_sum / norm
        metrics = {"ce": loss.item()}
        if opts["kl_weight"]:
            t_logits = teacher_targets(teacher, ids, mask, batch)
            # position t predicts token t+1: score the positions whose next token is the assistant's
            kl = forward_kl(s_logits[:, :-1], t_logits[:, :-1], loss_mask[:, 1:], temperature=cfg.temperature, chunk_size=cfg.kl_chunk)
            kl = kl * (count.clamp_min(1) / norm)  # forward_kl normalises by this batch's count
            loss = loss + opts["kl_weight"] * kl
            metrics["kl"] = kl.item()
        return loss, metrics


class DPOStage(StageKind):
    """Distilled DPO (paper 004, Eq. 4): preference pairs, the frozen teacher as the reference
    policy. Sequence log-probs are summed over reply tokens only; β = 0.01 by default. Metrics:
    implicit rewards β·(log π_θ − log π_T) of chosen and rejected replies, their margin, and the
    reward accuracy (share of pairs with chosen reward > rejected reward)."""

    name = "dpo"
    uses_teacher = True
    loss_defaults = {"beta": 0.01}
    data_formats = ("auto", "preference")

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        ids, mask, loss_mask = _stack_pairs(batch)
        n = batch["chosen_input_ids"].shape[0]
        with torch.no_grad():
            ref = sequence_logps(teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, loss_mask)
        policy = sequence_logps(student(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, loss_mask)
        loss = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], opts["beta"])
        with torch.no_grad():
            rewards = opts["beta"] * (policy - ref)
            chosen, rejected = rewards[:n], rewards[n:]
            metrics = {
                "reward_chosen": chosen.mean().item(),
                "reward_rejected": rejected.mean().item(),
                "reward_margin": (chosen - rejected).mean().item(),
                "reward_accuracy": (chosen > rejected).float().mean().item(),
                "logp_chosen": policy[:n].mean().item(),
                "logp_rejected": policy[n:].mean().item(),
            }
        return loss, metrics


def _stack_pairs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen rows then rejected rows in one right-padded batch, so each model runs once."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    out = []
    for key in ("input_ids", "attention_mask", "loss_mask"):
        parts = [torch.nn.functional.pad(batch[f"{side}_{key}"], (0, width - batch[f"{side}_{key}"].shape[1])) for side in ("chosen", "rejected")]
        out.append(torch.cat(parts))
    return tuple(out)


def _teacher_forced_output(mixer, io, mask):
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
    paper 001's release orients (its ``materialize_mixer`` puts D into T). Padded rows and columns are 0.
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

    def layer_loss(self, mixer, io, adapter, mask, opts: dict) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def loss(self, student, teacher, batch, cfg):
        from attn2ssm.adapters import get_adapter
        from attn2ssm.distill.teacher_forcing import capture_attention_io

        opts = self.options(cfg)
        student = getattr(student, "module", student)
        mixers = student.mixers()
        if not mixers:
            raise ConfigError(f"stage '{cfg.name}': the student has no mixer layers to transfer to", "convert at least one layer")
        for i, mixer in mixers.items():
            self.check_mixer(i, mixer, opts, cfg)
        mask = batch.get("attention_mask")
        io = capture_attention_io(teacher, batch["input_ids"], sorted(mixers), mask)
        adapter = get_adapter(teacher)
        total, sums = 0.0, {}
        for i, mixer in mixers.items():
            layer, metrics = self.layer_loss(mixer, io[i], adapter, mask, opts)
            total = total + layer
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        n = len(mixers)
        return total / n, {k: v / n for k, v in sums.items()}


class AttentionTransferStage(TeacherForcedStage):
    """Teacher-forced per layer: the mixer sees the teacher's layer input and learns to reproduce
    its attention weights (soft cross-entropy or KL per head, paper 002), its attention output
    (MSE, LoLCATs) and/or the output's direction (cosine, paper 000). Losses are averaged over
    layers. Typically only the feature maps train (``trainable: [feature_maps]``). The weight loss
    needs a mixer whose materialised weights are normalised attention (``normalized_weights``)."""

    name = "attention_transfer"
    loss_defaults = {"attention": 1.0, "attention_form": "soft_ce", "output_mse": 0.0, "output_cosine": 0.0}

    def check_mixer(self, i, mixer, opts, cfg):
        if opts["attention"] and not getattr(mixer, "normalized_weights", False):
            raise ConfigError(
                f"stage '{cfg.name}': the attention-weight loss needs normalised weights, but layer {i} is a '{mixer.mixer_type}' mixer",
                "set losses.attention: 0 and align outputs with output_mse / output_cosine",
            )

    def layer_loss(self, mixer, io, adapter, mask, opts):
        if opts["attention"]:
            out, weights = mixer.forward_quadratic(io.hidden_states, io.position_embeddings, mask)
        else:  # output losses only: the ordinary (chunked) forward, no l × l matrix
            out = _teacher_forced_output(mixer, io, mask)
        layer, metrics = out.new_zeros((), dtype=torch.float32), {}
        if opts["attention"]:
            with torch.no_grad():
                target = adapter.attention_probs(io.module, io.hidden_states, io.position_embeddings, mask)
            attn = attention_cross_entropy(target, weights, mask, form=opts["attention_form"])
            layer = layer + opts["attention"] * attn
            metrics["attn"] = attn.item()
        if opts["output_mse"]:
            mse = output_mse(out, io.output, mask)
            layer = layer + opts["output_mse"] * mse
            metrics["mse"] = mse.item()
        if opts["output_cosine"]:
            cos = output_cosine(out, io.output, mask)
            layer = layer + opts["output_cosine"] * cos
            metrics["cos"] = cos.item()
        return layer, metrics


class MatrixOrientationStage(TeacherForcedStage):
    """MOHAWK stage 1, matrix orientation (paper 001, Eq. 3): per layer, on the teacher's input to
    it, the distance between the student mixer's materialised l × l mixing matrix per head
    (``forward_quadratic``; with its D skip on the diagonal unless ``skip: exclude``) and the
    teacher's attention probabilities, padded rows and columns ignored; mean over sequences and
    heads, then over layers. ``matrix_norm``: ``fro`` (default; the paper's unsquared Frobenius
    norm per head, not normalised by length), ``fro_squared``, or ``row_squared`` (squared error
    per real query row) — see ``losses.matrix_distance``. Only the parameters that shape the
    matrix get gradients (for discrete Mamba-2: B/C (k/q) projections, decay, conv, D)."""

    name = "matrix_orientation"
    loss_defaults = {"matrix_norm": "fro", "skip": "include"}
    loss_choices = {"matrix_norm": MATRIX_NORMS, "skip": ("include", "exclude")}

    def check_mixer(self, i, mixer, opts, cfg):
        if not hasattr(mixer, "forward_quadratic"):
            raise ConfigError(
                f"stage '{cfg.name}' (matrix_orientation): layer {i} is a '{mixer.mixer_type}' mixer, which has no materialised mixing matrix",
                "use a mixer with one (discrete_mamba2, mamba2, linear_attention, hedgemamba), or drop this stage and start with hidden_alignment",
            )

    def layer_loss(self, mixer, io, adapter, mask, opts):
        _, M = mixing_matrix(mixer, io.hidden_states, io.position_embeddings, mask, skip=opts["skip"] == "include")
        with torch.no_grad():
            target = adapter.attention_probs(io.module, io.hidden_states, io.position_embeddings, mask)
        dist = matrix_distance(M, target, mask, norm=opts["matrix_norm"])
        return dist, {"matrix": dist.item()}


class HiddenAlignmentStage(TeacherForcedStage):
    """MOHAWK stage 2, hidden-state alignment (paper 001, Eq. 4): per layer, on the teacher's input
    to it, the distance between the whole student mixer's output and the teacher attention
    module's output (after its output projection), per real token; mean over layers. Only mixer
    parameters get gradients (recipes set ``trainable: [mixers]``). ``distance``: ``l2`` (default;
    the paper's unsquared per-token L2 norm), ``l2_squared`` or ``mse`` — see
    ``losses.hidden_distance``. The target is the attention sublayer's output, what the paper's
    release aligns when the MLPs stay frozen (not the whole block's output)."""

    name = "hidden_alignment"
    loss_defaults = {"distance": "l2"}
    loss_choices = {"distance": HIDDEN_DISTANCES}

    def layer_loss(self, mixer, io, adapter, mask, opts):
        dist = hidden_distance(_teacher_forced_output(mixer, io, mask), io.output, mask, form=opts["distance"])
        return dist, {"hidden": dist.item()}


STAGE_KINDS: dict[str, StageKind] = {
    k.name: k() for k in (CrossEntropyStage, KnowledgeDistillationStage, KDCrossEntropyStage, AttentionTransferStage, SFTStage, DPOStage,
                           MatrixOrientationStage, HiddenAlignmentStage, BridgeAlignmentStage, *VISION_STAGE_KINDS)
}

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
    * ``attention``: the kept softmax-attention modules of a hybrid;
    * ``mlps``: each decoder layer's feed-forward submodule (``mlp``; ``feed_forward``, ``ffn``, …);
    * ``embeddings``: input/output embeddings and any other ``nn.Embedding`` (e.g. GPT-2's positions);
    * ``norms``: every module whose class name contains "Norm", outside the mixers;
    * ``lora``: the stage's adapters; ``all``: everything.
    """
    cfg = student.config
    base = student.base
    names = {n for n, _ in student.named_parameters()}
    mixers = _names_of(student, [base.get_submodule(cfg.attention_paths[i]) for i in cfg.mixer_layers])
    kept = [i for i in range(len(cfg.attention_paths)) if i not in set(cfg.mixer_layers)]
    attention = _names_of(student, [base.get_submodule(cfg.attention_paths[i]) for i in kept])
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
        "feature_maps": {n for n in mixers if ".feature_map_" in n or n.endswith(".window_factor")},
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
        what = "no kept softmax-attention layer (the student has none)" if pattern == "attention" else "no parameter"
        raise ConfigError(f"{field_name} pattern '{pattern}' matches {what}", f"use a group ({', '.join(PARAMETER_GROUPS)}) or a glob like '{example}'")
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
        raise ConfigError(f"trainable {list(patterns)} minus frozen {list(frozen)} leaves no parameter to train", "drop a frozen pattern or widen trainable")
    for name, param in student.named_parameters():
        param.requires_grad_(name in chosen)
    return sorted(chosen)

"""``attn2ssm export STUDENT --format native``: a student as a checkpoint of a transformers class.

The target is ``GraniteMoeHybridForCausalLM`` in its dense form (``num_local_experts = 0``: one
shared SwiGLU MLP per layer) with every multiplier 1: pre-norm RMSNorm blocks, each either a
Mamba-2 mixer or softmax attention with full RoPE, as a Llama-family student is. It is served by
transformers, vLLM (and SGLang, mistral.rs) without remote code. ``BambaForCausalLM`` holds the
same blocks but its config hard-codes ``partial_rotary_factor = 0.5`` (full RoPE needs an override
that vLLM's Bamba does not read) and vLLM's Bamba attention has no biases (Qwen2's q/k/v);
``Mamba2ForCausalLM`` has no MLP and no attention; ``FalconH1`` runs attention and Mamba in
parallel. So: GraniteMoeHybrid, for students of Llama / SmolLM2 / Mistral / Qwen2 teachers whose
mixers are Mamba-2 with the gated RMSNorm on.

The map, per Mamba-2 layer (h heads of head_dim d, kv heads; query head j reads kv head
j // (h / kv); our mixer in mixers/mamba2.py, GraniteMoeHybrid's in transformers'
``GraniteMoeHybridMambaLayer``): n_groups = h, d_state = d, head_dim = d, expand = h·d / hidden (1);

    in_proj  rows  [z: gate | x: v_proj, kv rows repeated | B: k_proj, repeated | C: q_proj·√d⁻¹ | dt: dt_proj]
    in_proj  bias  [gate bias | v bias | k bias | q bias·√d⁻¹ | 0]      (mamba_proj_bias: True)
    conv1d         our conv's [x | B | C] channels, x and B channels repeated like their rows
    dt_bias ← dt_proj.bias,  A_log ← A_log,  D ← D (0 without D),  norm.weight ← norm.weight
    out_proj ← o_proj (bias 0 without one)

(our conv runs before the GQA repeat; it is depthwise, so repeating channels after it or before it
is the same). No gate (``gate: false``) is a zero-weight gate with bias b, SiLU(b) = 1. Both
compute y = SSD(Δ·x, B, C) + D·x, then RMSNorm(y·SiLU(z)) per head (``norm_before_gate=False``),
Δ = softplus(W_Δ u + b_Δ), A = −exp(A_log), the conv's activation SiLU. Kept attention layers
copy q/k/v/o (``attention_multiplier`` = the teacher's 1/√d); the MLP's gate and up rows become
``shared_mlp.input_linear`` (gate first: it is the activated half), down ``output_linear``.

For llama.cpp (``llama_cpp=True``, the GGUF route of student/gguf_export.py) the same map is written
in the form llama.cpp's GraniteHybrid loader takes: it asserts d_inner = 2·hidden (``mamba_expand``
2) and has no in_proj / out_proj biases. So h zero heads follow the h real ones (zero in_proj rows
and out_proj columns, zero conv channels, D 0, A_log 0): their x, B, C are SiLU(0) = 0, so their
state and y stay 0 and RMSNorm(0) = 0 per group: exact, at twice the mixer width. And
``mamba_proj_bias`` is off, which is exact only when every in_proj / out_proj bias is zero: a gate
without bias (``gate_bias: false``) and no q/k/v/o biases on converted layers (``llama_cpp_problem``).
A pure student gets one more layer there: llama.cpp (0.3.36) aborts on a GraniteHybrid without
attention layers (its hybrid memory's attention inputs are built but never allocated), so an
identity layer follows the last one: attention and MLP whose q/k/v/o and MLP weights are zero,
which add exactly 0 to the residual (one layer's KV cache and ~2 % more weights).

Students whose mixers are gated delta-rule layers go to ``Qwen3_5ForCausalLM`` instead (pure ones,
and hybrids whose kept attention layers have Qwen3.5's form, ``student.kept_attention: qwen35``; the
map and why in export/native_qwen35.py): ``native_target`` picks the class, and the
functions below hand such a student to that module.

Only exact maps are written: anything the class cannot express is a one-line ``ExportError``
naming the reason and the nearest recipe setting that exports. Before anything is written the
native model is run beside the student on a probe and must give the same logits.

Not imported by student/modeling.py: modeling's import closure is copied into every checkpoint.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attn2ssm.adapters import get_adapter
from attn2ssm.errors import CheckpointError, ConfigError, ExportError
from attn2ssm.export.native_qwen35 import (
    QWEN35_CLASS,
    conv_problem,
    first_problem,
    mlp_problem,
    norm_eps_differs,
    qwen35_notes,
    qwen35_problem,
    teacher_family,
    to_qwen35,
)
from attn2ssm.mixers.ssm_common import GATE_IDENTITY_BIAS
from attn2ssm.ops.kernels import check_environment
from attn2ssm.paths import (
    check_writable,
    lock_beside,
    remove_stale_staging,
    replace_dir,
    staging_beside,
    writing,
)
from attn2ssm.teachers import check_weight_files

NATIVE_CLASS = "GraniteMoeHybridForCausalLM"
FAMILIES = ("llama", "mistral", "qwen2")
# Why other families' blocks do not fit (their teacher-side structure, not a mixer setting).
_FAMILY_REASONS = {
    "gemma": "Gemma scales embeddings by √hidden, its norms by (1 + w), and its GELU MLP would set the Mamba conv's activation too (one hidden_act)",
    "gemma2": "Gemma-2 layers have four norms (sandwich) and soft-capped attention and logits",
    "gemma3": "Gemma-3 layers have four norms (sandwich) and q/k norms",
    "phi": "Phi runs attention and the MLP in parallel after one LayerNorm",
    "gpt_neox": "GPT-NeoX uses LayerNorm and a parallel residual",
    "gpt2": "GPT-2 uses LayerNorm and learned position embeddings",
}
# Legacy layer-type names in config.json: vLLM, llama.cpp's converter and transformers < 5 read
# these; transformers 5 maps them to "linear_attention" / "full_attention" on load.
_LAYER_TYPE = {"mamba2": "mamba", "attention": "attention"}
_KEEP = "keep this student in attn2ssm's format (trust_remote_code=True)"


# ------------------------------------------------------------------------------------ what exports
def native_target(config) -> str:
    """The class a student exports to: ``QWEN35_CLASS`` when any mixer is gated_delta, else ``NATIVE_CLASS``."""
    return (
        QWEN35_CLASS
        if any(config.layer_plan[i] == "gated_delta" for i in config.mixer_layers)
        else NATIVE_CLASS
    )


def _mamba2_options(config) -> dict:
    """The student's effective mamba2 options (its saved ones over the mixer's defaults)."""
    from attn2ssm.mixers.mamba2 import Mamba2Mixer  # heavy: the mixers import transformers

    defaults = {
        n: p.default
        for n, p in inspect.signature(Mamba2Mixer.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {**defaults, **((config.mixer_options or {}).get("mamba2") or {})}


def native_problem(config) -> tuple[str, str] | None:
    """(reason, fix) of the first thing ``NATIVE_CLASS`` cannot express in a student with this
    ``Attn2SSMConfig``, or None when it maps exactly. Reads the config only (no weights).
    Gated delta-rule students: ``QWEN35_CLASS``'s (``qwen35_problem``)."""
    if native_target(config) == QWEN35_CLASS:
        return qwen35_problem(config)
    return first_problem(
        config,
        _head_level_problem,
        _family_problem,
        _mixer_kind_problem,
        _mlp_problem,
        _head_dim_problem,
        _mamba2_problem,
        _kept_attention_problem,
    )


def _head_level_problem(config) -> tuple[str, str] | None:
    """A head-level hybrid (mixers/kept_heads.py): softmax and linear heads inside one layer."""
    layers = [i for i in config.mixer_layers if config.layer_plan[i] == "linear_attention_heads"]
    if not layers:
        return None
    return (
        f"layers {layers} keep softmax attention in some KV groups and linear attention in the others; "
        "no served class (transformers, llama.cpp) mixes softmax and linear heads inside one layer",
        _KEEP,
    )


def _family_problem(config) -> tuple[str, str] | None:
    family = teacher_family(config)
    if family in FAMILIES:
        return None
    reason = _FAMILY_REASONS.get(family, "its blocks are not Llama-style pre-norm RMSNorm + gated MLP")
    return (
        f"{NATIVE_CLASS} cannot express {family} blocks: {reason}",
        f"export students of {', '.join(FAMILIES)} teachers, or {_KEEP}",
    )


def _mixer_kind_problem(config) -> tuple[str, str] | None:
    for i in config.mixer_layers:
        kind = config.layer_plan[i]
        if kind != "mamba2":
            return (
                f"layer {i} is a '{kind}' mixer; {NATIVE_CLASS}'s layers are Mamba-2 (SSD) or attention",
                "distil with student.mixer: mamba2 and student.mixer_options: {norm: true, norm_eps: auto}",
            )
    return None


def _mlp_problem(config) -> tuple[str, str] | None:
    return mlp_problem(
        config.base_config, NATIVE_CLASS, "one hidden_act for the MLP and the Mamba conv (SiLU)", "shared MLP"
    )


def _head_dim_problem(config) -> tuple[str, str] | None:
    for i, g in enumerate(config.layer_geometry):
        if g["num_heads"] * g["head_dim"] != g["hidden_size"]:
            return (
                f"layer {i} has {g['num_heads']} heads × {g['head_dim']} = {g['num_heads'] * g['head_dim']} ≠ hidden_size {g['hidden_size']}; "
                f"{NATIVE_CLASS} (and vLLM) take head_dim = hidden_size / heads",
                _KEEP,
            )
    return None


def _mamba2_problem(config) -> tuple[str, str] | None:
    """A mamba2 option the target cannot express: sanity mode, the gated RMSNorm and its eps, conv, RoPE."""
    if not config.mixer_layers:
        return None
    o, eps = _mamba2_options(config), config.base_config.get("rms_norm_eps")
    fix = "distil with student.mixer_options: {norm: true, norm_eps: auto}" + (
        f" (auto: the teacher's rms_norm_eps, {eps!r})" if eps is not None else ""
    )
    if o["sanity"]:
        return "the mixers are in sanity mode (no conv, gate, norm, Δ or A)", fix
    if not o["norm"]:
        return (
            f"the mamba2 mixers have no gated RMSNorm (norm: false); {NATIVE_CLASS} always normalises y·SiLU(z) per head, so no map is exact",
            fix,
        )
    if norm_eps_differs(o, eps):
        return (
            f"the mixers' gated RMSNorm uses eps {float(o['norm_eps']):g} but {NATIVE_CLASS} uses the teacher's rms_norm_eps ({eps}) "
            "for it and for every block norm",
            fix,
        )
    return conv_problem(
        o, NATIVE_CLASS, "student.mixer_options", "hidden_act (SiLU)", "B and C", "Mamba layers"
    )


def _kept_attention_problem(config) -> tuple[str, str] | None:
    """A kept attention layer that is sliding, soft-capped, q/k-normed or partly rotated, or kept
    layers that scale q·k differently."""
    kept = [i for i, kind in enumerate(config.layer_plan) if kind == "attention"]
    global_layers = [i for i, g in enumerate(config.layer_geometry) if g.get("sliding_window") is None]
    for i in kept:
        g = config.layer_geometry[i]
        if g.get("sliding_window") is not None:
            keep = (
                f"student.keep_attention: {global_layers}"
                if global_layers
                else "student.attention_ratio: 0 (a pure Mamba-2 student)"
            )
            return (
                f"layer {i} keeps sliding-window attention (window {g['sliding_window']}); {NATIVE_CLASS}'s attention is global",
                f"convert the sliding layers too: {keep}",
            )
        if g.get("softcap") is not None or g.get("has_qk_norm"):
            return (
                f"layer {i} keeps attention with soft-capping or q/k norms, which {NATIVE_CLASS} lacks",
                _KEEP,
            )
        if g["rotary_dim"] != g["head_dim"]:
            return (
                f"layer {i} rotates {g['rotary_dim']} of {g['head_dim']} dims; {NATIVE_CLASS}'s RoPE is full",
                _KEEP,
            )
    scalings = {config.layer_geometry[i]["scaling"] for i in kept}
    if len(scalings) > 1:
        return (
            f"the kept attention layers scale q·k differently ({sorted(scalings)}); {NATIVE_CLASS} has one attention_multiplier",
            _KEEP,
        )
    return None


def llama_cpp_problem(config) -> tuple[str, str] | None:
    """(reason, fix) of the first thing that keeps a natively exportable student from mapping
    exactly onto llama.cpp's GraniteHybrid (no in_proj / out_proj bias), or None. Config only.
    (A gated delta-rule student that exports natively maps onto llama.cpp's qwen35 as it is.)"""
    if not config.mixer_layers or native_target(config) == QWEN35_CLASS:
        return None
    o = _mamba2_options(config)
    fix = "distil with student.mixer_options: {gate: true, gate_bias: false} (and norm: true, norm_eps: auto)"
    if not o["gate"]:
        return (
            "the mixers have no gate (gate: false), which the native map writes as a constant gate through the in_proj bias; "
            "llama.cpp's Mamba-2 in_proj has no bias",
            fix,
        )
    if o.get("gate_bias", True):
        return (
            "the mixers' gate has a bias (gate_bias: true, the default); llama.cpp's Mamba-2 in_proj has no bias",
            fix,
        )
    for i in config.mixer_layers:
        g = config.layer_geometry[i]
        if g.get("qkv_bias") or g.get("o_bias"):
            return (
                f"layer {i}'s mixer keeps the teacher's q/k/v/o biases (x, B, C and out_proj biases); llama.cpp's Mamba-2 has no "
                "in_proj or out_proj bias",
                "export --format native instead (transformers, vLLM)",
            )
    return None


def check_native(config, llama_cpp: bool = False) -> None:
    """Raise the one-line ``ExportError`` of ``native_problem`` (and, for llama.cpp,
    ``llama_cpp_problem``), if any."""
    problem = native_problem(config) or (llama_cpp_problem(config) if llama_cpp else None)
    if problem is not None:
        raise ExportError(*problem)


# ---------------------------------------------------------------------------------------- config
def native_config(config, llama_cpp: bool = False):
    """The ``GraniteMoeHybridConfig`` of a student that ``check_native`` passed; ``llama_cpp``:
    twice the Mamba heads (expand 2, the second half zero) and no in_proj / out_proj biases."""
    from transformers import GraniteMoeHybridConfig  # heavy: transformers (this module imports torch only)

    base = config.base_config
    g0 = config.layer_geometry[0]
    kept = [i for i, kind in enumerate(config.layer_plan) if kind == "attention"]
    identity = llama_cpp and not kept  # the identity attention layer llama.cpp needs (module docstring)
    layer_types = ["attention" if kind == "attention" else "mamba" for kind in config.layer_plan] + [
        "attention"
    ] * identity
    return GraniteMoeHybridConfig(
        vocab_size=base["vocab_size"],
        hidden_size=g0["hidden_size"],
        intermediate_size=base["intermediate_size"],
        shared_intermediate_size=base["intermediate_size"],
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=len(layer_types),
        hidden_act=base.get("hidden_act", "silu"),
        max_position_embeddings=base.get("max_position_embeddings", 2048),
        # see _notes: transformers' class cannot hold a cache without an attention layer
        use_cache=bool(kept) or identity,
        initializer_range=base.get("initializer_range", 0.02),
        rms_norm_eps=base["rms_norm_eps"],
        pad_token_id=base.get("pad_token_id"),
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        tie_word_embeddings=bool(base.get("tie_word_embeddings", False)),
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        layer_types=layer_types,
        **_attention_fields(config, kept),
        **_mamba_fields(config, llama_cpp),
    )


def _attention_fields(config, kept: list[int]) -> dict:
    """``native_config``'s attention settings: the teacher's heads, RoPE and biases of the kept
    layers (``kept``: their indices; none kept, no position embedding)."""
    base = config.base_config
    g0 = config.layer_geometry[0]
    biases = any(
        config.layer_geometry[i].get("qkv_bias") or config.layer_geometry[i].get("o_bias") for i in kept
    )
    return dict(
        num_attention_heads=g0["num_heads"],
        num_key_value_heads=g0["num_kv_heads"],
        rope_parameters=dict(
            base.get("rope_parameters")
            or {"rope_type": "default", "rope_theta": base.get("rope_theta", 10000.0)}
        ),
        attention_bias=bool(biases),
        attention_dropout=0.0,
        attention_multiplier=(
            float(config.layer_geometry[kept[0]]["scaling"]) if kept else g0["head_dim"] ** -0.5
        ),
        position_embedding_type="rope" if kept else None,
    )


def _mamba_fields(config, llama_cpp: bool) -> dict:
    """``native_config``'s Mamba-2 settings: one head per attention head with the head size as its
    state (``llama_cpp``: expand 2, twice the heads, no projection biases)."""
    g0 = config.layer_geometry[0]
    opts = _mamba2_options(config) if config.mixer_layers else {"d_conv": 4, "chunk_size": 256}
    expand = 2 if llama_cpp else 1  # h·d = hidden (native_problem), so expand·h heads of head_dim
    return dict(
        mamba_n_heads=expand * g0["num_heads"],
        mamba_n_groups=expand * g0["num_heads"],
        mamba_d_state=g0["head_dim"],
        mamba_d_head=g0["head_dim"],
        mamba_d_conv=int(opts["d_conv"]),
        mamba_expand=expand,
        mamba_chunk_size=int(opts["chunk_size"]),
        mamba_conv_bias=True,
        mamba_proj_bias=not llama_cpp,
        time_step_limit=(0.0, float("inf")),
    )


# --------------------------------------------------------------------------------------- weights
def _kv_rows(h: int, kv: int, d: int) -> torch.Tensor:
    """Row j·d + p of a per-query-head tensor reads row (j // (h/kv))·d + p of the kv-head one."""
    heads = torch.arange(h) // (h // kv)
    return (heads[:, None] * d + torch.arange(d)[None, :]).reshape(-1)


def _weight_bias(linear, rows=None, scale: float = 1.0):
    w = linear.weight.detach().float()
    b = linear.bias.detach().float() if linear.bias is not None else torch.zeros(w.shape[0])
    if rows is not None:
        w, b = w[rows], b[rows]
    return w * scale, b * scale


def _pad_heads(t: torch.Tensor, h: int, heads: int, dim: int = 0) -> torch.Tensor:
    """``t``, whose ``dim`` holds h equal blocks (one per head), followed by heads − h zero blocks."""
    if heads == h:
        return t
    shape = list(t.shape)
    shape[dim] = shape[dim] // h * (heads - h)
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def mamba2_tensors(mixer, heads: int | None = None, proj_bias: bool = True) -> dict[str, torch.Tensor]:
    """One of our ``Mamba2Mixer``s as ``GraniteMoeHybridMambaLayer`` tensors (fp32), by name;
    ``heads`` (≥ the mixer's): zero heads appended (see the module docstring); ``proj_bias`` off:
    no in_proj / out_proj biases (an ``ExportError`` unless they are all zero)."""
    out = _mamba2_tensors(mixer)
    h, n = mixer.num_heads, heads or mixer.num_heads
    if n != h:
        d = mixer.head_dim
        z, x, B, C, dt = out["in_proj.weight"].split([h * d, h * d, h * d, h * d, h])
        zb, xb, Bb, Cb, dtb = out["in_proj.bias"].split([h * d, h * d, h * d, h * d, h])
        out["in_proj.weight"] = torch.cat([_pad_heads(t, h, n) for t in (z, x, B, C, dt)])
        out["in_proj.bias"] = torch.cat([_pad_heads(t, h, n) for t in (zb, xb, Bb, Cb, dtb)])
        for key in ("conv1d.weight", "conv1d.bias"):  # channels [x | B | C], h·d each
            out[key] = torch.cat([_pad_heads(t, h, n) for t in out[key].split(h * d)])
        for key in ("dt_bias", "A_log", "D", "norm.weight"):
            out[key] = _pad_heads(out[key], h, n)
        out["out_proj.weight"] = _pad_heads(out["out_proj.weight"], h, n, dim=1)
    if not proj_bias:
        for key in ("in_proj.bias", "out_proj.bias"):
            bias = out.pop(key)
            if bias.abs().max() > 0:
                raise ExportError(
                    f"layer {mixer.layer_idx}'s {key} is not zero and the target has no place for it",
                    "distil with student.mixer_options: {gate: true, gate_bias: false} on a teacher without q/k/v/o biases",
                )
    return out


def _mamba2_tensors(mixer) -> dict[str, torch.Tensor]:
    h, kv, d, hidden = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim, mixer.hidden_size
    rows = _kv_rows(h, kv, d)
    if mixer.gate is not None:
        z = _weight_bias(mixer.gate)
    else:  # no gate: SiLU(0·u + b) = 1
        z = torch.zeros(h * d, hidden), torch.full((h * d,), GATE_IDENTITY_BIAS)
    x, B = _weight_bias(mixer.v_proj, rows), _weight_bias(mixer.k_proj, rows)
    C = _weight_bias(mixer.q_proj, scale=float(mixer.scaling))  # C keeps the teacher's 1/√d
    dt_w = mixer.dt_proj.weight.detach().float()
    parts = [z, x, B, C, (dt_w, torch.zeros(h))]
    conv_rows = torch.cat([rows, kv * d + rows, 2 * kv * d + torch.arange(h * d)])
    out_w, out_b = _weight_bias(mixer.o_proj)
    return {
        "in_proj.weight": torch.cat([w for w, _ in parts]),
        "in_proj.bias": torch.cat([b for _, b in parts]),
        "conv1d.weight": mixer.conv.weight.detach().float()[conv_rows][:, None, :],
        "conv1d.bias": mixer.conv.bias.detach().float()[conv_rows],
        "dt_bias": mixer.dt_proj.bias.detach().float(),
        "A_log": mixer.A_log.detach().float(),
        "D": mixer.D.detach().float() if mixer.D is not None else torch.zeros(h),
        "norm.weight": mixer.norm.weight.detach().float(),
        "out_proj.weight": out_w,
        "out_proj.bias": out_b,
    }


def attention_tensors(weights, with_bias: bool) -> dict[str, torch.Tensor]:
    """A kept attention layer's q/k/v/o (an adapter's ``AttentionWeights``), biases 0 where absent."""
    out = {}
    for name, w, b in (
        ("q_proj", weights.q, weights.q_bias),
        ("k_proj", weights.k, weights.k_bias),
        ("v_proj", weights.v, weights.v_bias),
        ("o_proj", weights.o, weights.o_bias),
    ):
        out[f"{name}.weight"] = w.float()
        if with_bias:
            out[f"{name}.bias"] = b.float() if b is not None else torch.zeros(w.shape[0])
    return out


def identity_layer_tensors(cfg, prefix: str) -> dict[str, torch.Tensor]:
    """An attention + MLP layer of ``cfg`` that adds exactly 0 to the residual: every q/k/v/o and
    MLP weight zero (norms 1), so attention averages zero values and o_proj and the MLP output 0."""
    hidden, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    q, kv, ff = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.shared_intermediate_size
    out = {
        f"{prefix}.input_layernorm.weight": torch.ones(hidden),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden),
        f"{prefix}.shared_mlp.input_linear.weight": torch.zeros(2 * ff, hidden),
        f"{prefix}.shared_mlp.output_linear.weight": torch.zeros(hidden, ff),
    }
    for name, rows, cols in (
        ("q_proj", q, hidden),
        ("k_proj", kv, hidden),
        ("v_proj", kv, hidden),
        ("o_proj", hidden, q),
    ):
        out[f"{prefix}.self_attn.{name}.weight"] = torch.zeros(rows, cols)
        if cfg.attention_bias:
            out[f"{prefix}.self_attn.{name}.bias"] = torch.zeros(rows)
    return out


def native_state_dict(student, native_cfg) -> dict[str, torch.Tensor]:
    """Every tensor of the ``GraniteMoeHybridForCausalLM`` for ``student`` (fp32), by name. Each of
    the student's own tensors is used exactly once (anything left over is an error, not dropped)."""
    config = student.config
    adapter = get_adapter(student.base)
    state = {k: v.detach().float() for k, v in student.base.state_dict().items()}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return state[key]

    out = {
        "model.embed_tokens.weight": take("model.embed_tokens.weight"),
        "model.norm.weight": take("model.norm.weight"),
    }
    if "lm_head.weight" in state:
        out["lm_head.weight"] = take("lm_head.weight")
    for i, kind in enumerate(config.layer_plan):
        src, dst = config.attention_paths[i].rpartition(".")[0], f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{dst}.{norm}.weight"] = take(f"{src}.{norm}.weight")
        gate, up, down = (take(f"{src}.mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
        out[f"{dst}.shared_mlp.input_linear.weight"] = torch.cat([gate, up])
        out[f"{dst}.shared_mlp.output_linear.weight"] = down
        module = student.base.get_submodule(config.attention_paths[i])
        prefix = f"{config.attention_paths[i]}."
        used.update(k for k in state if k.startswith(prefix))
        if kind == "attention":
            tensors = attention_tensors(adapter.read_weights(module), native_cfg.attention_bias)
            out.update({f"{dst}.self_attn.{k}": v for k, v in tensors.items()})
        else:
            out.update(
                {
                    f"{dst}.mamba.{k}": v
                    for k, v in mamba2_tensors(
                        module, native_cfg.mamba_n_heads, native_cfg.mamba_proj_bias
                    ).items()
                }
            )
    # the identity layer (llama_cpp, pure students)
    for i in range(len(config.layer_plan), native_cfg.num_hidden_layers):
        out.update(identity_layer_tensors(native_cfg, f"model.layers.{i}"))
    left = sorted(set(state) - used)
    if left:
        raise ExportError(
            f"the student has tensors {NATIVE_CLASS} has no place for: {left[:4]}",
            "keep this student in attn2ssm's format (trust_remote_code=True)",
        )
    return out


def to_native(student, llama_cpp: bool = False):
    """The student as a ``GraniteMoeHybridForCausalLM`` in fp32 (``check_native`` first);
    ``llama_cpp``: in the form llama.cpp's converter and loader take (see the module docstring)."""
    # heavy: transformers (this module imports torch only)
    from transformers import GraniteMoeHybridForCausalLM

    if native_target(student.config) == QWEN35_CLASS:
        return to_qwen35(student, llama_cpp)
    check_native(student.config, llama_cpp)
    cfg = native_config(student.config, llama_cpp)
    model = GraniteMoeHybridForCausalLM(cfg).float()
    model.load_state_dict(native_state_dict(student, cfg), strict=True)
    return model.eval()


# ---------------------------------------------------------------------------------------- export
@dataclass
class NativeExport:
    out: Path
    cls: str
    layer_types: list[str]
    max_abs_diff: float  # native vs student logits on the probe inputs (fp32; probe_inputs)
    # llama_cpp: the identity attention layer a pure student gets
    identity_layers: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# Real text for the probe: a student's activations on language differ from those on random ids
# (one export agreed to 4.4e-3 on random ids and differed by 2.0e-2 on a prompt).
PROBE_TEXT = (
    "Fellow citizens, the state of our Union is strong. We have cut the deficit, created millions of jobs and "
    "built schools across the country. Call me Ishmael. Some years ago, never mind how long precisely, having "
    "little or no money in my purse, I thought I would sail about a little and see the watery part of the world."
)


def probe_inputs(vocab: int, max_len: int, tokenizer=None) -> list[torch.Tensor]:
    """The probe's token batches: two short random sequences, one random sequence past a 256-token
    scan chunk (where chunked forms hand state across chunks), and real text when a tokenizer is given."""
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (2, min(24, max_len)), generator=gen),
        torch.randint(0, vocab, (1, min(300, max_len)), generator=gen),
    ]
    if tokenizer is not None:
        ids = tokenizer(" ".join([PROBE_TEXT] * 4), return_tensors="pt")["input_ids"][:, :max_len]
        batches.append(ids.clamp_(max=vocab - 1))
    return batches


@torch.no_grad()
def probe_difference(student, native, vocab: int, tokenizer=None) -> tuple[float, float]:
    """(max |native − student| logit, max |student logit|) over ``probe_inputs`` (unpadded, fp32)."""
    max_len = int(student.config.base_config.get("max_position_embeddings") or 300)
    diff = scale = 0.0
    for ids in probe_inputs(vocab, max_len, tokenizer):
        mine = student(input_ids=ids, use_cache=False).logits.float()
        theirs = native(input_ids=ids, use_cache=False).logits.float()
        diff, scale = max(diff, float((theirs - mine).abs().max())), max(scale, float(mine.abs().max()))
    return diff, scale


def _notes(config) -> list[str]:
    notes = []
    kept = [i for i, kind in enumerate(config.layer_plan) if kind == "attention"]
    if config.mixer_layers and any(config.layer_geometry[i].get("qkv_bias") for i in config.mixer_layers):
        notes.append(
            "the mixers' x/B/C projections have biases (the teacher's q/k/v biases): transformers' class zeroes a padded "
            "position's layer input, not its projection, so in a LEFT-padded batch those biases reach the first d_conv-1 "
            "real tokens' conv; unpadded prompts (and engines that run each prompt alone, as vLLM does) are exact"
        )
    if kept and config.mixer_layers:
        notes.append(
            "llama.cpp's converter treats GraniteMoeHybrid hybrids' attention as NoPE; these kept layers use RoPE "
            "(attn2ssm export --format gguf sets llama.cpp's RoPE flag back)"
        )
    if not kept:
        notes.append(
            "no layer keeps attention: transformers' GraniteMoeHybrid builds a softmax mask from its cache and raises when "
            "the cache holds no attention layer, so config.json and generation_config.json set use_cache: false (exact, "
            "but generate recomputes the prefix each token); vLLM keeps its own recurrent state"
        )
    return notes


def _fix_config_json(path: Path) -> None:
    """Legacy layer-type names (see ``_LAYER_TYPE``), as published Granite 4.0-H checkpoints have."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    legacy = {"linear_attention": "mamba", "full_attention": "attention"}
    cfg["layer_types"] = [legacy.get(t, t) for t in cfg["layer_types"]]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# The probe's tolerance, relative to the largest logit: float32 sums in another order. 1e-4 held on
# tiny teachers, but a 30-layer SmolLM2-135M student with an untrained gate (gate_bias: false)
# differs by 3.2e-3 on logits of 32 (and each fp32 model by ~2.5e-3 from its float64 run); a wrong
# map is O(1) apart (llama.cpp's NoPE reading of a hybrid: 30 on 32).
PROBE_TOLERANCE = 1e-3


def export_native(
    student_dir: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    tolerance: float = PROBE_TOLERANCE,
    llama_cpp: bool = False,
) -> NativeExport:
    """Write the student in ``student_dir`` to ``out`` as a ``GraniteMoeHybridForCausalLM`` (gated delta-rule
    students: ``Qwen3_5ForCausalLM``) checkpoint:
    config.json (no ``auto_map``), model.safetensors (the student's dtype), tokenizer, README.md;
    no Python files. Refused (``ExportError``, nothing written) when the map would not be exact;
    ``out`` holding a model is kept unless ``force``. Staged beside ``out``, then moved into place.
    ``llama_cpp``: the form llama.cpp's converter takes (the GGUF route; see the module docstring)."""
    student_dir, out = Path(student_dir), Path(out)
    saved = check_exportable(student_dir, llama_cpp)  # refuse before the weights load
    check_writable(out, beside=True, folder=True)
    _check_out(out, force)
    check_weight_files(student_dir)
    with lock_beside(out):  # a second export to this --out at the same time is refused
        _check_out(out, force)  # another export may have written it meanwhile
        remove_stale_staging(out.parent)  # what a killed export left beside it
        return _export(student_dir, out, saved, tolerance, llama_cpp)


def _export(student_dir: Path, out: Path, saved: dict, tolerance: float, llama_cpp: bool) -> NativeExport:
    """Load the student, map it onto its native class, check the two agree on a probe, and write
    the native model to ``out``."""
    from transformers import AutoTokenizer  # heavy: transformers (this module imports torch only)

    import attn2ssm.student  # noqa: F401  heavy: transformers; registers the Auto classes
    from attn2ssm.student.modeling import Attn2SSMForCausalLM  # heavy: as above

    dtype = getattr(torch, str(saved.get("dtype") or "float32"))
    student = Attn2SSMForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    cls = native_target(student.config)
    native = to_native(student, llama_cpp)
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    diff, scale = probe_difference(student, native, native.config.vocab_size, tokenizer)
    if not diff <= tolerance * max(1.0, scale):
        raise ExportError(
            f"the {cls} logits differ from the student's by {diff:.3g} on a probe (tolerance {tolerance * max(1.0, scale):.3g})",
            "nothing was written; this is a bug in the map: report it with the student's config.json",
        )
    notes = _write_native(native, dtype, tokenizer, student.config, saved, student_dir, out)
    if cls == NATIVE_CLASS:
        layer_types = [_LAYER_TYPE.get(kind, "mamba") for kind in student.config.layer_plan]
    else:  # Qwen3.5's names: linear_attention / full_attention
        layer_types = list(native.config.layer_types[: len(student.config.layer_plan)])
    identity = list(range(len(layer_types), native.config.num_hidden_layers))
    return NativeExport(out, cls, layer_types, diff, identity, notes)


def check_exportable(student_dir: str | Path, llama_cpp: bool = False) -> dict:
    """Refuse, from ``student_dir``'s config.json alone (no weights, nothing of llama.cpp), a
    student the native map (``llama_cpp``: llama.cpp's form of it) cannot express, or an
    ``ATTN2SSM_KERNELS`` the CPU probe cannot run: one line. Returns the saved config."""
    from attn2ssm.student.configuration import Attn2SSMConfig  # heavy: transformers

    check_environment("cpu")  # the probe runs the student on the CPU
    saved = _saved_student_config(Path(student_dir))
    check_native(Attn2SSMConfig.from_dict(saved), llama_cpp)
    return saved


def _saved_student_config(student_dir: Path) -> dict:
    """``student_dir``'s config.json (a ``CheckpointError`` unless it is an attn2ssm student's)."""
    try:
        saved = json.loads((student_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{student_dir} has no readable config.json ({exc.__class__.__name__})",
            "point at a student directory (a run's student/ folder)",
        ) from None
    if saved.get("model_type") != "attn2ssm":
        raise CheckpointError(
            f"{student_dir} holds a {saved.get('model_type')!r} model, not an attn2ssm student",
            "point at a student directory (a run's student/ folder)",
        )
    return saved


def _check_out(out: Path, force: bool) -> None:
    """A ``ConfigError`` when ``out`` holds a model and ``force`` is off."""
    if (out / "config.json").is_file() and not force:
        raise ConfigError(
            f"--out {out} already holds a model (config.json)",
            "pass --force to replace it, or choose another --out",
        )


def _modes_from_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes a plain mkdir / open would under the umask:
    the staging folder is mkdtemp's 0700 and save_pretrained's model.safetensors 0600, whatever it is."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _write_native(native, dtype, tokenizer, config, saved: dict, student_dir: Path, out: Path) -> list[str]:
    """Stage ``native`` (in ``dtype``), the tokenizer, a generation config and the card beside
    ``out``, then move them into place; the card's notes."""
    from transformers import GenerationConfig  # heavy: transformers (this module imports torch only)

    from attn2ssm.student.card import native_card, read_results  # heavy: as above

    cls = native_target(config)
    with (
        writing(out, "the exported model", "run the command again (what --out held is unchanged)"),
        staging_beside(out, "export") as staging,
    ):
        native.to(dtype).save_pretrained(staging)
        if cls == NATIVE_CLASS:
            _fix_config_json(staging / "config.json")
        tokenizer.save_pretrained(staging)
        if (student_dir / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(student_dir)
        else:
            generation = GenerationConfig.from_model_config(native.config)
        generation.use_cache = native.config.use_cache
        generation.save_pretrained(staging)
        notes = _notes(config) if cls == NATIVE_CLASS else qwen35_notes(native.config)
        (staging / "README.md").write_text(
            native_card(saved, read_results(student_dir), cls, notes), encoding="utf-8"
        )
        _modes_from_umask(staging)
        replace_dir(staging, out)
    return notes

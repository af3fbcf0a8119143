"""Gated delta-rule students (pure, or hybrids in Qwen3.5's form) as ``Qwen3_5ForCausalLM`` and llama.cpp's ``qwen35``.

Why Qwen3.5: of the three Gated DeltaNet homes in transformers 5.24 it is the dense one with the
same layer as our mixer (Qwen3-Next's blocks are mixture-of-experts and its q/k/v/z projection is
interleaved per key head; OLMo-Hybrid's attention blocks are post-norm and its output norm's ε is
fixed at 1e-5), and llama.cpp runs it on the CPU (``qwen35``: gated-delta-net op, no remote code).

The layer (transformers' ``Qwen3_5GatedDeltaNet``; ours in mixers/gated_delta.py): both compute

    q, k, v = SiLU(conv([W_Q u, W_K u, W_V u]))        depthwise causal conv, no bias
    q, k L2-normalised per head, o = gated delta rule(q / √d, k, v, g, β)
    g = −exp(A_log) · softplus(W_a u + dt_bias),  β = sigmoid(W_b u)        (no β bias)
    out = W_O (RMSNorm_head(o) · w ⊙ SiLU(W_z u))                           (no gate bias)

The map, per layer (h query heads, kv key/value heads of head_dim d; query head j reads kv head
j // (h / kv)): Qwen3.5 lets key heads serve several value heads, but its q and k share one head
count, so k and v are repeated to h heads (our conv runs before the repeat; it is depthwise, so
repeating channels after it or before is the same):

    linear_num_key_heads = linear_num_value_heads = h,  linear_key_head_dim = linear_value_head_dim = d
    in_proj_qkv ← [q_proj | k_proj, kv rows repeated | v_proj, repeated]
    conv1d      ← our conv's [q | k | v] channels, k and v repeated like their rows
    in_proj_z ← gate,  in_proj_a ← a_proj,  in_proj_b ← b_proj,  dt_bias, A_log, norm.weight as they are
    out_proj ← o_proj

and per block: Qwen3.5's RMSNorms are zero-centred (x̂ · (1 + w)), so each teacher norm weight w is
written as w − 1 (the GDN output norm is a plain one, x̂ · w); the MLP's gate/up/down as they are.
The target has no biases on any of these projections and on the conv, and always gates and
normalises: a student maps exactly with ``student.mixer_options: {gated_delta: {gate_bias: false,
beta_bias: false, conv_bias: false, norm_eps: auto}}`` (``norm_eps``: the target uses the
teacher's ``rms_norm_eps`` for the output norm), on a teacher without q/k/v/o biases.
One difference stays below float32 noise: q and k are L2-normalised as x / max(|x|, 1e-12) here
and as x · rsqrt(|x|² + ε) there (ε 1e-6 in transformers, the teacher's ``rms_norm_eps`` in llama.cpp).

Hybrids: Qwen3.5's softmax layers (``Qwen3_5Attention``) RMS-normalise every q and k head
(``q_norm``, ``k_norm``, zero-centred, ε = rms_norm_eps) before RoPE and gate the output with a
sigmoid (q_proj's rows are, per head j, j's d query rows then j's d gate rows). The gate can start
as the identity (zero rows: sigmoid(0) = 1/2, o_proj doubled), but no weight makes an RMSNorm the
identity, so a teacher's kept attention layer has no exact image and such a hybrid is refused. A
hybrid distilled with ``student.kept_attention: qwen35`` (student/kept_attention.py) has that form
from the start and maps one to one, per kept layer:

    q_proj ← [q_proj rows of head j | g_proj rows of head j] for each head j,  k_proj, v_proj, o_proj as they are
    q_norm ← w_q − 1,  k_norm ← w_k − 1                                         (zero-centred)

with ``layer_types`` full_attention there and linear_attention elsewhere, the teacher's GQA
(num_key_value_heads), head_dim, scaling 1/√d, rope_theta / rope_parameters and
``partial_rotary_factor`` 1.0 (Qwen3.5's default rotates a quarter of each head; a Llama all of it).
Qwen3.5's RoPE is an interleaved M-RoPE, but text positions are three equal rows, so every frequency
reads the same position and it is the teacher's 1-D RoPE (the tests check it numerically, up to
position 99). Refused besides: a sliding window shorter than the context (Mistral), partial RoPE,
attention biases (``_kept_problem``).

For llama.cpp (``llama_cpp=True``, the GGUF route): a hybrid maps as it is (the converter writes
``qwen35.attention.recurrent_layers`` per layer from ``layer_types``, so any placement of the kept
layers works, not only a regular ``full_attention_interval``). llama.cpp (0.3.36) aborts on a ``qwen35``
without attention layers (``GGML_ASSERT(buffer)``: its hybrid memory's attention inputs are built
but never allocated, as for GraniteHybrid), so a pure student gets one identity layer at the end — a
full-attention layer and MLP whose weights are all zero (norm weights 0, i.e. 1 zero-centred),
which add exactly 0 to the residual (one layer's KV cache, ~2 % more weights).

Not imported by student/modeling.py (its import closure is copied into every checkpoint).
"""

from __future__ import annotations

import inspect
import math

import torch

from attn2ssm.errors import ExportError
from attn2ssm.hf_compat import cpu_runs_reference_kernels

QWEN35_CLASS = "Qwen3_5ForCausalLM"
QWEN35_FAMILIES = ("llama", "mistral")  # Qwen2's q/k/v biases have no place (no projection bias)
EXPORT_OPTIONS = "student.mixer_options: {gated_delta: {gate_bias: false, beta_bias: false, conv_bias: false, norm_eps: auto}}"
_KEEP = "keep this student in attn2ssm's format (trust_remote_code=True)"
KEPT_OPTION = "student.kept_attention: qwen35"
LAYER_TYPES = {False: "linear_attention", True: "full_attention"}  # by "is it a kept attention layer"


def gated_delta_options(config) -> dict:
    """The student's effective gated_delta options (its saved ones over the mixer's defaults)."""
    from attn2ssm.mixers.gated_delta import GatedDeltaMixer  # heavy: the mixers import transformers

    defaults = {
        n: p.default
        for n, p in inspect.signature(GatedDeltaMixer.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {**defaults, **((config.mixer_options or {}).get("gated_delta") or {})}


def teacher_family(config) -> str | None:
    """The teacher's family: the one the recipe named, else the base config's ``model_type``."""
    return (config.teacher or {}).get("family") or config.base_config.get("model_type")


def first_problem(config, *checks) -> tuple[str, str] | None:
    """The first (reason, fix) that one of ``checks`` (each config -> (reason, fix) or None) finds, in order."""
    for check in checks:
        problem = check(config)
        if problem is not None:
            return problem
    return None


def mlp_problem(base: dict, cls: str, activation: str, mlp: str) -> tuple[str, str] | None:
    """(reason, fix) when the teacher's MLP (its ``base`` config) is not the SiLU, bias-free one of
    ``cls``; ``activation``: what ``cls``'s one hidden_act is used for, ``mlp``: its MLP's name."""
    act = base.get("hidden_act", "silu")
    if act != "silu":
        return f"the teacher's MLP activation is {act}; {cls} uses {activation}", _KEEP
    if base.get("mlp_bias"):
        return f"the teacher's MLP has biases (mlp_bias: true); {cls}'s {mlp} has none", _KEEP
    return None


def conv_problem(
    options: dict, cls: str, prefix: str, applies: str, rotated: str, layers: str
) -> tuple[str, str] | None:
    """(reason, fix) when a mixer's ``options`` (the settings under ``prefix``) lack the conv with
    SiLU that ``cls`` always runs (``applies``), or rotate ``rotated`` where ``cls``'s ``layers`` have
    no RoPE; else None."""
    if not options["d_conv"]:
        return (
            f"the mixers have no conv (d_conv: 0); {cls} always runs one, with SiLU",
            f"distil with {prefix}.d_conv: 4 (the default)",
        )
    if options["conv_activation"] not in ("silu",):
        return (
            f"the mixers' conv has no activation (conv_activation: {options['conv_activation']}); {cls}'s conv applies {applies}",
            f"distil with {prefix}.conv_activation: silu (the default)",
        )
    if options["rope"] != "none":
        return (
            f"the mixers rotate {rotated} (rope: {options['rope']}); {cls}'s {layers} have no RoPE",
            f"distil with {prefix}.rope: none (the default)",
        )
    return None


def norm_eps_differs(options: dict, eps) -> bool:
    """Whether a mixer's output-norm eps (``options``) is not the teacher's rms_norm_eps ``eps`` (None: unknown)."""
    return eps is None or not math.isclose(float(options["norm_eps"]), float(eps), rel_tol=1e-9, abs_tol=0.0)


def qwen35_problem(config) -> tuple[str, str] | None:
    """(reason, fix) of the first thing ``QWEN35_CLASS`` cannot express in a student whose mixers
    are gated_delta, or None when it maps exactly. Reads the config only (no weights)."""
    return first_problem(
        config,
        _family_problem,
        _layers_problem,
        _kept_problem,
        _mlp_problem,
        _projections_problem,
        _options_problem,
    )


def _family_problem(config) -> tuple[str, str] | None:
    family = teacher_family(config)
    if family in QWEN35_FAMILIES:
        return None
    why = (
        "q/k/v projections with biases"
        if family == "qwen2"
        else "blocks that are not Llama-style pre-norm RMSNorm + SwiGLU"
    )
    return (
        f"{QWEN35_CLASS} cannot express a {family} teacher's layers ({why})",
        f"export gated_delta students of {', '.join(QWEN35_FAMILIES)} teachers, or {_KEEP}",
    )


def _mlp_problem(config) -> tuple[str, str] | None:
    return mlp_problem(
        config.base_config, QWEN35_CLASS, "one hidden_act (SiLU) for the MLP and the GDN conv", "MLP"
    )


def _layers_problem(config) -> tuple[str, str] | None:
    """Mixers other than gated_delta, or a softmax attention layer kept in the teacher's form."""
    kinds = sorted({config.layer_plan[i] for i in config.mixer_layers})
    if kinds != ["gated_delta"]:
        return (
            f"the student mixes {', '.join(kinds)} layers; {QWEN35_CLASS}'s linear layers are Gated DeltaNet only",
            f"distil with student.mixer: gated_delta, or {_KEEP}",
        )
    kept = kept_layers(config)
    if kept and getattr(config, "kept_attention", "teacher") != "qwen35":
        return (
            f"layer {kept[0]} keeps the teacher's softmax attention; {QWEN35_CLASS}'s attention RMS-normalises each q and k head and "
            "gates its output, which no weights make an identity, so the teacher's layer has no exact image",
            f"distil with {KEPT_OPTION} (the kept layers in Qwen3.5's form from the start), or student.attention_ratio: 0, or {_KEEP}",
        )
    return None


def kept_layers(config) -> list[int]:
    """The layers that keep softmax attention."""
    return [i for i, kind in enumerate(config.layer_plan) if kind == "attention"]


def _kept_problem(config) -> tuple[str, str] | None:
    """Kept attention layers (in Qwen3.5's form) that the class's one attention shape cannot hold:
    partial RoPE, a sliding window, biases, or layers of different shapes."""
    kept = kept_layers(config)
    shapes = {
        tuple(config.layer_geometry[i][k] for k in ("num_heads", "num_kv_heads", "head_dim")) for i in kept
    }
    if len(shapes) > 1:
        return (
            f"the kept attention layers have different head shapes {sorted(shapes)}; {QWEN35_CLASS} has one",
            _KEEP,
        )
    base = config.base_config
    window = base.get("sliding_window")
    if kept and window is not None and window < base.get("max_position_embeddings", 2048):
        return (
            f"the teacher's attention sees a sliding window of {window} tokens; {QWEN35_CLASS}'s attention layers see every token",
            f"distil with student.attention_ratio: 0 (no attention layer), or {_KEEP}",
        )
    for i in kept:
        g = config.layer_geometry[i]
        if g.get("rotary_dim", g["head_dim"]) != g["head_dim"]:
            return (
                f"layer {i}'s attention rotates {g['rotary_dim']} of {g['head_dim']} head dims; the export writes full RoPE",
                _KEEP,
            )
        if g.get("qkv_bias") or g.get("o_bias"):
            return (
                f"layer {i}'s attention has q/k/v/o biases; {QWEN35_CLASS} writes none (attention_bias: false)",
                _KEEP,
            )
    return None


def _projections_problem(config) -> tuple[str, str] | None:
    """Mixers of different head shapes, or with the teacher's q/k/v/o biases."""
    shapes = {
        (config.layer_geometry[i]["num_heads"], config.layer_geometry[i]["head_dim"])
        for i in config.mixer_layers
    }
    if len(shapes) > 1:
        return (
            f"the mixers have different head shapes {sorted(shapes)}; {QWEN35_CLASS} has one linear-attention shape",
            _KEEP,
        )
    for i in config.mixer_layers:
        g = config.layer_geometry[i]
        if g.get("qkv_bias") or g.get("o_bias"):
            return (
                f"layer {i}'s mixer keeps the teacher's q/k/v/o biases; {QWEN35_CLASS}'s in_proj_qkv and out_proj have none",
                _KEEP,
            )
    return None


def _options_problem(config) -> tuple[str, str] | None:
    """A gated_delta option the target cannot express: conv, RoPE, gate, norm, biases, norm eps."""
    o = gated_delta_options(config)
    eps = config.base_config.get("rms_norm_eps")
    conv = conv_problem(
        o, QWEN35_CLASS, "student.mixer_options.gated_delta", "SiLU", "q and k", "linear layers"
    )
    if conv is not None:
        return conv
    if not o["gate"]:
        return (
            f"the mixers have no output gate (gate: false); {QWEN35_CLASS} always multiplies by SiLU(W_z u)",
            f"distil with {EXPORT_OPTIONS}",
        )
    if not o["norm"]:
        return (
            f"the mixers have no output norm (norm: false); {QWEN35_CLASS} always RMS-normalises each head's output",
            f"distil with {EXPORT_OPTIONS}",
        )
    for option, what in (
        ("conv_bias", "conv1d"),
        ("beta_bias", "in_proj_b (β)"),
        ("gate_bias", "in_proj_z (the gate)"),
    ):
        if o[option]:
            return (
                f"the mixers' {option} is true (the default); {QWEN35_CLASS}'s {what} has no bias",
                f"distil with {EXPORT_OPTIONS}",
            )
    if norm_eps_differs(o, eps):
        return (
            f"the mixers' output norm uses eps {float(o['norm_eps']):g} but {QWEN35_CLASS} uses the teacher's rms_norm_eps ({eps}) for it",
            f"distil with {EXPORT_OPTIONS}",
        )
    return None


# ---------------------------------------------------------------------------------------- config
def qwen35_config(config, llama_cpp: bool = False):
    """The ``Qwen3_5TextConfig`` of a student that ``qwen35_problem`` passed; ``llama_cpp``: one
    identity full-attention layer after the student's (module docstring)."""
    from transformers import Qwen3_5TextConfig  # heavy: transformers (this module imports torch only)

    base = config.base_config
    g = config.layer_geometry[config.mixer_layers[0]]
    kept = kept_layers(config)
    a = config.layer_geometry[kept[0]] if kept else g  # the attention layers' shape
    layer_types = [LAYER_TYPES[kind == "attention"] for kind in config.layer_plan]
    layer_types += ["full_attention"] * (bool(llama_cpp) and not kept)  # the identity layer
    rope = dict(
        base.get("rope_parameters") or {"rope_type": "default", "rope_theta": base.get("rope_theta", 10000.0)}
    )
    rope["partial_rotary_factor"] = 1.0  # the teacher's full RoPE (Qwen3.5's default rotates a quarter)
    return Qwen3_5TextConfig(
        vocab_size=base["vocab_size"],
        hidden_size=g["hidden_size"],
        intermediate_size=base["intermediate_size"],
        num_hidden_layers=len(layer_types),
        num_attention_heads=a["num_heads"],
        num_key_value_heads=a["num_kv_heads"],
        head_dim=a["head_dim"],
        hidden_act="silu",
        max_position_embeddings=base.get("max_position_embeddings", 2048),
        initializer_range=base.get("initializer_range", 0.02),
        rms_norm_eps=base["rms_norm_eps"],
        use_cache="full_attention"
        in layer_types,  # see qwen35_notes: transformers' cache needs an attention layer
        tie_word_embeddings=bool(base.get("tie_word_embeddings", False)),
        rope_parameters=rope,
        attention_bias=False,
        linear_conv_kernel_dim=int(gated_delta_options(config)["d_conv"]),
        linear_key_head_dim=g["head_dim"],
        linear_value_head_dim=g["head_dim"],
        linear_num_key_heads=g["num_heads"],
        linear_num_value_heads=g["num_heads"],
        layer_types=layer_types,
        pad_token_id=base.get("pad_token_id"),
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
    )


# --------------------------------------------------------------------------------------- weights
def _kv_rows(h: int, kv: int, d: int) -> torch.Tensor:
    """Row j·d + p of a per-query-head tensor reads row (j // (h/kv))·d + p of the kv-head one."""
    heads = torch.arange(h) // (h // kv)
    return (heads[:, None] * d + torch.arange(d)[None, :]).reshape(-1)


def gated_delta_tensors(mixer) -> dict[str, torch.Tensor]:
    """One of our ``GatedDeltaMixer``s as ``Qwen3_5GatedDeltaNet`` tensors (fp32), by name (an
    ``ExportError`` if one of the biases the target lacks is present: ``qwen35_problem`` first)."""
    h, kv, d = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    for name, module in (
        ("q_proj", mixer.q_proj),
        ("k_proj", mixer.k_proj),
        ("v_proj", mixer.v_proj),
        ("o_proj", mixer.o_proj),
        ("gate", mixer.gate),
        ("b_proj", mixer.b_proj),
        ("conv", mixer.conv),
    ):
        if module is None or getattr(module, "bias", None) is not None:
            raise ExportError(
                f"layer {mixer.layer_idx}'s {name} {'is missing' if module is None else 'has a bias'}; {QWEN35_CLASS} has no place for it",
                f"distil with {EXPORT_OPTIONS} on a teacher without q/k/v/o biases",
            )
    rows = _kv_rows(h, kv, d)
    w = lambda linear: linear.weight.detach().float()  # noqa: E731
    conv_rows = torch.cat([torch.arange(h * d), h * d + rows, h * d + kv * d + rows])
    return {
        "in_proj_qkv.weight": torch.cat([w(mixer.q_proj), w(mixer.k_proj)[rows], w(mixer.v_proj)[rows]]),
        "in_proj_z.weight": w(mixer.gate),
        "in_proj_a.weight": w(mixer.a_proj),
        "in_proj_b.weight": w(mixer.b_proj),
        "conv1d.weight": mixer.conv.weight.detach().float()[conv_rows][:, None, :],
        "dt_bias": mixer.dt_bias.detach().float(),
        "A_log": mixer.A_log.detach().float(),
        "norm.weight": mixer.norm.weight.detach().float(),
        "out_proj.weight": w(mixer.o_proj),
    }


def attention_tensors(module) -> dict[str, torch.Tensor]:
    """A kept attention layer in Qwen3.5's form (student/kept_attention.py) as ``Qwen3_5Attention``
    tensors (fp32): q_proj holds each head's query rows then its gate rows ([q_j | g_j] per head j),
    the norms are zero-centred (w − 1)."""
    if not hasattr(module, "g_proj"):
        raise ExportError(
            f"layer {module.layer_idx} keeps the teacher's attention; {QWEN35_CLASS}'s has q/k norms and an output gate",
            f"distil with {KEPT_OPTION}",
        )
    d = module.head_dim
    w = lambda linear: linear.weight.detach().float()  # noqa: E731
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if getattr(module, name).bias is not None:
            raise ExportError(f"layer {module.layer_idx}'s {name} has a bias; {QWEN35_CLASS} has none", _KEEP)
    q, gate = (
        w(module.q_proj).view(-1, d, w(module.q_proj).shape[1]),
        w(module.g_proj).view(-1, d, w(module.g_proj).shape[1]),
    )
    return {
        "q_proj.weight": torch.cat([q, gate], dim=1).reshape(-1, q.shape[-1]),
        "k_proj.weight": w(module.k_proj),
        "v_proj.weight": w(module.v_proj),
        "o_proj.weight": w(module.o_proj),
        "q_norm.weight": module.q_norm.weight.detach().float() - 1.0,  # Qwen3.5's RMSNorm scales by 1 + w
        "k_norm.weight": module.k_norm.weight.detach().float() - 1.0,
    }


def identity_layer_tensors(cfg, prefix: str) -> dict[str, torch.Tensor]:
    """A full-attention + MLP layer of ``cfg`` that adds exactly 0 to the residual: q/k/v/o and MLP
    weights zero (zero-centred norms at 0, i.e. scale 1): attention averages zero values, o_proj and
    the MLP output 0."""
    hidden, d, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out = {
        f"{prefix}.{n}.weight": torch.zeros(hidden) for n in ("input_layernorm", "post_attention_layernorm")
    }
    out.update({f"{prefix}.self_attn.{n}.weight": torch.zeros(d) for n in ("q_norm", "k_norm")})
    for name, shape in (
        ("q_proj", (2 * q, hidden)),
        ("k_proj", (kv, hidden)),
        ("v_proj", (kv, hidden)),
        ("o_proj", (hidden, q)),
        ("mlp.gate_proj", (ff, hidden)),
        ("mlp.up_proj", (ff, hidden)),
        ("mlp.down_proj", (hidden, ff)),
    ):
        out[f"{prefix}.{'' if name.startswith('mlp') else 'self_attn.'}{name}.weight"] = torch.zeros(shape)
    return out


def qwen35_state_dict(student, cfg) -> dict[str, torch.Tensor]:
    """Every tensor of the ``Qwen3_5ForCausalLM`` for ``student`` (fp32), by name. Each of the
    student's own tensors is used exactly once (anything left over is an error, not dropped)."""
    config = student.config
    state = {k: v.detach().float() for k, v in student.base.state_dict().items()}
    used: set[str] = set()

    def take(key: str, centred: bool = False) -> torch.Tensor:
        used.add(key)
        return state[key] - 1.0 if centred else state[key]  # Qwen3.5's RMSNorm scales by 1 + w

    out = {
        "model.embed_tokens.weight": take("model.embed_tokens.weight"),
        "model.norm.weight": take("model.norm.weight", centred=True),
    }
    if "lm_head.weight" in state:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(len(config.layer_plan)):
        src, dst = config.attention_paths[i].rpartition(".")[0], f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{dst}.{norm}.weight"] = take(f"{src}.{norm}.weight", centred=True)
        for p in ("gate", "up", "down"):
            out[f"{dst}.mlp.{p}_proj.weight"] = take(f"{src}.mlp.{p}_proj.weight")
        prefix = f"{config.attention_paths[i]}."
        used.update(k for k in state if k.startswith(prefix))
        module = student.base.get_submodule(config.attention_paths[i])
        if config.layer_plan[i] == "attention":
            out.update({f"{dst}.self_attn.{k}": v for k, v in attention_tensors(module).items()})
        else:
            out.update({f"{dst}.linear_attn.{k}": v for k, v in gated_delta_tensors(module).items()})
    for i in range(len(config.layer_plan), cfg.num_hidden_layers):  # the identity layer (llama_cpp)
        out.update(identity_layer_tensors(cfg, f"model.layers.{i}"))
    left = sorted(set(state) - used)
    if left:
        raise ExportError(f"the student has tensors {QWEN35_CLASS} has no place for: {left[:4]}", _KEEP)
    return out


def to_qwen35(student, llama_cpp: bool = False):
    """The student as a ``Qwen3_5ForCausalLM`` in fp32 (``qwen35_problem`` first)."""
    from transformers import Qwen3_5ForCausalLM  # heavy: transformers (this module imports torch only)

    problem = qwen35_problem(student.config)
    if problem is not None:
        raise ExportError(*problem)
    cfg = qwen35_config(student.config, llama_cpp)
    model = Qwen3_5ForCausalLM(cfg).float()
    state = qwen35_state_dict(student, cfg)
    if cfg.tie_word_embeddings:  # one tensor under both names, as the tied model's state_dict has it
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    cpu_runs_reference_kernels(model)  # fla's Triton kernels, where fla imports, cannot run on a CPU
    return model.eval()


def qwen35_notes(cfg) -> list[str]:
    """What a user of the exported ``Qwen3_5TextConfig`` ``cfg`` should know (the model card's notes)."""
    notes = []
    if "full_attention" not in cfg.layer_types:
        notes.append(
            "no layer is attention: transformers' Qwen3.5 builds a softmax mask from its cache and raises when the cache holds "
            "no attention layer, so config.json and generation_config.json set use_cache: false (exact, but generate "
            "recomputes the prefix each token); llama.cpp keeps its own recurrent state"
        )
    return notes + [
        "transformers 5.24 runs Qwen3.5's Gated DeltaNet through fla's Triton kernels whenever flash-linear-attention is "
        "importable, also on a CPU, where they fail ('0 active drivers'): attn2ssm generate / eval run it on a CPU with "
        "transformers' own PyTorch forms; in your own code, after loading it call "
        "attn2ssm.hf_compat.cpu_runs_reference_kernels(model), or without attn2ssm set each of "
        "transformers.models.qwen3_5.modeling_qwen3_5's torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule "
        "to inspect.unwrap() of itself",
        "q and k are L2-normalised as x·rsqrt(|x|² + ε) by the target and as x / max(|x|, 1e-12) by the student: equal to float32 "
        "noise for any key that is not ~0",
    ]

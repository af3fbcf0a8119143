"""What every ``bench generate`` run shares: its settings (``BenchSettings``), the students it
builds from the teacher (``STUDENTS``; the built-in recipes' students, ``RECIPE_STUDENTS``;
trained ones as ``NAME=DIR``; ``build_models`` in each weight format; the llama.cpp backend's
``LLAMA_CPP_STUDENTS``) and the prompt text."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

# name → (mixer kind, attention ratio, mixer options): the students the benchmark builds
STUDENTS = {
    "linear": ("linear_attention", 0.0, {"feature_map": "hedgehog"}),
    "mamba": ("mamba", 0.0, {}),
    "mamba2": ("mamba2", 0.0, {}),
    "hybrid25": ("mamba2", 0.25, {}),
    "gdn": ("gated_delta", 0.0, {}),
}

# The long-context students: built-in recipes whose student the benchmark builds untrained, exactly
# as a run of the recipe builds it (its layer plan, mixer options and kept heads read from the recipe
# and built by distill/build_student.py), with the choices that cost a pass over the teacher fixed
# (``recipe_student``).
RECIPE_STUDENTS = ("linear_hybrid25", "retrieval_heads")

# What those choices picked for the built-in teacher (SmolLM2-135M: 30 layers of 3 KV groups), kept
# fixed for a teacher of that shape because choosing costs time and changes neither speed nor
# memory: KL-guided layer selection for linear_hybrid25 (``keep_attention: auto``; benchmarks/README.md)
# and the retrieval probe for retrieval_heads (4 of 90 groups at ``kv_budget: 0.05``; docs/heads.md).
BUILTIN_SHAPE = (30, 3)  # layers, KV groups per layer
BUILTIN_KEPT_LAYERS = [2, 8, 14, 17, 18, 19, 20, 23]
BUILTIN_KEPT_GROUPS = {"6": [0], "17": [1], "18": [2], "23": [0]}

# The llama.cpp backend's students: what exports exactly to GGUF (export/native.py llama_cpp_problem,
# export/native_qwen35.py qwen35_problem), built with their kind's options for it.
LLAMA_CPP_STUDENTS = ("mamba2", "hybrid25", "gdn")

LLAMA_CPP_STUDENT_OPTIONS = {
    "mamba2": {"norm": True, "norm_eps": "auto", "gate": True, "gate_bias": False},
    "gated_delta": {
        "norm": True,
        "norm_eps": "auto",
        "gate": True,
        "gate_bias": False,
        "beta_bias": False,
        "conv_bias": False,
    },
}


@dataclass
class BenchSettings:
    teacher: str | None = None
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    # teacher, NAME (an untrained student: STUDENTS, RECIPE_STUDENTS) or NAME=DIR (a trained student)
    models: tuple[str, ...] = ("teacher", "linear", "mamba", "mamba2", "hybrid25")
    new_tokens: int = 16
    max_context: dict | None = None  # model → longest context to run (longer ones are recorded as skipped)
    spec: bool = False  # run the speculative benchmark (run_spec_bench) instead of the decode table
    # NAME (untrained, from STUDENTS or RECIPE_STUDENTS) or NAME=DIR (a trained student)
    spec_targets: tuple[str, ...] = (
        "mamba2",
        "hybrid25",
    )
    spec_drafters: tuple[str, ...] = ("ngram",)
    draft: tuple[str, ...] | None = None  # model drafts (student directories or teacher specs)
    spec_contexts: tuple[int, ...] = (1024, 8192)
    spec_ks: tuple = (2, 4, 6, "auto")
    spec_new_tokens: int = 64
    corpus: str = "sotu"
    device: str | None = None
    threads: int | None = None
    rounds: int = 3
    cpu_layout: bool = True
    # CPU: students decode through a torch.compile'd step (compiled before timing)
    compile_students: bool = False
    backend: str = "torch"  # or "llama.cpp": every model a GGUF in llama_cpp (see the module docstring)
    quants: tuple[str, ...] = ("q8_0", "f16")  # llama.cpp: the GGUF types, teacher and students alike
    flash_attn: bool = True  # llama.cpp: flash attention (llama.cpp's CLI default on CPU)
    gguf_dir: str | None = None  # llama.cpp: keep (and reuse) the GGUF files here; None: a temporary folder
    # torch: weight formats (decode/quantize.py): float32, bfloat16, int8, bfloat16+int8
    formats: tuple[str, ...] = ("float32",)
    plain_check: str = "shortest"  # torch: also time a user's plain generate at the "shortest" context, "all" of them, or "none"


def prompt_ids(tokenizer, corpus: str, length: int, device) -> torch.Tensor:
    """``length`` tokens of real text: the corpus' documents in order, tokenized and concatenated."""
    from attn2ssm.data.builtin import is_builtin, load_builtin

    if is_builtin(corpus):
        texts = [d.text for d in load_builtin(corpus)]
    else:
        texts = [Path(corpus).read_text(encoding="utf-8")]
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= length:
            break
    while len(ids) < length:  # a short corpus is repeated
        ids.extend(ids[: length - len(ids)])
    return torch.tensor([ids[:length]], device=device)


def parse_format(name: str) -> tuple[str, str | None]:
    """A benchmark weight format → (dtype, quantize): float32, bfloat16, int8 (float32
    activations), bfloat16+int8 (decode/quantize.py format_name's inverse)."""
    dtype, _, quantize = name.partition("+")
    if dtype == "int8":
        dtype, quantize = "float32", "int8"
    return dtype, quantize or None


def build_models(teacher, names, device, formats: tuple[str, ...] = ("float32",)) -> dict:
    """name → model: the teacher itself, untrained students converted from it (``STUDENTS``, and the
    recipes' students, ``RECIPE_STUDENTS``) and trained ones (``NAME=DIR``: the row is NAME), in each
    weight format (``apply_weight_format``): float32 rows keep their plain names, others are
    NAME@FORMAT (``teacher@bfloat16`` is the reference of ``mamba2@bfloat16``). ``.weight_format`` on
    each model says what it holds (format, bytes a step reads), ``.bench_model`` what it is."""
    from attn2ssm.decode.quantize import apply_weight_format, step_weight_bytes

    base = {}
    for item in names:
        name, sep, path = item.partition("=")
        base[name] = _base_model(teacher, name, path if sep else None)
        if base[name] is not teacher:
            base[name] = base[name].to(device).eval()
    models = {}
    for fmt in formats:
        for name, model in base.items():
            if fmt == "float32":
                model.__dict__["weight_format"] = {
                    "format": "float32",
                    "weight_bytes": step_weight_bytes(model),
                }
                models[name] = model
                continue
            copy_ = copy.deepcopy(model)
            copy_.__dict__["weight_format"] = apply_weight_format(copy_, *parse_format(fmt))
            models[f"{name}@{fmt}"] = copy_
    return models


def _base_model(teacher, name: str, path: str | None):
    """One benchmark model in float32, its description in ``.bench_model``."""
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    if path is not None:
        from attn2ssm.student.loading import load_model_and_tokenizer

        model, _ = load_model_and_tokenizer(path)
        what = f"trained student {path}"
    elif name == "teacher":
        model, what = teacher, "the teacher (HF's forward with its KV cache)"
    elif name in RECIPE_STUDENTS:
        model, what = recipe_student(teacher, name)
    elif name in STUDENTS:
        kind, ratio, options = STUDENTS[name]
        plan = make_plan(teacher.config.num_hidden_layers, kind, attention_ratio=ratio)
        model = convert(teacher, plan, {kind: options})
        what = f"untrained {kind} conversion, {ratio:.0%} of the layers keep attention"
    else:
        raise ValueError(
            f"unknown benchmark model {name!r}; choose from teacher, {', '.join([*STUDENTS, *RECIPE_STUDENTS])} or NAME=DIR"
        )
    model.__dict__["bench_model"] = what
    return model


def recipe_student(teacher, name: str):
    """(student, description): the untrained student of built-in recipe ``name``, built by the
    recipe's own code (``build_student``, the kept-heads plan included) with the choices that run
    the teacher fixed: the layers that keep attention (``keep_attention: auto``) and the KV groups
    that keep softmax heads (``keep_heads``' probe) are the built-in teacher's (``BUILTIN_*``) for a
    teacher of its shape, else ``make_plan``'s layers at the recipe's ratio and the budget's count of
    groups, one in each of evenly spread layers (``_spread_groups``)."""
    from dataclasses import replace

    from attn2ssm.distill.build_student import build_student
    from attn2ssm.distill.recipe import load_recipe

    recipe = load_recipe(name)
    s = recipe.student
    shape = _kv_groups(teacher)
    builtin = (len(shape), max(shape, default=0)) == BUILTIN_SHAPE and len(set(shape)) == 1
    if s.keep_attention == "auto":
        s.keep_attention = list(BUILTIN_KEPT_LAYERS) if builtin else None
    if s.keep_heads is not None and s.keep_heads.groups is None:
        groups = BUILTIN_KEPT_GROUPS if builtin else _spread_groups(shape, s.keep_heads.kv_budget)
        s.keep_heads = replace(s.keep_heads, groups=groups)
    student = build_student(
        recipe,
        teacher,
        {"source": f"untrained {name} student for bench generate"},
        resume_from=None,
        images=False,
        # no calibration in these recipes (no gated_delta decay_init: calibrated, kept attention in
        # the teacher's form): the blocks are asked for but not read
        ids=lambda: torch.zeros(1, 8, dtype=torch.long, device=teacher.device),
        note=lambda *args, **kwargs: None,
        progress=False,
    )
    plan = student.config.layer_plan
    kept = [i for i, kind in enumerate(plan) if kind == "attention"]
    heads = getattr(student.config, "retrieval_probe", {}).get("kept", {})
    what = (
        f"untrained {name} recipe student: {s.mixer} {s.mixer_options}, attention kept in layers {kept}"
        + (f", softmax KV groups kept {heads}" if heads else "")
        + (
            " (the built-in teacher's choices)"
            if builtin
            else " (not the built-in teacher's shape: make_plan's layers, KV groups spread evenly)"
        )
    )
    return student, what


def _kv_groups(teacher) -> list[int]:
    """The KV groups of each of the teacher's attention layers."""
    from attn2ssm.adapters.registry import get_adapter

    adapter = get_adapter(teacher)
    paths = adapter.attention_module_paths(teacher)
    return [adapter.geometry(teacher.config, i).num_kv_heads for i in range(len(paths))]


def _spread_groups(kv_groups: list[int], budget: float) -> dict[str, list[int]]:
    """As many KV groups as ``budget`` of them allows (``kv_group_budget``), group 0 of evenly
    spread layers (``interleaved_keep``): where the retrieval probe puts them does not change speed."""
    from attn2ssm.distill.retrieval_probe import kv_group_budget
    from attn2ssm.student.plans import interleaved_keep

    count = kv_group_budget(budget, sum(kv_groups))
    if count > len(kv_groups):
        raise ValueError(f"a KV budget of {count} groups is more than one per layer of {len(kv_groups)}")
    return {str(i): [0] for i in interleaved_keep(len(kv_groups), count / len(kv_groups), "last")}

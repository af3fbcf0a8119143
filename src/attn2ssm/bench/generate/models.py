"""What every ``bench generate`` run shares: its settings (``BenchSettings``), the students it
builds from the teacher (``STUDENTS``, ``build_models`` in each weight format; the llama.cpp
backend's ``LLAMA_CPP_STUDENTS``) and the prompt text."""

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
    models: tuple[str, ...] = ("teacher", "linear", "mamba", "mamba2", "hybrid25")
    new_tokens: int = 16
    max_context: dict | None = None  # model → longest context to run (longer ones are recorded as skipped)
    spec: bool = False  # run the speculative benchmark (run_spec_bench) instead of the decode table
    # NAME (untrained, from STUDENTS) or NAME=DIR (a trained student)
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
    """name → model: the teacher itself and untrained students converted from it, in each weight
    format (``apply_weight_format``): float32 rows keep their plain names, others are NAME@FORMAT
    (``teacher@bfloat16`` is the reference of ``mamba2@bfloat16``). ``.weight_format`` on each
    model says what it holds (format, bytes a step reads)."""
    from attn2ssm.decode.quantize import apply_weight_format, step_weight_bytes
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    n = teacher.config.num_hidden_layers
    base = {}
    for name in names:
        if name == "teacher":
            base[name] = teacher
            continue
        if name not in STUDENTS:
            raise ValueError(f"unknown benchmark model {name!r}; choose from teacher, {', '.join(STUDENTS)}")
        kind, ratio, options = STUDENTS[name]
        base[name] = (
            convert(teacher, make_plan(n, kind, attention_ratio=ratio), {kind: options}).to(device).eval()
        )
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

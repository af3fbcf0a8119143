"""``attn2ssm export STUDENT --format gguf --out FILE.gguf``: a student for llama.cpp.

The route is the native export (student/native_export.py) in the form llama.cpp's GraniteHybrid
takes (``llama_cpp=True``: expand 2 with zero heads, no in_proj / out_proj bias), written to a
temporary folder and turned into GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (llamacpp.py:
from the llama-cpp-python sdist that ``make llama-cpp`` unpacks); types the converter lacks are
quantised from its f32 output with ``llama_model_quantize``.

Gated delta-rule students take the Qwen3.5 route (export/native_qwen35.py): the native export (a
pure one with one identity attention layer, which llama.cpp's hybrid memory needs; a hybrid with
``student.kept_attention: qwen35`` as it is, its attention layers named per layer), converted as
llama.cpp's ``qwen35`` with ``--no-mtp`` (the converter otherwise asserts that a Qwen3.5 has
multi-token-prediction layers); nothing is set back afterwards (the converter reads it as written).

One thing the converter gets wrong for our hybrids: it reads every GraniteMoeHybrid with Mamba
layers as Granite 4.0-H, whose attention has no position embedding, so it writes llama.cpp's RoPE
switch (``<arch>.rope.scaling.finetuned``) off and a 2^20 context. Our kept attention layers use
the teacher's RoPE, so both are set back (the switch on, the teacher's context length) with
llama.cpp's own ``gguf_set_metadata.py``. Pure students have no attention and keep what it wrote.

When ``llama_cpp`` is importable the file is loaded and its logits on a probe are compared with
the student's (fp32 KV cache, so the difference is the map's and the weights' type's alone): an f32
GGUF that differs by more than the tolerance is an ``ExportError`` and nothing is written; other
types report their difference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attn2ssm.errors import ConfigError, ExportError
from attn2ssm.export.llamacpp import (
    OUTTYPES,
    QUANTIZE_TYPES,
    ToolFailed,
    converter_dir,
    load_runtime,
    logits_in_subprocess,
    read_metadata,
    set_metadata,
    to_gguf,
)
from attn2ssm.export.native import check_exportable, export_native
from attn2ssm.export.native_qwen35 import QWEN35_CLASS
from attn2ssm.paths import check_writable, lock_beside, remove_stale_staging, staging_beside, writing

PROBE_LENGTH = 24


@dataclass
class GGUFExport:
    out: Path
    outtype: str
    layer_types: list[str]  # the student's layers ("mamba" / "attention")
    # layers added for llama.cpp that compute the identity (a pure student's one attention layer)
    identity_layers: list[int]
    native_max_abs_diff: float  # the llama.cpp-form GraniteMoeHybrid vs the student, fp32, in transformers
    # the GGUF in llama.cpp vs the student (None: llama_cpp not importable)
    llama_cpp_max_abs_diff: float | None
    logit_scale: float  # max |student logit| on the probe, to read the differences against
    bytes: int
    notes: list[str] = field(default_factory=list)


def llama_cpp_tolerance(scale: float) -> float:
    """How far an f32 GGUF's logits may be from the student's in llama.cpp: float32 sums in another
    order through every layer. Measured on SmolLM2-135M students: 4e-3 on logits of 32 (25 %
    hybrid), 5e-4 (pure); the teacher's own f32 GGUF 7e-5. A wrong map is O(1) apart."""
    return 1e-3 * max(1.0, scale)


@torch.no_grad()
def compare_in_llama_cpp(student, gguf: Path, length: int = PROBE_LENGTH) -> tuple[float, float]:
    """(max |llama.cpp − student| logit, max |student logit|) on one random sequence, the GGUF run
    with an f32 KV cache and without flash attention so only the weights' type differs."""
    vocab = student.config.base_config["vocab_size"]
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    mine = student(input_ids=ids, use_cache=False).logits[0].float()
    theirs = torch.from_numpy(logits_in_subprocess(gguf, ids[0].tolist()))[:, :vocab]
    return float((theirs - mine).abs().max()), float(mine.abs().max())


def export_gguf(
    student_dir: str | Path,
    out: str | Path,
    *,
    outtype: str = "f16",
    force: bool = False,
    threads: int | None = None,
    verify: bool = True,
) -> GGUFExport:
    """Write the student in ``student_dir`` as one GGUF file ``out`` of ``outtype`` (``OUTTYPES``).
    Refused before anything runs when the student does not map exactly onto llama.cpp's
    GraniteHybrid; staged beside ``out`` and moved into place only when every step passed."""
    out = Path(out)
    _check_request(out, outtype, force)
    # what llama.cpp cannot run exactly: refused from the config, before llama.cpp is looked for
    check_exportable(student_dir, llama_cpp=True)
    converter_dir()  # the converter missing: one line naming make llama-cpp, before any work
    if outtype in QUANTIZE_TYPES:
        load_runtime()
    check_writable(out)
    with lock_beside(out):  # a second export to this --out at the same time is refused
        _check_request(out, outtype, force)  # another export may have written it meanwhile
        remove_stale_staging(out.parent)  # what a killed export left beside it
        return _convert(student_dir, out, outtype, threads, verify)


def _convert(student_dir, out: Path, outtype: str, threads: int | None, verify: bool) -> GGUFExport:
    """The llama.cpp-form native export and llama.cpp's converter in a staging folder beside
    ``out``, the GGUF's logits checked in llama.cpp (``verify``), then moved to ``out``."""
    # heavy: transformers (this module imports torch only)
    from attn2ssm.student.modeling import Attn2SSMForCausalLM

    with (
        writing(out, "the GGUF file", "run the command again (what --out held is unchanged)"),
        staging_beside(out, "export") as tmp,
    ):
        native = export_native(student_dir, tmp / "native", llama_cpp=True)
        qwen35 = native.cls == QWEN35_CLASS
        try:
            staged = to_gguf(
                tmp / "native",
                tmp / "model.gguf",
                outtype,
                tmp,
                threads,
                converter_args=("--no-mtp",) if qwen35 else (),
            )
        except ToolFailed as failed:
            raise _kept_for_a_hand_run(failed, tmp, out) from failed
        notes = _layout_notes(native, staged, tmp / "native")
        diff, scale = None, 0.0
        if verify and _runtime_available():
            student = Attn2SSMForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
            diff, scale = compare_in_llama_cpp(student, staged)
            if outtype == "f32" and not diff <= llama_cpp_tolerance(scale):
                raise ExportError(
                    f"the GGUF's logits in llama.cpp differ from the student's by {diff:.3g} on a probe (tolerance {llama_cpp_tolerance(scale):.3g})",
                    "nothing was written; this is a bug in the map or a llama.cpp change: report it with the student's config.json",
                )
        elif verify:
            notes.append(
                "llama_cpp is not importable, so the GGUF was not run: 'make llama-cpp' builds it and export checks the logits"
            )
        os.replace(staged, out)
    return GGUFExport(
        out,
        outtype,
        native.layer_types,
        native.identity_layers,
        native.max_abs_diff,
        diff,
        scale,
        out.stat().st_size,
        notes,
    )


def _kept_for_a_hand_run(failed: ToolFailed, tmp: Path, out: Path) -> ExportError:
    """The converter failed on the staged native model: keep that model beside ``out`` (the staging
    folder goes) and name it in a command that reruns the converter by hand, writing ``out``."""
    kept = out.with_name(f"{out.stem}.llama-cpp-input")
    n = 1
    while kept.exists():
        n += 1
        kept = out.with_name(f"{out.stem}.llama-cpp-input-{n}")
    os.replace(tmp / "native", kept)
    moved = {str(tmp / "native"): str(kept), str(tmp / "model.gguf"): str(out)}
    cmd = [
        moved.get(a, str(out.parent / Path(a).name) if a.startswith(f"{tmp}{os.sep}") else a)
        for a in failed.cmd
    ]
    return ExportError(
        failed.problem,
        f"the converter's input is kept in {kept}; run it by hand for the full log: {shlex.join(cmd)} "
        f"(then delete {kept})",
    )


def _check_request(out: Path, outtype: str, force: bool) -> None:
    """A ``ConfigError`` for an unknown ``outtype``, an ``out`` that is not a .gguf file, or one that
    exists without ``force``."""
    if outtype not in OUTTYPES:
        raise ConfigError(
            f"--outtype {outtype!r} is not a GGUF type here", f"choose one of {', '.join(OUTTYPES)}"
        )
    if out.suffix != ".gguf":
        raise ConfigError(
            f"--out {out} does not end in .gguf", "give the GGUF file to write, e.g. --out student-f16.gguf"
        )
    if out.is_dir():
        raise ConfigError(
            f"--out {out} is a directory", "give the GGUF file to write, e.g. --out student-f16.gguf"
        )
    if out.exists() and not force:
        raise ConfigError(
            f"--out {out} already exists", "pass --force to replace it, or choose another --out"
        )


def _layout_notes(native, staged: Path, native_dir: Path) -> list[str]:
    """What llama.cpp's form of the student changed (identity layer, zero Mamba heads), as notes;
    a hybrid's GGUF ``staged`` gets its context length (and RoPE switch) back from ``native_dir``."""
    qwen35, notes = native.cls == QWEN35_CLASS, []
    if qwen35 and native.identity_layers:
        notes.append(
            f"llama.cpp aborts on a qwen35 without attention layers (GGML_ASSERT(buffer): its hybrid memory's attention inputs), so layer {native.identity_layers[0]} is an identity layer "
            "(attention and MLP with zero weights: exact, one layer's KV cache and ~2% more weights)"
        )
    if "mamba" in native.layer_types:
        notes.append(
            "llama.cpp's GraniteHybrid runs Mamba-2 at expand 2: the Mamba layers carry as many zero heads as real ones (exact, at twice the mixer width)"
        )
    if native.identity_layers and not qwen35:
        notes.append(
            f"llama.cpp aborts on a GraniteHybrid without attention layers, so layer {native.identity_layers[0]} is an identity layer "
            "(attention and MLP with zero weights: exact, one layer's KV cache and ~2% more weights)"
        )
    if "mamba" in native.layer_types and ("attention" in native.layer_types or native.identity_layers):
        arch = read_metadata(staged)["general.architecture"]
        context = int(
            json.loads((native_dir / "config.json").read_text(encoding="utf-8"))["max_position_embeddings"]
        )
        set_metadata(staged, f"{arch}.context_length", context)  # the converter's NoPE reading wrote 2^20
        if "attention" in native.layer_types:
            set_metadata(staged, f"{arch}.rope.scaling.finetuned", "true")
            notes.append(
                f"the converter reads GraniteMoeHybrid hybrids as NoPE; {arch}.rope.scaling.finetuned (llama.cpp's RoPE switch) "
                f"set back to true and the context length to {context}"
            )
    return notes


def _runtime_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None

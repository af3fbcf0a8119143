"""``attn2ssm export`` (a student as a native transformers checkpoint or a llama.cpp GGUF) and
``attn2ssm upgrade`` (refresh saved students' modeling code)."""

from __future__ import annotations

import sys

from attn2ssm.errors import ConfigError
from attn2ssm.export.llamacpp import OUTTYPES


def add_parser(subparsers) -> None:
    u = subparsers.add_parser(
        "upgrade",
        help="refresh saved students' modeling code (trust_remote_code files) with this attn2ssm's; weights untouched",
    )
    u.add_argument("dirs", nargs="+", metavar="DIR", help="student directories (with config.json)")
    u.set_defaults(func=run_upgrade)

    x = subparsers.add_parser(
        "export",
        help="write a student as a checkpoint of a native transformers class (no remote code), or as a llama.cpp GGUF, where the map is exact",
    )
    x.add_argument("student", help="student directory (a run's student/ folder or a convert --out)")
    x.add_argument(
        "--format",
        required=True,
        choices=("native", "gguf"),
        help="native: GraniteMoeHybridForCausalLM (Mamba-2 students with norm: true "
        "of Llama / Mistral / Qwen2 teachers, pure or hybrid with global attention layers) or Qwen3_5ForCausalLM (pure gated_delta "
        "students with gate_bias, beta_bias, conv_bias false and norm_eps: auto, of Llama / Mistral teachers); gguf: that model through "
        "llama.cpp's own converter (Mamba-2 also needs gate_bias: false and no q/k/v biases; 'make llama-cpp' installs the converter)",
    )
    x.add_argument(
        "--out", required=True, help="directory for the exported model (native), or the .gguf file (gguf)"
    )
    x.add_argument(
        "--outtype",
        default=None,
        choices=OUTTYPES,
        help="gguf: the weights' type (default f16); f32/f16/bf16/q8_0 from llama.cpp's converter, "
        "the others quantised from its f32 output with llama_model_quantize",
    )
    x.add_argument("--threads", type=int, default=None, help="gguf: threads for quantising")
    x.add_argument("--force", action="store_true", help="replace a model already in --out")
    x.set_defaults(func=run)


def run(args) -> int:
    if args.format == "gguf":
        return _export_gguf(args)
    if args.outtype is not None:
        raise ConfigError(
            "--outtype is for --format gguf", "drop --outtype (a native export keeps the student's dtype)"
        )
    from attn2ssm.export.native import export_native  # heavy: torch

    result = export_native(args.student, args.out, force=args.force)
    n_attn = result.layer_types.count("attention")
    print(
        f"wrote {result.out}: {result.cls}, {len(result.layer_types) - n_attn} {_mixer_name(result.layer_types)} + {n_attn} attention layers; "
        f"logits equal the student's to {result.max_abs_diff:.1e} on a probe; loads without trust_remote_code"
    )
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _export_gguf(args) -> int:
    from attn2ssm.export.gguf import export_gguf, llama_cpp_tolerance  # heavy: torch

    result = export_gguf(
        args.student, args.out, outtype=args.outtype or "f16", force=args.force, threads=args.threads
    )
    n_attn = result.layer_types.count("attention")
    if result.llama_cpp_max_abs_diff is None:
        checked = "not run in llama.cpp (llama_cpp not importable)"
    else:
        within = (
            " (within tolerance)"
            if result.llama_cpp_max_abs_diff <= llama_cpp_tolerance(result.logit_scale)
            else ""
        )
        checked = f"llama.cpp's logits differ from the student's by {result.llama_cpp_max_abs_diff:.1e}{within} on a probe (largest logit {result.logit_scale:.1f})"
    identity = (
        f" (+ {len(result.identity_layers)} identity layer llama.cpp needs)" if result.identity_layers else ""
    )
    arch = "qwen35" if "linear_attention" in result.layer_types else "granitehybrid"
    print(
        f"wrote {result.out} ({result.outtype}, {result.bytes / 2**20:.1f} MiB): llama.cpp {arch}, {len(result.layer_types) - n_attn} {_mixer_name(result.layer_types)} + {n_attn} "
        f"attention layers{identity}; {checked}"
    )
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _mixer_name(layer_types: list[str]) -> str:
    return "Gated DeltaNet" if "linear_attention" in layer_types else "Mamba-2"


def run_upgrade(args) -> int:
    # heavy: torch + transformers (student.remote_code)
    from attn2ssm.export.upgrade import check_upgradable, upgrade_remote_code
    from attn2ssm.hf_compat import TESTED_TRANSFORMERS  # heavy: transformers

    for directory in args.dirs:  # every folder checked before any is written
        check_upgradable(directory)
    for directory in args.dirs:
        written = upgrade_remote_code(directory)
        low, high = TESTED_TRANSFORMERS
        print(
            f"refreshed {len(written)} modeling files in {directory} (code tested with transformers >={low},<{high}); weights untouched"
        )
    return 0

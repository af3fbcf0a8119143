"""Loading any model the commands take: an attn2ssm student directory (with the installed attn2ssm
code), or any teacher spec (``attn2ssm.teachers``); and how many positions a model may read."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from attn2ssm.errors import CheckpointError
from attn2ssm.teachers import check_weight_files, first_line, load_teacher, quiet_loading


def position_limit(config) -> int | None:
    """How many positions a model may read: its ``max_position_embeddings``, or None (no limit) for
    an attn2ssm student that uses no positions at all: no attention layer kept, no mixer rotating
    with RoPE (every mixer's ``rope`` option is "none"), no learned position table (GPT-2's wpe)."""
    limit = getattr(config, "max_position_embeddings", None)
    plan = getattr(config, "layer_plan", None)
    if getattr(config, "model_type", None) != "attn2ssm" or not plan or "attention" in plan:
        return limit
    from attn2ssm.adapters import get_adapter
    from attn2ssm.mixers.registry import MIXERS

    if get_adapter(config.build_base_config()).learned_positions:
        return limit
    for kind in set(plan):
        rope = inspect.signature(MIXERS[kind].__init__).parameters.get("rope")
        if rope is None or (config.mixer_options.get(kind) or {}).get("rope", rope.default) != "none":
            return limit
    return None


def load_model_and_tokenizer(path: str, device=None):
    """A student directory (loaded with the installed attn2ssm code) or any teacher spec →
    (model in eval mode, tokenizer), on ``device`` (None: the CPU; the commands pass
    ``devices.resolve_device(--device)``). Used by the CLI, evaluation and benchmarks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import attn2ssm.student  # noqa: F401  (registers the Auto classes)
    from attn2ssm.ops.kernels import check_environment

    check_environment(torch.device(device or "cpu").type)  # a bad ATTN2SSM_KERNELS: one line, before loading
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists():
        fix = (
            f"pass {p / 'student'} (a distillation run keeps its student there)"
            if (p / "student" / "config.json").exists()
            else "pass a student directory (written by 'attn2ssm convert', or a run's student/ folder), a model directory, a .gguf file or a hub id"
        )
        raise CheckpointError(f"{p} holds no model: config.json is missing", fix)
    if p.is_dir() and (p / "config.json").exists():
        try:
            cfg = json.loads((p / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"{p / 'config.json'} is not readable JSON ({first_line(exc)})",
                "restore the file or point at another model directory",
            ) from exc
        if cfg.get("model_type") == "attn2ssm":
            check_weight_files(p)
            try:
                with quiet_loading():
                    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
                    tokenizer = AutoTokenizer.from_pretrained(p)
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"could not load the student in {p} ({first_line(exc)})",
                    "point at a directory written by 'attn2ssm convert' or by 'attn2ssm distill' (its student/ folder)",
                ) from exc
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            return model.eval().to(device or "cpu"), tokenizer
    model, tokenizer, _ = load_teacher(path, device=device)
    return model, tokenizer

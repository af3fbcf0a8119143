"""The README.md (model card) written into every saved student, and into a native export.

A saved folder is what gets pushed to the hub, so it says what it is: the teacher it was distilled
from, what replaced attention in which layers, the recipe and token budget, how close it came to
the teacher (held-out perplexity ratio) when the run measured it, and how to load it.

A distillation run writes ``results.json`` beside ``student/`` only after the student is saved,
so the card is written again by the run's report (``eval/report.py``); a card written with no
``results.json`` beside the folder says that nothing was measured.

This module is imported by ``student/modeling.py``'s ``save_pretrained`` and therefore copied into
every checkpoint as remote code: standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path

# What each mixer is, with the paper it comes from (by name).
_METHODS = {
    "linear_attention": "linear attention (kernel feature maps, as in Hedgehog & the Porcupine and LoLCATs)",
    "mamba": "Mamba (selective-scan) mixers started from the attention weights, as in The Mamba in the Llama",
    "mamba2": "Mamba-2 (SSD) mixers started from the attention weights, as in The Mamba in the Llama",
    "discrete_mamba2": "discrete Mamba-2 (Phi-Mamba) mixers, as in Transformers to SSMs (MOHAWK)",
    "hedgemamba": "HedgeMamba mixers (Hedgehog feature maps inside a Mamba block)",
}


def read_results(directory: str | Path) -> dict | None:
    """The distillation run's ``results.json`` beside ``directory`` (a run's ``student/``), if any."""
    path = Path(directory).parent / "results.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None


def teacher_name(config: dict) -> tuple[str, str | None]:
    """(what to call the teacher, its hub id or None) from a student config's ``teacher`` entry.
    Local paths are never shown (configs saved before they were scrubbed may still hold one)."""
    teacher = config.get("teacher") or {}
    source = teacher.get("source") or {}
    location = source.get("location")
    hub_id = source.get("hub_id") or (location if source.get("kind") == "hub" else None)
    local = source.get("kind") in ("dir", "gguf", "builtin") or (
        isinstance(location, str) and location.startswith(("/", "~", "."))
    )
    shown_location = None if local or not location else location
    if local and location and not source.get("name"):
        shown_location = location.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    name = source.get("name") or shown_location or teacher.get("model_type") or "unknown teacher"
    if source.get("gguf_file"):
        name = f"{name} ({source['gguf_file']})"
    return name, hub_id


def _front_matter(hub_id: str | None, tags: list[str]) -> list[str]:
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    lines += [f"- {tag}" for tag in tags]
    if hub_id:
        lines += [f"base_model: {hub_id}"]
    return lines + ["---", ""]


def _plan_lines(config: dict) -> list[str]:
    plan = list(config.get("layer_plan") or [])
    kept = [i for i, kind in enumerate(plan) if kind == "attention"]
    kinds = sorted({kind for kind in plan if kind != "attention"})
    lines = [
        f"- **Layers**: {len(plan) - len(kept)} of {len(plan)} converted; softmax attention kept in layers {kept or 'none'}."
    ]
    for kind in kinds:
        options = (config.get("mixer_options") or {}).get(kind) or {}
        shown = ", ".join(f"{k}={v}" for k, v in sorted(options.items())) or "defaults"
        lines.append(f"- **Mixer** `{kind}`: {_METHODS.get(kind, kind)}; options: {shown}.")
    if config.get("teacher_layers"):
        lines.append(f"- **Depth**: built from teacher layers {config['teacher_layers']}.")
    return lines


def _tokens(n) -> str:
    """A stage's budget: ``n`` tokens, or what a stage without one (``epochs:``) ran on."""
    return f"{n:,} tokens" if isinstance(n, int) and not isinstance(n, bool) else "its dataset's epochs"


def _results_lines(results: dict | None) -> list[str]:
    if not results:
        return []
    lines = ["", "## Distillation", ""]
    if results.get("recipe"):
        lines.append(f"- **Recipe**: `{results['recipe']}`")
    stages = results.get("stages") or []
    if stages:
        lines.append(
            "- **Stages**: "
            + " → ".join(f"{s.get('name')} ({s.get('kind')}, {_tokens(s.get('tokens'))})" for s in stages)
        )
    if results.get("train_tokens") is not None:
        lines.append(f"- **Training budget**: {results['train_tokens']:,} tokens (all stages)")
    if results.get("corpus"):
        lines.append(f"- **Corpus**: {results['corpus']}")
    if results.get("student_ppl") is not None and results.get("teacher_ppl") is not None:
        held = results.get("heldout") or {}
        lines.append(
            f"- **Held-out perplexity**: student {results['student_ppl']:.2f} vs teacher {results['teacher_ppl']:.2f} "
            f"(ratio {results['student_ppl'] / results['teacher_ppl']:.3f}; {held.get('tokens', '?')} tokens, window {held.get('window', '?')})"
        )
    return lines


def _unmeasured_lines(results: dict | None) -> list[str]:
    if results:
        return []
    return [
        "",
        "## Distillation",
        "",
        (
            "Not recorded with this folder (no `results.json` beside it): a student written by `attn2ssm "
            "convert` (mixers initialised from the teacher's attention, untrained), a run's checkpoint or a model saved from Python. "
            "`attn2ssm distill` writes the recipe, token budget and measured ratio to the teacher into its final `student/` card."
        ),
    ]


def student_card(config: dict, results: dict | None = None) -> str:
    """The model card of a saved student (config: its ``config.json`` as a dict)."""
    name, hub_id = teacher_name(config)
    family = (config.get("teacher") or {}).get("family") or (config.get("base_config") or {}).get(
        "model_type", "?"
    )
    kinds = sorted({kind for kind in config.get("layer_plan") or [] if kind != "attention"})
    hybrid = "attention" in (config.get("layer_plan") or [])
    lines = _front_matter(hub_id, ["attn2ssm", "distillation", *kinds, *(["hybrid"] if hybrid else [])])
    lines += [
        f"# {' + '.join(kinds) or 'attention'} student of {name}",
        "",
        (
            f"Distilled from **{name}** ({family} architecture) with attn2ssm: the teacher with some "
            "attention modules replaced by sequence mixers; embeddings, norms, MLPs and the LM head are the teacher's."
        ),
        "",
        *_plan_lines(config),
        f"- **Weights**: {config.get('dtype') or config.get('torch_dtype') or 'float32'}",
        *_results_lines(results),
        *_unmeasured_lines(results),
        "",
        "## How to load",
        "",
        (
            "The modeling code is in this folder (`attn2ssm_*.py`), so attn2ssm need not be installed, but transformers must be "
            "allowed to run it (`trust_remote_code=True`):"
        ),
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_HUB_ID", trust_remote_code=True, dtype=torch.bfloat16)',
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_HUB_ID", trust_remote_code=True)  # it reads config.json, whose auto_map names this code',
        'ids = tokenizer("The", return_tensors="pt")',
        "print(tokenizer.decode(model.generate(**ids, max_new_tokens=32)[0]))",
        "```",
        "",
        (
            '`dtype` applies to the whole model (Mamba-style `A_log` / `D` stay float32); `dtype="auto"` keeps the saved one. '
            "`AutoModel` (no LM head: hidden states) loads the same way. Where attn2ssm is installed, `import attn2ssm.student` "
            "registers the classes and `trust_remote_code` is not needed. `generate` decodes with a recurrent cache (constant "
            "memory per mixer layer, KV only for kept attention layers)."
        ),
        *_peft_lines(config),
        *_native_lines(config),
        "",
    ]
    return "\n".join(lines)


def _peft_lines(config: dict) -> list[str]:
    """How to put LoRA on this student with peft (its learned feature maps are not nn.Linear)."""
    plan, options = config.get("layer_plan") or [], config.get("mixer_options") or {}
    default_map = {"linear_attention": "elu", "hedgemamba": "hedgehog"}  # the mixers' own defaults
    learned = any(
        kind in plan and (options.get(kind) or {}).get("feature_map", default) in ("hedgehog", "t2r")
        for kind, default in default_map.items()
    )
    if not learned:
        return []
    return [
        "",
        (
            "LoRA with peft (>= 0.17): the learned feature maps hold per-head weights (heads × head_dim × features), not "
            '`nn.Linear`s, so name them in `target_parameters`, e.g. `LoraConfig(target_modules=["q_proj", "k_proj", '
            '"v_proj", "o_proj"], target_parameters=["feature_map_q.weight", "feature_map_k.weight"])` (one rank-r '
            'update per head), or train them whole with `modules_to_save=["feature_map_q", "feature_map_k"]`. '
            "`merge_and_unload()` gives back a plain student."
        ),
    ]


def _native_lines(config: dict) -> list[str]:
    plan = config.get("layer_plan") or []
    kinds = {kind for kind in plan if kind != "attention"}
    if kinds != {"mamba2"}:
        return []
    return [
        "",
        (
            "Mamba-2 students of Llama-family teachers with the gated norm on can also be written as a plain transformers "
            "`GraniteMoeHybridForCausalLM` (no remote code; served by vLLM): `attn2ssm export DIR --format native --out NATIVE_DIR`."
        ),
    ]


def native_card(config: dict, results: dict | None, cls: str, notes: list[str] = ()) -> str:
    """The model card of a student exported as a native transformers class (config: the student's)."""
    name, hub_id = teacher_name(config)
    plan = list(config.get("layer_plan") or [])
    hybrid = "attention" in plan
    gdn = cls == "Qwen3_5ForCausalLM"
    mixer, tag, form, engine = (
        ("Gated DeltaNet", "gated-deltanet", "dense MLP, zero-centred norms", None)
        if gdn
        else ("Mamba-2", "mamba2", "dense shared MLP, multipliers 1", "GraniteMoeHybrid")
    )
    lines = _front_matter(
        hub_id,
        [
            "attn2ssm",
            "distillation",
            tag,
            *(["hybrid"] if hybrid else []),
            "qwen3_5" if gdn else "granitemoehybrid",
        ],
    )
    lines += [
        f"# {mixer} {'hybrid ' if hybrid else ''}student of {name}, as {cls}",
        "",
        (
            f"Distilled from **{name}** with attn2ssm and exported with `attn2ssm export --format native`: a plain transformers "
            f"`{cls}` checkpoint ({form}), no remote code. Its logits equal the attn2ssm student's."
        ),
        "",
        *_plan_lines(config),
        *_results_lines(results),
        "",
        "## How to load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("PATH_OR_HUB_ID")',
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_HUB_ID")',
        "```",
        "",
        (
            f"Engines that serve {engine} load it as it is, e.g. `vllm serve PATH_OR_HUB_ID`."
            if not gdn
            else "llama.cpp runs it as its `qwen35` architecture: `attn2ssm export STUDENT --format gguf` writes the GGUF."
        ),
        "",
    ]
    if notes:
        lines += ["## Notes", "", *[f"- {note}" for note in notes], ""]
    return "\n".join(lines)


def write_student_card(directory: str | Path, config: dict | None = None) -> Path:
    """Write ``directory/README.md`` for the student saved there (its config.json unless given)."""
    directory = Path(directory)
    if config is None:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    path = directory / "README.md"
    path.write_text(student_card(config, read_results(directory)), encoding="utf-8")
    return path

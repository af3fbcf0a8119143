"""The checks of a recipe's values (``validate``: before anything loads) and of the recipe against
its teacher's config (``validate_for_teacher``: before the teacher's weights load). Each check is
one line naming the key and a value that works (``ConfigError``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from attn2ssm.adapters import get_adapter
from attn2ssm.data import check_block_len
from attn2ssm.data.builtin import names as builtin_corpora
from attn2ssm.data.specs import (
    MIX_PREFIX,
    MIXTURES,
    expand_mixture,
    is_chat,
    is_generated,
    is_mixture,
    parse_chat_spec,
    parse_generated_spec,
)
from attn2ssm.distill.recipe_schema import DATA_FORMATS, DataConfig, Recipe, StageConfig, StudentConfig
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.ssm_common import resolve_norm_eps
from attn2ssm.ops.kernels import check_kernels
from attn2ssm.precision import PRECISIONS

TEACHER_DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_corpus_given(raw: dict) -> None:
    """The raw recipe, before its dataclasses fill defaults: ``data.corpus: null`` with no
    ``data.sources`` names nothing to train on (left out, the corpus is sotu)."""
    data = raw.get("data")
    corpora = [*builtin_corpora(), *(MIX_PREFIX + name for name in MIXTURES)]
    if isinstance(data, dict) and "corpus" in data and data["corpus"] is None and not data.get("sources"):
        raise ConfigError(
            "data.corpus is null and data.sources lists nothing, so the recipe names no corpus",
            f"set data.corpus to a built-in corpus ({', '.join(corpora)}), a file or "
            "folder, hf:<dataset>, generated:<n_tokens> or chat:<corpus>, or list data.sources",
        )


def validate(recipe: Recipe) -> None:
    _validate_run_settings(recipe)
    _validate_stages(recipe)
    _validate_student(recipe)
    _validate_attention_schedule(recipe)
    if recipe.data.block_len < 2:
        raise ConfigError("data.block_len must be at least 2", "set data.block_len=256 for example")
    _validate_eval(recipe)
    _validate_data(recipe.data)


def _validate_run_settings(recipe: Recipe) -> None:
    """Kernels, device, mixed precision and the teacher's dtype."""
    check_kernels(recipe.kernels, "recipe.kernels")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", recipe.device):
        raise ConfigError(
            f"recipe.device={recipe.device!r} is not a device", "use auto, cpu, cuda or cuda:N (e.g. cuda:1)"
        )
    if recipe.mixed_precision not in PRECISIONS:
        raise ConfigError(
            f"recipe.mixed_precision: unknown precision '{recipe.mixed_precision}'",
            f"use one of: {', '.join(PRECISIONS)}",
        )
    if recipe.teacher_dtype not in TEACHER_DTYPES:
        raise ConfigError(
            f"recipe.teacher_dtype={recipe.teacher_dtype!r} is not a dtype",
            f"use one of: {', '.join(TEACHER_DTYPES)}",
        )


def _validate_stages(recipe: Recipe) -> None:
    # heavy: the stage kinds, mixers and plans import transformers
    from attn2ssm.distill.stages import STAGE_KINDS

    if not recipe.stages:
        raise ConfigError("the recipe has no stages", "add at least one entry under 'stages'")
    for i, stage in enumerate(recipe.stages):
        where = f"stages[{i}] ({stage.name})"
        if stage.kind not in STAGE_KINDS:
            raise ConfigError(
                f"{where}: unknown kind '{stage.kind}'", f"use one of: {', '.join(STAGE_KINDS)}"
            )
        kind = STAGE_KINDS[stage.kind]
        kind.options(stage)  # unknown `losses` keys fail here, before any loading
        if stage.schedule.kind not in ("warmup_cosine", "wsd", "constant"):
            raise ConfigError(
                f"{where}: unknown schedule '{stage.schedule.kind}'", "use warmup_cosine, wsd or constant"
            )
        _validate_stage_budget(stage, kind, i, where)
        _validate_stage_numbers(stage, i, where)
        _validate_stage_data(stage, kind, i, where)
        if kind.image_task != (recipe.images is not None):
            raise ConfigError(
                f"{where}: kind '{stage.kind}' {'needs' if recipe.images is None else 'cannot use'} the recipe's images",
                "image recipes (with `images:`) use vision_ce, vision_kd or vision_cab stages; language recipes the others",
            )
        if stage.logit_cache is not None:
            _validate_logit_cache(stage, kind, i, where)
        for setting in ("gradient_checkpointing", "compile_layers"):
            if getattr(stage, setting):
                _validate_layer_setting(setting, stage, kind, i, where)


def _validate_stage_budget(stage: StageConfig, kind, i: int, where: str) -> None:
    """Tokens, batch size, gradient accumulation, block length and epochs."""
    if stage.tokens < 0 or stage.batch_size <= 0 or stage.grad_accum <= 0:
        raise ConfigError(
            f"{where}: batch_size and grad_accum must be positive, tokens positive or 0 (the stage skipped)",
            "fix the stage's budget",
        )
    if stage.block_len is not None:
        if kind.data_formats is not None or kind.image_task:
            raise ConfigError(
                f"{where}: kind '{stage.kind}' does not train on the recipe's corpus blocks, so block_len does not apply",
                f"remove stages.{i}.block_len (its own dataset has data.max_len)",
            )
        if isinstance(stage.block_len, bool) or not isinstance(stage.block_len, int) or stage.block_len < 2:
            raise ConfigError(
                f"{where}: block_len={stage.block_len!r} is not a block length",
                f"set stages.{i}.block_len to at least 2 tokens, e.g. 4096, or null for data.block_len",
            )
    if stage.batch_size % stage.grad_accum:
        raise ConfigError(
            f"{where}: batch_size {stage.batch_size} is not divisible by grad_accum {stage.grad_accum}",
            "make batch_size a multiple of grad_accum",
        )
    if stage.epochs is not None and stage.epochs <= 0:
        raise ConfigError(
            f"{where}: epochs must be positive, got {stage.epochs}",
            "set epochs to e.g. 1, or leave it unset to use tokens",
        )


def _validate_student(recipe: Recipe) -> None:
    from attn2ssm.mixers.registry import (  # heavy: the mixers and plans import transformers
        ENCODER_MIXERS,
        MIXERS,
        check_mixer_options,
    )
    from attn2ssm.student.kept_attention import KEPT_ATTENTION  # heavy: as above
    from attn2ssm.student.plans import LAYER_MAPS  # heavy: as above

    s = recipe.student
    for name, value, valid in (
        ("placement", s.placement, ("interleaved", "clustered")),
        ("align", s.align, ("first", "last")),
        ("where", s.where, ("first", "middle", "last")),
        ("init", s.init, ("attention", "random")),
        ("layer_map", s.layer_map, LAYER_MAPS),
        ("kept_attention", s.kept_attention, KEPT_ATTENTION),
    ):
        if value not in valid:
            raise ConfigError(f"student.{name}={value!r} is not valid", f"use one of: {', '.join(valid)}")
    if s.init_from is not None:
        _validate_init_from(recipe)
    if recipe.images is not None and s.kept_attention != "teacher":
        raise ConfigError(
            f"student.kept_attention={s.kept_attention} rewrites a language student's kept attention layers; image students keep none",
            "drop student.kept_attention",
        )
    mixers = ENCODER_MIXERS if recipe.images is not None else MIXERS
    if s.mixer not in mixers:
        raise ConfigError(
            f"student.mixer={s.mixer!r} is not a mixer{' for an image recipe' if recipe.images is not None else ''}",
            f"use one of: {', '.join(sorted(mixers))}",
        )
    if not isinstance(s.mixer_options, dict):
        raise ConfigError(
            f"student.mixer_options must be a mapping, got {s.mixer_options!r}",
            "write e.g. student.mixer_options: {feature_map: elu}",
        )
    check_mixer_options(s.mixer, s.mixer_options)
    if not 0.0 <= s.attention_ratio <= 1.0:
        raise ConfigError(
            f"student.attention_ratio={s.attention_ratio} is outside [0, 1]",
            "set the fraction of layers that keep attention, e.g. student.attention_ratio=0.25",
        )
    _validate_keep_attention(s)
    if s.keep_heads is not None:
        _validate_keep_heads(recipe)


def _validate_keep_heads(recipe: Recipe) -> None:
    """student.keep_heads: a head-level hybrid of linear_attention layers built from the teacher."""
    from attn2ssm.mixers.kept_heads import parse_kept_heads  # heavy: the mixers import torch

    s, k = recipe.student, recipe.student.keep_heads
    why = (
        "it keeps KV groups inside linear_attention layers"
        if s.mixer != "linear_attention"
        else "the probe scores the teacher's own layers"
        if s.depth is not None
        else "a stage's attention_ratio would convert layers later"
        if any(stage.attention_ratio is not None for stage in recipe.stages)
        else "image students keep no attention"
        if recipe.images is not None
        else ""
    )
    if why:
        raise ConfigError(
            f"student.keep_heads cannot be used here: {why}",
            "use student.mixer: linear_attention at the teacher's depth without stepwise stages, or drop student.keep_heads",
        )
    _check_ranges(
        "student.keep_heads",
        (
            ("kv_budget", k.kv_budget, 0.0 <= k.kv_budget <= 1.0, "a fraction in [0, 1], e.g. 0.05"),
            ("probe_examples", k.probe_examples, k.probe_examples >= 1, "at least 1"),
            (
                "probe_queries",
                k.probe_queries,
                1 <= k.probe_queries <= k.probe_pairs <= 40,
                "1 <= probe_queries <= probe_pairs <= 40",
            ),
        ),
    )
    parse_kept_heads(k.groups)


def _validate_init_from(recipe: Recipe) -> None:
    """student.init_from: a saved language student's folder, and no stage converting more layers."""
    s = recipe.student
    if recipe.images is not None:
        raise ConfigError(
            "student.init_from continues a language student; image recipes build theirs",
            "drop student.init_from",
        )
    if not (Path(s.init_from).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"student.init_from={s.init_from!r} is no student directory (no config.json there)",
            "point it at a run's student/ folder (written by attn2ssm distill)",
        )
    if any(stage.attention_ratio is not None for stage in recipe.stages):
        raise ConfigError(
            "student.init_from keeps the saved student's layers, and a stage sets attention_ratio (a conversion)",
            "drop the stages' attention_ratio, or start from the teacher",
        )


def _validate_keep_attention(s: StudentConfig) -> None:
    """student.keep_attention ('auto' or layer indices) and student.depth, alone and together."""
    if isinstance(s.keep_attention, str) and s.keep_attention != "auto":
        raise ConfigError(
            f"student.keep_attention={s.keep_attention!r} is not valid",
            "use a list of layer indices or 'auto'",
        )
    if s.depth is not None and s.depth < 1:
        raise ConfigError(
            f"student.depth={s.depth} is not a number of layers",
            "set student.depth to at least 1, or null for the teacher's depth",
        )
    if s.depth is not None and s.keep_attention == "auto":
        raise ConfigError(
            "student.keep_attention=auto scores the teacher's own layers and cannot choose for student.depth",
            "list the attention layers of the student, or leave student.depth unset",
        )
    if isinstance(s.keep_attention, list):
        bad = [
            i
            for i in s.keep_attention
            if not isinstance(i, int)
            or isinstance(i, bool)
            or i < 0
            or (s.depth is not None and i >= s.depth)
        ]
        if bad:
            within = f"0..{s.depth - 1} (student.depth {s.depth})" if s.depth is not None else "0 and up"
            raise ConfigError(
                f"student.keep_attention has entries {bad} that are not layer indices {within}",
                "list the layers that keep attention, e.g. student.keep_attention=[3, 7]",
            )


def _validate_attention_schedule(recipe: Recipe) -> None:
    """The stages' attention_ratio: a stepwise schedule only ever lowers it."""
    ratio = recipe.student.attention_ratio
    for i, stage in enumerate(recipe.stages):
        if stage.attention_ratio is None:
            continue
        if not 0.0 <= stage.attention_ratio <= ratio:
            raise ConfigError(
                f"stages[{i}] ({stage.name}): attention_ratio {stage.attention_ratio} would keep more attention than before ({ratio})",
                "a stepwise schedule only converts more layers: list decreasing ratios, e.g. student.attention_ratio=0.5 then 0.25",
            )
        ratio = stage.attention_ratio


def _validate_eval(recipe: Recipe) -> None:
    e = recipe.eval
    window = e.window or recipe.data.block_len
    _check_ranges(
        "eval",
        (
            ("max_tokens", e.max_tokens, e.max_tokens >= 2, "at least 2 held-out tokens, e.g. 20000"),
            (
                "window",
                e.window,
                e.window is None or e.window >= 2,
                "at least 2 tokens, or null for data.block_len",
            ),
            (
                "stride",
                e.stride,
                e.stride is None or 1 <= e.stride <= window,
                f"1..{window} (the window), or null for half the window",
            ),
            ("batch_size", e.batch_size, e.batch_size >= 1, "a positive number of windows, e.g. 4"),
        ),
    )


def validate_for_teacher(recipe: Recipe, config) -> None:
    """Checks that need the teacher's transformers ``config`` but none of its weights: the family is
    supported, blocks fit its positions, keep_attention indices are its (or student.depth's) layers,
    and one mixer builds (on the meta device) with the recipe's options at the teacher's shapes."""
    from attn2ssm.mixers.registry import build_mixer  # heavy: the mixers import transformers

    adapter = get_adapter(config)
    limit = getattr(config, "max_position_embeddings", None)
    check_block_len(recipe.data.block_len, limit)
    for i, stage in enumerate(recipe.stages):
        if stage.block_len is not None and limit is not None and stage.block_len > limit:
            raise ConfigError(
                f"stages[{i}] ({stage.name}): block_len {stage.block_len} exceeds the teacher's maximum of {limit} positions",
                f"set stages.{i}.block_len to at most {limit}, or null for data.block_len",
            )
    if limit is not None and (recipe.eval.window or 0) > limit:
        raise ConfigError(
            f"eval.window {recipe.eval.window} exceeds the teacher's maximum of {limit} positions",
            f"set eval.window to at most {limit}, or null for data.block_len",
        )
    s = recipe.student
    n = s.depth or config.num_hidden_layers
    bad = [i for i in s.keep_attention if i >= n] if isinstance(s.keep_attention, list) else []
    if bad:
        raise ConfigError(
            f"student.keep_attention has layer indices {bad} outside 0..{n - 1} (the student has {n} layers)",
            "list valid layer indices",
        )
    with torch.device("meta"):  # the options' values, checked by the mixer itself; nothing is allocated
        build_mixer(
            s.mixer,
            adapter.geometry(config, 0).to_dict(),
            0,
            resolve_norm_eps(s.mixer, dict(s.mixer_options), config),
        )


def _validate_data(d: DataConfig) -> None:
    if d.corpus is not None and d.sources:
        raise ConfigError(
            "data.corpus and data.sources are both set",
            "keep data.sources for a mixture and set data.corpus: null, or drop data.sources",
        )
    for name, value in (
        ("max_train_tokens", d.max_train_tokens),
        ("max_heldout_tokens", d.max_heldout_tokens),
    ):
        if value is not None and value < 0:
            raise ConfigError(
                f"data.{name}={value} is negative", f"set data.{name} to a token count, or null for no limit"
            )
    for i, s in enumerate(d.sources):
        where = f"data.sources[{i}]"
        if not isinstance(s.corpus, str) or not s.corpus.strip():
            raise ConfigError(
                f"{where} names no corpus",
                f"set {where}.corpus to a built-in name, a file, a directory, hf:<dataset> or generated:<n_tokens>",
            )
        if not (s.weight > 0 and math.isfinite(s.weight)):
            raise ConfigError(
                f"{where} ({s.corpus}): weight {s.weight} is not a positive number",
                "weights are relative shares, e.g. 0.5, 0.2, 0.3",
            )
        if s.max_tokens is not None and s.max_tokens < 1:
            raise ConfigError(
                f"{where} ({s.corpus}): max_tokens={s.max_tokens} is not positive",
                f"set {where}.max_tokens to a token count, or null",
            )
    if d.corpus is not None and is_mixture(d.corpus):
        expand_mixture(d.corpus)  # an unknown name fails here
    for spec in (s.corpus for s in d.source_list()):
        if is_generated(spec):
            parse_generated_spec(spec)  # a bad spec fails here, before the teacher loads
        elif is_chat(spec):
            parse_chat_spec(spec)


def _check_ranges(prefix: str, checks, where: str | None = None) -> None:
    """``checks``: (key, value, in range, what to write instead); a value out of range (or NaN / inf) is a ConfigError."""
    for key, value, ok, hint in checks:
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(
                f"{f'{where}: ' if where else f'{prefix}.'}{key}={value} is out of range",
                f"set {prefix}.{key} to {hint}",
            )


def _validate_stage_numbers(stage: StageConfig, i: int, where: str) -> None:
    """Optimizer, schedule and loss numbers that torch would refuse mid-run, or take and misbehave with."""
    _check_ranges(f"stages.{i}", _optim_checks(stage) + _stage_run_checks(stage), where)
    if stage.lora is not None:
        lo = stage.lora
        _check_ranges(
            f"stages.{i}",
            (
                ("lora.r", lo.r, lo.r >= 1, "a positive rank, e.g. 8"),
                ("lora.alpha", lo.alpha, lo.alpha > 0, "a positive number, e.g. 16"),
                ("lora.dropout", lo.dropout, 0 <= lo.dropout < 1, "a probability in [0, 1), e.g. 0"),
            ),
            where,
        )


def _optim_checks(stage: StageConfig) -> tuple:
    """``_check_ranges`` checks of the stage's optimizer and schedule numbers."""
    o, sc = stage.optim, stage.schedule
    return (
        (
            "optim.lr",
            o.lr,
            o.lr >= 0,
            "a positive learning rate, e.g. 1e-3 (0 leaves the weights as they are)",
        ),
        ("optim.beta1", o.beta1, 0 <= o.beta1 < 1, "a value in [0, 1), e.g. 0.9"),
        ("optim.beta2", o.beta2, 0 <= o.beta2 < 1, "a value in [0, 1), e.g. 0.95"),
        ("optim.eps", o.eps, o.eps > 0, "a small positive number, e.g. 1e-8"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, "0 or a positive number, e.g. 0.01"),
        (
            "schedule.warmup",
            sc.warmup,
            sc.warmup >= 0,
            "a fraction of the steps (< 1) or a number of steps, e.g. 0.05",
        ),
        (
            "schedule.decay",
            sc.decay,
            sc.decay >= 0,
            "a fraction of the steps (< 1) or a number of steps, e.g. 0.2",
        ),
        (
            "schedule.min_lr_ratio",
            sc.min_lr_ratio,
            0 <= sc.min_lr_ratio <= 1,
            "a fraction of the peak lr in [0, 1], e.g. 0.1",
        ),
    )


def _stage_run_checks(stage: StageConfig) -> tuple:
    """``_check_ranges`` checks of the stage's clipping, loss, memory, evaluation and checkpoint numbers."""
    return (
        ("clip", stage.clip, stage.clip >= 0, "a gradient-norm limit, or 0 for no clipping, e.g. 1.0"),
        ("temperature", stage.temperature, stage.temperature > 0, "a positive number, e.g. 1"),
        (
            "kl_chunk",
            stage.kl_chunk,
            stage.kl_chunk == "auto" or (type(stage.kl_chunk) is int and stage.kl_chunk >= 1),
            "auto (by device) or a positive number of tokens, e.g. 64",
        ),
        (
            "gradient_checkpointing",
            stage.gradient_checkpointing,
            isinstance(stage.gradient_checkpointing, bool),
            "true or false",
        ),
        (
            "eval_every",
            stage.eval_every,
            stage.eval_every >= 0,
            "a number of steps, or 0 to evaluate at the stage end only",
        ),
        (
            "eval_batches",
            stage.eval_batches,
            stage.eval_batches >= 1,
            "a positive number of batches, e.g. 4",
        ),
        (
            "save_every",
            stage.save_every,
            stage.save_every >= 0,
            "a number of steps, or 0 to save at the stage end only",
        ),
        (
            "keep_checkpoints",
            stage.keep_checkpoints,
            stage.keep_checkpoints >= 1,
            "a positive number of checkpoints, e.g. 2",
        ),
    )


def _validate_stage_data(stage: StageConfig, kind, i: int, where: str) -> None:
    d = stage.data
    if kind.data_formats is None:
        if d is not None:
            raise ConfigError(
                f"{where}: kind '{stage.kind}' trains on the recipe's corpus blocks and takes no 'data'",
                f"remove stages.{i}.data, or use kind sft / dpo for a chat or preference dataset",
            )
        return
    if d is None or not d.source:
        raise ConfigError(
            f"{where}: kind '{stage.kind}' needs a dataset but the stage has no data.source",
            f"set stages.{i}.data.source to a .jsonl/.json/.parquet file or hf:<dataset>[:<config>][:<split>]",
        )
    if d.format not in kind.data_formats:
        hint = (
            f"unknown data format '{d.format}'"
            if d.format not in DATA_FORMATS
            else f"data format '{d.format}' does not fit kind '{stage.kind}'"
        )
        raise ConfigError(
            f"{where}: {hint}", f"set stages.{i}.data.format to one of: {', '.join(kind.data_formats)}"
        )
    if d.max_len < 2:
        raise ConfigError(
            f"{where}: data.max_len must be at least 2, got {d.max_len}",
            f"set stages.{i}.data.max_len to e.g. 512",
        )
    if d.max_examples is not None and d.max_examples < 1:
        raise ConfigError(
            f"{where}: data.max_examples must be positive, got {d.max_examples}",
            f"set stages.{i}.data.max_examples=null to use every record",
        )


def _validate_logit_cache(stage: StageConfig, kind, i: int, where: str) -> None:
    c = stage.logit_cache
    if not kind.caches_teacher_logits or (stage.kind == "sft" and not kind.options(stage)["kl_weight"]):
        raise ConfigError(
            f"{where}: kind '{stage.kind}' uses no teacher logits, so logit_cache has nothing to cache",
            f"remove stages.{i}.logit_cache (it applies to kd, kd_ce, and sft with losses.kl_weight > 0)",
        )
    if isinstance(c.top_k, bool) or c.top_k < 1:
        raise ConfigError(
            f"{where}: logit_cache.top_k={c.top_k!r} is not a positive number of tokens",
            f"set stages.{i}.logit_cache.top_k to e.g. 64",
        )
    if stage.temperature != 1.0:
        raise ConfigError(
            f"{where}: logit_cache stores the teacher at temperature 1, but temperature is {stage.temperature}",
            f"set stages.{i}.temperature: 1, or remove stages.{i}.logit_cache",
        )


def _validate_layer_setting(setting: str, stage: StageConfig, kind, i: int, where: str) -> None:
    """gradient_checkpointing and compile_layers act on the decoder layers the student's forward runs."""
    from attn2ssm.distill.stages.base import TeacherForcedStage  # heavy: as in validate

    if not kind.through_model_forward or kind.image_task:
        if isinstance(kind, TeacherForcedStage):
            why = "is layer-local: each mixer runs alone on its layer's input, outside the decoder layers (one layer's activations held)"
        elif kind.image_task:
            why = "trains an image student, whose layers this does not cover"
        else:
            why = "runs the student's forward under its own hooks (its bridges live outside the model)"
        raise ConfigError(
            f"{where}: {setting} applies to stages through the student's forward, and kind '{stage.kind}' {why}",
            f"remove stages.{i}.{setting} (it applies to ce, kd, kd_ce, sft and dpo)",
        )

"""Where a run's teacher outputs come from: the frozen teacher's weights, or — for a resume whose
remaining stages all read complete teacher-logit caches — the caches alone, with only the teacher's
tokenizer and config loaded (a teacherless run); and each stage's logit cache."""

from __future__ import annotations

import attn2ssm.teachers as teachers  # called through the module: tests replace its load_teacher
from attn2ssm.data import block_indices
from attn2ssm.data.specs import needs_teacher
from attn2ssm.distill.logit_cache import CacheStats, LogitCache, find_cache_dir, teacher_source_key
from attn2ssm.distill.stage_setup import stage_steps
from attn2ssm.errors import ConfigError
from attn2ssm.teachers.vision import load_vision_teacher


def load_teacher_weights(recipe, dtype, device, progress: bool):
    """``(teacher, tokenizer or image processor, info)``: the frozen teacher of ``recipe`` on ``device``."""
    if recipe.images is not None:  # an image classifier and its image processor
        teacher, tokenizer, info = load_vision_teacher(recipe.teacher, progress=progress)
        teacher.to(dtype=dtype)
    else:
        teacher, tokenizer, source = teachers.load_teacher(recipe.teacher, check_supported=True, dtype=dtype)
        info = {"source": source.describe()}
    teacher.to(device).eval().requires_grad_(False)
    return teacher, tokenizer, info


def load_teacher_files(recipe):
    """``(config, tokenizer, info)`` of ``recipe``'s teacher, without its weights (a teacherless run)."""
    source = teachers.resolve_teacher(recipe.teacher)
    gguf = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    from transformers import AutoConfig, AutoTokenizer  # heavy: transformers

    with teachers.quiet_loading():
        config = AutoConfig.from_pretrained(source.location, **gguf)
        tokenizer = AutoTokenizer.from_pretrained(source.location, **gguf)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return config, tokenizer, {"source": source.describe()}


def remaining_stages(recipe, state) -> list[int]:
    """The indices of the stages still to run from ``state`` (a switched-off stage is not)."""
    stages = recipe.stages
    return [
        i
        for i in range(state.stage, len(stages))
        if i not in state.finished and not (stages[i].tokens == 0 and stages[i].epochs is None)
    ]


def plan_teacherless(recipe, remaining: list[int], teacher_dtype, mode: str) -> dict | None:
    """``{(top_k, dir): (cache folder, fingerprint)}`` when a resumed run can go without the teacher's
    weights, else None: every stage still to run is kd / kd_ce with a logit_cache and no
    attention_ratio (no layer to convert), no data source samples the teacher, and each of those
    caches records this teacher spec's files (same files, dtype and mode:
    ``logit_cache.teacher_source_key``). Whether the caches hold every block is checked once the data
    is loaded (``missing_blocks``)."""
    if recipe.images is not None or any(needs_teacher(src.corpus) for src in recipe.data.source_list()):
        return None
    stages = [recipe.stages[i] for i in remaining]
    if not stages or any(
        c.kind not in ("kd", "kd_ce") or c.logit_cache is None or c.attention_ratio is not None
        for c in stages
    ):
        return None
    key = teacher_source_key(recipe.teacher, teacher_dtype, mode)
    if key is None:  # a hub id: its files are not on this disk to compare
        return None
    found = {}
    for c in stages:
        hit = find_cache_dir(c.logit_cache.dir, c.logit_cache.top_k, key)
        if hit is None:
            return None
        found[(c.logit_cache.top_k, c.logit_cache.dir)] = hit
    return found


def missing_blocks(recipe, state, cached: dict, stage_blocks, block_len, mode: str) -> tuple[int, int]:
    """``(missing, total)``: of the blocks the remaining steps of a teacherless run draw, how many
    its caches lack. ``stage_blocks(i)`` gives stage i's (training, held-out) blocks, ``block_len(cfg)``
    its block length."""
    need: dict[tuple, set[int]] = {}
    blocks_of = {}
    for i in remaining_stages(recipe, state):
        cfg = recipe.stages[i]
        blocks, _ = stage_blocks(i)
        steps = stage_steps(cfg, len(blocks), block_len(cfg))
        # every process's blocks of steps first..steps-1, in one draw
        first = state.step if i == state.stage else 0
        drawn = block_indices(
            len(blocks), recipe.seed + 1000 * i, first * cfg.batch_size, (steps - first) * cfg.batch_size
        )
        need.setdefault((cfg.logit_cache.top_k, cfg.logit_cache.dir), set()).update(
            (block_len(cfg), b) for b in drawn.tolist()
        )
        blocks_of[block_len(cfg)] = blocks
    missing = 0
    for key, wanted in need.items():
        folder, fingerprint = cached[key]
        cache = LogitCache(None, key[0], mode, key[1], fingerprint=fingerprint)
        missing += sum(not cache.has(blocks_of[n][b]) for n, b in sorted(wanted))
    return missing, sum(len(b) for b in need.values())


def teacherless_notice(cached: dict, missing: int, total: int, teacher: str) -> str:
    folders = ", ".join(str(f) for f, _ in cached.values())
    if missing:
        return f"teacher-logit cache {folders} lacks {missing} of the {total} blocks the remaining steps draw: loading the teacher"
    return (
        f"teacher weights not loaded: every remaining stage reads the teacher's top-k from {folders} "
        f"(all {total} blocks there); tokenizer and config from {teacher}"
    )


def stage_logit_cache(
    cfg, vocab: int, caches: dict, teacher, mode: str, cached: dict | None, source: dict | None
):
    """The stage's teacher-logit cache (None without a ``logit_cache`` option), keyed by the teacher
    and the run's compute ``mode``, shared in ``caches`` by the run's stages (one fingerprint per
    run: the teacher is frozen). Without the ``teacher``: the cache its spec filled (``cached``), by
    its fingerprint. ``source``: what the caches the teacher fills record of its spec."""
    if cfg.logit_cache is None:
        return None
    if cfg.logit_cache.top_k > vocab:
        raise ConfigError(
            f"stage '{cfg.name}': logit_cache.top_k={cfg.logit_cache.top_k} exceeds the teacher's vocabulary ({vocab})",
            f"set logit_cache.top_k to at most {vocab} (e.g. 64)",
        )
    key = (cfg.logit_cache.top_k, cfg.logit_cache.dir)
    if key not in caches:
        top_k, folder, chunk = cfg.logit_cache.top_k, cfg.logit_cache.dir, cfg.kl_chunk
        if teacher is None:
            caches[key] = LogitCache(None, top_k, mode, folder, chunk_size=chunk, fingerprint=cached[key][1])
        else:
            caches[key] = LogitCache(teacher, top_k, mode, folder, chunk_size=chunk, source=source)
    cache = caches[key]
    cache.stats = CacheStats()  # counted per stage
    return cache

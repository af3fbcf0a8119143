"""What a run trains on: the recipe's sources as training and held-out blocks (at ``data.block_len``,
and at each LM stage's own ``block_len``), and the datasets of the stages that bring their own data
(``sft``, ``dpo``), tokenized once when loaded. One process tokenizes (or samples the teacher), the
others read its cache."""

from __future__ import annotations

import math

from attn2ssm.data import check_block_len, load_preference_dataset, load_sft_dataset, load_training_data
from attn2ssm.data.teacher_samples import build_teacher_sft_data, is_teacher_source
from attn2ssm.errors import ConfigError


def block_len(cfg, recipe) -> int:
    """The block length an LM stage trains on: its own ``block_len``, else ``data.block_len``."""
    return cfg.block_len or recipe.data.block_len


def load_blocks(recipe, length: int, tokenizer, teacher, teacher_config, acc, progress: bool):
    """The recipe's sources as training and held-out blocks of ``length`` tokens (``load_training_data``'s
    result), sized for the LM stages that train at that length (tokenized text and teacher samples
    come from the caches). ``progress``: this process shows bars and says what it loaded."""
    d = recipe.data
    check_block_len(length, getattr(teacher_config, "max_position_embeddings", None))
    # The most blocks one LM stage at this length draws: a mixture's size, and how far a hub source
    # streams (None: epochs budgets only).
    budget = max(
        (
            math.ceil(s.tokens / (s.batch_size * length)) * s.batch_size
            for s in recipe.stages
            if s.data is None and s.epochs is None and block_len(s, recipe) == length
        ),
        default=None,
    )
    with acc.main_process_first():
        data = load_training_data(
            d.source_list(),
            tokenizer,
            length,
            seed=recipe.seed,
            max_train_tokens=d.max_train_tokens,
            max_heldout_tokens=d.max_heldout_tokens,
            text_field=d.text_field,
            budget_blocks=budget or None,
            teacher=teacher,
            progress=progress,
            compact=True,
        )
    if acc.is_main_process and len(data.sources) > 1:
        print(data.describe())
    return data


def stage_dataset(recipe, stage_idx: int, cfg, kind, teacher, tokenizer, acc, progress: bool):
    """The stage's own dataset, tokenized once (per process: deterministic, and small next to training)."""
    d = cfg.data
    check_block_len(d.max_len, getattr(teacher.config, "max_position_embeddings", None))
    load = load_preference_dataset if "preference" in kind.data_formats else load_sft_dataset
    source = d.source
    if is_teacher_source(source):  # the teacher's own replies to corpus-derived prompts, sampled once
        if load is load_preference_dataset:
            raise ConfigError(
                f"stage '{cfg.name}': a teacher: source gives chat data, not preference pairs",
                "use it in an sft stage, and a preference dataset for dpo",
            )
        with acc.main_process_first():
            source = str(
                build_teacher_sft_data(source, teacher, tokenizer, seed=recipe.seed, progress=progress)
            )
    dataset = load(
        source, tokenizer, format=d.format, max_len=d.max_len, max_examples=d.max_examples, stage=cfg.name
    )
    if acc.is_main_process:
        m = dataset.meta
        dropped = (
            f" ({m['dropped']} dropped: no reply token within max_len={d.max_len})" if m["dropped"] else ""
        )
        print(
            f"[stage {stage_idx + 1}] {cfg.name}: {m['examples']} {m['format']} examples from {m['source']}{dropped}"
        )
    return dataset

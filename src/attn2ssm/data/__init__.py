"""Corpora for distillation (load documents, split them, tokenize and pack them into blocks; mix
several sources, stream hub datasets, sample text from the teacher, write and read token shards) and
the chat / preference datasets of ``sft`` and ``dpo`` stages (:mod:`.chat`).

The names below load on first use, so that importing a light module of the package (``.specs``:
parsing a corpus spec, as the command line does before anything heavy loads) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BUILTIN_CORPORA": (".builtin", "PACKAGES"),
    "ChatDataset": (".chat", "ChatDataset"),
    "PreferenceDataset": (".chat", "PreferenceDataset"),
    "encode_conversation": (".chat", "encode_conversation"),
    "load_preference_dataset": (".chat", "load_preference_dataset"),
    "load_sft_dataset": (".chat", "load_sft_dataset"),
    "TokenBlocks": (".mixture", "TokenBlocks"),
    "TrainingData": (".mixture", "TrainingData"),
    "load_training_data": (".mixture", "load_training_data"),
    "TokenizedCorpus": (".tokenize", "TokenizedCorpus"),
    "block_indices": (".packing", "block_indices"),
    "block_order": (".packing", "block_order"),
    "check_block_len": (".packing", "check_block_len"),
    "load_tokenized": (".packing", "load_tokenized"),
    "pack_blocks": (".packing", "pack_blocks"),
    "prepare_corpus": (".packing", "prepare_corpus"),
    "tokenizer_fingerprint": (".tokenize", "tokenizer_fingerprint"),
    "read_shards": (".shards", "read_shards"),
    "write_corpus_shards": (".shard_writer", "write_corpus_shards"),
    "Document": (".document", "Document"),
    "is_generated": (".specs", "is_generated"),
    "iter_hf_documents": (".sources", "iter_hf_documents"),
    "load_documents": (".sources", "load_documents"),
    "split_documents": (".splits", "split_documents"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

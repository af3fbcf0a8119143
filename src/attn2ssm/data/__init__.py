"""Corpora for distillation (load documents, split them, tokenize and pack them into blocks) and the
chat / preference datasets of ``sft`` and ``dpo`` stages (:mod:`.chat`)."""

from .builtin import PACKAGES as BUILTIN_CORPORA
from .chat import (
    ChatDataset,
    PreferenceDataset,
    encode_conversation,
    load_preference_dataset,
    load_sft_dataset,
)
from .packing import (
    TokenizedCorpus,
    block_indices,
    block_order,
    check_block_len,
    load_tokenized,
    pack_blocks,
    prepare_corpus,
    tokenizer_fingerprint,
)
from .sources import Document, load_documents
from .splits import split_documents

__all__ = [
    "BUILTIN_CORPORA",
    "ChatDataset",
    "Document",
    "PreferenceDataset",
    "TokenizedCorpus",
    "block_indices",
    "block_order",
    "check_block_len",
    "encode_conversation",
    "load_documents",
    "load_preference_dataset",
    "load_sft_dataset",
    "load_tokenized",
    "pack_blocks",
    "prepare_corpus",
    "split_documents",
    "tokenizer_fingerprint",
]

"""Corpora for distillation (load documents, split them, tokenize and pack them into blocks; mix
several sources, stream hub datasets, sample text from the teacher) and the chat / preference
datasets of ``sft`` and ``dpo`` stages (:mod:`.chat`)."""

from .builtin import PACKAGES as BUILTIN_CORPORA
from .chat import (
    ChatDataset,
    PreferenceDataset,
    encode_conversation,
    load_preference_dataset,
    load_sft_dataset,
)
from .mixture import TrainingData, load_training_data
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
from .sources import Document, is_generated, iter_hf_documents, load_documents
from .splits import split_documents

__all__ = [
    "BUILTIN_CORPORA",
    "ChatDataset",
    "Document",
    "PreferenceDataset",
    "TokenizedCorpus",
    "TrainingData",
    "block_indices",
    "block_order",
    "check_block_len",
    "encode_conversation",
    "is_generated",
    "iter_hf_documents",
    "load_documents",
    "load_preference_dataset",
    "load_sft_dataset",
    "load_tokenized",
    "load_training_data",
    "pack_blocks",
    "prepare_corpus",
    "split_documents",
    "tokenizer_fingerprint",
]

"""Corpora for distillation: load documents, split them, tokenize and pack them into blocks."""

from .builtin import PACKAGES as BUILTIN_CORPORA
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
    "Document",
    "TokenizedCorpus",
    "block_indices",
    "block_order",
    "check_block_len",
    "load_documents",
    "load_tokenized",
    "pack_blocks",
    "prepare_corpus",
    "split_documents",
    "tokenizer_fingerprint",
]

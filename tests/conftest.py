"""Shared test setup: ``tests/`` on sys.path (for ``tiny_models``), fp32, a private cache, and a tiny
teacher directory + corpus for end-to-end distill and bench tests (real loading code paths)."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tokenizer, tiny_config, tiny_overrides, write_corpus  # noqa: E402  (tests/ on sys.path first)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_default_dtype(torch.float32)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Unless the caller set one, tests share a throwaway ATTN2SSM_CACHE (never the user's)."""
    if "ATTN2SSM_TEST_CACHE" in os.environ:
        os.environ["ATTN2SSM_CACHE"] = os.environ["ATTN2SSM_TEST_CACHE"]
    else:
        os.environ["ATTN2SSM_CACHE"] = str(tmp_path_factory.mktemp("attn2ssm-cache"))
    yield


@pytest.fixture
def one_thread():
    """One torch thread for the test, restored after (tiny models gain nothing from threads, and on
    a busy 2-core machine their spin-waiting makes sampling many times slower). Modules that want it
    for every test say ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------ a tiny teacher directory and corpus (distill and bench tests)
@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory):
    """(teacher_dir, corpus_dir): a 2-layer Llama with GQA and its byte-level BPE tokenizer."""
    from transformers import AutoModelForCausalLM  # after HF_HUB_OFFLINE is set above

    root = tmp_path_factory.mktemp("tiny-setup")
    tok = make_tokenizer(300)
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    cfg.max_position_embeddings = 128
    cfg.eos_token_id = tok.eos_token_id
    teacher = AutoModelForCausalLM.from_config(cfg)
    teacher.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    return root / "teacher", write_corpus(root / "corpus")


@pytest.fixture(scope="session")
def run_overrides(tiny_setup):
    """A function: extra key → value overrides in, the full --set list for the tiny run out."""
    teacher_dir, corpus_dir = tiny_setup
    return lambda **extra: tiny_overrides(teacher_dir, corpus_dir, **extra)

"""Shared test setup: ``tests/`` on sys.path (for ``tiny_models``), fp32 and a private cache."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
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

"""Fixtures for the data-layer tests: a tiny offline tokenizer and an isolated cache."""

import pytest

from tiny_models import make_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer(300)


@pytest.fixture(scope="session")
def other_tokenizer():
    return make_tokenizer(280)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own ATTN2SSM_CACHE so nothing touches the user's cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("ATTN2SSM_CACHE", str(path))
    return path

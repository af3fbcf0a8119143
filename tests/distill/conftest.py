"""Chat and preference data for the sft / dpo stage tests (the tiny teacher and corpus fixtures
``tiny_setup`` / ``run_overrides`` are in tests/conftest.py)."""

import pytest
from chat_data import CHAT_TEMPLATE, write_chat_data

from tiny_models import make_tokenizer, tiny_overrides

# --------------------------------------------------------------------------- chat / preference data


@pytest.fixture
def chat_tokenizer():
    """The tiny tokenizer with CHAT_TEMPLATE (a fresh one per test: tests may drop the template)."""
    tok = make_tokenizer(300)
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def chat_setup(tiny_setup, tmp_path_factory):
    """(teacher_dir, corpus_dir, data files by format): the tiny teacher, its tokenizer with a chat template."""
    import shutil

    from transformers import AutoTokenizer

    teacher_dir, corpus_dir = tiny_setup
    root = tmp_path_factory.mktemp("chat-setup")
    chat_teacher = root / "teacher"
    shutil.copytree(teacher_dir, chat_teacher)
    tok = AutoTokenizer.from_pretrained(chat_teacher)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(chat_teacher)
    return chat_teacher, corpus_dir, write_chat_data(root / "data")


@pytest.fixture(scope="session")
def chat_overrides(chat_setup):
    """A function: stages (a YAML list string) and extra overrides in, the --set list out."""
    teacher_dir, corpus_dir, _ = chat_setup

    def make(stages, **extra):
        return tiny_overrides(teacher_dir, corpus_dir, stages=stages, **extra)

    return make

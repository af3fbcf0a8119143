"""A tiny teacher directory and corpus for end-to-end trainer tests (real loading code paths)."""

import random

import pytest
from chat_data import CHAT_TEMPLATE, write_chat_data
from tiny_models import make_tokenizer, tiny_config
from transformers import AutoModelForCausalLM

WORDS = (
    "the union state people congress nation government year war peace law work children future "
    "america world economy freedom trade tax health security jobs energy history hope country we our"
).split()


def write_corpus(root, n_docs=24, words_per_doc=400, seed=0):
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words_per_doc))
        (root / f"doc{i:02d}.txt").write_text(text.capitalize() + ".\n")
    return root


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory):
    """(teacher_dir, corpus_dir): a 2-layer Llama with GQA and its byte-level BPE tokenizer."""
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


def tiny_overrides(teacher_dir, corpus_dir, **extra):
    """--set strings for a fast two-stage run on the tiny setup."""
    sets = {
        "teacher": str(teacher_dir),
        "data.corpus": str(corpus_dir),
        "data.block_len": 32,
        "data.max_heldout_tokens": 2000,
        "eval.max_tokens": 512,
        "stages": "[{name: kd, kind: kd, tokens: 1536, batch_size: 4, save_every: 3, eval_every: 4, optim: {lr: 0.01}},"
        " {name: ce, kind: ce, tokens: 768, batch_size: 4, grad_accum: 2, trainable: [all], save_every: 3, optim: {lr: 0.001},"
        " schedule: {kind: wsd}},"
        " {name: lora, kind: ce, tokens: 384, batch_size: 4, trainable: [lora], lora: {r: 4, alpha: 8}, save_every: 1, optim: {lr: 0.01}}]",
    }
    sets.update(extra)
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.fixture(scope="session")
def run_overrides(tiny_setup):
    """A function: extra key → value overrides in, the full --set list for the tiny run out."""
    teacher_dir, corpus_dir = tiny_setup
    return lambda **extra: tiny_overrides(teacher_dir, corpus_dir, **extra)


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

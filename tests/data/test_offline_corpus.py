"""A corpus carried to a machine with no network: written here as token shards, read there in a fresh
process with the same tokenizer into the same blocks, alone or mixed by weight with other shard
folders or teacher-generated text; and the compact form of the training blocks (uint16 ids, a
mixture as an index) holding exactly the blocks of the default int64 form."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.data import load_training_data
from attn2ssm.data.mixture import TokenBlocks
from attn2ssm.data.shard_writer import write_corpus_shards
from attn2ssm.data.teacher_samples import generate_corpus
from tiny_models import tiny_config

TESTS = Path(__file__).resolve().parents[1]


def source(corpus, weight=1.0, max_tokens=None):
    return SimpleNamespace(corpus=corpus, weight=weight, max_tokens=max_tokens)


def text_corpus(root, letter, n_docs, words=60, seed=0):
    import random

    rng = random.Random(seed)
    vocab = {"a": ["apple", "anchor", "amber", "arrow"], "b": ["berry", "bishop", "bronze", "bridge"]}[letter]
    root.mkdir(parents=True)
    for i in range(n_docs):
        (root / f"{letter}{i:03d}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(words)))
    return str(root)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher():
    config = tiny_config("llama")
    config.vocab_size = 300
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def folders(tmp_path, tokenizer):
    """Two shard folders written from two text corpora (a: 40 documents, b: 12)."""
    a = write_corpus_shards(
        text_corpus(tmp_path / "a", "a", 40), tmp_path / "shards-a", tokenizer, progress=False
    )
    b = write_corpus_shards(
        text_corpus(tmp_path / "b", "b", 12), tmp_path / "shards-b", tokenizer, progress=False
    )
    assert a["sides"]["heldout"] and b["sides"]["heldout"]
    return f"shards:{tmp_path / 'shards-a'}", f"shards:{tmp_path / 'shards-b'}"


READ_THERE = """
import hashlib, json, sys
from types import SimpleNamespace
from transformers import AutoTokenizer
from attn2ssm.data import load_training_data
tok = AutoTokenizer.from_pretrained(sys.argv[1])
data = load_training_data([SimpleNamespace(corpus=sys.argv[2], weight=1.0, max_tokens=None)], tok, 32, progress=False)
print(json.dumps({"blocks": hashlib.sha256(data.blocks.numpy().tobytes()).hexdigest(), "shape": list(data.blocks.shape),
                  "eval": hashlib.sha256(data.eval_blocks.numpy().tobytes()).hexdigest()}))
"""


def test_a_folder_read_in_a_fresh_process_gives_the_same_blocks(folders, tokenizer, tmp_path):
    import hashlib

    # what the other machine has: the teacher's tokenizer, no text
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    here = load_training_data([source(folders[0])], tokenizer, 32, progress=False)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]),
        "ATTN2SSM_CACHE": str(tmp_path / "empty-cache"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    r = subprocess.run(
        [sys.executable, "-c", READ_THERE, str(tmp_path / "tokenizer"), folders[0]],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    there = json.loads(r.stdout.splitlines()[-1])
    assert there["shape"] == list(here.blocks.shape) and here.blocks.shape[0] > 10
    assert there["blocks"] == hashlib.sha256(here.blocks.numpy().tobytes()).hexdigest()
    assert there["eval"] == hashlib.sha256(here.eval_blocks.numpy().tobytes()).hexdigest()
    assert not (tmp_path / "empty-cache" / "tokenized").exists()  # nothing tokenized there


def test_two_shard_folders_mixed_by_weight(folders, tokenizer):
    a, b = folders
    data = load_training_data(
        [source(a, 0.7), source(b, 0.3)], tokenizer, 16, budget_blocks=100, progress=False
    )
    assert torch.bincount(data.source_of).tolist() == [70, 30]
    only_b = load_training_data([source(b)], tokenizer, 16, progress=False).blocks
    rows_b = {tuple(r) for r in only_b.tolist()}
    # b's blocks, repeated as its weight asks
    assert {tuple(r) for r in data.blocks[data.source_of == 1].tolist()} <= rows_b
    assert not {tuple(r) for r in data.blocks[data.source_of == 0].tolist()} & rows_b


def test_generated_text_mixed_with_a_shard_folder(folders, teacher, tokenizer):
    spec = "generated:800?length=32&batch=8"
    mix = [source(folders[0], 0.5), source(spec, 0.5)]
    data = load_training_data(
        mix, tokenizer, 16, budget_blocks=60, max_heldout_tokens=160, teacher=teacher, progress=False
    )
    assert torch.bincount(data.source_of).tolist() == [30, 30]
    gen = generate_corpus(spec, teacher, tokenizer, progress=False)
    gen_rows = {tuple(r) for r in gen.train_ids[: gen.train_ids.numel() // 16 * 16].view(-1, 16).tolist()}
    assert {tuple(r) for r in data.blocks[data.source_of == 1].tolist()} <= gen_rows


@pytest.mark.parametrize("budget", [None, 90])
def test_compact_blocks_are_the_default_blocks(folders, teacher, tokenizer, tmp_path, budget):
    mix = [
        source(folders[0], 0.5),
        source(text_corpus(tmp_path / "b-text", "b", 12), 0.2),
        source("generated:600?length=24&batch=8", 0.3),
    ]
    for sources in (mix[:1], mix):
        kw = dict(budget_blocks=budget, max_heldout_tokens=128, teacher=teacher, progress=False)
        default = load_training_data(sources, tokenizer, 16, **kw)
        compact = load_training_data(sources, tokenizer, 16, compact=True, **kw)
        assert isinstance(compact.blocks, TokenBlocks) and compact.blocks.shape == default.blocks.shape
        assert torch.equal(compact.blocks.tensor(), default.blocks) and torch.equal(
            compact.eval_blocks.tensor(), default.eval_blocks
        )
        assert torch.equal(compact.source_of, default.source_of) and torch.equal(
            compact.corpus.heldout_ids, default.corpus.heldout_ids
        )
        unstamped = lambda infos: [{k: v for k, v in i.items() if k != "from_cache"} for i in infos]  # noqa: E731 (the second call reads caches)
        assert compact.corpus.train_ids.numel() == 0 and unstamped(compact.sources) == unstamped(
            default.sources
        )
        assert all(p.dtype == torch.uint16 for p in compact.blocks.parts)
        # (source, row) per block: 1/block_len of that per token
        index = 0 if len(sources) == 1 else 16 * len(default.blocks)
        # 2 bytes a source token, not 8 a drawn one
        assert compact.blocks.nbytes == 2 * sum(p.numel() for p in compact.blocks.parts) + index
        order = torch.randperm(len(default.blocks), generator=torch.Generator().manual_seed(0))[:9]
        # how the trainer and tests index them
        for idx in (
            3,
            slice(2, 7),
            order,
            default.source_of == 0,
            [4, 1, 4],
        ):
            got = compact.blocks[idx]
            assert got.dtype == torch.long and torch.equal(got, default.blocks[idx])
        assert torch.equal(compact.eval_blocks[0:4], default.eval_blocks[0:4]) and len(
            compact.eval_blocks
        ) == len(default.eval_blocks)
        assert compact.describe().splitlines()[0] == default.describe().splitlines()[0]

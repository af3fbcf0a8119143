"""Token shards: written streaming, read back as the corpus they hold, refused when damaged or
made with another tokenizer, and usable as a training source (``shards:DIR``)."""

import json

import numpy as np
import pytest
import torch
from tiny_models import make_tokenizer

from attn2ssm.data.packing import TokenizedCorpus, tokenizer_fingerprint
from attn2ssm.data.shards import ShardWriter, id_dtype, read_manifest, read_shards, write_shards
from attn2ssm.errors import DataError


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(300)


def _corpus(tok, n_train=1000, n_held=150, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return TokenizedCorpus(torch.randint(0, len(tok), (n_train,), generator=gen), torch.randint(0, len(tok), (n_held,), generator=gen),
                           tokenizer_fingerprint(tok), {"spec": "test"})


def test_round_trip_over_several_files(tok, tmp_path):
    corpus = _corpus(tok)
    write_shards(tmp_path / "s", corpus, tok, source="test", shard_tokens=128)
    manifest = read_manifest(tmp_path / "s")
    assert [f["tokens"] for f in manifest["sides"]["train"]] == [128] * 7 + [1000 - 7 * 128]
    assert manifest["dtype"] == "uint16" and manifest["eos_token_id"] == tok.eos_token_id
    back = read_shards(tmp_path / "s", tok, verify=True)
    assert torch.equal(back.train_ids, corpus.train_ids) and torch.equal(back.heldout_ids, corpus.heldout_ids)
    assert back.train_ids.dtype == torch.long and back.meta["spec"] == f"shards:{tmp_path / 's'}"
    assert (tmp_path / "s" / "train-00000.bin").stat().st_size == 128 * 2  # 16 bits a token
    limited = read_shards(f"shards:{tmp_path / 's'}", tok, max_train_tokens=300, max_heldout_tokens=0)
    assert torch.equal(limited.train_ids, corpus.train_ids[:300]) and limited.heldout_ids.numel() == 0


def test_streaming_writes_and_a_failure_leaves_nothing(tok, tmp_path):
    with ShardWriter(tmp_path / "s", tok, source="stream", shard_tokens=100) as w:
        for i in range(5):
            w.add("train", [i] * 37)
        w.add("heldout", torch.tensor([7, 8, 9]))
        assert w.tokens("train") == 185
    assert read_shards(tmp_path / "s", tok).train_ids.tolist() == sum(([i] * 37 for i in range(5)), [])
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "t", tok, source="x") as w:
            w.add("train", [1, 2, 3])
            raise RuntimeError("killed")
    assert not (tmp_path / "t").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".t.")]


def test_refusals(tok, tmp_path):
    write_shards(tmp_path / "s", _corpus(tok), tok, source="test", shard_tokens=256)
    with pytest.raises(DataError, match="already holds token shards"):
        ShardWriter(tmp_path / "s", tok, source="again")
    with pytest.raises(DataError, match="another tokenizer"):
        read_shards(tmp_path / "s", make_tokenizer(280))
    with pytest.raises(DataError, match="holds no token shards"):
        read_shards(tmp_path / "nothing", tok)
    with open(tmp_path / "s" / "train-00001.bin", "r+b") as fh:  # same size, other bytes
        fh.write(b"\xff\xff")
    read_shards(tmp_path / "s", tok)  # sizes match: read without hashing
    with pytest.raises(DataError, match="SHA-256"):
        read_shards(tmp_path / "s", tok, verify=True)
    (tmp_path / "s" / "train-00002.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match="copy the shard folder again"):
        read_shards(tmp_path / "s", tok)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(DataError, match="format 99"):
        read_shards(tmp_path / "s", tok)


def test_wide_vocabularies_use_32_bits():
    assert id_dtype(65536) == np.dtype("<u2") and id_dtype(65537) == np.dtype("<u4")


def test_a_shard_folder_is_a_training_source(tok, tmp_path):
    from types import SimpleNamespace

    from attn2ssm.data import load_training_data

    corpus = _corpus(tok, n_train=2000, n_held=400)
    write_shards(tmp_path / "s", corpus, tok, source="test")
    source = SimpleNamespace(corpus=f"shards:{tmp_path / 's'}", weight=1.0, max_tokens=None)
    data = load_training_data([source], tok, 64, max_heldout_tokens=128, progress=False)
    assert torch.equal(data.blocks, corpus.train_ids[:1984].view(-1, 64))
    assert torch.equal(data.corpus.heldout_ids, corpus.heldout_ids[:128])
    mixed = load_training_data([source, SimpleNamespace(corpus=f"shards:{tmp_path / 's'}", weight=3.0, max_tokens=640)], tok, 64, progress=False)
    assert mixed.source_of.bincount().tolist() == [10, 31]  # 1 : 3 of the 31 + 10 blocks the two parts hold

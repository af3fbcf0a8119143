"""General-domain training text: key-value recall passages (``recall:``), the teacher's chat answers
as a corpus (``chat:``) and the built-in mixtures (``mix:general``, ``mix:corpora``) the recipes
train on — each against a hand-checked case; no training item is an evaluation item, no held-out or
evaluation text enters training; bad specs are one-line errors."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.data import load_documents, load_training_data, recall, split_documents
from attn2ssm.data.sources import corpus_stamp
from attn2ssm.data.specs import MIXTURES, check_spec, expand_mixture, parse_chat_spec
from attn2ssm.distill.recipe import (
    SourceConfig,
    builtin_recipes,
    load_recipe,
    recipe_from_dict,
)
from attn2ssm.errors import Attn2SSMError, ConfigError, DataError
from attn2ssm.eval import needle
from attn2ssm.eval.suite_settings import suite_settings
from tiny_models import make_tokenizer, tiny_config

EVAL_CORPORA = ("emails", "kjv", "pydoc")


@pytest.fixture
def prose(tmp_path):
    """20 documents, each of 12 sentences that name their document: a sentence shows where it came from."""
    root = tmp_path / "prose"
    root.mkdir()
    for d in range(20):
        (root / f"doc{d:02d}.txt").write_text(
            " ".join(f"Document {d} says sentence {s} is here." for s in range(12))
        )
    return str(root)


# ---------------------------------------------------------------------------------------- recall:
def test_recall_spec_parsing_and_errors():
    assert recall.parse_recall_spec("recall:256") == (256, "sotu", recall.DEFAULT_MAX_WORDS, 0)
    assert recall.parse_recall_spec("recall:8:moby-dick?max_words=100&seed=3") == (8, "moby-dick", 100, 3)
    for bad, needle_ in (
        ("recall:x", "bad recall corpus spec"),
        ("recall:0", "bad recall corpus spec"),
        ("recall:4?max_words=5", "bad option"),
        ("recall:4?depth=1", "bad option"),
        ("recall:4:recall:2", "cannot take its prose"),
    ):
        with pytest.raises(DataError, match=needle_) as e:
            recall.parse_recall_spec(bad)
        assert "\n" not in str(e.value)


def test_a_passage_by_hand():
    """Seed 0, passage 0 over four sentences: the text is the template filled with the passage's own
    needles; the answer is written out in the evaluation's answer format."""
    sentences = ["One is here.", "Two is there.", "Three is far.", "Four is near."]
    text, meta = recall.passage(0, sentences, seed=0, max_words=recall.MIN_WORDS)
    # replay the passage's random stream by hand
    rng = random.Random("attn2ssm-recall:0:0")
    form = recall.FORMS[rng.randrange(3)]
    assert meta["form"] == form
    words = rng.randint(recall.MIN_WORDS, recall.MIN_WORDS)
    start = rng.randrange(4)
    assert words == recall.MIN_WORDS
    # 4 sentences of 3 words < 40 words: the whole list once
    hay = [sentences[(start + i) % 4] for i in range(4)]
    if form == "passkey":
        _, value = recall.key_value(form, rng)
        hay.insert(rng.randint(0, 4), recall.PASSKEY_NEEDLE.format(value=value))
        assert text.endswith(f"What is the pass key? The pass key is {value}.")
        assert text == recall.PASSKEY_TEMPLATE.format(context=" ".join(hay), value=value)
    else:
        kind = "uuid" if form == "uuid" else "number"
        key, value = meta["items"][0]
        assert text.endswith(f"The special magic {kind} for {key} mentioned in the provided text is {value}.")
        assert f"One of the special magic {kind}s for {key} is: {value}." in text
        for s in sentences:
            assert s in text
    # a function of (i, seed, sentences)
    assert recall.passage(0, sentences, seed=0, max_words=recall.MIN_WORDS) == (
        text,
        meta,
    )


def test_answer_formats_match_the_evaluation_prompts():
    """The training passages end exactly as the evaluation's prompts end, plus the answer."""
    key, value = "amber-acorn", "1234567"
    assert needle.NIAH_ANSWER_PREFIX.format(
        kind="number", key=key
    ) + f" {value}." in recall.RULER_TEMPLATE.format(kind="number", context="x", key=key, value=value)
    assert needle.NIAH_NEEDLE.format(kind="number", key=key, value=value) == recall.RULER_NEEDLE.format(
        kind="number", key=key, value=value
    )
    assert needle.needle_text("12345").strip() == recall.PASSKEY_NEEDLE.format(value="12345")
    assert recall.PASSKEY_TEMPLATE.format(context="x", value="12345").endswith(
        needle.QUESTION.strip() + " 12345."
    )


def test_no_training_item_is_an_evaluation_item(prose):
    """Keys come from word lists that share no word with the evaluation's, so no key-value pair of
    a training passage equals one of the suite's needles (standard and --quick, every form, length
    and trial, replayed as niah_grid draws them); and no passage uses the evaluation's filler."""
    assert not set(recall.ADJECTIVES) & set(needle._ADJECTIVES) and not set(recall.NOUNS) & set(needle._NOUNS)
    evaluation = set()
    for quick in (False, True):
        s = suite_settings("standard", quick=quick)
        for form in s.niah_forms:
            for length in s.niah_lengths:
                rng = random.Random(f"{form}/{length}/{s.seed}")
                evaluation |= {needle.niah_key_value(form, rng) for _ in range(s.niah_trials)}
    docs = load_documents("recall:300:" + prose)
    items = set()
    sentences = recall.training_sentences(prose, load_documents)
    for i, doc in enumerate(docs):
        text, meta = recall.passage(i, sentences)
        assert text == doc.text
        items |= {tuple(kv) for kv in meta["items"] if kv[0] is not None}
        assert needle.NIAH_REPEAT not in text and needle.FILLER.strip() not in text
    assert items and not items & evaluation
    assert not {k for k, _ in items} & {k for k, _ in evaluation}


def test_haystacks_are_training_prose_only(prose):
    """Every haystack sentence comes from a training document of the prose corpus, never a held-out one."""
    train, held = split_documents(load_documents(prose), prose)
    assert held
    held_names = {
        f"Document {d.id.removeprefix('doc').removesuffix('.txt').lstrip('0') or '0'} " for d in held
    }
    for doc in load_documents(f"recall:200:{prose}"):
        for name in held_names:
            assert name not in doc.text
    train_names = {
        f"Document {d.id.removeprefix('doc').removesuffix('.txt').lstrip('0') or '0'} " for d in train
    }
    assert any(name in doc.text for doc in load_documents(f"recall:50:{prose}") for name in train_names)


def test_recall_corpus_tokenizes_splits_and_stamps(prose, tokenizer):
    from attn2ssm.data import prepare_corpus

    spec = f"recall:40:{prose}?max_words=60"
    corpus = prepare_corpus(spec, tokenizer)
    docs = load_documents(spec)
    train, held = split_documents(docs, spec)
    assert {d.id for d in docs} == {f"recall:{i}" for i in range(40)} and train and held  # the id hash rule
    assert corpus.train_ids.numel() > 0 and corpus.heldout_ids.numel() > 0
    assert corpus_stamp(spec) != corpus_stamp(f"recall:40:{prose}?max_words=60&seed=1")
    check_spec(spec)
    with pytest.raises(DataError, match="does not exist"):
        check_spec("recall:4:/no/such/corpus")


# ------------------------------------------------------------------------------------------- chat:
def test_chat_spec_parsing():
    assert parse_chat_spec("chat:sotu:32") == ("sotu", 32)
    assert parse_chat_spec("chat:moby-dick") == ("moby-dick", 64)
    for bad in ("chat:", "chat:generated:100:5", "chat:mix:general", "chat:sotu:0"):
        with pytest.raises(DataError, match="bad chat corpus spec"):
            parse_chat_spec(bad)
    with pytest.raises(DataError, match="cannot be read without the teacher"):
        load_documents("chat:sotu:4")


@pytest.fixture(scope="module")
def teacher():
    config = tiny_config("llama")
    config.vocab_size = 300
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_chat_corpus_renders_the_teachers_answers(teacher, prose, tmp_path):
    """chat:<corpus>:<n>: n conversations, instruction i mod 10 over a training passage, each rendered
    by the chat template (a template known by hand), one .jsonl line each; a second call reads the cache."""
    import json

    from attn2ssm.data.teacher_samples import CHAT_INSTRUCTIONS, build_chat_corpus

    torch.set_num_threads(1)
    tok = make_tokenizer(300)
    tok.pad_token = tok.eos_token
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    path = build_chat_corpus(f"chat:{prose}:3", teacher, tok, progress=False)
    lines = [json.loads(x)["text"] for x in path.read_text().splitlines()]
    replies = [
        json.loads(x)["messages"]
        for x in path.with_name(path.name.replace(".text.jsonl", ".jsonl")).read_text().splitlines()
    ]
    assert len(lines) == len(replies) >= 1
    for i, (text, (user, assistant)) in enumerate(zip(lines, replies)):
        assert (
            text
            == f"<|user|>\n{user['content']}<|endoftext|>\n<|assistant|>\n{assistant['content']}<|endoftext|>\n"
        )
        assert user["content"].startswith(CHAT_INSTRUCTIONS[i].split("{text}")[0])
    assert build_chat_corpus(f"chat:{prose}:3", teacher, tok, progress=False) == path
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        build_chat_corpus(f"chat:{prose}:2", teacher, tok, progress=False)


def test_a_mixture_with_recall_and_chat_sources(teacher, prose):
    torch.set_num_threads(1)
    tok = make_tokenizer(300)
    tok.pad_token = tok.eos_token
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    sources = [
        SourceConfig(prose, 0.5),
        SourceConfig(f"recall:30:{prose}?max_words=50", 0.3),
        SourceConfig(f"chat:{prose}:4", 0.2),
    ]
    data = load_training_data(sources, tok, 32, teacher=teacher, budget_blocks=40, progress=False)
    assert len(data.blocks) == 40 and [s["draws"] for s in data.sources] == [20, 12, 8]
    with pytest.raises(DataError, match="answered by the teacher"):
        load_training_data(sources, tok, 32, budget_blocks=40, progress=False)


# ---------------------------------------------------------------------------------------- mixtures
def test_builtin_mixtures_hold_no_evaluation_corpus():
    for name, sources in MIXTURES.items():
        assert expand_mixture(f"mix:{name}") == sources
        for spec, weight in sources:
            assert weight > 0 and not any(c in spec for c in EVAL_CORPORA), spec
    # no teacher sampling
    assert [s for s, _ in MIXTURES["corpora"]] == [
        "sotu",
        "moby-dick",
        "recall:512:sotu",
    ]
    with pytest.raises(DataError, match="no built-in mixture 'web'"):
        expand_mixture("mix:web")
    with pytest.raises(DataError, match="names a mixture"):
        load_documents("mix:general")


def test_recipes_train_on_the_general_mixture_and_a_corpus_stays_one_flag(tmp_path):
    language = {name: load_recipe(name) for name in builtin_recipes() if load_recipe(name).images is None}
    for name, r in language.items():
        want = "mix:corpora" if name == "quickstart" else "mix:general"
        assert r.data.corpus == want and not r.data.sources, name
        assert [s.corpus for s in r.data.source_list()] == [s for s, _ in expand_mixture(want)]
    r = load_recipe("hybrid25", ["data.corpus=sotu"])
    assert [s.corpus for s in r.data.source_list()] == ["sotu"] and r.data.describe() == "sotu"
    assert load_recipe("quickstart").data.describe() == "0.6×sotu + 0.3×moby-dick + 0.1×recall:512:sotu"
    with pytest.raises(Attn2SSMError, match="no built-in mixture 'nope'"):
        recipe_from_dict({"data": {"corpus": "mix:nope"}})
    with pytest.raises(Attn2SSMError, match="bad chat corpus spec"):
        recipe_from_dict({"data": {"sources": [{"corpus": "chat:sotu:0"}]}})
    fixture = (__import__("pathlib").Path(__file__).parents[1] / "fixtures" / "base_recipe.yaml").read_text()
    assert "mix:" not in fixture

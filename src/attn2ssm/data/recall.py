"""Key-value recall passages: the answer format of retrieval prompts, in the training text.

An instruct student distilled on prose alone recalls a needle teacher-forced yet answers in its own
words greedily (after "The pass key is" it prefers " a"): the *form* of the answer never appeared in
its training text. ``recall:<n>[:<prose corpus>]`` is a corpus of ``n`` passages that put it there:
each is a haystack of consecutive sentences from the prose corpus' **training** documents (default
``sotu``: addresses before 2000; never held-out text) with one or two needles at random depths, a
question, and the answer written out — in the forms of the evaluation's prompts
(:mod:`attn2ssm.eval.needle`):

* RULER's single needle (``niah_single``): "A special magic number is hidden within the following
  text. …", the needle "One of the special magic numbers for {key} is: {value}.", then
  "What is the special magic number for {key} mentioned in the provided text? The special magic
  number for {key} mentioned in the provided text is {value}." — a 7-digit number or a UUID;
* the classic passkey: "The pass key is {key}. Remember it. {key} is the pass key." and "What is
  the pass key? The pass key is {key}." — a 5-digit number.

None of it is an evaluation item: keys are adjective-noun pairs from word lists of their own, which
share no word with the evaluation's (so no key, and no key-value pair, can be an evaluation's), the
haystacks are training prose (the evaluation's are the repeated "The grass is green …" filler and
*held-out* prose), and everything random comes from a stream of this module's own
(``"attn2ssm-recall:<seed>:<i>"``, ``?seed=S``, default 0; the evaluation draws from its own seeds
and form names). A passage has 40 to ``max_words`` words of haystack (default 600:
about 800 SmolLM2 tokens, so most passages fit one 1024-token block); ``?max_words=N`` changes it.
Passage ``i`` is the document ``recall:<i>``; the held-out split is the id hash rule of any corpus.
Ideas of the kind: the passkey task of "Landmark Attention" and RULER's needles; the spec is
``recall:<passages>[:<prose corpus>][?max_words=N&seed=S]``.
"""

from __future__ import annotations

import random
import re
import uuid

from attn2ssm.errors import DataError

from .document import Document
from .specs import DEFAULT_MAX_WORDS, MIN_WORDS, parse_recall_spec
from .splits import split_documents

FORMAT = 1  # bump when a passage's text changes (part of the corpus' cache stamp)

# Word lists of the training passages: none of these words is in the evaluation's key lists.
ADJECTIVES = (
    "amber",
    "brave",
    "crisp",
    "dim",
    "early",
    "faint",
    "grand",
    "humble",
    "idle",
    "keen",
    "loud",
    "mellow",
    "narrow",
    "plain",
    "proud",
    "rough",
    "silent",
    "sturdy",
    "tender",
    "urban",
    "velvet",
    "wild",
    "woolen",
    "yellow",
)
NOUNS = (
    "acorn",
    "barrel",
    "cabin",
    "desk",
    "feather",
    "glove",
    "hammer",
    "kite",
    "ladder",
    "mirror",
    "notebook",
    "oven",
    "parrot",
    "quilt",
    "rocket",
    "spoon",
    "tiger",
    "tower",
    "valley",
    "wagon",
    "whistle",
    "window",
    "zebra",
    "bridge",
)

RULER_TEMPLATE = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it. I will quiz you about the {kind} afterwards.\n"
    "{context}\nWhat is the special magic {kind} for {key} mentioned in the provided text? "
    "The special magic {kind} for {key} mentioned in the provided text is {value}."
)
RULER_NEEDLE = "One of the special magic {kind}s for {key} is: {value}."
PASSKEY_TEMPLATE = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about it.\n"
    "{context}\nWhat is the pass key? The pass key is {value}."
)
PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key."
FORMS = ("number", "uuid", "passkey")


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def training_sentences(prose: str, load_documents) -> list[str]:
    """The prose corpus' *training* documents (read by ``load_documents``, :func:`.sources.load_documents`)
    cut into sentences (held-out text never enters)."""
    train, _ = split_documents(load_documents(prose), prose)
    sentences = [s for d in train for s in _sentences(d.text)]
    if len(sentences) < 2:
        raise DataError(
            f"prose corpus {prose!r} has {len(sentences)} training sentences, too few for a haystack",
            "name a corpus of prose, e.g. recall:256:sotu",
        )
    return sentences


def key_value(form: str, rng: random.Random) -> tuple[str, str]:
    """A key (adjective-noun from this module's lists; unused by the passkey form) and its value."""
    key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    if form == "uuid":
        return key, str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if form == "passkey":
        return key, str(rng.randint(10000, 99999))
    return key, str(rng.randint(10**6, 10**7 - 1))


def passage(
    i: int, sentences: list[str], seed: int = 0, max_words: int = DEFAULT_MAX_WORDS
) -> tuple[str, dict]:
    """Passage ``i`` (text, and its items: form, keys, values) — a function of (i, seed, sentences) alone."""
    rng = random.Random(f"attn2ssm-recall:{seed}:{i}")
    form = FORMS[rng.randrange(len(FORMS))]
    words = rng.randint(MIN_WORDS, max_words)
    start = rng.randrange(len(sentences))
    hay, n = [], 0
    while n < words:
        s = sentences[(start + len(hay)) % len(sentences)]
        hay.append(s)
        n += len(s.split())
        if len(hay) >= len(sentences):
            break
    kind = "uuid" if form == "uuid" else "number"
    if form == "passkey":
        key, value = key_value(form, rng)
        hay.insert(rng.randint(0, len(hay)), PASSKEY_NEEDLE.format(value=value))
        return PASSKEY_TEMPLATE.format(context=" ".join(hay), value=value), {
            "form": form,
            "items": [(None, value)],
        }
    items = [key_value(form, rng)]
    if rng.random() < 0.5:  # a second needle, a distractor with another key, so the key has to be read
        other = key_value(form, rng)
        if other[0] != items[0][0]:
            items.append(other)
    for key, value in items:
        hay.insert(rng.randint(0, len(hay)), RULER_NEEDLE.format(kind=kind, key=key, value=value))
    key, value = items[0]
    return RULER_TEMPLATE.format(kind=kind, context=" ".join(hay), key=key, value=value), {
        "form": form,
        "items": items,
    }


def load_recall(spec: str, load_documents) -> list[Document]:
    """The documents of ``recall:<n>[:<prose>]`` (see the module docstring), the prose read by
    ``load_documents`` (:func:`.sources.load_documents`, which calls this)."""
    n, prose, max_words, seed = parse_recall_spec(spec)
    sentences = training_sentences(prose, load_documents)
    docs = []
    for i in range(n):
        text, meta = passage(i, sentences, seed, max_words)
        docs.append(Document(f"recall:{i}", text, {"form": meta["form"], "prose": prose}))
    return docs

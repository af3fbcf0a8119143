"""Passkey prompts and scoring; generation-agreement metrics against hand computations."""

import pytest
import torch

from attn2ssm.eval.agreement import generation_agreement, heldout_prompts, lcs_length, prefix_match, rouge_l
from attn2ssm.eval.needle import (
    FILLER,
    NIAH_FORMS,
    build_prompt,
    essay_sentences,
    key_recalled,
    needle_text,
    niah_depths,
    niah_grid,
    niah_key_value,
    niah_prompt,
    niah_text,
    passkey_grid,
    plot_passkey,
)
from tiny_models import make_tokenizer, tiny_model


def test_lcs_and_rouge_hand_cases():
    assert lcs_length([1, 2, 3, 4], [2, 4, 3]) == 2
    assert lcs_length([], [1]) == 0
    # LCS 3 of candidate 4 / reference 5 → P 3/4, R 3/5, F1 = 2·.75·.6/1.35 = 2/3
    assert rouge_l([1, 2, 3, 9], [1, 7, 2, 3, 8]) == pytest.approx(2 / 3)
    assert rouge_l([1, 2], [1, 2]) == 1.0 and rouge_l([5], [6]) == 0.0
    assert prefix_match([1, 2, 3], [1, 2, 4]) == 2


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt_length_and_depth(depth):
    tok = make_tokenizer()
    ids = build_prompt(tok, 1000, depth, "12345")
    filler = len(tok(FILLER, add_special_tokens=False)["input_ids"])  # 70 tokens with this tiny BPE
    assert 1000 - filler < len(ids) <= 1000
    text = tok.decode(ids)
    assert text.endswith("The pass key is") and text.count("12345") == 2
    where = text.index(needle_text("12345")) / len(text)
    assert abs(where - depth) < 0.12


class _Oracle(torch.nn.Module):
    """Answers with the key it finds in the prompt when ``honest``, else with 00000 (or with words
    when ``answer`` is given). Teacher-forced, it predicts each next input token exactly when
    ``recalls``, else always "0"."""

    def __init__(self, tok, honest=True, recalls=True, answer=None):
        super().__init__()
        self.tok, self.honest, self.recalls, self.answer, self.p = (
            tok,
            honest,
            recalls,
            answer,
            torch.nn.Parameter(torch.zeros(1)),
        )

    def generate(self, input_ids, **kw):
        import re

        key = (
            re.search(r"pass key is (\d+)\.", self.tok.decode(input_ids[0])).group(1)
            if self.honest
            else "00000"
        )
        text = self.answer if self.answer is not None else " " + key
        return torch.cat([input_ids, torch.tensor([self.tok(text)["input_ids"]])], 1)

    def forward(self, input_ids, logits_to_keep=0, **kw):
        from types import SimpleNamespace

        nxt = (
            torch.roll(input_ids, -1, 1)
            if self.recalls
            else torch.full_like(input_ids, self.tok("0", add_special_tokens=False)["input_ids"][0])
        )
        logits = torch.nn.functional.one_hot(nxt, len(self.tok)).float()
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_passkey_grid_scores_and_plots(tmp_path):
    tok = make_tokenizer()
    good = passkey_grid(_Oracle(tok), tok, [100, 200], [0.0, 1.0], trials=2, progress=False)
    bad = passkey_grid(
        _Oracle(tok, honest=False, recalls=False), tok, [100, 200], [0.0, 1.0], trials=2, progress=False
    )
    assert (
        good["accuracy"] == [[1.0, 1.0], [1.0, 1.0]]
        and good["mean_accuracy"] == 1.0
        and good["mean_recall"] == 1.0
    )
    assert bad["mean_accuracy"] == 0.0 and bad["recall"] == [[0.0, 0.0], [0.0, 0.0]]
    plot_passkey({"teacher": good, "student": bad}, tmp_path / "needle.png")
    assert (tmp_path / "needle.png").stat().st_size > 0


def test_passkey_recall_separates_memory_from_answer_form():
    """A model that holds the key but answers in words fails the greedy test and passes recall;
    one that answers 00000 teacher-forced too fails both."""
    tok = make_tokenizer()
    worded = passkey_grid(
        _Oracle(tok, answer=" a secret code"), tok, [150], [0.0, 0.5, 1.0], trials=2, progress=False
    )
    assert worded["mean_accuracy"] == 0.0 and worded["mean_recall"] == 1.0
    assert all(e["recalled"] and not e["correct"] for e in worded["examples"])
    assert key_recalled(_Oracle(tok), tok, build_prompt(tok, 150, 0.5, "48213"), "48213")
    assert not key_recalled(_Oracle(tok, recalls=False), tok, build_prompt(tok, 150, 0.5, "48213"), "48213")


def test_generation_agreement_self_is_perfect_and_other_is_not():
    teacher, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    stream = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(0))
    prompts = heldout_prompts(stream, 4, prompt_len=12, new_tokens=10)
    assert len(prompts) == 4 and all(p.numel() == 12 for p in prompts)
    same = generation_agreement(teacher, teacher, prompts, new_tokens=10, progress=False)
    assert (
        same["token_agreement"] == same["rouge_l"] == same["forced_agreement"] == 1.0
        and same["prefix_match"] == 10
    )
    diff = generation_agreement(other, teacher, prompts, new_tokens=10, progress=False)
    assert diff["token_agreement"] < 0.5 and diff["forced_agreement"] < 0.5
    with pytest.raises(ValueError, match="fewer than"):
        heldout_prompts(stream[:15], 2, 12, 10)


# ------------------------------------------------------------------------------ RULER niah_single


def test_niah_text_is_rulers_single_needle_prompt():
    text = niah_text("niah_single_1", "calm-river", "1234567", 2, 0.5)
    assert text == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.\n"
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
        "One of the special magic numbers for calm-river is: 1234567.\n"
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
        "What is the special magic number for calm-river mentioned in the provided text? "
        "The special magic number for calm-river mentioned in the provided text is"
    )
    essay = essay_sentences("First one.  Second\n one! Third?")
    assert essay == ["First one.", "Second one!", "Third?"]
    uuid_text = niah_text("niah_single_3", "k", "v", 3, 0.0, essay)
    assert (
        "A special magic uuid is hidden" in uuid_text
        and "\nOne of the special magic uuids for k is: v. First one. Second one! Third?\n" in uuid_text
    )
    with pytest.raises(ValueError, match="needs essay sentences"):
        niah_text("niah_single_2", "k", "v", 3, 0.0, None)
    with pytest.raises(ValueError, match="unknown needle form"):
        niah_text("niah_multikey_1", "k", "v", 3, 0.0)


def test_niah_keys_values_and_depths():
    import random
    import re

    rng = random.Random(0)
    key, value = niah_key_value("niah_single_1", rng)
    assert re.fullmatch(r"[a-z]+-[a-z]+", key) and re.fullmatch(r"[1-9]\d{6}", value)
    _, u = niah_key_value("niah_single_3", rng)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u)
    assert niah_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0] and niah_depths(1) == [0.5]


@pytest.mark.parametrize("form", NIAH_FORMS)
def test_niah_prompt_is_the_longest_that_fits(form):
    tok = make_tokenizer()
    essay = essay_sentences(" ".join(SENTENCES_FOR_ESSAY))
    ids = niah_prompt(tok, form, 600, 0.5, "calm-river", "1234567", essay)
    assert len(ids) <= 600
    text = tok.decode(ids)
    assert text.endswith("mentioned in the provided text is") and "for calm-river is: 1234567." in text
    n = text.count("The grass is green.") if form == "niah_single_1" else None
    if n is not None:  # one more filler unit would not fit
        longer = tok(niah_text(form, "calm-river", "1234567", n + 1, 0.5), add_special_tokens=False)[
            "input_ids"
        ]
        assert len(longer) > 600
    with pytest.raises(ValueError, match="without any haystack"):
        niah_prompt(tok, form, 20, 0.5, "calm-river", "1234567", essay)


SENTENCES_FOR_ESSAY = [
    "Call me Ishmael.",
    "Some years ago, never mind how long precisely.",
    "It was the best of times.",
] * 3


class _NiahOracle(_Oracle):
    """Answers with the value of the needle it finds (or 0000000 when not ``honest``)."""

    def generate(self, input_ids, max_new_tokens=8, **kw):
        import re

        value = (
            re.search(r"is: ([0-9a-f-]+)\.", self.tok.decode(input_ids[0])).group(1)
            if self.honest
            else "0000000"
        )
        new = self.tok(" " + value + " ok", add_special_tokens=False)["input_ids"][:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([new])], 1)


def test_niah_grid_scores_greedy_match_and_recall():
    tok = make_tokenizer()
    essay = essay_sentences(" ".join(SENTENCES_FOR_ESSAY))
    good = niah_grid(_NiahOracle(tok), tok, "niah_single_3", [500], trials=3, essay=essay, progress=False)
    assert good["accuracy"] == {"500": 1.0} and good["recall"] == {"500": 1.0} and good["n"] == {"500": 3}
    assert good["examples"][0]["prompt_tokens"] <= 500 and good["cpu_seconds"]["500"] >= 0
    bad = niah_grid(
        _NiahOracle(tok, honest=False, recalls=False), tok, "niah_single_1", [600], trials=2, progress=False
    )
    assert bad["accuracy"] == {"600": 0.0} and bad["recall"] == {"600": 0.0}
    holds = niah_grid(
        _NiahOracle(tok, honest=False, recalls=True), tok, "niah_single_1", [600], trials=2, progress=False
    )
    assert holds["accuracy"] == {"600": 0.0} and holds["recall"] == {"600": 1.0}  # retrieved, answered wrong
    same = niah_grid(_NiahOracle(tok), tok, "niah_single_1", [600], trials=2, progress=False)
    assert [e["value"] for e in same["examples"]] == [
        e["value"]
        for e in niah_grid(_NiahOracle(tok), tok, "niah_single_1", [600], trials=2, progress=False)[
            "examples"
        ]
    ]

"""Passkey prompts and scoring; generation-agreement metrics against hand computations."""

import pytest
import torch
from tiny_models import make_tokenizer, tiny_model

from attn2ssm.eval.agreement import generation_agreement, heldout_prompts, lcs_length, prefix_match, rouge_l
from attn2ssm.eval.needle import FILLER, build_prompt, key_recalled, needle_text, passkey_grid, plot_passkey


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
        self.tok, self.honest, self.recalls, self.answer, self.p = tok, honest, recalls, answer, torch.nn.Parameter(torch.zeros(1))

    def generate(self, input_ids, **kw):
        import re

        key = re.search(r"pass key is (\d+)\.", self.tok.decode(input_ids[0])).group(1) if self.honest else "00000"
        text = self.answer if self.answer is not None else " " + key
        return torch.cat([input_ids, torch.tensor([self.tok(text)["input_ids"]])], 1)

    def forward(self, input_ids, logits_to_keep=0, **kw):
        from types import SimpleNamespace

        nxt = torch.roll(input_ids, -1, 1) if self.recalls else torch.full_like(input_ids, self.tok("0", add_special_tokens=False)["input_ids"][0])
        logits = torch.nn.functional.one_hot(nxt, len(self.tok)).float()
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_passkey_grid_scores_and_plots(tmp_path):
    tok = make_tokenizer()
    good = passkey_grid(_Oracle(tok), tok, [100, 200], [0.0, 1.0], trials=2, progress=False)
    bad = passkey_grid(_Oracle(tok, honest=False, recalls=False), tok, [100, 200], [0.0, 1.0], trials=2, progress=False)
    assert good["accuracy"] == [[1.0, 1.0], [1.0, 1.0]] and good["mean_accuracy"] == 1.0 and good["mean_recall"] == 1.0
    assert bad["mean_accuracy"] == 0.0 and bad["recall"] == [[0.0, 0.0], [0.0, 0.0]]
    plot_passkey({"teacher": good, "student": bad}, tmp_path / "needle.png")
    assert (tmp_path / "needle.png").stat().st_size > 0


def test_passkey_recall_separates_memory_from_answer_form():
    """A model that holds the key but answers in words fails the greedy test and passes recall;
    one that answers 00000 teacher-forced too fails both."""
    tok = make_tokenizer()
    worded = passkey_grid(_Oracle(tok, answer=" a secret code"), tok, [150], [0.0, 0.5, 1.0], trials=2, progress=False)
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
    assert same["token_agreement"] == same["rouge_l"] == same["forced_agreement"] == 1.0 and same["prefix_match"] == 10
    diff = generation_agreement(other, teacher, prompts, new_tokens=10, progress=False)
    assert diff["token_agreement"] < 0.5 and diff["forced_agreement"] < 0.5
    with pytest.raises(ValueError, match="fewer than"):
        heldout_prompts(stream[:15], 2, 12, 10)

"""``attn2ssm generate`` run in-process on a saved tiny student: where a prompt gives no tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.cli import main
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from tiny_models import make_tokenizer, tiny_config


def _student_dir(path, bos: bool):
    tok = make_tokenizer()
    if bos:  # a tokenizer that has a BOS token but does not add it to what it encodes
        tok.bos_token = "<|endoftext|>"
    assert tok("").input_ids == []
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    convert(teacher, make_plan(cfg.num_hidden_layers, "linear_attention")).save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


def test_an_empty_prompt_starts_from_bos(tmp_path, capsys):
    path, tok = _student_dir(tmp_path / "bos", bos=True)
    capsys.readouterr()
    assert main(["generate", str(path), "--prompt", "", "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want = model.generate(
            torch.tensor([[tok.bos_token_id]]),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    assert printed.strip() == tok.decode(want[0, 1:], skip_special_tokens=True).strip()


@pytest.mark.parametrize("flags", [[], ["--draft", "SELF"]])
def test_an_empty_prompt_without_bos_is_one_line(tmp_path, capsys, flags):
    path, _ = _student_dir(tmp_path / "nobos", bos=False)
    capsys.readouterr()  # (the save's progress bars)
    flags = [str(path) if f == "SELF" else f for f in flags]
    assert main(["generate", str(path), "--prompt", "", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no tokens" in err[0] and "BOS" in err[0], err

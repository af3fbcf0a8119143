"""``attn2ssm generate --prompt`` with bytes that are not UTF-8: one line naming the first bad byte and
its offset, before any model loads (the shell's bytes reach Python as lone surrogates, which the
tokenizer refused with a TypeError)."""

import pytest

import attn2ssm.student.loading as loading
from tiny_models import one_line_error


@pytest.mark.parametrize(
    ("prompt", "where"),
    [
        ("ab\udcff", "byte 0xff at offset 2"),  # what Python makes of $(printf 'ab\xff')
        ("h\u00e9 ab\udcc3", "byte 0xc3 at offset 6"),  # a multi-byte character cut short, after a whole one
    ],
)
def test_a_prompt_that_is_not_utf8_is_one_line_before_the_model_loads(
    tmp_path, capsys, monkeypatch, prompt, where
):
    monkeypatch.setattr(
        loading, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("the model loaded first")
    )
    err = one_line_error(capsys, ["generate", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "2"])
    assert err == (
        f"error: --prompt is not UTF-8 text ({where}) — pass the prompt in UTF-8 (e.g. convert it with iconv -t UTF-8)"
    )

"""End to end on the real built-in teacher (SmolLM2-135M) and corpus: `pytest -m slow`."""

import json
import os
import subprocess
import sys

import pytest

from real_cache import real_cache


@pytest.mark.slow
def test_quickstart_on_the_builtin_teacher(tmp_path):
    """A few steps of each quickstart stage; the student beats its untrained self and loads remotely."""
    env = dict(os.environ)
    env["ATTN2SSM_CACHE"] = str(real_cache())
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "attn2ssm",
        "distill",
        "quickstart",
        "--out",
        str(out),
        "--no-progress",
        "--set",
        "stages.0.tokens=4096",
        "--set",
        "stages.1.tokens=2048",
        "--set",
        "eval.max_tokens=2048",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "teacher" in proc.stdout and "student" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert 10 < res["teacher_ppl"] < 40  # SmolLM2-135M on post-2000 addresses (≈22.7 measured)
    assert res["student_ppl"] < 1000  # the untrained 1+ELU conversion is in the thousands
    script = (
        "import sys; sys.modules['attn2ssm'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"d = {str(out / 'student')!r}\n"
        "tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True); m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)\n"
        "ids = tok('The state of the Union is', return_tensors='pt')\n"
        "print(tok.decode(m.generate(**ids, max_new_tokens=8, do_sample=False)[0]))\n"
    )
    gen = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip().startswith("The state of the Union is")


@pytest.mark.slow
def test_speculative_greedy_is_identical_on_the_builtin_teachers_students():
    """Students of the real teacher as verifier and draft (and the teacher as either): speculative
    greedy output equals plain greedy, through our loop and through transformers' assisted decoding."""
    import torch

    from attn2ssm.generation.speculative import speculative_generate
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan
    from attn2ssm.teachers import load_teacher

    teacher, tok, _ = load_teacher(None)
    n = teacher.config.num_hidden_layers
    hybrid = convert(teacher, make_plan(n, "mamba2", attention_ratio=0.5), {"mamba2": {}}).eval()
    linear = convert(
        teacher, make_plan(n, "linear_attention"), {"linear_attention": {"feature_map": "hedgehog"}}
    ).eval()
    ids = tok("The state of the Union is strong because", return_tensors="pt")["input_ids"]
    accepted = drafted = 0
    for verifier, draft in ((hybrid, teacher), (teacher, hybrid), (linear, hybrid), (hybrid, linear)):
        plain = verifier.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
        spec = speculative_generate(verifier, draft, ids, max_new_tokens=20, num_draft_tokens=3)
        assert torch.equal(spec.sequences, plain)
        accepted, drafted = accepted + spec.stats.accepted, drafted + spec.stats.drafted
        assisted = verifier.generate(
            ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id, assistant_model=draft
        )
        assert torch.equal(assisted, plain)
    assert 0 < accepted < drafted  # both the accept and the rollback paths ran

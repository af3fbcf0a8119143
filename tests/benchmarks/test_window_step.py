"""``benchmarks/window_step.py``: both forms timed on the recipes' students (the same tokens, or it
fails), JSON and PNG written; its block form really is the window step turned off."""

from __future__ import annotations

import json

import torch

from bench_scripts import load_benchmark
from tiny_models import save_tiny_teacher_and_corpus, tiny_student


def test_both_forms_are_timed_on_the_recipes_students(tmp_path, one_thread):
    bench = load_benchmark("window_step.py")
    teacher, corpus = save_tiny_teacher_and_corpus(tmp_path)
    out = tmp_path / "ws.json"
    argv = ["--teacher", str(teacher), "--corpus", str(corpus), "--context", "80", "--new-tokens", "3"]
    data = bench.main([*argv, "--rounds", "1", "--threads", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert list(saved["models"]) == ["linear_hybrid25", "retrieval_heads"]
    for name, r in saved["models"].items():
        assert r["tokens_per_second"] == data["models"][name]["tokens_per_second"]
        assert set(r["tokens_per_second"]) == {"window step", "block form"} and len(r["tokens"]) == 3
        assert all(len(s) == 2 for s in r["token_seconds"].values())  # 3 tokens: 2 timed gaps a round
    assert saved["command"].startswith("python benchmarks/window_step.py --teacher")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_the_block_form_turns_the_window_step_off_and_decodes_the_same(monkeypatch):
    import attn2ssm.mixers.linear_attention as la

    bench = load_benchmark("window_step.py")
    calls = []
    real = la.window_linear_attention_step
    monkeypatch.setattr(la, "window_linear_attention_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_student("gqa_9x3", "linear_attention", options={"feature_map": "hedgehog", "window": 4})
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    logits = {}
    for form in bench.FORMS:
        cache = model.new_cache()
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)  # 7 tokens: every 4-token window full
            before = len(calls)
            if form == "block form":
                with bench.block_form_only():
                    logits[form] = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits
            else:
                logits[form] = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits
        assert (len(calls) > before) == (form == "window step")
    torch.testing.assert_close(logits["block form"], logits["window step"], rtol=1e-5, atol=1e-5)

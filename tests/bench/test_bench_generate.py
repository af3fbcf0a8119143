"""``attn2ssm bench generate`` on a tiny teacher: the measurements are sane (KV cache grows with
context, recurrent state does not), the JSON and
PNG are written, and bad flags are one-line errors."""

import json

import pytest
import torch

from attn2ssm.bench.generate import (
    build_models,
    decode_round,
    measure_decode,
    measure_decode_interleaved,
    prefill,
)
from tiny_models import save_tiny_teacher_and_corpus, tiny_model


def test_measure_decode_memory_shape():
    teacher = tiny_model("llama")
    models = build_models(teacher, ["teacher", "mamba2", "linear", "hybrid25"], torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 64))
    rows = {
        name: [measure_decode(m, ids[:, :length], 4) for length in (16, 64)] for name, m in models.items()
    }
    for short, _long in rows.values():
        assert (
            short["timed_tokens"] == 3
            and short["decode_tokens_per_second"] > 0
            and short["prefill_seconds"] > 0
        )
    # teacher KV: 2 layers x (k, v) x 2 kv heads x 16 dims x 4 bytes per token
    per_token = 2 * 2 * 2 * 16 * 4 / 2**20
    assert rows["teacher"][1]["cache_mb"] - rows["teacher"][0]["cache_mb"] == pytest.approx(48 * per_token)
    for name in ("mamba2", "linear"):  # O(1) in the context
        assert rows[name][0]["cache_mb"] == rows[name][1]["cache_mb"] > 0


def test_interleaved_rounds_decode_the_same_tokens_as_plain_generate():
    """Every round continues the same prefilled cache: its tokens are the model's own greedy
    continuation of the prompt, and the rate is the median of the recorded token times."""
    teacher = tiny_model("llama")
    models = build_models(teacher, ["teacher", "linear", "mamba2"], torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    rows = measure_decode_interleaved(models, ids, new_tokens=5, rounds=3)
    for name, row in rows.items():
        assert row["rounds"] == 3 and row["timed_tokens"] == 3 * 4 and row["same_tokens_every_round"]
        times = sorted(row["ms_per_token_all"])
        assert row["decode_ms_per_token"] == pytest.approx((times[5] + times[6]) / 2, abs=1e-3)
        assert row["decode_ms_per_token_p25"] <= row["decode_ms_per_token"] <= row["decode_ms_per_token_p75"]
        with torch.no_grad():
            plain = models[name].generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        pre = prefill(models[name], ids)
        assert decode_round(models[name], pre, 5)["tokens"] == plain[0, 21:].tolist()


def test_a_prefill_out_of_memory_skips_that_model_and_the_others_still_run(monkeypatch):
    """A GPU too small for one forward over the long prompt (the teacher's SDPA at 32k on an 80 GB
    card) is recorded as skipped with the reason; the other models are measured as usual."""
    from attn2ssm.bench.generate import timing as bench  # measure_decode_interleaved reads prefill there

    teacher = tiny_model("llama")
    models = build_models(teacher, ["teacher", "mamba2"], torch.device("cpu"))
    real = bench.prefill

    def prefill_or_oom(model, prompt):
        if model is models["teacher"] and prompt.shape[1] > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 36.00 GiB.\nmore detail")
        return real(model, prompt)

    monkeypatch.setattr(bench, "prefill", prefill_or_oom)
    ids = torch.randint(0, 256, (1, 32))
    short = measure_decode_interleaved(models, ids[:, :16], new_tokens=3, rounds=1)
    long = measure_decode_interleaved(models, ids, new_tokens=3, rounds=1)
    assert "skipped" not in short["teacher"] and "skipped" not in long["mamba2"]
    assert long["teacher"] == {
        "context": 32,
        "skipped": "out of memory on cpu in the prefill: CUDA out of memory. Tried to allocate 36.00 GiB.",
    }


def test_cli_bench_skips_longer_contexts_after_an_out_of_memory_prefill(tmp_path, monkeypatch):
    from attn2ssm.bench.generate import timing as bench  # measure_decode_interleaved reads prefill there
    from attn2ssm.cli import main

    teacher, corpus = save_tiny_teacher_and_corpus(tmp_path)
    real = bench.prefill

    def prefill_or_oom(model, prompt):
        if type(model).__name__.startswith("Llama") and prompt.shape[1] >= 16:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return real(model, prompt)

    monkeypatch.setattr(bench, "prefill", prefill_or_oom)
    out = tmp_path / "gen.json"
    argv = [
        "bench",
        "generate",
        "--teacher",
        str(teacher),
        "--models",
        "teacher,linear",
        "--contexts",
        "8,16,32",
        "--new-tokens",
        "3",
        "--rounds",
        "1",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["decode"]
    assert "skipped" not in rows["teacher"][0] and "out of memory on cpu" in rows["teacher"][1]["skipped"]
    assert rows["teacher"][2] == {"context": 32, "skipped": "the prefill ran out of memory at context 16"}
    assert all("skipped" not in r for r in rows["linear"]) and "speedup_vs_teacher" in rows["linear"][0]


def test_cli_bench_generate_writes_json_and_png(tmp_path):
    from attn2ssm.cli import main

    teacher, corpus = save_tiny_teacher_and_corpus(tmp_path)
    out = tmp_path / "res" / "gen.json"
    argv = [
        "bench",
        "generate",
        "--teacher",
        str(teacher),
        "--models",
        "teacher,mamba2",
        "--contexts",
        "16,32",
        "--max-context",
        "teacher=16",
        "--new-tokens",
        "3",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert result["decode"]["teacher"][1] == {
        "context": 32,
        "skipped": "longer than --max-context 16 for teacher",
    }
    assert [r["context"] for r in result["decode"]["mamba2"]] == [16, 32]
    assert (
        result["decode"]["mamba2"][0]["speedup_vs_teacher"] > 0
        and "speedup_vs_teacher" not in result["decode"]["mamba2"][1]
    )
    assert result["settings"]["cpu_layout"] is True and result["settings"]["rounds"] == 3
    assert result["environment"]["torch"] == torch.__version__ and "command" in result


class _CountingBackend:
    """Traces the compiled step and runs the traced graph as it is (no inductor: seconds)."""

    def __init__(self):
        self.traces, self.calls = 0, 0

    def __call__(self, graph_module, example_inputs):
        self.traces += 1

        def run(*args):
            self.calls += 1
            return graph_module.forward(*args)

        return run


def test_cli_bench_compile_compiles_students_before_timing(tmp_path, monkeypatch):
    from attn2ssm.cli import main
    from attn2ssm.decode import compiled as compiled_step

    backend = _CountingBackend()
    monkeypatch.setattr(compiled_step, "BACKEND", backend)
    teacher, corpus = save_tiny_teacher_and_corpus(tmp_path)
    out = tmp_path / "gen.json"
    argv = [
        "bench",
        "generate",
        "--teacher",
        str(teacher),
        "--models",
        "teacher,mamba2",
        "--contexts",
        "16",
        "--new-tokens",
        "4",
        "--rounds",
        "2",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--no-progress",
        "--compile",
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    compiled = result["compiled_decode_step"]
    assert compiled["mamba2"] == "compiled" and compiled["teacher"].startswith("not compiled")
    assert result["settings"]["compile_students"] is True
    assert backend.traces == 1  # traced in the warm-up, reused by every timed step
    # warm-up: 2 decode steps; 2 rounds x 4 one-token steps (the cache holds the prompt); beside each
    # round a plain generate (--plain-check at the shortest context): 3 one-token steps after its prefill
    assert backend.calls == 2 + 2 * 4 + 2 * 3
    row = result["decode"]["mamba2"][0]
    assert row["plain_generate_same_tokens"] and row["benchmark_vs_plain_generate"] > 0


def test_cli_generate_compile_prints_the_same_text(tmp_path, monkeypatch, capsys):
    from attn2ssm.cli import main
    from attn2ssm.decode import compiled as compiled_step

    backend = _CountingBackend()
    monkeypatch.setattr(compiled_step, "BACKEND", backend)
    teacher, _ = save_tiny_teacher_and_corpus(tmp_path)
    student = tmp_path / "student"
    assert (
        main(["convert", "--teacher", str(teacher), "--mixer", "linear_attention", "--out", str(student)])
        == 0
    )
    capsys.readouterr()
    texts = []
    for extra in ([], ["--compile"]):
        assert (
            main(
                [
                    "generate",
                    str(student),
                    "--prompt",
                    "the state of the union",
                    "--max-new-tokens",
                    "6",
                    *extra,
                ]
            )
            == 0
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    assert backend.traces == 1 and backend.calls == 5  # 6 new tokens: one prefill, five decode steps


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--models", "teacher,gpt5"], "unknown models"),
        (["--contexts", "1k"], "--contexts"),
        (["--max-context", "teacher"], "MODEL=TOKENS"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--rounds", "0"], "--rounds"),
        (["--draft", "/nope"], "add --spec"),
        (["--compile", "--no-cpu-layout"], "--compile needs the CPU decode layout"),
    ],
)
def test_bench_bad_flags_are_one_line(flags, needle, capsys):
    from attn2ssm.cli import main

    assert main(["bench", "generate", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err

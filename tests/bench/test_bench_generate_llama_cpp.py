"""``attn2ssm bench generate --backend llama.cpp``: its flags are one-line errors (fast), and on the
built-in teacher (slow; skipped without ``make llama-cpp``) GGUFs of the teacher and its Mamba-2
students at one type give the torch backend's rows (speed against the teacher row of the same
type, a KV cache that grows with the context and a recurrent state that does not), and a round
restored from the prefilled state decodes what a fresh greedy run decodes."""

import json

import pytest
import torch

from attn2ssm.cli import main
from real_cache import needs_llama_cpp, real_cache
from tiny_models import one_line_error


def test_bench_llama_cpp_flags_are_one_line_errors(capsys, monkeypatch):
    monkeypatch.delenv("ATTN2SSM_LLAMA_CPP", raising=False)
    bench = ["bench", "generate", "--no-progress", "--contexts", "16"]
    assert "only Mamba-2 and pure gated_delta students" in one_line_error(
        capsys, [*bench, "--backend", "llama.cpp", "--models", "teacher,linear"]
    )
    assert "--backend llama.cpp" in one_line_error(capsys, [*bench, "--quant", "q8_0"])
    assert "q3_x" in one_line_error(capsys, [*bench, "--backend", "llama.cpp", "--quant", "q3_x"])
    assert "--compile is for the torch backend" in one_line_error(
        capsys, [*bench, "--backend", "llama.cpp", "--compile"]
    )
    assert "make llama-cpp" in one_line_error(capsys, [*bench, "--backend", "llama.cpp"])


def test_reference_rows_pair_each_type():
    from attn2ssm.bench.generate import reference_name

    assert (
        reference_name("mamba2") == "teacher"
        and reference_name("mamba2@q8_0") == "teacher@q8_0"
        and reference_name("teacher@f16") == "teacher@f16"
    )


@pytest.mark.slow
def test_llama_cpp_backend_on_the_builtin_teacher(tmp_path, monkeypatch):
    from attn2ssm.export.llamacpp import runtime_version

    root = needs_llama_cpp()
    monkeypatch.setenv("ATTN2SSM_CACHE", str(real_cache()))
    monkeypatch.setenv("ATTN2SSM_LLAMA_CPP", str(root))
    out, gguf = tmp_path / "bench.json", tmp_path / "gguf"
    argv = [
        "bench",
        "generate",
        "--backend",
        "llama.cpp",
        "--contexts",
        "64,256",
        "--new-tokens",
        "4",
        "--rounds",
        "2",
        "--quant",
        "q8_0",
        "--threads",
        "2",
        "--gguf-dir",
        str(gguf),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "llama.cpp" and result["threads"] == 2 and out.with_suffix(".png").is_file()
    assert result["environment"]["llama_cpp"]["llama_cpp_python"] == runtime_version()
    assert set(result["decode"]) == {"teacher@q8_0", "mamba2@q8_0", "hybrid25@q8_0", "gdn@q8_0"}
    for name, rows in result["decode"].items():
        for row in rows:
            assert (
                row["timed_tokens"] == 2 * 3
                and row["decode_tokens_per_second"] > 0
                and row["same_tokens_every_round"]
            ), (name, row)
            assert ("speedup_vs_teacher" in row) == (name != "teacher@q8_0")
    grow = {name: rows[1]["cache_mb"] - rows[0]["cache_mb"] for name, rows in result["decode"].items()}
    per_token = 30 * 2 * 192 * 2 / 2**20  # teacher KV: 30 layers × (k, v) × 3 kv heads × 64 × f16
    assert grow["teacher@q8_0"] == pytest.approx(192 * per_token, rel=0.05)
    for recurrent in ("mamba2@q8_0", "gdn@q8_0"):  # only the identity layer's KV
        assert grow[recurrent] == pytest.approx(192 * per_token / 30, rel=0.05), recurrent
    assert (
        result["gguf"]["mamba2@q8_0"]["identity_layers"] == [30]
        and result["gguf"]["gdn@q8_0"]["identity_layers"] == [30]
        and result["gguf"]["hybrid25@q8_0"]["identity_layers"] == []
    )

    # a round from the restored prefill state decodes the GGUF's own greedy continuation
    from attn2ssm.bench.generate import LlamaCppBench, decode_round, prefill
    from attn2ssm.export.llamacpp import GGUFModel

    prompt = torch.randint(0, 49152, (1, 40), generator=torch.Generator().manual_seed(0))
    for name in ("teacher", "mamba2", "hybrid25"):
        path = gguf / f"{name}-q8_0.gguf"
        runner = LlamaCppBench(path, threads=2, new_tokens=5)
        pre = prefill(runner, prompt)
        first = decode_round(runner, pre, 5)["tokens"]
        again = decode_round(runner, pre, 5)["tokens"]
        runner.release(pre)
        fresh = GGUFModel(path, n_ctx=64, threads=2)
        assert first == again == fresh.greedy(prompt[0].tolist(), 6)[1:], name
        fresh.close()

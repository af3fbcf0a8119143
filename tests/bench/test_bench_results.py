"""What the benchmarks print and write: the tables of ``bench generate`` (decode and --spec), and
``write_result`` (the JSON, the PNG beside it, the table, the paths)."""

import json

from attn2ssm.bench.generate import format_generate_bench, format_spec_bench
from attn2ssm.bench.results import write_result


def test_generate_table_has_a_row_per_model_and_a_cell_per_context():
    result = {
        "device": "cpu",
        "threads": 2,
        "decode": {
            "teacher": [
                {"context": 16, "decode_tokens_per_second": 10.0, "prefill_seconds": 0.25, "cache_mb": 1.5},
                {"context": 32, "skipped": "oom"},
            ],
            "mamba2": [
                {
                    "context": 16,
                    "decode_tokens_per_second": 20.0,
                    "prefill_seconds": 0.5,
                    "cache_mb": 0.25,
                    "speedup_vs_teacher": 2.0,
                    "benchmark_vs_plain_generate": 1.0,
                    "plain_generate_tokens_per_second": 19.5,
                    "fraction_of_bandwidth_bound": 0.5,
                }
            ],
        },
    }
    assert format_generate_bench(result).splitlines() == [
        "decode (cpu, 2 threads): tokens/s | prefill s | cache MB, by context",
        "  teacher   16: 10.00 | 0.2 | 1.5; 32: skipped",
        "  mamba2    16: 20.00 (2.00x teacher) [plain generate 19.50] [50% of bound] | 0.5 | 0.2",
    ]
    assert format_generate_bench({**result, "backend": "llama.cpp"}).startswith(
        "decode (llama.cpp, cpu, 2 threads)"
    )


def test_spec_table_has_a_line_per_drafter_and_k():
    result = {
        "device": "cpu",
        "threads": 2,
        "speculative": [
            {
                "target": "mamba2",
                "context": 300,
                "task": "copy",
                "plain_tokens_per_second": 10.0,
                "by_drafter": {
                    "ngram": [
                        {
                            "k": 2,
                            "tokens_per_second": 15.0,
                            "speedup": 1.5,
                            "acceptance_rate": 0.75,
                            "tokens_per_target_forward": 2.5,
                            "identical_to_plain_greedy": True,
                        }
                    ],
                },
            }
        ],
    }
    assert format_spec_bench(result).splitlines() == [
        "speculative decoding (cpu, 2 threads), the student as target; speedup over its plain greedy decode",
        "mamba2 @ 300 copy (plain 10.00 tok/s):",
        "  ngram K=2: 15.00 tok/s (1.50x), acceptance 75.0%, 2.50 tokens/forward, identical True",
    ]


def test_write_result_writes_json_and_png_then_prints_the_table(tmp_path, capsys):
    def plot(result, path):
        path.write_bytes(b"png")
        return path

    out = tmp_path / "new" / "bench.json"
    write_result({"rows": [1, 2]}, str(out), plot, lambda r: f"{len(r['rows'])} rows")
    assert json.loads(out.read_text()) == {"rows": [1, 2]} and out.read_text().endswith("\n")
    assert out.with_suffix(".png").read_bytes() == b"png"
    assert capsys.readouterr().out.splitlines() == ["2 rows", f"wrote {out} and {out.with_suffix('.png')}"]
    # no temporary file left
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench.json", "bench.png"]

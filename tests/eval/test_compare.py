"""Teacher-vs-student report on tiny models: rows for every requested part, recovered fractions
computed the right way round, markdown/JSON/PNG written."""

import json

import pytest

from attn2ssm.eval.compare import ReportSettings, compare_report
from attn2ssm.eval.tables import table_row
from tiny_models import SENTENCES, save_tiny_teacher


def test_recovered_fraction_direction():
    assert table_row("g", "acc", 0.5, 0.4)["recovered"] == pytest.approx(0.8)
    assert table_row("g", "ppl", 20.0, 40.0, higher_is_better=False)["recovered"] == pytest.approx(0.5)
    assert table_row("g", "acc", None, 0.4)["recovered"] is None
    # the teacher is the reference
    assert table_row("g", "kl", 0.0, 0.7, higher_is_better=False)["recovered"] is None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from attn2ssm.cli import main

    root = tmp_path_factory.mktemp("compare")
    save_tiny_teacher(root / "teacher", max_positions=512)
    assert (
        main(
            [
                "convert",
                "--teacher",
                str(root / "teacher"),
                "--option",
                "feature_map=hedgehog",
                "--out",
                str(root / "student"),
            ]
        )
        == 0
    )
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(SENTENCES[i % 4 :] * 3) for i in range(40)))
    return root, corpus


def test_compare_report_writes_table_and_plots(pair, tmp_path):
    root, corpus = pair
    settings = ReportSettings(
        corpora=(str(corpus),),
        window=32,
        max_tokens=2000,
        needle_lengths=(200,),
        needle_depths=(0.0, 1.0),
        needle_trials=1,
        agreement_prompts=2,
        agreement_prompt_len=16,
        agreement_new_tokens=6,
        fidelity_blocks=1,
    )
    report = compare_report(str(root / "student"), str(root / "teacher"), tmp_path, settings, progress=False)
    groups = [r["group"] for r in report["rows"]]
    assert (
        groups[0].startswith("perplexity")
        and "generation vs teacher" in groups
        and "passkey" in groups
        and "attention fidelity" in groups
    )
    ppl = report["rows"][0]
    assert ppl["recovered"] == pytest.approx(ppl["teacher"] / ppl["student"])
    for name in ("report.md", "report.json", "report.png", "needle.png"):
        assert (tmp_path / name).stat().st_size > 0
    md = (tmp_path / "report.md").read_text()
    assert "| group | metric | teacher | student | recovered |" in md and "passkey" in md
    assert json.loads((tmp_path / "report.json").read_text())["rows"] == json.loads(
        json.dumps(report["rows"])
    )


def test_report_flags_reach_the_settings_and_an_absent_one_keeps_its_default(monkeypatch, tmp_path):
    """``eval --report``: --needle-trials given reaches ReportSettings; absent, the settings' own
    default holds (the CLI writes no second copy of it)."""
    import attn2ssm.cli.eval_report as eval_report
    from attn2ssm.cli import main

    seen = []

    def capture(model, against, out, settings, device=None):
        seen.append(settings)
        return {}  # nothing loaded, nothing run

    monkeypatch.setattr(eval_report, "compare_report", capture)
    monkeypatch.setattr(eval_report, "format_markdown", lambda report: "")
    for extra in ([], ["--needle-trials", "7"]):
        assert main(["eval", str(tmp_path), "--report", "--needle-lengths", "512", *extra]) == 0
    assert [s.needle_trials for s in seen] == [ReportSettings().needle_trials, 7]
    assert seen[0].needle_lengths == (512,)

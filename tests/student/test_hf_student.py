"""The saved student as a Hugging Face user meets it (issue 20, item 5).

- ``from_pretrained(dir, dtype=torch.bfloat16)`` puts the whole student in bf16 — the wrapped
  teacher part too, which used to stay in the teacher's recorded fp32 — except Mamba's ``A_log`` /
  ``D`` (and HedgeMamba's ``A``), which stay fp32 as Mamba keeps them; ``dtype="auto"`` reloads a
  bf16 save as it was saved; a student converted from a bf16 teacher or grown in bf16 holds the same.
- config.json holds names, not local paths (it is what ``push_to_hub`` publishes).
- every saved student has a model card; a run's final card gains the run's recipe, budget and ratio.
- ``AutoModel`` (no LM head) loads a saved student, here and where attn2ssm is not installed.
"""

import json
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers the Auto classes)
from attn2ssm.student.configuration import Attn2SSMConfig
from attn2ssm.student.convert import convert, grow_student
from attn2ssm.student.modeling import Attn2SSMModel
from attn2ssm.teachers import TeacherSource
from cache_forms import positions, run_remote
from tiny_models import tiny_model

MIXED_PLAN = ["mamba2", "attention", "mamba", "hedgemamba"]
OPTIONS = {"mamba2": {"norm": True}, "mamba": {}, "hedgemamba": {}}
FP32_NAMES = re.compile(r"\.(A_log|D|A)$")


def _ids(b=2, l=9, seed=0):
    return torch.randint(3, 256, (b, l), generator=torch.Generator().manual_seed(seed))


def _teacher(layers=4, dtype=torch.float32):
    teacher = tiny_model("llama", layers=layers).to(dtype)
    teacher.config.dtype = dtype  # as a teacher loaded with from_pretrained(dtype=...) records it
    teacher.config._name_or_path = "/home/someone/models/my-teacher"  # and where it was loaded from
    return teacher


def _student(plan=MIXED_PLAN, dtype=torch.float32, teacher_info=None):
    torch.manual_seed(0)
    student = convert(_teacher(len(plan), dtype), plan, OPTIONS, teacher_info=teacher_info)
    with torch.no_grad():  # move the mixers' own parameters off their init, as tiny_student does
        for mixer in student.mixers().values():
            for name, p in mixer.named_parameters():
                if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                    p.add_((0.1 * torch.randn(p.shape)).to(p.dtype))
    return student.eval()


def _dtypes(model) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in model.named_parameters()}


def _expected_dtypes(model, dtype) -> dict[str, torch.dtype]:
    return {name: torch.float32 if FP32_NAMES.search(name) else dtype for name, _ in model.named_parameters()}


# ---------------------------------------------------------------------------------------- dtypes
def test_from_pretrained_dtype_applies_to_the_whole_student(tmp_path):
    student = _student()
    student.save_pretrained(tmp_path / "fp32")
    saved = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert (
        saved["dtype"] == "float32"
        and "dtype" not in saved["base_config"]
        and "torch_dtype" not in saved["base_config"]
    )

    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).eval()
    assert _dtypes(bf16) == _expected_dtypes(bf16, torch.bfloat16)
    kept = [n for n, d in _dtypes(bf16).items() if d == torch.float32]
    assert {n.rsplit(".", 1)[1] for n in kept} == {"A_log", "D", "A"}  # one of each mixer kind's
    for name in kept:  # loaded as saved, not through bf16
        assert torch.equal(bf16.get_parameter(name), student.get_parameter(name)), name
    ids, mask = _ids(), torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        ref = student(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False
        ).logits
        out = bf16(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    assert out.dtype == torch.bfloat16
    real = mask.bool()
    assert (out.float() - ref)[real].abs().max() < 0.05 * ref[real].abs().max()
    assert bf16.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (1, 7)

    # a bf16 save says so, and "auto" gives back exactly what was saved
    bf16.save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert _dtypes(auto) == _dtypes(bf16)
    for name, p in bf16.named_parameters():
        assert torch.equal(auto.get_parameter(name), p), name
    # and fp32 is still fp32 everywhere
    assert set(
        _dtypes(AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)).values()
    ) == {torch.float32}


def test_a_student_built_in_bf16_keeps_mamba_parameters_in_fp32():
    """convert from a bf16 teacher and grow_student in bf16 hold what from_pretrained gives."""
    student = convert(
        _teacher(4, torch.bfloat16), ["mamba2", "attention", "attention", "hedgemamba"], OPTIONS
    )
    assert _dtypes(student) == _expected_dtypes(student, torch.bfloat16)
    grown = grow_student(
        student, _teacher(4, torch.bfloat16), ["mamba2", "mamba2", "attention", "hedgemamba"]
    )
    assert _dtypes(grown) == _expected_dtypes(grown, torch.bfloat16)
    assert grown.mixers()[1].A_log.dtype == torch.float32
    with torch.no_grad():
        assert torch.isfinite(grown(input_ids=_ids(), use_cache=False).logits.float()).all()


# ------------------------------------------------------------------------------------ local paths
@pytest.mark.parametrize(
    "source, name, hub_id",
    [
        (TeacherSource("dir", "/home/someone/models/my-teacher"), "my-teacher", None),
        (TeacherSource("gguf", "/home/someone/ggufs", "teacher.Q8_0.gguf"), "ggufs", None),
        (
            TeacherSource(
                "builtin", "/home/someone/.cache/attn2ssm/teachers/smollm2-135m/hf", name="smollm2-135m"
            ),
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        (TeacherSource("hub", "org/some-model"), None, "org/some-model"),
    ],
    ids=["dir", "gguf", "builtin", "hub"],
)
def test_saved_config_holds_names_not_local_paths(source, name, hub_id, tmp_path):
    student = _student(["mamba2", "attention"], teacher_info={"source": source.describe()})
    student.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "/home/someone" not in text and "_name_or_path" not in json.loads(text)["base_config"]
    saved = json.loads(text)["teacher"]["source"]
    assert saved.get("name") == name and saved["kind"] == source.kind
    assert ("location" in saved) == (source.kind == "hub")
    card = (tmp_path / "README.md").read_text()
    assert "/home/someone" not in card
    assert (f"base_model: {hub_id}" in card) == (hub_id is not None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # nothing needed the paths
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=_ids(), use_cache=False).logits,
            student(input_ids=_ids(), use_cache=False).logits,
            rtol=0,
            atol=0,
        )


def test_a_config_saved_with_paths_loses_them_when_saved_again():
    old = {
        "base_config": {
            "model_type": "llama",
            "_name_or_path": "/data/teacher",
            "dtype": "float32",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 1,
            "vocab_size": 256,
        },
        "teacher": {
            "family": "llama",
            "source": {"kind": "dir", "location": "/data/teacher", "gguf_file": None, "name": None},
        },
    }
    config = Attn2SSMConfig(**old)
    assert "/data" not in json.dumps(config.to_dict())
    assert config.teacher["source"] == {"kind": "dir", "gguf_file": None, "name": "teacher"}


# ------------------------------------------------------------------------------------ model card
def test_every_saved_student_has_a_model_card(tmp_path):
    student = _student(
        ["mamba2", "attention"], teacher_info={"source": TeacherSource("hub", "org/some-model").describe()}
    )
    student.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "base_model: org/some-model" in card
    assert "student of org/some-model" in card and "The Mamba in the Llama" in card  # method, by paper
    assert "1 of 2 converted; softmax attention kept in layers [1]" in card
    assert "trust_remote_code=True" in card and "AutoModel" in card and "--format native" in card
    assert "Not recorded with this folder" in card  # convert: no recipe, budget or ratio to show


def test_the_cards_loading_code_runs_without_asking(tmp_path):
    """The card's snippet, run as written in a fresh interpreter with stdin closed and attn2ssm
    unimportable: transformers must not ask "Do you wish to run the custom code? [y/N]". It would
    for the tokenizer without trust_remote_code: AutoTokenizer reads config.json first, whose
    auto_map (the student's own modeling code) transformers may only run when allowed."""
    import os
    import subprocess
    import sys

    from tiny_models import make_tokenizer, tiny_config

    tokenizer = make_tokenizer()
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    convert(AutoModelForCausalLM.from_config(config), ["mamba2", "attention"]).save_pretrained(
        tmp_path / "student"
    )
    tokenizer.save_pretrained(tmp_path / "student")
    card = (tmp_path / "student" / "README.md").read_text()
    snippet = (
        card.split("## How to load", 1)[1]
        .split("```python\n", 1)[1]
        .split("```", 1)[0]
        .replace("PATH_OR_HUB_ID", str(tmp_path / "student"))
    )
    script = (
        'import sys\nsys.modules["attn2ssm"] = None\n'
        + snippet
        + '\nprint("ids", tokenizer("hello").input_ids)\n'
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "custom code" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ids {tokenizer('hello').input_ids}" in proc.stdout


def test_a_runs_card_gains_recipe_budget_and_ratio(tmp_path, monkeypatch):
    """``write_report`` (the end of every distill run) rewrites the student's card once
    results.json exists: recipe, stages with their tokens, total budget, perplexity ratio."""
    from attn2ssm.distill.recipe import load_recipe
    from attn2ssm.eval import report

    student = _student(["mamba2", "attention"])
    student.save_pretrained(tmp_path / "student")
    assert "Not recorded" in (tmp_path / "student" / "README.md").read_text()
    ppl = iter([{"ppl": 10.0, "tokens": 512}, {"ppl": 12.5, "tokens": 512}])  # teacher, then student
    monkeypatch.setattr(report, "perplexity", lambda *a, **k: next(ppl))
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"stage": "finetune", "total_tokens": 65536, "loss": 1.0}) + "\n"
    )
    recipe = load_recipe("hybrid50")
    # perplexity is faked; None would mean a run that never loaded its teacher (logit cache)
    teacher = SimpleNamespace()
    report.write_report(
        tmp_path,
        recipe,
        teacher,
        student,
        SimpleNamespace(heldout_ids=torch.zeros(600, dtype=torch.long)),
        progress=False,
    )
    card = (tmp_path / "student" / "README.md").read_text()
    assert "- **Recipe**: `hybrid50`" in card and "Not recorded" not in card
    assert "hidden_alignment (hidden_alignment, 49,152 tokens) → finetune (kd, 16,384 tokens)" in card
    assert "- **Training budget**: 65,536 tokens" in card
    assert "student 12.50 vs teacher 10.00 (ratio 1.250; 512 tokens, window 1024)" in card


# -------------------------------------------------------------------------------------- AutoModel
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
def test_automodel_gives_the_students_hidden_states(family, tmp_path):
    torch.manual_seed(0)
    teacher = tiny_model(family)
    student = convert(teacher, ["mamba2", "attention"], {"mamba2": {"norm": True}}).eval()
    student.save_pretrained(tmp_path)
    model = AutoModel.from_pretrained(tmp_path).eval()
    assert type(model) is Attn2SSMModel and not any(
        "lm_head" in n or "embed_out" in n for n, _ in model.named_parameters()
    )
    ids, mask = _ids(l=10), torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    pos = positions(mask)
    with torch.no_grad():
        ref = student(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, output_hidden_states=True
        ).hidden_states[-1]
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        cache = model.new_cache()  # and in pieces through the student's cache
        first = model(
            input_ids=ids[:, :6],
            attention_mask=mask[:, :6],
            position_ids=pos[:, :6],
            cache=cache,
            use_cache=True,
        ).last_hidden_state
        rest = model(
            input_ids=ids[:, 6:], attention_mask=mask, position_ids=pos[:, 6:], cache=cache, use_cache=True
        ).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(full[real], ref[real], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([first, rest], 1)[real], full[real], rtol=1e-5, atol=1e-5)


REMOTE = r"""
from transformers import AutoModel
ids = torch.load(d + "/ids.pt")
base = AutoModel.from_pretrained(d, trust_remote_code=True)
hidden = base(input_ids=ids, use_cache=False).last_hidden_state
lm = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, dtype=torch.bfloat16)
print(json.dumps({"cls": type(base).__module__ + "." + type(base).__name__,
                  "hidden_diff": (hidden - torch.load(d + "/hidden.pt")).abs().max().item(),
                  "fp32": sorted(n for n, p in lm.named_parameters() if p.dtype == torch.float32),
                  "bf16": sum(p.dtype == torch.bfloat16 for p in lm.parameters())}))
"""


def test_automodel_and_dtype_without_attn2ssm(tmp_path):
    """Where attn2ssm is not installed: AutoModel through auto_map, and the dtype rule, as remote code."""
    student = _student()
    ids = _ids()
    student.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModel"].endswith(
        ".Attn2SSMModel"
    )
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        torch.save(
            student(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states[-1],
            tmp_path / "hidden.pt",
        )
    result = run_remote(REMOTE, tmp_path)
    assert result["cls"].startswith("transformers_modules") and result["cls"].endswith(".Attn2SSMModel")
    assert result["hidden_diff"] == 0.0
    assert result["fp32"] == sorted(n for n in _dtypes(student) if FP32_NAMES.search(n))
    assert result["bf16"] == len(_dtypes(student)) - len(result["fp32"])

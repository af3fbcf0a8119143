"""``attn2ssm export --format native``: pure gated delta-rule students written as Qwen3_5ForCausalLM.

Exactness: for tiny random teachers (Llama with 2:1 GQA, SmolLM2's tied 3:1-GQA shape, Mistral) the
native checkpoint, loaded by transformers alone in a process that can import neither attn2ssm nor
fla (transformers binds fla's Triton kernels whenever fla is importable, and they cannot run on a
CPU), gives the student's logits on a left-padded batch (fp32) and the same greedy tokens. The
mixers' new parameters and the block norms are moved off their init first, so a map that ignored
one of them (or mixed up q/k/v, the GQA repeat, the zero-centred norms, a/b, the gate) would show.

Refusals: everything the class cannot express is one line naming the reason and a setting.
"""

import json

import pytest
import torch

from attn2ssm.cli import main
from attn2ssm.errors import ExportError
from attn2ssm.export.native import check_native, native_problem
from attn2ssm.export.native_qwen35 import QWEN35_CLASS
from attn2ssm.student.convert import convert
from cache_forms import positions, run_remote
from tiny_models import make_tokenizer, one_line_error, tiny_model

GDN = "gated_delta"
EXPORT_FORM = {"gate_bias": False, "beta_bias": False, "conv_bias": False, "norm_eps": "auto"}
FAMILIES = ("llama", "smollm2", "mistral")


def _teacher(family: str, layers: int = 3):
    return tiny_model(family, layers=layers)


def _student(teacher, plan=None, **options):
    plan = plan or [GDN] * teacher.config.num_hidden_layers
    student = convert(teacher, plan, {GDN: {**EXPORT_FORM, **options}})
    torch.manual_seed(1)
    # off the init: conv, gate, a/b, decays, norms (the block norms too: w − 1 must show)
    with torch.no_grad():
        for mixer in student.mixers().values():
            for name, p in mixer.named_parameters():
                if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                    p.add_(0.1 * torch.randn_like(p))
        for name, p in student.named_parameters():
            if name.endswith("norm.weight") and "mixer" not in name:
                p.add_(0.1 * torch.randn_like(p))
    return student.eval()


REMOTE = r"""
import os
sys.modules["fla"] = None  # transformers would bind fla's Triton kernels, which cannot run on a CPU
from transformers import Qwen3_5ForCausalLM
out = {}
for case in sorted(os.listdir(d)):
    path = os.path.join(d, case, "native")
    m = AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask, single = torch.load(os.path.join(d, case, "batch.pt"))
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits
        alone = m(input_ids=single, use_cache=False).logits
    run = {"cls": type(m).__name__, "module": type(m).__module__, "native": isinstance(m, Qwen3_5ForCausalLM)}
    for key, cached in (("default", {}), ("cached", {"use_cache": True}), ("uncached", {"use_cache": False})):
        try:
            run[key] = {"greedy": m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **cached).tolist(),
                        "greedy_alone": m.generate(input_ids=single, max_new_tokens=8, do_sample=False, pad_token_id=0, **cached).tolist()}
        except ValueError as error:
            run[key] = {"error": str(error)}
    torch.save({"logits": logits, "alone": alone}, os.path.join(d, case, "native_out.pt"))
    out[case] = run
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every family's pure student converted, saved, exported through the CLI, run by transformers alone."""
    root = tmp_path_factory.mktemp("native_qwen35")
    students = {}
    # > one 64-token chunk of either chunked form
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # row 1 left-padded by 4 (> d_conv − 1)
    single = ids[:1]
    for family in FAMILIES:
        student = _student(_teacher(family))
        student.save_pretrained(root / family / "student")
        make_tokenizer().save_pretrained(root / family / "student")
        assert (
            main(
                [
                    "export",
                    str(root / family / "student"),
                    "--format",
                    "native",
                    "--out",
                    str(root / family / "native"),
                ]
            )
            == 0
        )
        torch.save((ids, mask, single), root / family / "batch.pt")
        students[family] = student
    return root, students, run_remote(REMOTE, root), (ids, mask, single)


def test_checkpoint_is_qwen35_without_remote_code(exported):
    root, students, remote, _ = exported
    for family in students:
        native = root / family / "native"
        config = json.loads((native / "config.json").read_text())
        assert (
            config["architectures"] == [QWEN35_CLASS]
            and config["model_type"] == "qwen3_5_text"
            and "auto_map" not in config
        )
        assert config["layer_types"] == ["linear_attention"] * 3 and config["use_cache"] is False
        assert (
            not list(native.glob("*.py"))
            and (native / "model.safetensors").is_file()
            and (native / "tokenizer.json").is_file()
        )
        assert QWEN35_CLASS in (native / "README.md").read_text()
        assert remote[family]["native"] and remote[family]["module"].startswith(
            "transformers.models.qwen3_5"
        ), remote[family]


def _assert_native_logits_equal(exported) -> None:
    """The exported models' saved logits equal each student's, on a left-padded batch and alone (1e-4)."""
    root, students, _, (ids, mask, single) = exported
    real = mask.bool()
    for family, student in students.items():
        theirs = torch.load(root / family / "native_out.pt")
        with torch.no_grad():
            mine = student(
                input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False
            ).logits
            mine_alone = student(input_ids=single, use_cache=False).logits
        torch.testing.assert_close(theirs["alone"], mine_alone, rtol=0, atol=1e-4, msg=family)
        torch.testing.assert_close(theirs["logits"][real], mine[real], rtol=0, atol=1e-4, msg=family)


def test_logits_equal_the_students_on_a_left_padded_batch(exported):
    _assert_native_logits_equal(exported)


def test_greedy_generation_equals_the_students(exported):
    """generate() as the checkpoint comes (use_cache: false) and without a cache; with one,
    transformers 5.24's Qwen3.5 builds a softmax mask from a cache that holds no attention layer
    and raises, which is why the export turns the cache off."""
    _, students, remote, (ids, mask, single) = exported
    for family, student in students.items():
        alone = student.generate(input_ids=single, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
        batch = student.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        ).tolist()
        for key in ("default", "uncached"):
            assert remote[family][key]["greedy_alone"] == alone and remote[family][key]["greedy"] == batch, (
                family,
                key,
            )
        assert "only contain LinearAttention layers" in remote[family]["cached"].get("error", ""), remote[
            family
        ]["cached"]


# options (over EXPORT_FORM), plan, family → a word the one-line reason must hold
REFUSALS = [
    ({"gate_bias": True}, None, "llama", "gate_bias"),
    ({"beta_bias": True}, None, "llama", "beta_bias"),
    ({"conv_bias": True}, None, "llama", "conv_bias"),
    ({"norm_eps": 1e-3}, None, "llama", "eps"),
    ({"norm": False}, None, "llama", "norm: false"),
    ({"gate": False}, None, "llama", "gate: false"),
    ({"d_conv": 0}, None, "llama", "d_conv: 0"),
    ({"rope": "before"}, None, "llama", "rope"),
    ({}, [GDN, GDN, "attention"], "llama", "RMS-normalises each q and k head"),
    ({}, [GDN, "mamba2", GDN], "llama", "mixes"),
    ({}, None, "qwen2", "biases"),
    ({}, None, "gemma", "gemma"),
]


@pytest.mark.parametrize("options, plan, family, needle", REFUSALS)
def test_what_qwen35_cannot_express_is_refused_in_one_line(options, plan, family, needle):
    teacher = _teacher(family)
    mixer_options = {GDN: {**EXPORT_FORM, **options}}
    if plan and "mamba2" in plan:
        mixer_options["mamba2"] = {"norm": True, "norm_eps": "auto"}
    config = convert(teacher, plan or [GDN] * 3, mixer_options).config
    reason, fix = native_problem(config)
    assert needle in reason and fix, reason
    with pytest.raises(ExportError):
        check_native(config, llama_cpp=True)


def test_cli_refusal_is_one_line_and_writes_nothing(tmp_path, capsys):
    student = convert(_teacher("llama"), [GDN] * 3, {GDN: {}})  # the defaults: biases on
    student.save_pretrained(tmp_path / "student")
    make_tokenizer().save_pretrained(tmp_path / "student")
    err = one_line_error(
        capsys, ["export", str(tmp_path / "student"), "--format", "native", "--out", str(tmp_path / "native")]
    )
    assert "conv_bias" in err and "beta_bias: false" in err and not (tmp_path / "native").exists()


# ------------------------------------------------------------------------------------------ hybrids
HYBRID_PLAN = [GDN, "attention", GDN, "attention"]  # 4 layers: kept attention at 1 and 3
HYBRID_FAMILIES = ("llama", "smollm2")  # 2:1 GQA untied, 3:1 GQA tied


def _hybrid(family: str):
    """A gated_delta hybrid of ``family`` with ``student.kept_attention: qwen35``, every new
    parameter (the kept layers' q/k norms and gate too) moved off its init."""
    teacher = _teacher(family, layers=4)
    student = convert(teacher, HYBRID_PLAN, {GDN: EXPORT_FORM}, kept_attention="qwen35")
    torch.manual_seed(1)
    with torch.no_grad():
        for mixer in student.mixers().values():
            for name, p in mixer.named_parameters():
                if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                    p.add_(0.1 * torch.randn_like(p))
        for name, p in student.named_parameters():
            if name.endswith(("norm.weight", "g_proj.weight")) and "mixer" not in name:
                p.add_(0.1 * torch.randn_like(p))
    return student.eval()


@pytest.fixture(scope="module")
def exported_hybrids(tmp_path_factory):
    """Each hybrid converted, saved, exported through the CLI, run by transformers alone."""
    root = tmp_path_factory.mktemp("native_qwen35_hybrid")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 256, (2, 100), generator=gen)  # positions up to 99: RoPE's slow dims turn
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    single = ids[:1]
    students = {}
    for family in HYBRID_FAMILIES:
        student = _hybrid(family)
        student.save_pretrained(root / family / "student")
        make_tokenizer().save_pretrained(root / family / "student")
        argv = [
            "export",
            str(root / family / "student"),
            "--format",
            "native",
            "--out",
            str(root / family / "native"),
        ]
        assert main(argv) == 0
        torch.save((ids, mask, single), root / family / "batch.pt")
        students[family] = student
    return root, students, run_remote(REMOTE, root), (ids, mask, single)


def test_hybrid_checkpoint_names_each_layers_kind(exported_hybrids):
    root, students, remote, _ = exported_hybrids
    for family in students:
        config = json.loads((root / family / "native" / "config.json").read_text())
        assert config["architectures"] == [QWEN35_CLASS] and "auto_map" not in config
        assert (
            config["layer_types"] == ["linear_attention", "full_attention"] * 2
            and config["use_cache"] is True
        )
        assert config["num_key_value_heads"] == students[family].config.layer_geometry[1]["num_kv_heads"]
        assert config["rope_parameters"]["partial_rotary_factor"] == 1.0
        assert remote[family]["native"], remote[family]


def test_hybrid_logits_equal_the_students(exported_hybrids):
    """Qwen3.5's interleaved M-RoPE on text positions (three equal position rows) is the teacher's
    1-D RoPE: checked here numerically, with the q/k norms before RoPE, the gate's interleave in
    q_proj, GQA and the zero-centred norms."""
    _assert_native_logits_equal(exported_hybrids)


def test_hybrid_greedy_generation_equals_the_students_with_and_without_a_cache(exported_hybrids):
    _, students, remote, (ids, mask, single) = exported_hybrids
    for family, student in students.items():
        alone = student.generate(input_ids=single, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
        batch = student.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        ).tolist()
        for key in ("default", "cached", "uncached"):
            assert remote[family][key].get("greedy_alone") == alone, (family, key, remote[family][key])
            assert remote[family][key]["greedy"] == batch, (family, key)


def test_hybrid_in_the_teachers_form_is_refused_naming_the_option():
    config = convert(_teacher("llama", layers=4), HYBRID_PLAN, {GDN: EXPORT_FORM}).config
    reason, fix = native_problem(config)
    assert "RMS-normalises each q and k head" in reason and "student.kept_attention: qwen35" in fix


def test_hybrid_with_a_sliding_window_is_refused():
    config = convert(
        _teacher("mistral", layers=4), HYBRID_PLAN, {GDN: EXPORT_FORM}, kept_attention="qwen35"
    ).config
    reason, fix = native_problem(config)
    assert "sliding window" in reason and fix

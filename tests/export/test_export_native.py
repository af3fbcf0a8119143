"""``attn2ssm export --format native``: Mamba-2 students written as GraniteMoeHybridForCausalLM.

Exactness: for tiny random teachers of each family the export supports (Llama, SmolLM2's tied
3:1-GQA shape, Mistral, Qwen2) and every plan it accepts (pure, 50 %, 25 % attention), the native
checkpoint, loaded by transformers alone in a process that cannot import attn2ssm, gives the
student's logits on a left-padded batch (fp32) and the same greedy tokens. The mixers' new
parameters and the teachers' q/k/v biases are moved off their init first, so a map that ignored
one of them (or mixed up x/B/C, the GQA repeat, the C scale, the gate) would show.

Refusals: everything the class cannot express is one line naming the reason and a setting.
"""

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.cli import main
from attn2ssm.errors import ExportError
from attn2ssm.export.native import check_native, export_native, native_problem
from attn2ssm.student.convert import convert
from cache_forms import positions, run_remote
from read_only import deny_access, not_as_root, read_only_folder
from tiny_models import make_tokenizer, one_line_error, tiny_config

MAMBA2 = "mamba2"


def _teacher(family: str, layers: int = 4, **overrides):
    """A tiny random teacher of ``family`` with ``layers`` layers (Qwen2: layer 0 global, the rest
    sliding) and random q/k/v biases where the family has them."""
    config = tiny_config(family)
    config.num_hidden_layers = layers
    if family == "qwen2":
        config.layer_types = ["full_attention"] + ["sliding_attention"] * (layers - 1)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in teacher.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(std=0.3)
    return teacher


def _student(teacher, plan, **options):
    options = {"norm": True, "norm_eps": teacher.config.rms_norm_eps, **options}
    student = convert(teacher, plan, {MAMBA2: options})
    torch.manual_seed(1)
    with torch.no_grad():  # off the identity init (conv, gate, Δ, A, D, norm)
        for mixer in student.mixers().values():
            for name, p in mixer.named_parameters():
                if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                    p.add_(0.1 * torch.randn_like(p))
    return student.eval()


def _save(student, directory):
    student.save_pretrained(directory)
    make_tokenizer().save_pretrained(directory)
    return directory


# family, teacher layers, attention kept (plan); the Qwen2 hybrid keeps its one global layer.
CASES = [
    ("llama", 4, []),
    ("llama", 4, [1, 3]),  # 50 %
    ("llama", 4, [3]),  # 25 %
    ("smollm2", 4, []),
    ("smollm2", 4, [1, 3]),
    ("mistral", 4, []),  # every Mistral layer is sliding: only the pure student exports
    ("qwen2", 4, []),
    ("qwen2", 4, [0]),  # 25 %, the global layer
]

REMOTE = r"""
import os
from transformers import GraniteMoeHybridForCausalLM
out = {}
for case in sorted(os.listdir(d)):
    path = os.path.join(d, case, "native")
    m = AutoModelForCausalLM.from_pretrained(path).eval()
    ids, mask, single = torch.load(os.path.join(d, case, "batch.pt"))
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        alone = m(input_ids=single, use_cache=False).logits
    run = {"cls": type(m).__name__, "module": type(m).__module__, "native": isinstance(m, GraniteMoeHybridForCausalLM)}
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
    """Every case converted, saved, exported through the CLI, and run by transformers alone."""
    root = tmp_path_factory.mktemp("native")
    students = {}
    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # row 1 left-padded by 4 (> d_conv − 1)
    single = ids[:1]
    for family, layers, kept in CASES:
        case = f"{family}-{layers}-{'_'.join(map(str, kept)) or 'pure'}"
        teacher = _teacher(family, layers)
        plan = ["attention" if i in kept else MAMBA2 for i in range(layers)]
        student = _student(teacher, plan)
        _save(student, root / case / "student")
        assert (
            main(
                [
                    "export",
                    str(root / case / "student"),
                    "--format",
                    "native",
                    "--out",
                    str(root / case / "native"),
                ]
            )
            == 0
        )
        torch.save((ids, mask, single), root / case / "batch.pt")
        students[case] = (family, student)
    remote = run_remote(REMOTE, root)
    return root, students, remote, (ids, mask, single)


def test_native_checkpoint_has_no_remote_code(exported):
    root, students, remote, _ = exported
    for case, (_, student) in students.items():
        native = root / case / "native"
        config = json.loads((native / "config.json").read_text())
        assert config["architectures"] == ["GraniteMoeHybridForCausalLM"] and "auto_map" not in config
        assert (
            not list(native.glob("*.py"))
            and (native / "model.safetensors").is_file()
            and (native / "tokenizer.json").is_file()
        )
        # legacy names, as vLLM / llama.cpp / transformers < 5 read them (transformers 5 maps them on load)
        assert config["layer_types"] == [
            "attention" if k == "attention" else "mamba" for k in student.config.layer_plan
        ]
        assert "GraniteMoeHybridForCausalLM" in (native / "README.md").read_text()
        # a pure export turns transformers' cache off (see the greedy test)
        hybrid = "attention" in student.config.layer_plan
        assert (
            config["use_cache"] is hybrid
            and json.loads((native / "generation_config.json").read_text()).get("use_cache", True) is hybrid
        )
        assert remote[case]["native"] and remote[case]["module"].startswith(
            "transformers.models.granitemoehybrid"
        ), remote[case]


def test_native_logits_equal_the_students_on_a_left_padded_batch(exported):
    root, students, remote, (ids, mask, single) = exported
    pos = positions(mask)
    real = mask.bool()
    for case, (family, student) in students.items():
        theirs = torch.load(root / case / "native_out.pt")
        with torch.no_grad():
            mine = student(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
            mine_alone = student(input_ids=single, use_cache=False).logits
        torch.testing.assert_close(theirs["alone"], mine_alone, rtol=0, atol=1e-4, msg=case)
        if family == "qwen2" and student.config.mixer_layers:
            continue  # q/k/v biases + left padding: see test_qwen2_left_padding_is_the_native_class_own
        torch.testing.assert_close(theirs["logits"][real], mine[real], rtol=0, atol=1e-4, msg=case)


def test_native_greedy_generation_equals_the_students(exported):
    """generate() as the checkpoint comes, with a cache and without. transformers 5.24's
    GraniteMoeHybrid builds a softmax mask from the cache even when no layer is attention, which
    raises for a pure student: its export turns the cache off (use_cache: false), so plain
    generate() works; hybrids decode with their cache."""
    root, students, remote, (ids, mask, single) = exported
    for case, (family, student) in students.items():
        alone = student.generate(input_ids=single, max_new_tokens=8, do_sample=False, pad_token_id=0).tolist()
        batch = student.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        ).tolist()
        hybrid = "attention" in student.config.layer_plan
        runs = [remote[case]["default"], remote[case]["uncached"]]
        if hybrid or "error" not in remote[case]["cached"]:
            runs.append(remote[case]["cached"])
        else:
            assert "only contain LinearAttention layers" in remote[case]["cached"]["error"], remote[case][
                "cached"
            ]
        for run in runs:
            assert run["greedy_alone"] == alone, case
            if not (family == "qwen2" and student.config.mixer_layers):  # left padding: see the Qwen2 test
                assert run["greedy"] == batch, case


def test_qwen2_left_padding_is_the_native_class_own(exported):
    """With q/k/v biases the map is exact (unpadded logits and greedy above), but transformers'
    class zeroes a padded position's layer INPUT, so the x/B/C biases of the padding reach the
    conv of the first real tokens: the native model's own padded row differs from the same
    tokens unpadded, where the student's does not. (vLLM runs prompts unpadded.)"""
    from transformers import AutoModelForCausalLM as Auto

    root, students, remote, (ids, mask, single) = exported
    case = "qwen2-4-pure"
    native = Auto.from_pretrained(root / case / "native").eval()
    student = students[case][1]
    row = ids[1:, 4:]
    with torch.no_grad():
        padded = native(input_ids=ids, attention_mask=mask, use_cache=False).logits[1, 4:]
        unpadded = native(input_ids=row, use_cache=False).logits[0]
        s_padded = student(input_ids=ids, attention_mask=mask, use_cache=False).logits[1, 4:]
        s_unpadded = student(input_ids=row, use_cache=False).logits[0]
    torch.testing.assert_close(s_padded, s_unpadded, rtol=0, atol=1e-4)
    torch.testing.assert_close(unpadded, s_unpadded, rtol=0, atol=1e-4)
    assert (padded - unpadded).abs().max() > 1e-2


def test_export_refuses_an_occupied_out_and_replaces_with_force(exported, tmp_path, capsys):
    root, students, _, _ = exported
    src = root / "llama-4-pure" / "student"
    out = tmp_path / "native"
    out.mkdir()
    (out / "config.json").write_text("{}")
    capsys.readouterr()
    assert main(["export", str(src), "--format", "native", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "--force" in err and len(err.splitlines()) == 1
    assert (out / "config.json").read_text() == "{}"
    result = export_native(src, out, force=True)
    assert (
        json.loads((out / "config.json").read_text())["model_type"] == "granitemoehybrid"
        and result.max_abs_diff < 1e-4
    )


def test_bf16_student_exports_in_bf16(tmp_path):
    student = _student(_teacher("llama"), ["attention", MAMBA2, MAMBA2, MAMBA2]).to(torch.bfloat16)
    _save(student, tmp_path / "student")
    export_native(tmp_path / "student", tmp_path / "native")
    assert json.loads((tmp_path / "native" / "config.json").read_text())["dtype"] == "bfloat16"
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "native", dtype="auto")
    assert {p.dtype for p in native.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------ refusals
def _student_config(family="llama", plan=None, layers=2, teacher_overrides=None, **options):
    """The config of a student built with these mixer options (mamba2 ones over norm: true and the teacher's eps)."""
    teacher = _teacher(family, layers, **(teacher_overrides or {}))
    plan = plan or [MAMBA2] * layers
    kinds = {k for k in plan if k != "attention"}
    eps = getattr(teacher.config, "rms_norm_eps", 1e-6)  # (LayerNorm families have none)
    opts = {"norm": True, "norm_eps": eps, **options} if kinds == {MAMBA2} else options
    return convert(teacher, plan, {kind: opts for kind in kinds}).config


@pytest.mark.parametrize(
    "args, reason, fix",
    [
        (
            dict(plan=["linear_attention"] * 2),
            "layer 0 is a 'linear_attention' mixer",
            "student.mixer: mamba2",
        ),
        (dict(plan=["mamba", "attention"]), "layer 0 is a 'mamba' mixer", "student.mixer: mamba2"),
        (
            dict(plan=["attention", "discrete_mamba2"]),
            "layer 1 is a 'discrete_mamba2' mixer",
            "student.mixer: mamba2",
        ),
        (dict(norm=False), "no gated RMSNorm (norm: false)", "norm: true"),
        (
            dict(norm_eps=1e-5),
            "gated RMSNorm uses eps 1e-05 but GraniteMoeHybridForCausalLM uses the teacher's rms_norm_eps (1e-06)",
            "norm_eps: auto} (auto: the teacher's rms_norm_eps, 1e-06)",
        ),
        (dict(d_conv=0), "no conv (d_conv: 0)", "d_conv: 4"),
        (dict(conv_activation="none"), "conv has no activation", "conv_activation: silu"),
        (dict(rope="before"), "rotate B and C (rope: before)", "rope: none"),
        (dict(sanity=True), "sanity mode", "norm: true"),
        (
            dict(family="mistral", plan=["attention", MAMBA2]),
            "layer 0 keeps sliding-window attention (window 4)",
            "student.attention_ratio: 0",
        ),
        (
            dict(family="qwen2", layers=4, plan=["attention", MAMBA2, MAMBA2, "attention"]),
            "layer 3 keeps sliding-window attention",
            "student.keep_attention: [0]",
        ),
        (
            dict(family="phi"),
            "cannot express phi blocks: Phi runs attention and the MLP in parallel",
            "llama, mistral, qwen2",
        ),
        (dict(family="gpt2"), "cannot express gpt2 blocks: GPT-2 uses LayerNorm", "trust_remote_code=True"),
        (dict(family="gemma"), "cannot express gemma blocks", "llama, mistral, qwen2"),
        (
            dict(teacher_overrides={"mlp_bias": True}),
            "MLP has biases (mlp_bias: true)",
            "trust_remote_code=True",
        ),
        (
            dict(teacher_overrides={"head_dim": 32}),
            "4 heads × 32 = 128 ≠ hidden_size 64",
            "trust_remote_code=True",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None,
)
def test_students_the_class_cannot_express_get_one_line(args, reason, fix):
    config = _student_config(**args)
    problem = native_problem(config)
    assert problem is not None and reason in problem[0] and fix in problem[1], problem
    with pytest.raises(ExportError) as info:
        check_native(config)
    assert "\n" not in str(info.value) and str(info.value) == f"{problem[0]} — {problem[1]}"


def test_refusal_through_the_cli_writes_nothing(tmp_path, capsys):
    teacher = _teacher("llama", 2)
    _save(convert(teacher, ["linear_attention", "attention"]), tmp_path / "student")
    capsys.readouterr()
    assert (
        main(["export", str(tmp_path / "student"), "--format", "native", "--out", str(tmp_path / "native")])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: layer 0 is a 'linear_attention' mixer; GraniteMoeHybridForCausalLM's layers are Mamba-2 (SSD) or attention "
        "— distil with student.mixer: mamba2 and student.mixer_options: {norm: true, norm_eps: auto}"
    )
    assert not (tmp_path / "native").exists() and not [
        p for p in tmp_path.iterdir() if p.name.startswith(".native")
    ]


def test_probe_checks_short_long_and_real_text_inputs():
    """The probe covers more than one input: short random batches, one past a 256-token scan chunk,
    and real text; a native model that goes wrong only on one of them is caught by the maximum."""
    from types import SimpleNamespace

    from attn2ssm.export.native import probe_difference, probe_inputs

    tok = make_tokenizer()
    batches = probe_inputs(len(tok), 400, tok)
    assert [b.shape[1] for b in batches[:2]] == [24, 300] and len(batches) == 3
    assert batches[2].shape[1] > 50 and int(batches[2].max()) < len(tok)
    assert [b.shape[1] for b in probe_inputs(len(tok), 64)] == [24, 64]  # capped at the model's positions

    class Model(torch.nn.Module):
        """Logits from a fixed embedding; ``wrong_after``: the positions past it are off by 1."""

        def __init__(self, config, wrong_after=None):
            super().__init__()
            self.config, self.wrong_after = config, wrong_after
            self.table = torch.nn.Embedding(len(tok), 8).requires_grad_(False)
            torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(0))

        def forward(self, input_ids, use_cache=False):
            logits = self.table(input_ids).clone()
            if self.wrong_after is not None:
                logits[:, self.wrong_after :] += 1.0
            return SimpleNamespace(logits=logits)

    config = SimpleNamespace(base_config={"max_position_embeddings": 400})
    student = Model(config)
    assert probe_difference(student, Model(config), len(tok), tok)[0] == 0.0
    # only the long inputs reach it
    assert probe_difference(student, Model(config, wrong_after=100), len(tok), tok)[0] == pytest.approx(1.0)


def test_a_truncated_student_is_one_line_and_writes_nothing(tmp_path, capsys):
    import os

    _save(_student(_teacher("llama", 2), [MAMBA2, MAMBA2]), tmp_path / "student")
    os.truncate(tmp_path / "student" / "model.safetensors", 5000)
    capsys.readouterr()
    assert (
        main(["export", str(tmp_path / "student"), "--format", "native", "--out", str(tmp_path / "native")])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: weights file ")
        and str(tmp_path / "student" / "model.safetensors") in err
        and " — " in err
    ), err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "native").exists() and not [
        p for p in tmp_path.iterdir() if p.name.startswith(".native")
    ]


# ------------------------------------------------------------------ a read-only --out, a full disk, a killed export
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_unwritable_out_is_one_line_before_the_weights_load(tmp_path, monkeypatch, capsys):
    from attn2ssm.student.modeling import Attn2SSMForCausalLM

    _save(_student(_teacher("llama", 2), [MAMBA2, MAMBA2]), tmp_path / "student")
    deny_access(monkeypatch, tmp_path)  # as if tmp_path were read-only
    monkeypatch.setattr(
        Attn2SSMForCausalLM,
        "from_pretrained",
        lambda *a, **k: pytest.fail("the student loaded for an --out that cannot be written"),
    )
    out = tmp_path / "native"
    err = one_line_error(
        capsys, ["export", str(tmp_path / "student"), "--format", "native", "--out", str(out)]
    )
    assert (
        err
        == f"error: --out {out}: {tmp_path} is not writable (permission denied) — choose another --out, or make {tmp_path} writable"
    )


@not_as_root
def test_a_read_only_parent_is_refused(tmp_path, capsys):
    _save(_student(_teacher("llama", 2), [MAMBA2, MAMBA2]), tmp_path / "student")
    with read_only_folder(tmp_path / "ro") as parent:
        err = one_line_error(
            capsys,
            ["export", str(tmp_path / "student"), "--format", "native", "--out", str(parent / "native")],
        )
    assert err.startswith(f"error: --out {parent / 'native'}: {parent} is not writable")


def test_a_full_disk_keeps_the_old_export_and_a_killed_exports_staging_goes(tmp_path, monkeypatch, capsys):
    from transformers import GraniteMoeHybridForCausalLM

    _save(_student(_teacher("llama", 2), [MAMBA2, MAMBA2]), tmp_path / "student")
    out, host = tmp_path / "native", socket.gethostname()
    assert main(["export", str(tmp_path / "student"), "--format", "native", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    stale = tmp_path / f".native.export-abc123.{_dead_pid()}@{host}"  # export --force SIGKILLed while saving
    live = tmp_path / f".native.export-def456.{os.getpid()}@{host}"  # an export still writing
    for staging in (stale, live):
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"\0" * 4096)

    def fills_the_disk(self, directory, *args, **kwargs):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "model.safetensors").write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(GraniteMoeHybridForCausalLM, "save_pretrained", fills_the_disk)
    capsys.readouterr()
    assert (
        main(["export", str(tmp_path / "student"), "--format", "native", "--out", str(out), "--force"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own progress bars
    assert (
        err
        == f"error: cannot write the exported model to {out}: No space left on device — free space on its disk, then run the command again (what --out held is unchanged)"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # the stale staging and the failed one gone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["student", "native", live.name])

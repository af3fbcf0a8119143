"""CAB: bridge losses by hand, what each side hands the bridges, the A ≈ 0 switch, the
bridge_alignment stage through the trainer (training-only bridges, resume) and the cab recipe."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from attn2ssm.adapters import get_adapter
from attn2ssm.adapters.capture import capture_attention_io
from attn2ssm.distill.recipe import StageConfig, load_recipe
from attn2ssm.distill.stages import STAGE_KINDS
from attn2ssm.distill.stages.cab import (
    BridgeAlignmentStage,
    Bridges,
    attention_bridge_loss,
    bridge_l2,
    capture_student_bc,
    capture_teacher_qk,
)
from attn2ssm.distill.trainer import distill, latest_checkpoint
from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert
from tiny_models import Crash, assert_same_student, crash_after, tiny_model

M2 = "mamba2"


def _ids(b=2, l=10, seed=0):
    return torch.randint(0, 256, (b, l), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# losses by hand


def test_bridge_l2_by_hand():
    # one sequence, 2 tokens, 2 heads of 2 features; pred = 0 so the loss is ‖target‖² per head
    target = torch.tensor([[[[1.0, 2.0], [0.0, 3.0]], [[1.0, 1.0], [2.0, 0.0]]]])  # (1, 2, 2, 2)
    pred = torch.zeros_like(target)
    # token 0: heads 1+4=5 and 0+9=9 → mean 7; token 1: 2 and 4 → 3
    assert bridge_l2(pred, target).item() == pytest.approx(5.0)
    assert bridge_l2(pred, target, torch.tensor([[1, 0]])).item() == pytest.approx(7.0)  # padding ignored
    assert bridge_l2(target, target).item() == 0.0


def test_attention_bridge_loss_by_hand():
    """Eq. 8: mean over layers of b_weight·‖φ_B(B) − K‖² + c_weight·‖φ_C(C) − Q‖²."""
    target = torch.tensor([[[[1.0, 2.0], [0.0, 3.0]], [[1.0, 1.0], [2.0, 0.0]]]])
    ones = torch.ones(1, 2, 1, 3)
    b_pairs = [(torch.zeros_like(target), target), (target, target)]  # layer terms 5 and 0
    c_pairs = [(ones, torch.zeros_like(ones)), (torch.zeros_like(ones), 2 * ones)]  # 3 and 12
    loss, b, c = attention_bridge_loss(b_pairs, c_pairs, b_weight=1.0, c_weight=0.5)
    assert b.item() == pytest.approx(2.5) and c.item() == pytest.approx(7.5)
    assert loss.item() == pytest.approx(2.5 + 0.5 * 7.5)
    with pytest.raises(ValueError):
        attention_bridge_loss(b_pairs, c_pairs[:1])


def test_bridges_shapes_and_sharing():
    widths = {0: (8, 12, 16, 24), 2: (8, 12, 16, 24)}
    per_layer = Bridges({0: 0, 2: 1}, widths)
    shared = Bridges({0: 0, 2: 1}, widths, sharing="shared")
    phi_B, phi_C = per_layer.pair(2)
    assert phi_B(torch.randn(2, 5, 2, 4)).shape == (2, 5, 12) and phi_C(torch.randn(2, 5, 4, 4)).shape == (
        2,
        5,
        24,
    )
    assert phi_B.net[0].out_features == 12 and phi_C.net[0].out_features == 24  # hidden = output width
    assert per_layer.pair(0)[0] is not per_layer.pair(2)[0] and shared.pair(0)[0] is shared.pair(2)[0]
    assert sum(p.numel() for p in per_layer.parameters()) == 2 * sum(p.numel() for p in shared.parameters())
    assert Bridges({0: 0}, {0: (8, 12, 16, 24)}, hidden=5).pair(0)[1].net[0].out_features == 5
    with pytest.raises(ConfigError, match="per_layer"):
        Bridges({0: 0, 1: 1}, {0: (8, 12, 16, 24), 1: (8, 12, 16, 32)}, sharing="shared")


# --------------------------------------------------------------------------------------------
# what each side hands the bridges


class _Counter:
    def __init__(self, module):
        self.n = 0
        module.register_forward_hook(lambda *a: setattr(self, "n", self.n + 1))


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_teacher_k_q_are_its_projections(family):
    """K and Q per head after q/k norms, before 1/√d; RoPE only for post_rope targets. The forward
    stops at the last needed layer's attention unless logits are wanted."""
    teacher = tiny_model(family)
    adapter = get_adapter(teacher)
    ids = _ids()
    io = capture_attention_io(teacher, ids, [0, 1])
    head = _Counter(teacher.get_output_embeddings())
    pre, logits = capture_teacher_qk(teacher, ids, [0, 1])
    assert logits is None and head.n == 0
    post, logits = capture_teacher_qk(teacher, ids, [1], rope=True, logits=True)
    assert head.n == 1 and torch.allclose(logits, teacher(input_ids=ids, use_cache=False).logits)
    for j in (0, 1):
        x = io[j]
        q, k, _ = adapter.project_qkv(x.module, x.hidden_states, adapter.layer_geometry(x.module))
        q_norm, k_norm = adapter.qk_norms(x.module)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        torch.testing.assert_close(pre[j][0], k.transpose(1, 2))  # (b, l, kv, d)
        torch.testing.assert_close(pre[j][1], q.transpose(1, 2))  # (b, l, h, d)
    q_rot, k_rot = adapter.qk(io[1].module, io[1].hidden_states, io[1].position_embeddings)
    torch.testing.assert_close(post[1][0], k_rot.transpose(1, 2))
    torch.testing.assert_close(post[1][1], q_rot.transpose(1, 2))
    if family != "gpt2":  # RoPE families: pre- and post-RoPE targets differ
        assert not torch.allclose(post[1][0], pre[1][0])


def _mixer_inputs(student, ids):
    """Each mixer's input hidden states, from a plain forward."""
    seen = {}
    handles = [
        m.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: seen.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True,
        )
        for i, m in student.mixers().items()
    ]
    with torch.no_grad():
        student(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("kind", ["mamba2", "discrete_mamba2", "mamba"])
def test_student_b_c_are_what_the_scan_reads(kind):
    """At init the conv passes the current token: Mamba-2's B = act(W_K u), C = act(W_Q u / √d)
    (SiLU for mamba2, none for discrete_mamba2); Mamba-1 has no conv on B, C. B keeps the kv width."""
    teacher = tiny_model("llama")  # 4 query heads, 2 kv heads: GQA
    student = convert(teacher, [kind, kind])
    ids = _ids()
    inputs = _mixer_inputs(student, ids)
    head = _Counter(student.get_output_embeddings())
    feats, logits = capture_student_bc(student, ids, [0, 1])
    assert logits is None and head.n == 0  # stopped after the last mixer
    act = F.silu if kind == "mamba2" else (lambda t: t)
    for i, mixer in student.mixers().items():
        assert not mixer.bc_tap._forward_hooks  # its hook removed again
        u = inputs[i]
        B, C = feats[i]
        assert B.shape == (2, 10, 2, 16) and C.shape == (2, 10, 4, 16) and B.requires_grad
        torch.testing.assert_close(B, act(mixer.k_proj(u)).view(2, 10, 2, 16), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            C, act(mixer.q_proj(u) * mixer.scaling).view(2, 10, 4, 16), atol=1e-5, rtol=1e-5
        )
    _, logits = capture_student_bc(student, ids, [0], logits=True)
    assert head.n == 1 and logits.shape == (2, 10, 256)


def test_a_init_starts_the_decay_at_one():
    teacher = tiny_model("llama")
    for kind in ("mamba2", "mamba"):
        student = convert(teacher, [kind, kind], {kind: {"A_init": -1e-4}})
        for mixer in student.mixers().values():
            A = -torch.exp(mixer.A_log)
            torch.testing.assert_close(A, torch.full_like(A, -1e-4))
        default = convert(teacher, [kind, kind])
        assert (-torch.exp(default.mixers()[0].A_log)).max() <= -1.0  # mamba2 [-16, -1], mamba S4D −(1..N)
    for bad in (0.0, 1e-3, "zero", True):
        with pytest.raises(ConfigError, match="A_init"):
            convert(teacher, [M2, M2], {M2: {"A_init": bad}})


# --------------------------------------------------------------------------------------------
# the stage kind on its own


def _stage(**losses):
    return StageConfig(name="align", kind="bridge_alignment", losses=losses)


def test_stage_loss_is_eq_8_on_independently_computed_features():
    teacher = tiny_model("llama")
    # deeper: built from (and aligned to) teacher layers 0, 1, 1
    student = convert(teacher, [M2, M2, M2], depth=3)
    kind = STAGE_KINDS["bridge_alignment"]
    cfg = _stage()
    student.stage_modules = kind.stage_modules(student, teacher, cfg)
    assert student.stage_modules.pairs == {0: 0, 1: 1, 2: 1}
    ids = _ids()
    loss, metrics = kind.loss(student, teacher, {"input_ids": ids}, cfg)
    # the same loss from B, C recomputed out of each mixer's input and K, Q out of the teacher's
    inputs, io, adapter = (
        _mixer_inputs(student, ids),
        capture_attention_io(teacher, ids, [0, 1]),
        get_adapter(teacher),
    )
    b_pairs, c_pairs = [], []
    for i, j in {0: 0, 1: 1, 2: 1}.items():
        m, x = student.mixers()[i], io[j]
        B = F.silu(m.k_proj(inputs[i])).view(2, 10, 2, 16)
        C = F.silu(m.q_proj(inputs[i]) * m.scaling).view(2, 10, 4, 16)
        q, k, _ = adapter.project_qkv(x.module, x.hidden_states, adapter.layer_geometry(x.module))
        phi_B, phi_C = student.stage_modules.pair(i)
        b_pairs.append((phi_B(B).view(2, 10, 2, 16), k.transpose(1, 2)))
        c_pairs.append((phi_C(C).view(2, 10, 4, 16), q.transpose(1, 2)))
    expected, b, c = attention_bridge_loss(b_pairs, c_pairs)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert metrics == pytest.approx({"align_B": b.item(), "align_C": c.item()}, rel=1e-5)
    # gradients reach the bridges, the mixers and (through the residual stream) earlier layers' MLPs
    student.requires_grad_(True)
    loss.backward()
    assert student.stage_modules.pair(2)[1].net[2].weight.grad is not None
    assert student.mixers()[2].k_proj.weight.grad.abs().sum() > 0
    assert student.base.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    assert student.base.model.layers[2].mlp.down_proj.weight.grad is None  # after the last B, C: not used


def test_stage_adds_kl_and_ce_when_asked():
    from attn2ssm.distill.losses import cross_entropy, forward_kl

    teacher = tiny_model("llama")
    student = convert(teacher, [M2, M2])
    kind = STAGE_KINDS["bridge_alignment"]
    base = _stage()
    joint = _stage(kl_weight=0.5, ce_weight=0.25, b_weight=0.0)
    torch.manual_seed(0)
    student.stage_modules = kind.stage_modules(student, teacher, joint)
    ids = _ids()
    align, m0 = kind.loss(student, teacher, {"input_ids": ids}, base)
    total, m1 = kind.loss(student, teacher, {"input_ids": ids}, joint)
    with torch.no_grad():
        s, t = student(input_ids=ids, use_cache=False).logits, teacher(input_ids=ids, use_cache=False).logits
    kl, ce = forward_kl(s, t), cross_entropy(s, ids)
    torch.testing.assert_close(total, m0["align_C"] + 0.5 * kl + 0.25 * ce, atol=1e-4, rtol=1e-5)
    assert float(m1["kl"]) == pytest.approx(kl.item(), rel=1e-5) and float(m1["ce"]) == pytest.approx(
        ce.item(), rel=1e-5
    )


def test_stage_option_and_mixer_errors():
    teacher = tiny_model("llama")
    kind = STAGE_KINDS["bridge_alignment"]
    assert isinstance(kind, BridgeAlignmentStage)
    with pytest.raises(ConfigError, match="valid keys: .*b_weight"):
        kind.options(_stage(b_wieght=1.0))
    with pytest.raises(ConfigError, match="pre_rope"):
        kind.options(_stage(targets="after_rope"))
    with pytest.raises(ConfigError, match="hidden"):
        kind.options(_stage(hidden=-3))
    with pytest.raises(ConfigError, match="no per-token B and C"):
        kind.stage_modules(convert(teacher, ["linear_attention", M2]), teacher, _stage())
    with pytest.raises(ConfigError, match="no mixer layers"):
        kind.stage_modules(convert(teacher, ["attention", "attention"]), teacher, _stage())
    with pytest.raises(ConfigError, match="carries no bridges"):
        kind.loss(convert(teacher, [M2, M2]), teacher, {"input_ids": _ids()}, _stage())
    # a hybrid aligns only its mixer layers; layer_map recomputes the pairing for a student of another depth
    hybrid = convert(teacher, ["attention", M2, M2], depth=3)
    assert kind.stage_modules(hybrid, teacher, _stage()).pairs == {1: 1, 2: 1}
    assert kind.stage_modules(hybrid, teacher, _stage(layer_map="paper")).pairs == {1: 1, 2: 1}
    shallow = convert(teacher, [M2], depth=1)
    assert kind.stage_modules(shallow, teacher, _stage()).pairs == {0: 1}


# --------------------------------------------------------------------------------------------
# through the trainer, and the recipe


def test_recipe_student_depth_options():
    r = load_recipe("cab")
    assert (
        r.student.depth == 24
        and r.student.layer_map == "endpoints"
        and r.student.mixer_options == {"A_init": -1e-4}
    )
    assert load_recipe("cab", ["student.depth=null"]).student.depth is None
    with pytest.raises(ConfigError, match="depth"):
        load_recipe("cab", ["student.depth=0"])
    with pytest.raises(ConfigError, match="auto"):
        load_recipe("cab", ["student.keep_attention=auto"])
    with pytest.raises(ConfigError, match="layer_map"):
        load_recipe("cab", ["student.layer_map=floor"])
    with pytest.raises(ConfigError, match="valid keys"):
        load_recipe("cab", ["stages.0.losses.bridge_hidden=64"])


def _cab_sets(run_overrides, **extra):
    """The cab recipe's own stages at tiny size (the tiny-run helper's stage list dropped)."""
    sets = [s for s in run_overrides() if not s.startswith("stages=")]
    small = {
        "stages.0.tokens": 1024,
        "stages.0.save_every": 3,
        "stages.0.optim.lr": 0.01,
        "stages.1.tokens": 256,
        "stages.1.save_every": 1,
        "stages.1.eval_every": 0,
        **extra,
    }
    return sets + [f"{k}={v}" for k, v in small.items()]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_bridge_stage_trains_and_bridges_stay_out_of_the_student(run_overrides, tmp_path):
    out = tmp_path / "run"
    recipe = load_recipe("cab", _cab_sets(run_overrides, **{"student.depth": 3}))
    distill(recipe, out, progress=False)
    align = [r for r in _records(out) if r["stage"] == "align"]
    assert len(align) == 8 and align[-1]["train_align_C"] < align[0]["train_align_C"]
    assert align[-1]["train_align_B"] < align[0]["train_align_B"]
    # the final student: no bridge weights, the same tensors as a freshly converted student, loadable
    weights = load_file(out / "student" / "model.safetensors")
    assert not any("stage_modules" in k or "phi_" in k for k in weights)
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(out / "student")
    assert not hasattr(student, "stage_modules") and len(student.config.layer_plan) == 3
    fresh = convert(tiny_model("llama"), [M2] * 3, depth=3)
    assert set(student.state_dict()) == set(fresh.state_dict())
    out_ids = student.generate(
        _ids(b=1, l=4), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0
    )
    assert out_ids.shape == (1, 7)


def test_resume_inside_the_bridge_stage_matches_uninterrupted(run_overrides, tmp_path, monkeypatch):
    sets = _cab_sets(run_overrides, **{"student.depth": 1})
    reference = tmp_path / "reference"
    distill(load_recipe("cab", sets), reference, progress=False)

    crash_after(monkeypatch, 2)  # after step 6 of 8 of the bridge stage
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        distill(load_recipe("cab", sets), crashed, progress=False)
    mid = latest_checkpoint(crashed)
    assert mid.name == "stage0-step000006"
    # mid-stage: a plain student checkpoint, the bridges beside it in optimizer.pt; none after the stage
    assert not any("stage_modules" in k or "phi_" in k for k in load_file(mid / "model.safetensors"))
    assert any(
        k.startswith("phi_B.") for k in torch.load(mid / "optimizer.pt", weights_only=False)["stage_modules"]
    )
    monkeypatch.undo()
    distill(load_recipe("cab", sets), crashed, resume=True, progress=False)
    assert "stage_modules" not in torch.load(
        reference / "checkpoints" / "stage1-step000002" / "optimizer.pt", weights_only=False
    )
    assert_same_student(reference, crashed)
    ref, res = _records(reference), _records(crashed)
    assert [(r["stage_index"], r["step"]) for r in res] == [(r["stage_index"], r["step"]) for r in ref]
    assert [r["loss"] for r in res] == pytest.approx([r["loss"] for r in ref], rel=1e-5)


def test_cab_recipe_runs_from_the_cli_with_a_shallower_student(run_overrides, tmp_path):
    """The built-in recipe end to end (align then kd), student shallower than the teacher (1 of 2 layers)."""
    recipe = load_recipe("cab")
    assert [s.kind for s in recipe.stages] == ["bridge_alignment", "kd"] and recipe.student.depth == 24 < 30
    out = tmp_path / "run"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    sets = _cab_sets(run_overrides, **{"student.depth": 1})
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "attn2ssm",
            "distill",
            "cab",
            "--out",
            str(out),
            "--no-progress",
            *sum((["--set", s] for s in sets), []),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["layer_plan"] == [M2] and results["student_ppl"] > 1
    assert [r["stage"] for r in _records(out)] == ["align"] * 8 + ["kd"] * 2
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(out / "student", trust_remote_code=True)
    assert student.config.teacher_layers == [1] and student.config.mixer_options[M2]["A_init"] == -1e-4
    assert student.generate(
        _ids(b=1, l=4), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0
    ).shape == (1, 7)

"""MOHAWK: matrix-orientation and hidden-alignment losses against hand computations,
the two layer-local stage kinds on a tiny teacher, discrete Mamba-2's full mixing matrix (with
D) against its chunked and recurrent forms, and the recipes end to end."""

import json
import math

import pytest
import torch

from attn2ssm.distill.losses import hidden_distance, matrix_distance
from attn2ssm.distill.recipe import StageConfig, load_recipe
from attn2ssm.distill.stages import STAGE_KINDS, select_trainable
from attn2ssm.distill.stages.base import mixing_matrix, parameter_groups
from attn2ssm.distill.trainer import distill
from attn2ssm.errors import ConfigError
from attn2ssm.ops.conv import causal_conv1d
from attn2ssm.ops.ssd import ssd_chunked, ssd_sequential
from attn2ssm.student.convert import convert
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from tiny_models import tiny_model

# --------------------------------------------------------------------------- losses by hand


def _matrix_pair():
    """Two sequences × two heads of 2×2 matrices; the second sequence's first token is padding."""
    S = torch.zeros(2, 2, 2, 2)
    T = torch.zeros(2, 2, 2, 2)
    S[0, 0] = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    T[0, 0] = torch.tensor([[1.0, 0.0], [0.2, 0.8]])  # row 2 differs by (0.3, -0.3)
    S[0, 1] = T[0, 1] = torch.tensor([[1.0, 0.0], [0.6, 0.4]])  # equal
    S[1, 0] = torch.tensor([[9.0, 9.0], [0.0, 0.7]])
    T[1, 0] = torch.tensor([[0.5, 0.5], [0.4, 1.0]])  # only entry (1, 1) is real: differs by 0.3
    S[1, 1] = torch.tensor([[0.0, 0.0], [5.0, 1.0]])
    T[1, 1] = torch.tensor([[0.3, 0.7], [0.0, 1.0]])  # real entry equal; garbage elsewhere
    mask = torch.tensor([[1, 1], [0, 1]])
    return S, T, mask


@pytest.mark.parametrize(
    "norm,expected",
    [
        ("fro", (math.sqrt(0.18) + 0.3) / 4),  # per (sequence, head) norms 0.4243, 0, 0.3, 0; mean of 4
        ("fro_squared", (0.18 + 0.09) / 4),
        ("row_squared", (0.18 + 0.09) / 6),  # 3 real query rows × 2 heads
    ],
)
def test_matrix_distance_hand_computed(norm, expected):
    S, T, mask = _matrix_pair()
    assert matrix_distance(S, T, mask, norm=norm).item() == pytest.approx(expected, rel=1e-6)


def test_matrix_distance_without_mask_and_zero_gradient_at_a_match():
    S, T, _ = _matrix_pair()
    S, T = S[:1], T[:1]
    assert matrix_distance(S, T).item() == pytest.approx(math.sqrt(0.18) / 2, rel=1e-6)
    same = T.clone().requires_grad_(True)
    loss = matrix_distance(same, T)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(same.grad, torch.zeros_like(T))  # not NaN
    with pytest.raises(ValueError, match="unknown matrix norm"):
        matrix_distance(S, T, norm="spectral")


@pytest.mark.parametrize(
    "form,both,first_only", [("l2", 3.0, 5.0), ("l2_squared", 13.0, 25.0), ("mse", 6.5, 12.5)]
)
def test_hidden_distance_hand_computed(form, both, first_only):
    t = torch.tensor([[[1.0, 1.0], [2.0, 0.0]]])
    s = t + torch.tensor([[[3.0, 4.0], [0.0, 1.0]]])  # per-token L2 distances 5 and 1
    assert hidden_distance(s, t, form=form).item() == pytest.approx(both, rel=1e-6)
    assert hidden_distance(s, t, torch.tensor([[1, 0]]), form=form).item() == pytest.approx(
        first_only, rel=1e-6
    )


# --------------------------------------------------------------------------- stage kinds


def _ids(b=4, l=32, seed=0):
    return torch.randint(0, 256, (b, l), generator=torch.Generator().manual_seed(seed))


def _steps(kind_name, student, teacher, n, lr, cfg=None, seed=0):
    kind, cfg = STAGE_KINDS[kind_name], cfg or StageConfig(name="s", kind=kind_name)
    # as OptimConfig
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    g, losses = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        loss, metrics = kind.loss(
            student, teacher, {"input_ids": torch.randint(0, 256, (4, 32), generator=g)}, cfg
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, metrics


def test_matrix_orientation_is_zero_when_the_student_matrix_is_the_teacher_attention():
    """Zeroed key projections make softmax attention uniform over the visible keys; linear
    attention with elu+1 maps on the copied (zero) keys gives the same uniform weights, so the
    distance vanishes — with left padding, whose rows and columns must be ignored."""
    teacher = tiny_model("llama")
    with torch.no_grad():
        for layer in teacher.model.layers:
            layer.self_attn.k_proj.weight.zero_()
    student = convert(teacher, ["linear_attention"] * 2, {"linear_attention": {"feature_map": "elu"}})
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    for norm in ("fro", "fro_squared", "row_squared"):
        cfg = StageConfig(name="mo", kind="matrix_orientation", losses={"matrix_norm": norm})
        loss, metrics = STAGE_KINDS["matrix_orientation"].loss(
            student, teacher, {"input_ids": _ids(2, 12), "attention_mask": mask}, cfg
        )
        assert loss.item() < 1e-5 and metrics["matrix"] < 1e-5, (norm, loss.item())
    # and it is not zero for a real teacher
    loss, _ = STAGE_KINDS["matrix_orientation"].loss(
        student, tiny_model("llama"), {"input_ids": _ids(2, 12)}, cfg
    )
    assert loss.item() > 1e-2


def test_matrix_orientation_lowers_the_distance_and_trains_only_what_shapes_the_matrix():
    torch.manual_seed(0)
    teacher = tiny_model("llama")
    student = convert(teacher, ["discrete_mamba2"] * 2, {"discrete_mamba2": {"D_init": 1.0}})
    select_trainable(student, ["mixers"])
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    losses, metrics = _steps("matrix_orientation", student, teacher, 25, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0], losses
    assert set(metrics) == {"matrix"}
    moved = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert (
        any(".q_proj." in n for n in moved)
        and any(".k_proj." in n for n in moved)
        and any(".a_proj." in n for n in moved)
    )
    assert any(n.endswith(".D") for n in moved)
    # values, output projection and gate do not enter the matrix: zero or no gradient, no step
    assert not any(x in n for n in moved for x in (".v_proj.", ".o_proj.", ".gate."))
    assert moved <= parameter_groups(student)["mixers"]


def test_matrix_orientation_skip_option_adds_D_on_the_diagonal():
    teacher = tiny_model("llama")
    student = convert(teacher, ["discrete_mamba2"] * 2, {"discrete_mamba2": {"D_init": 0.75}})
    mixer = student.mixers()[0]
    x = torch.randn(2, 6, 64)
    mask = torch.ones(2, 6)
    mask[1, :2] = 0
    _, with_d = mixing_matrix(mixer, x, mask=mask)
    _, without = mixing_matrix(mixer, x, mask=mask, skip=False)
    diag = (with_d - without).diagonal(dim1=-2, dim2=-1)  # (b, h, l)
    expected = 0.75 * mask[:, None, :].expand_as(diag)  # D on real tokens only
    torch.testing.assert_close(diag, expected)
    off = (with_d - without) - torch.diag_embed(diag)
    assert torch.equal(off, torch.zeros_like(off))


def test_matrix_orientation_refuses_a_mixer_without_a_matrix():
    teacher = tiny_model("llama")
    student = convert(teacher, ["discrete_mamba2", "mamba"])
    cfg = StageConfig(name="mo", kind="matrix_orientation")
    with pytest.raises(ConfigError, match=r"layer 1 is a 'mamba' mixer.*hidden_alignment"):
        STAGE_KINDS["matrix_orientation"].loss(student, teacher, {"input_ids": _ids()}, cfg)
    with pytest.raises(ConfigError, match="matrix_norm"):
        STAGE_KINDS["matrix_orientation"].options(
            StageConfig(name="mo", kind="matrix_orientation", losses={"matrix_norm": "l1"})
        )


def test_hidden_alignment_moves_only_mixer_parameters_and_lowers_the_distance():
    torch.manual_seed(0)
    teacher = tiny_model("llama")
    student = convert(teacher, ["discrete_mamba2", "mamba"])  # any mixer: no matrix needed
    select_trainable(student, ["all"])  # even with everything unfrozen, only mixers get a gradient
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    losses, metrics = _steps("hidden_alignment", student, teacher, 25, lr=3e-3)
    assert losses[-1] < 0.7 * losses[0], losses
    assert set(metrics) == {"hidden"}
    mixers = parameter_groups(student)["mixers"]
    moved = {n for n, p in student.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= mixers
    assert {n for n, p in student.named_parameters() if p.grad is not None} <= mixers


def test_attention_weight_loss_accepts_normalised_mixers_and_refuses_ssms():
    teacher = tiny_model("llama")
    cfg = StageConfig(name="at", kind="attention_transfer")
    for kind in ("linear_attention", "hedgemamba"):
        student = convert(teacher, [kind] * 2)
        loss, metrics = STAGE_KINDS["attention_transfer"].loss(
            student, teacher, {"input_ids": _ids(2, 12)}, cfg
        )
        assert torch.isfinite(loss) and "attn" in metrics
    student = convert(teacher, ["discrete_mamba2"] * 2)
    with pytest.raises(ConfigError, match="normalised weights"):
        STAGE_KINDS["attention_transfer"].loss(student, teacher, {"input_ids": _ids(2, 12)}, cfg)
    out_only = StageConfig(
        name="at",
        kind="attention_transfer",
        losses={"attention": 0.0, "output_mse": 1.0, "output_cosine": 1.0},
    )
    loss, metrics = STAGE_KINDS["attention_transfer"].loss(
        student, teacher, {"input_ids": _ids(2, 12)}, out_only
    )
    assert torch.isfinite(loss) and set(metrics) == {"mse", "cos"}


# --------------------------------------------------------------------------- discrete Mamba-2 forms


def test_discrete_mamba2_full_matrix_equals_chunked_and_recurrent_with_padding():
    """(M + D·I) x from the materialised matrix (what stage 1 orients) equals the chunked SSD and
    the token-by-token recurrence on the same x, a, B, C, D, with left padding; and through the
    gate and output projection it is the mixer's ordinary forward."""
    torch.manual_seed(0)
    student = convert(
        tiny_model("gqa_9x3"), ["discrete_mamba2"] * 2, {"discrete_mamba2": {"D_init": 1.0, "chunk_size": 4}}
    )
    mixer = student.mixers()[0]
    with torch.no_grad():  # off the init so decay, conv, gate and D all matter
        for p in mixer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    u = torch.randn(2, 11, 72)
    mask = torch.ones(2, 11)
    mask[1, :3] = 0
    with torch.no_grad():
        _, M = mixing_matrix(mixer, u, mask=mask)
        xbc, _ = causal_conv1d(
            mixer._xbc(u, None),
            mixer.conv.weight,
            mixer.conv.bias,
            mask=mask,
            activation=mixer.conv_activation,
        )
        x, B, C = mixer._split(xbc)
        a, _ = mixer._decay(u)
        y_matrix = (M @ x.transpose(1, 2)).transpose(1, 2)  # (b, l, h, p)
        y_chunked, _ = ssd_chunked(x, a, B, C, mask=mask, D=mixer.D, chunk_size=4)
        y_steps, _ = ssd_sequential(x, a, B, C, mask=mask, D=mixer.D)
        mixer.context.padding_mask = mask
        out_forward = mixer(u)[0]
        mixer.context.padding_mask = None
        out_matrix = mixer.o_proj(y_matrix.flatten(2) * torch.nn.functional.silu(mixer.gate(u)))
    real = mask.bool()
    torch.testing.assert_close(y_matrix[real], y_chunked[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y_matrix[real], y_steps[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_matrix[real], out_forward[real], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- recipes


def _tiny_recipe(run_overrides, name, *stage_tokens, **extra):
    """The built-in recipe ``name`` on the tiny setup: its own stages, ``stage_tokens`` each
    (batches of 2 blocks of 32 tokens), saving every step."""
    sets = [s for s in run_overrides() if not s.startswith("stages=")]
    for i, tokens in enumerate(stage_tokens):
        sets += [f"stages.{i}.tokens={tokens}", f"stages.{i}.batch_size=2", f"stages.{i}.save_every=1"]
    sets += [f"{k}={v}" for k, v in extra.items()]
    return load_recipe(name, sets)


def test_mohawk_recipes_load_with_the_paper_stage_order():
    kinds = {
        name: [s.kind for s in load_recipe(name).stages]
        for name in ("mohawk", "mohawk_2_3", "mohawk_3", "mohawk_hybrid")
    }
    assert kinds == {
        "mohawk": ["matrix_orientation", "hidden_alignment", "kd"],
        "mohawk_2_3": ["hidden_alignment", "kd"],
        "mohawk_3": ["kd"],
        "mohawk_hybrid": ["matrix_orientation", "hidden_alignment", "kd"],
    }
    budgets = {name: sum(s.tokens for s in load_recipe(name).stages) for name in kinds}
    assert len(set(budgets.values())) == 1  # the stage ablation compares equal token budgets
    full = load_recipe("mohawk")
    assert full.student.mixer == "discrete_mamba2" and [s.trainable for s in full.stages] == [
        ["mixers"],
        ["mixers"],
        ["all"],
    ]
    assert full.stages[0].losses == {"matrix_norm": "fro", "skip": "include"} and full.stages[1].losses == {
        "distance": "l2"
    }
    assert load_recipe("mohawk_hybrid").student.attention_ratio > 0


@pytest.mark.parametrize(
    "name,ratio,plan",
    [("mohawk", 0.0, ["discrete_mamba2"] * 2), ("mohawk_hybrid", 0.5, ["discrete_mamba2", "attention"])],
)
def test_mohawk_end_to_end_on_the_tiny_setup(run_overrides, tmp_path, name, ratio, plan):
    out = tmp_path / "run"
    recipe = _tiny_recipe(run_overrides, name, 128, 128, 128, **{"student.attention_ratio": ratio})
    distill(recipe, out, progress=False)
    student = Attn2SSMForCausalLM.from_pretrained(out / "student")
    assert student.config.layer_plan == plan
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_stage = {r["stage"]: r for r in records if "stage" in r}
    assert "train_matrix" in by_stage["matrix_orientation"] and "train_hidden" in by_stage["hidden_alignment"]
    assert "train_kl" in by_stage["distill"] and math.isfinite(by_stage["distill"]["loss"])

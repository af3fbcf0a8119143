"""Vision CAB (Algorithm 1) and its baselines: losses against hand-computed values,
the hooked K/Q and B/C captures, and the trainer end to end on a tiny ViT and a tiny image set."""

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageClassification, ViTConfig, ViTForImageClassification

from attn2ssm.distill.recipe import ImageDataConfig, Recipe, StageConfig, StudentConfig, load_recipe, validate
from attn2ssm.distill.stages.cab import Bridges
from attn2ssm.distill.stages.cab_vision import (
    bidirectional_bridge_loss,
    softened_kl,
    student_bc_and_logits,
    teacher_qk_and_logits,
)
from attn2ssm.errors import ConfigError
from attn2ssm.student.convert_vision import build_vision_student
from attn2ssm.teachers.vision import image_processor_for


def tiny_vit(seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    return ViTForImageClassification(cfg).eval()


# ---- losses by hand ------------------------------------------------------------------------


def test_softened_kl_matches_hand_values():
    s, t = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
    # τ = 1: p_T = (3/4, 1/4), p_S = (1/2, 1/2): KL = 3/4 ln(3/2) + 1/4 ln(1/2)
    assert softened_kl(s, t, 1.0).item() == pytest.approx(
        0.75 * math.log(1.5) + 0.25 * math.log(0.5), abs=1e-6
    )
    # τ = 2: p_T = (√3, 1)/(1+√3), scaled by τ² = 4
    r = math.sqrt(3.0)
    p = (r / (1 + r), 1 / (1 + r))
    want = 4 * (p[0] * math.log(p[0] / 0.5) + p[1] * math.log(p[1] / 0.5))
    assert softened_kl(s, t, 2.0).item() == pytest.approx(want, abs=1e-6)
    assert want == pytest.approx(0.145363, abs=1e-6)


def _identity_ish_bridges():
    """One layer (0 → teacher 0), B/C width 1 → K/Q width 2 (1 head of 2): φ(x) = (silu(x), 2·silu(x))."""
    br = Bridges({0: 0}, {0: (1, 2, 1, 2)}, hidden=1)
    with torch.no_grad():
        for phi in (br.phi_B["0"], br.phi_C["0"]):
            phi.net[0].weight.fill_(1.0), phi.net[0].bias.zero_()
            phi.net[2].weight.copy_(torch.tensor([[1.0], [2.0]])), phi.net[2].bias.zero_()
    return br


def test_bidirectional_bridge_loss_matches_hand_values():
    br = _identity_ish_bridges()
    silu1 = 1 / (1 + math.exp(-1))  # silu(1) = σ(1)
    # one image, two tokens; B, C (1, 2, 1, 1); K, Q (1, 2, 1, 2)
    B_fw, C_fw = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1), torch.tensor([0.0, 0.0]).view(1, 2, 1, 1)
    B_bw, C_bw = torch.tensor([0.0, 0.0]).view(1, 2, 1, 1), torch.tensor([1.0, 1.0]).view(1, 2, 1, 1)
    K = torch.tensor([[1.0, 1.0], [0.0, 0.0]]).view(1, 2, 1, 2)
    Q = torch.tensor([[0.0, 1.0], [1.0, 0.0]]).view(1, 2, 1, 2)
    feats = {0: {"fw": (B_fw, C_fw), "bw": (B_bw, C_bw)}}
    loss, m = bidirectional_bridge_loss(feats, {0: (K, Q)}, br)
    # fw: B token 0: (s, 2s) vs (1, 1); token 1: (0, 0) vs (0, 0) → mean over tokens
    b_fw = ((silu1 - 1) ** 2 + (2 * silu1 - 1) ** 2) / 2
    c_fw = (1 + 1) / 2  # C = 0 → φ = 0: ‖(0,0)−(0,1)‖² = 1, ‖(0,0)−(1,0)‖² = 1
    b_bw = (2 + 0) / 2  # B = 0: ‖−(1,1)‖² = 2, 0
    c_bw = ((silu1 - 0) ** 2 + (2 * silu1 - 1) ** 2 + (silu1 - 1) ** 2 + (2 * silu1) ** 2) / 2
    assert m["align_B_fw"] == pytest.approx(b_fw, abs=1e-6) and m["align_C_fw"] == pytest.approx(
        c_fw, abs=1e-6
    )
    assert m["align_B_bw"] == pytest.approx(b_bw, abs=1e-6) and m["align_C_bw"] == pytest.approx(
        c_bw, abs=1e-6
    )
    assert loss.item() == pytest.approx(b_fw + c_fw + b_bw + c_bw, abs=1e-5)
    # patches only: a mask dropping token 0 leaves token 1's terms
    loss_p, _ = bidirectional_bridge_loss(
        feats, {0: (K, Q)}, br, torch.tensor([[0.0, 1.0]]), b_weight=0.5, c_weight=2.0
    )
    want = 0.5 * 0 + 2.0 * 1 + 0.5 * 0 + 2.0 * ((silu1 - 1) ** 2 + (2 * silu1) ** 2)
    assert loss_p.item() == pytest.approx(want, abs=1e-5)


# ---- captures ----------------------------------------------------------------------------------


def test_teacher_qk_are_the_projections_of_each_layer_input():
    teacher = tiny_vit()
    x = torch.randn(2, 1, 8, 8)
    out, logits = teacher_qk_and_logits(teacher, x, [1])
    torch.testing.assert_close(logits, teacher(pixel_values=x).logits)
    hidden = teacher(pixel_values=x, output_hidden_states=True).hidden_states[1]  # input of layer 1
    layer = teacher.vit.layers[1]
    h = layer.layernorm_before(hidden)
    K, Q = out[1]
    assert K.shape == (2, 5, 2, 8)
    torch.testing.assert_close(Q.flatten(2), layer.attention.q_proj(h))
    torch.testing.assert_close(K.flatten(2), layer.attention.k_proj(h))


def test_student_reports_both_directions_in_token_order():
    student = build_vision_student(tiny_vit(), mixer_options={"d_state": 4}, depth=4)
    assert student.config.teacher_layers == [0, 0, 1, 1]  # Eq. 7 (paper map): 4 ← 2
    feats, logits = student_bc_and_logits(student, torch.randn(3, 1, 8, 8), [0, 3])
    assert set(feats) == {0, 3} and logits.shape == (3, 3)
    B, C = feats[3]["bw"]
    assert B.shape == C.shape == (3, 5, 1, 4) and B.requires_grad
    assert not any(m.bc_tap._forward_hooks for m in student.mixers().values())  # hooks removed again


# ---- recipes and the trainer ------------------------------------------------------------------


def _image_dir(tmp_path, n_per_class=6):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
    from PIL import Image as PILImage

    rng = np.random.default_rng(0)
    feats = Features({"image": Image(), "label": ClassLabel(names=["a", "b", "c"])})

    def split(n):
        labels = [c for c in range(3) for _ in range(n)]
        images = [
            PILImage.fromarray((rng.random((8, 8)) * 80 + 60 * c).astype(np.uint8), mode="L") for c in labels
        ]
        return Dataset.from_dict({"image": images, "label": labels}, features=feats)

    path = tmp_path / "images"
    DatasetDict({"train": split(n_per_class), "test": split(2)}).save_to_disk(str(path))
    return str(path)


def _teacher_dir(tmp_path):
    teacher = tiny_vit()
    path = tmp_path / "teacher"
    teacher.save_pretrained(path)
    image_processor_for(teacher.config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", ["vision_cab", "vision_kd", "vision_ce"])
def test_trainer_runs_each_vision_kind_and_saves_an_hf_classifier(tmp_path, kind):
    from attn2ssm.distill.trainer import distill

    losses = {
        "vision_cab": {"align_until": 0.5, "align_tokens": "patches"},
        "vision_kd": {},
        "vision_ce": {},
    }[kind]
    recipe = Recipe(
        name=f"t_{kind}",
        teacher=_teacher_dir(tmp_path),
        images=ImageDataConfig(source=_image_dir(tmp_path), fraction=0.5, eval_images=4),
        student=StudentConfig(
            mixer="bimamba", mixer_options={"d_state": 4, "A_init": -1e-4}, layer_map="paper"
        ),
        stages=[
            StageConfig(
                name="s",
                kind=kind,
                tokens=16,
                batch_size=4,
                trainable=["all"],
                temperature=2.0,
                losses=losses,
                save_every=2,
            )
        ],
    )
    results = distill(recipe, tmp_path / "run", progress=False)
    # half of 6 per class, all of the test split
    assert results["train_images"] == 9 and results["test_images"] == 6
    assert 0.0 <= results["student_top1"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and "eval_top1" in rows[-1]
    if kind == "vision_cab":  # alignment on for steps 0-1 of 4, then KL only
        assert "align" in rows[0] or "train_align" in rows[0]
        assert "train_align" not in rows[-1] and "train_kl" in rows[-1]
    student = AutoModelForImageClassification.from_pretrained(tmp_path / "run" / "student")
    assert type(student).__name__ == "Attn2SSMForImageClassification"


def test_vision_kinds_and_images_must_go_together():
    with pytest.raises(ConfigError, match="needs the recipe's images"):
        validate(Recipe(stages=[StageConfig(kind="vision_kd")]))
    with pytest.raises(ConfigError, match="cannot use the recipe's images"):
        validate(Recipe(images=ImageDataConfig(), stages=[StageConfig(kind="kd")]))
    with pytest.raises(ConfigError, match="align_until"):
        load_recipe("cab_vision", ["stages.0.losses.align_until=2"])


@pytest.mark.parametrize("name", ["cab_vision", "cab_vision_kd", "cab_vision_scratch"])
def test_builtin_vision_recipes_load(name):
    r = load_recipe(name)
    assert r.images is not None and r.student.mixer == "bimamba"

"""LoRA on a linear-attention student through peft, learned feature maps included (issue 20, item 5).

A Hedgehog (or T2R) map is one small Linear per head, stored as ``weight`` (heads, head_dim,
features) — not an ``nn.Linear``, so peft refuses it in ``target_modules``. peft's
``target_parameters`` takes such a 3-D weight as it takes MoE expert weights (one rank-r update per
head: ΔW_h = B_h·A_h), and ``modules_to_save`` trains the whole map. Both routes are checked here:
only what was asked trains, cached decoding equals full forwards, ``merge_and_unload`` gives back a
plain student whose state dict has the original names and which saves and reloads with the same
logits, and a peft adapter saved on its own loads onto a fresh student.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers the Auto classes)
from cache_forms import greedy_by_full_forwards
from tiny_models import tiny_student

peft = pytest.importorskip("peft")

LA = "linear_attention"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MAPS = ["feature_map_q", "feature_map_k"]
ROUTES = {
    "target_parameters": {"target_modules": PROJECTIONS, "target_parameters": [f"{m}.weight" for m in MAPS]},
    "modules_to_save": {"target_modules": PROJECTIONS, "modules_to_save": MAPS},
}


def _student(feature_map="hedgehog"):
    return tiny_student("llama", LA, 0.5, {"feature_map": feature_map})


def _ids(b=2, l=9, seed=0):
    return torch.randint(3, 256, (b, l), generator=torch.Generator().manual_seed(seed))


def _train(model, steps=3):
    """A few SGD steps on next-token CE; returns the trainable parameters' names."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in trainable], lr=0.5)
    ids = _ids(l=12, seed=1)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
    model.eval()
    return [n for n, _ in trainable]


@pytest.mark.parametrize("feature_map", ["hedgehog", "t2r"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_lora_on_feature_maps_trains_decodes_and_merges(route, feature_map, tmp_path):
    student = _student(feature_map)
    plain_keys = set(student.state_dict())
    ids = _ids()
    with torch.no_grad():
        before = student(input_ids=ids, use_cache=False).logits
    model = peft.get_peft_model(student, peft.LoraConfig(r=4, lora_alpha=8, **ROUTES[route]))
    names = _train(model)
    map_names = [n for n in names if ".feature_map_" in n]
    assert map_names, "the feature maps train"
    if route == "target_parameters":  # only adapters train: the maps' own weights stay frozen
        assert all("lora_" in n for n in names)
    else:  # the maps train whole (a trainable copy), the projections through adapters
        assert all("lora_" in n or "modules_to_save" in n for n in names) and any(
            "modules_to_save" in n for n in map_names
        )
    with torch.no_grad():
        tuned = model(input_ids=ids, use_cache=False).logits
    assert (tuned - before).abs().max() > 1e-3

    # generate's cached steps run the adapted maps too
    prompt = ids[:1, :5]
    out = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(model, prompt, 5))

    # a saved adapter loads onto a fresh student
    model.save_pretrained(tmp_path / "adapter")
    again = peft.PeftModel.from_pretrained(_student(feature_map), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids, use_cache=False).logits, tuned, rtol=0, atol=1e-5)

    # merged: a plain student again, same names, same logits, saved and reloaded
    merged = model.merge_and_unload()
    assert type(merged).__name__ == "Attn2SSMForCausalLM" and set(merged.state_dict()) == plain_keys
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids, use_cache=False).logits, tuned, rtol=1e-4, atol=1e-4)
    merged.save_pretrained(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, tuned, rtol=1e-4, atol=1e-4)


def test_target_parameters_update_each_head_separately():
    """One (r × head_dim) A and (features × r) B per head: heads do not share an update."""
    student = _student()
    model = peft.get_peft_model(
        student, peft.LoraConfig(r=2, target_parameters=["feature_map_q.weight"], init_lora_weights=False)
    )
    fmap = next(
        m for n, m in model.named_modules() if n.endswith("feature_map_q") and hasattr(m, "get_delta_weight")
    )
    heads, head_dim, features = fmap.get_base_layer().weight.shape
    delta = fmap.get_delta_weight("default")
    assert delta.shape == (heads, head_dim, features)
    assert not torch.allclose(delta[0], delta[1])
    assert all(torch.linalg.matrix_rank(delta[h]) <= 2 for h in range(heads))


def test_card_of_a_learned_map_student_names_the_peft_routes(tmp_path):
    _student().save_pretrained(tmp_path / "hedgehog")
    card = (tmp_path / "hedgehog" / "README.md").read_text()
    assert (
        'target_parameters=["feature_map_q.weight", "feature_map_k.weight"]' in card
        and "modules_to_save" in card
    )
    _student("elu").save_pretrained(tmp_path / "elu")  # nothing learned in the maps: nothing to say
    assert "target_parameters" not in (tmp_path / "elu" / "README.md").read_text()

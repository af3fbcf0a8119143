"""Students of another depth than their teacher: the layer map, conversion, HF round trips, cache forms."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers Auto classes)
from attn2ssm.adapters import get_adapter
from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert, grow_student
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from attn2ssm.student.plans import layer_map
from cache_forms import full_and_pieces, greedy_by_full_forwards, run_remote
from tiny_models import tiny_model

M2 = "mamba2"


def _ids(b=2, l=12, vocab=256, seed=0):
    return torch.randint(0, vocab, (b, l), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# layer_map


def test_layer_map_hand_cases():
    # equal depth: the identity, in both forms
    assert layer_map(12, 12) == layer_map(12, 12, "paper") == list(range(12))
    # deeper (CAB's Vim 24 <- DeiT 12): two student layers per teacher layer
    assert layer_map(24, 12) == layer_map(24, 12, "paper") == [i // 2 for i in range(24)]
    assert layer_map(4, 2) == [0, 0, 1, 1]
    # shallower: endpoints keeps first and last; the fixed paper form keeps the last, skips the first
    assert layer_map(6, 12) == [0, 2, 4, 7, 9, 11]
    assert layer_map(6, 12, "paper") == [1, 3, 5, 7, 9, 11]
    assert layer_map(3, 6) == [0, 3, 5]
    # edge cases: one student layer (the last teacher layer, as the paper's g(1) = T), one teacher layer
    assert layer_map(1, 5) == layer_map(1, 5, "paper") == [4]
    assert layer_map(5, 1) == layer_map(5, 1, "paper") == [0] * 5
    assert layer_map(1, 1) == [0]


@pytest.mark.parametrize("mode", ["endpoints", "paper"])
def test_layer_map_properties(mode):
    for n_s in range(1, 13):
        for n_t in range(1, 13):
            g = layer_map(n_s, n_t, mode)
            assert len(g) == n_s and all(0 <= j < n_t for j in g), (n_s, n_t, g)
            assert g == sorted(g) and g[-1] == n_t - 1  # non-decreasing, last -> last
            if n_s >= n_t:  # deeper (or equal): every teacher layer supervises someone, first -> first
                assert set(g) == set(range(n_t)) and g[0] == 0
            if n_s <= n_t:  # shallower (or equal): no teacher layer twice
                assert len(set(g)) == n_s
            if mode == "endpoints" and n_s > 1:
                assert g[0] == 0


def test_layer_map_errors():
    with pytest.raises(ConfigError, match="at least 1"):
        layer_map(0, 4)
    with pytest.raises(ConfigError, match="at least 1"):
        layer_map(3, 0)
    with pytest.raises(ConfigError, match="endpoints, paper"):
        layer_map(3, 4, "floor")


# --------------------------------------------------------------------------------------------
# conversion at another depth


def _layer_tensors(model, path: str) -> dict:
    prefix = path.rpartition(".")[0] + "."
    return {k[len(prefix) :]: v for k, v in model.state_dict().items() if k.startswith(prefix)}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gpt2"])
@pytest.mark.parametrize("depth", [1, 3, 5])
def test_each_layer_is_a_copy_of_its_teacher_layer(family, depth):
    teacher = tiny_model(family)
    n_t = teacher.config.num_hidden_layers
    plan = [M2 if i % 2 == 0 else "attention" for i in range(depth)]
    student = convert(teacher, plan, depth=depth)
    cfg = student.config
    source = layer_map(depth, n_t)
    assert cfg.teacher_layers == source and cfg.layer_plan == plan
    assert len(cfg.attention_paths) == len(cfg.layer_geometry) == depth
    adapter = get_adapter(teacher)
    assert cfg.build_base_config().num_hidden_layers == len(adapter.decoder_layers(student.base)) == depth
    t_paths = adapter.attention_module_paths(teacher)
    for i, j in enumerate(source):
        assert cfg.layer_geometry[i] == adapter.geometry(teacher.config, j).to_dict()
        mine, theirs = (
            _layer_tensors(student.base, cfg.attention_paths[i]),
            _layer_tensors(teacher, t_paths[j]),
        )
        attn = cfg.attention_paths[i].rpartition(".")[2] + "."
        for name, value in theirs.items():  # norms, MLP and (kept) attention: the teacher layer's own
            if plan[i] == "attention" or not name.startswith(attn):
                assert torch.equal(mine[name], value), (i, name)
        if plan[i] == M2:  # the mixer starts from that teacher layer's q/k/v/o
            w = adapter.read_weights(teacher.get_submodule(t_paths[j]))
            mixer = student.mixers()[i]
            assert torch.equal(mixer.k_proj.weight, w.k) and torch.equal(mixer.o_proj.weight, w.o)
    # embeddings and the final norm are shared as they are
    torch.testing.assert_close(
        student.get_input_embeddings().weight, teacher.get_input_embeddings().weight, atol=0, rtol=0
    )


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_per_layer_config_fields_follow_the_map(family):
    """Sliding-window layers stay where their teacher layers were (layer_types, max_window_layers)."""
    teacher = tiny_model(family)
    types = teacher.config.layer_types  # qwen2: [full, sliding]; gemma2: [sliding, full]
    for depth in (1, 3, 4):
        student = convert(teacher, [M2] * depth, depth=depth)
        source = student.config.teacher_layers
        base = student.config.build_base_config()
        assert base.layer_types == [types[j] for j in source]
        windows = [g["sliding_window"] for g in student.config.layer_geometry]
        assert windows == [4 if types[j] == "sliding_attention" else None for j in source]
        if family == "qwen2":  # a config rebuilt from max_window_layers alone gives the same layer types
            d = dict(student.config.base_config)
            d.pop("layer_types")
            rebuilt = AutoConfig.for_model(d.pop("model_type"), **d)
            assert rebuilt.layer_types == base.layer_types


def test_depth_errors():
    teacher = tiny_model("llama")
    with pytest.raises(ConfigError, match="depth"):
        convert(teacher, [], depth=0)
    with pytest.raises(ValueError, match="3 layers"):
        convert(teacher, [M2] * 2, depth=3)
    gpt2 = tiny_model("gpt2")
    gpt2.config.scale_attn_by_inverse_layer_idx = True  # attention scale tied to the layer index
    with pytest.raises(ConfigError, match="layer index"):
        convert(gpt2, [M2] * 3, depth=3)


def test_teacher_depth_is_unchanged():
    """depth=None and depth=T build the same student as before (no teacher_layers recorded)."""
    teacher = tiny_model("llama")
    a = convert(teacher, [M2, M2])
    torch.manual_seed(0)
    b = convert(teacher, [M2, M2], depth=2)
    assert a.config.teacher_layers is None and b.config.teacher_layers is None
    assert a.config.attention_paths == b.config.attention_paths
    assert a.config.base_config == b.config.base_config


# --------------------------------------------------------------------------------------------
# a depth-changed student is an ordinary HF checkpoint


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("depth", [1, 3])
def test_save_load_generate(family, depth, tmp_path):
    teacher = tiny_model(family)
    plan = [M2] * depth if depth == 1 else [M2, "attention", M2]
    student = convert(teacher, plan, depth=depth)
    ids = _ids()
    logits = student(input_ids=ids, use_cache=False).logits
    assert logits.shape == (2, 12, teacher.config.vocab_size) and torch.isfinite(logits).all()
    student.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == cfg["base_config"]["num_hidden_layers"] == depth
    assert len(cfg["layer_plan"]) == len(cfg["attention_paths"]) == len(cfg["layer_geometry"]) == depth
    assert cfg["teacher_layers"] == layer_map(depth, 2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, Attn2SSMForCausalLM) and loaded.config.teacher_layers == layer_map(depth, 2)
    torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, logits, atol=0, rtol=0)
    # greedy generate (recurrent cache) == repeated full forwards
    prompt = ids[:1, :5]
    out = loaded.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_by_full_forwards(loaded, prompt, 5))


REMOTE = r"""
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
ids = torch.load(d + "/ids.pt")
logits = m(input_ids=ids, use_cache=False).logits
gen = m.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
print(json.dumps({"max_diff": (logits - torch.load(d + "/logits.pt")).abs().max().item(), "layers": len(m.config.layer_plan), "gen": gen.tolist()}))
"""


def test_deeper_student_loads_with_trust_remote_code_without_attn2ssm(tmp_path):
    teacher = tiny_model("qwen2")
    student = convert(teacher, [M2, "attention", M2, "attention", M2], depth=5)
    ids = _ids()
    student.save_pretrained(tmp_path)
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(student(input_ids=ids, use_cache=False).logits, tmp_path / "logits.pt")
    result = run_remote(REMOTE, tmp_path)
    assert result["max_diff"] == 0.0 and result["layers"] == 5 and len(result["gen"][0]) == 8


@pytest.mark.parametrize("family,depth", [("llama", 3), ("qwen2", 3), ("gemma2", 4), ("gpt2", 1)])
def test_cache_forms_agree(family, depth):
    """Full forward == chunked prefill == prefill + decode, with left padding, at another depth
    (kept attention layers keep their sliding windows where the teacher had them)."""
    teacher = tiny_model(family)
    plan = [M2 if i % 2 == 0 else "attention" for i in range(depth)]
    student = convert(teacher, plan, depth=depth)
    ids = _ids(l=14)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :4] = 0
    real = mask.bool()
    full, stepped = full_and_pieces(student, ids, mask, [6] + [1] * 8)
    torch.testing.assert_close(stepped[real], full[real], atol=1e-4, rtol=1e-4)
    full, chunked = full_and_pieces(student, ids, mask, [5, 3, 6])
    torch.testing.assert_close(chunked[real], full[real], atol=1e-4, rtol=1e-4)


def test_grow_a_deeper_student_from_its_teacher_layers():
    """Stepwise schedules work at another depth: a newly converted layer starts from the teacher
    layer it was built from (config.teacher_layers), not from the teacher layer of the same index."""
    teacher = tiny_model("llama")
    student = convert(teacher, ["attention", M2, "attention", "attention"], depth=4)  # layers from 0, 0, 1, 1
    grown = grow_student(student, teacher, [M2, M2, "attention", M2])
    adapter = get_adapter(teacher)
    t_paths = adapter.attention_module_paths(teacher)
    for i in (0, 3):
        w = adapter.read_weights(teacher.get_submodule(t_paths[student.config.teacher_layers[i]]))
        assert torch.equal(grown.mixers()[i].q_proj.weight, w.q)
    assert torch.equal(grown.mixers()[1].A_log, student.mixers()[1].A_log)  # the trained mixer carries over
    assert grown.config.teacher_layers == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match="does not match"):
        grow_student(student, tiny_model("gpt2"), [M2, M2, "attention", M2])

"""A head-level hybrid student (mixers/kept_heads.py) outside its mixer: greedy generate of a padded
batch, the CPU decode plan, a rolled-back cache, save/load as remote code without attn2ssm (the
probe's record included), and native / GGUF export's refusal (``attn2ssm convert --kv-budget``:
tests/cli/test_cli_convert_heads.py)."""

import json
from types import SimpleNamespace

import pytest
import torch

from attn2ssm.decode.layout import cpu_decode_layout
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.errors import ExportError
from attn2ssm.eval import report
from attn2ssm.eval.kv_cache import kept_kv_groups
from attn2ssm.export.native import check_exportable
from attn2ssm.mixers.kept_heads import head_level_plan
from attn2ssm.student.convert import convert
from cache_forms import greedy_by_full_forwards, run_remote
from tiny_models import perturb_new_mixer_parameters, tiny_model

KEPT = {0: [2], 1: [0, 1]}
RECORD = {"kept": {"0": [2], "1": [0, 1]}, "kv_groups_kept": 3, "source": "test"}


def _student(options=None):
    torch.manual_seed(0)
    teacher = tiny_model("gqa_9x3")
    plan, by_kind = head_level_plan(
        ["linear_attention"] * 2, options or {"feature_map": "hedgehog", "window": 3}, KEPT
    )
    student = convert(teacher, plan, by_kind)
    perturb_new_mixer_parameters(student)
    student.config.retrieval_probe = RECORD
    return student.eval()


def test_greedy_generate_of_a_padded_batch_is_argmax_of_full_forwards():
    student = _student()
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(3, 256, (1, 9), generator=g), torch.randint(3, 256, (1, 6), generator=g)
    pad = torch.zeros(1, 3, dtype=torch.long)
    ids = torch.cat([a, torch.cat([pad, b], 1)])
    mask = torch.cat([torch.ones(1, 9), torch.cat([torch.zeros(1, 3), torch.ones(1, 6)], 1)]).long()
    with torch.no_grad():
        out = student.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0], greedy_by_full_forwards(student, a, 6)[0])
    assert torch.equal(out[1, 3:], greedy_by_full_forwards(student, b, 6)[0])


@pytest.mark.parametrize("options", [{"feature_map": "hedgehog", "window": 3}, {"feature_map": "hedgehog"}])
def test_the_decode_plan_takes_kept_heads_and_equals_hf_forward(options):
    reference, fast = _student(options), _student(options)
    cpu_decode_layout(fast)
    assert fast.__dict__["_decode_plan"] is not None, fast.decode_plan_reason
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    logits = []
    for model in (reference, fast):
        cache, steps = model.new_cache(), []
        with torch.no_grad():
            token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(4):
                out = model(token, past_key_values=cache, use_cache=True)
                steps.append(out.logits)
                token = out.logits[:, -1:].argmax(-1)
        logits.append(torch.cat(steps, 1))
        assert cache.mixer_layer(1).states["softmax_kv"].k.shape == (2, 2, 11, 8)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_a_rolled_back_cache_equals_one_that_never_saw_the_tokens():
    student = _student()
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        kept = student.new_cache()
        student(ids[:, :7], past_key_values=kept, use_cache=True)
        rolled = student.new_cache()
        student(ids[:, :5], past_key_values=rolled, use_cache=True)
        rolled.activate_past_recording()
        student(ids[:, 5:9], past_key_values=rolled, use_cache=True)
        rolled.crop(-2)
        a = student(ids[:, 7:], past_key_values=kept, use_cache=True).logits
        b = student(ids[:, 7:], past_key_values=rolled, use_cache=True).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert rolled.mixer_layer(1).states["softmax_kv"].k.shape[2] == 10


REMOTE = r"""
ids = torch.load(d + "/ids.pt")
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
cache = m.new_cache()
with torch.no_grad():
    full = m(input_ids=ids, use_cache=False).logits
    first = m(input_ids=ids[:, :5], past_key_values=cache, use_cache=True).logits
    rest = [m(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits for i in range(5, ids.shape[1])]
stepped = torch.cat([first, *rest], 1)
print(json.dumps({"diff": (full - torch.load(d + "/logits.pt")).abs().max().item(),
                  "stepped": (stepped - full).abs().max().item(),
                  "kept": [getattr(x, "kv_heads_kept", 0) for x in m.mixers().values()],
                  "probe": m.config.retrieval_probe}))
"""


def test_save_and_load_as_remote_code_without_attn2ssm(tmp_path):
    student = _student()
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    student.save_pretrained(tmp_path)
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        torch.save(student(input_ids=ids, use_cache=False).logits, tmp_path / "logits.pt")
    result = run_remote(REMOTE, tmp_path)
    # the same weights and code in another process: equal up to the thread count's summation order
    assert result["diff"] < 1e-5 and result["stepped"] < 1e-4
    assert result["kept"] == [1, 2] and result["probe"] == RECORD


def test_native_and_gguf_export_refuse_in_one_line(tmp_path):
    _student().save_pretrained(tmp_path)
    for llama_cpp in (False, True):
        with pytest.raises(ExportError, match="no served class") as err:
            check_exportable(tmp_path, llama_cpp=llama_cpp)
        assert "\n" not in str(err.value) and "layers [0, 1]" in str(err.value)


def test_a_compiled_decode_step_steps_aside_for_kept_heads():
    """A kept layer decodes through its mix (no one-token step), so the compiled step is never ready
    and the plan's eager step runs: the same logits, nothing traced."""
    from attn2ssm.decode.plan import enable_decode_plan

    reference, fast = _student(), _student()
    cpu_decode_layout(fast)
    enable_decode_plan(fast, compile=True)
    compiled = fast.__dict__["_decode_plan"].compiled
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    outs = []
    for model in (reference, fast):
        cache = model.new_cache()
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            assert not (model is fast and compiled.ready(cache))
            outs.append(model(ids[:, -1:], past_key_values=cache, use_cache=True).logits)
    assert not compiled.compiled_once
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_the_run_report_names_the_kept_kv_groups(tmp_path, monkeypatch):
    """A head-level run's report.md and results.json say which KV groups stay softmax attention
    (its plan alone says "attention kept at none")."""
    student = _student()
    assert kept_kv_groups(student) == KEPT and kept_kv_groups(tiny_model("gqa_9x3")) == {}
    ppl = iter([{"ppl": 10.0, "tokens": 64}, {"ppl": 11.0, "tokens": 64}])  # teacher, then student
    monkeypatch.setattr(report, "perplexity", lambda *a, **k: next(ppl))
    recipe = load_recipe("retrieval_heads")
    corpus = SimpleNamespace(heldout_ids=torch.zeros(100, dtype=torch.long))
    report.write_report(tmp_path, recipe, SimpleNamespace(), student, corpus, progress=False)
    assert json.loads((tmp_path / "results.json").read_text())["kv_groups_kept"] == {"0": [2], "1": [0, 1]}
    line = "(attention kept at none; KV groups kept as softmax attention (3): layer 0: [2], layer 1: [0, 1])"
    assert line in (tmp_path / "report.md").read_text()

"""Generation from a checkpoint loaded with ``trust_remote_code=True`` in a process where attn2ssm
cannot be imported: batched left-padded greedy, sampling, and transformers' assisted decoding
(which needs our cache's rollback) run on the flattened remote code. The decode machinery is not
in a checkpoint (the model never imports it): attn2ssm.decode attaches itself to a model loaded
as remote code, and a pure student's compiled decode step runs on the flattened code."""

import pytest
import torch
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from attn2ssm.decode.plan import enable_decode_plan
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from cache_forms import run_remote
from tiny_models import tiny_model

REMOTE = r"""
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
draft = AutoModelForCausalLM.from_pretrained(d + "/draft", trust_remote_code=True).eval()
batch, mask = torch.load(d + "/batch.pt")
greedy = m.generate(input_ids=batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
assisted = m.generate(input_ids=batch[:1], max_new_tokens=8, do_sample=False, pad_token_id=0, assistant_model=draft)
torch.manual_seed(0)
sampled = m.generate(input_ids=batch, attention_mask=mask, max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.7, pad_token_id=0)
print(json.dumps({"greedy": greedy.tolist(), "assisted": assisted.tolist(), "sampled": sampled.shape[1], "cls": type(m).__module__}))
"""


@pytest.mark.parametrize("kind", ["mamba2", "linear_attention"])
def test_remote_code_generation(kind, tmp_path):
    torch.manual_seed(0)
    teacher = tiny_model("llama")
    n = teacher.config.num_hidden_layers
    student = convert(teacher, make_plan(n, kind, attention_ratio=0.5)).eval()
    draft = convert(teacher, make_plan(n, kind, attention_ratio=0.0)).eval()
    student.save_pretrained(tmp_path)
    draft.save_pretrained(tmp_path / "draft")
    batch = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    batch[1, :3], mask[1, :3] = 0, 0
    torch.save((batch, mask), tmp_path / "batch.pt")
    expected = student.generate(
        input_ids=batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    drafted = draft.generate(
        input_ids=batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    result = run_remote(REMOTE, tmp_path)
    assert result["cls"].startswith("transformers_modules")
    assert result["greedy"] == expected.tolist()
    assert result["assisted"] == expected[:1].tolist()
    assert result["sampled"] == 15
    assert not list(tmp_path.glob("attn2ssm_decode*.py")) and list(tmp_path.glob("attn2ssm_mixers_taps.py"))
    # the decode plan and its compiled step (traced only, no inductor) attach to the remote-code draft
    remote_class = get_class_from_dynamic_module(
        "attn2ssm_student_modeling.Attn2SSMForCausalLM", tmp_path / "draft"
    )
    # (AutoModel would pick attn2ssm's own class here)
    remote = remote_class.from_pretrained(tmp_path / "draft").eval()
    assert type(remote).__module__.startswith("transformers_modules")
    assert enable_decode_plan(remote), remote.decode_plan_reason
    reason = remote.__dict__["_decode_plan"].compile_step("eager")
    with torch.no_grad():
        compiled = remote.generate(
            input_ids=batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    step = remote.__dict__["_decode_plan"].compiled
    assert (
        reason == "" and step.compiled_once and step.failed is None and compiled.tolist() == drafted.tolist()
    )

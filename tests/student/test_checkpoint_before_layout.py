"""Students saved before the layout redesign still load, with this attn2ssm and without it.

``tests/fixtures/students_before_layout_bd7ae1f.tar.xz`` holds two tiny students written by
attn2ssm bd7ae1f (the last commit before the packages moved): a 50 % Mamba-2 hybrid and a LoLCATs
student (Hedgehog maps + a 4-token softmax window), each with its weights, the remote code of that
time, the token ids of a probe and the logits that attn2ssm computed for them when it saved them.
Their state-dict names and config keys must keep meaning the same thing in every later layout.
"""

import tarfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers the Auto classes: loads with this attn2ssm's code)
from cache_forms import greedy_by_full_forwards, run_remote

FIXTURE = Path(__file__).parents[1] / "fixtures" / "students_before_layout_bd7ae1f.tar.xz"
STUDENTS = ["mamba2_hybrid", "lolcats"]

REMOTE = r"""
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
ref = torch.load(d + "/reference.pt")
with torch.no_grad():
    logits = m(input_ids=ref["ids"], use_cache=False).logits
print(json.dumps({"gap": float((logits - ref["logits"]).abs().max()), "module": type(m).__module__}))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("before-layout")
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(root, filter="data")
    return root


@pytest.mark.parametrize("name", STUDENTS)
def test_loads_with_this_attn2ssm_and_gives_the_saved_logits(saved, name):
    model = AutoModelForCausalLM.from_pretrained(saved / name).eval()
    assert type(model).__module__.startswith("attn2ssm.")  # this code, not the checkpoint's copy
    ref = torch.load(saved / name / "reference.pt")
    with torch.no_grad():
        logits = model(input_ids=ref["ids"], use_cache=False).logits
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=1e-5)
    prompt = ref["ids"][:1, :6]  # and decodes through its cache as its full forwards do
    out = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.tolist() == greedy_by_full_forwards(model, prompt, 5).tolist()


@pytest.mark.parametrize("name", STUDENTS)
def test_loads_without_attn2ssm_from_its_own_remote_code(saved, name):
    result = run_remote(REMOTE, saved / name)
    assert result["module"].startswith("transformers_modules")
    assert result["gap"] < 1e-5

"""A Gated DeltaNet student exported as ``Qwen3_5ForCausalLM`` loads and runs on a CPU in this venv as
installed, flash-linear-attention and Triton included. transformers 5.24 binds Qwen3.5's gated delta
rule to fla's Triton kernels whenever fla imports, and on a CPU they fail ("0 active drivers"):
attn2ssm's loaders send CPU tensors to transformers' own PyTorch forms (``hf_compat``), and the
model card's recipe does the same for a user of transformers alone. Each runs in a fresh process
that imports fla as the venv has it, and gives the student's logits."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.cli import main
from attn2ssm.hf_compat import cpu_runs_reference_kernels
from attn2ssm.student.convert import convert
from cache_forms import REMOTE_PRELUDE
from tiny_models import make_tokenizer, tiny_config

EXPORT_FORM = {"gate_bias": False, "beta_bias": False, "conv_bias": False, "norm_eps": "auto"}

WITH_ATTN2SSM = r"""
import importlib.util, json, sys, torch
from attn2ssm.student.loading import load_model_and_tokenizer
model, _ = load_model_and_tokenizer(sys.argv[1])
ids = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits
torch.save(logits, sys.argv[3])
print(json.dumps({"fla": importlib.util.find_spec("fla") is not None, "cls": type(model).__name__}))
"""

# The model card's recipe, for a user of transformers alone (attn2ssm cannot be imported here).
CARD_RECIPE = r"""
import importlib.util, inspect
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5
for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
    setattr(qwen3_5, name, inspect.unwrap(getattr(qwen3_5, name)))
model = AutoModelForCausalLM.from_pretrained(d).eval()
ids = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits
torch.save(logits, sys.argv[3])
print(json.dumps({"fla": importlib.util.find_spec("fla") is not None, "cls": type(model).__name__}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35_cpu")
    config = tiny_config("llama")
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    student = convert(teacher, ["gated_delta"] * 2, {"gated_delta": EXPORT_FORM}).eval()
    student.save_pretrained(root / "student")
    make_tokenizer().save_pretrained(root / "student")
    assert main(["export", str(root / "student"), "--format", "native", "--out", str(root / "native")]) == 0
    ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(2))  # > one 64-token chunk
    torch.save(ids, root / "ids.pt")
    with torch.no_grad():
        return root, student(input_ids=ids, use_cache=False).logits


def _run(root, script: str, name: str) -> torch.Tensor:
    out = root / f"{name}.pt"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(root / "native"), str(root / "ids.pt"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run == {"fla": importlib.util.find_spec("fla") is not None, "cls": "Qwen3_5ForCausalLM"}, run
    return torch.load(out)


def test_attn2ssm_loads_the_export_on_a_cpu_with_fla_installed(exported):
    root, mine = exported
    torch.testing.assert_close(_run(root, WITH_ATTN2SSM, "attn2ssm"), mine, rtol=0, atol=1e-4)


def test_the_model_card_s_recipe_runs_it_with_transformers_alone(exported):
    root, mine = exported
    assert "inspect.unwrap()" in (root / "native" / "README.md").read_text()
    torch.testing.assert_close(_run(root, REMOTE_PRELUDE + CARD_RECIPE, "card"), mine, rtol=0, atol=1e-4)


def test_gpu_tensors_keep_what_transformers_bound(monkeypatch):
    """Only CPU tensors are sent to the reference: anything else runs the function transformers bound."""
    import types

    calls = []

    def reference(x, scale=1.0):
        calls.append(("reference", x.device.type))
        return x

    def bound(*args, **kwargs):
        calls.append(("bound", args[0].device.type))
        return args[0]

    bound.__wrapped__ = reference
    module = types.ModuleType("fake_modeling")
    module.torch_chunk_gated_delta_rule = bound
    monkeypatch.setitem(sys.modules, "fake_modeling", module)
    model = type("FakeModel", (), {"__module__": "fake_modeling"})()
    assert cpu_runs_reference_kernels(model) == ["torch_chunk_gated_delta_rule"]
    assert cpu_runs_reference_kernels(model) == []  # once
    routed = module.torch_chunk_gated_delta_rule
    routed(torch.zeros(1), scale=2.0, cu_seqlens=None)  # a keyword the reference lacks is dropped
    routed(torch.zeros(1, device="meta"))
    assert calls == [("reference", "cpu"), ("bound", "meta")]

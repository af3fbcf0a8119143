"""``attn2ssm upgrade DIR`` on a checkpoint that carries the remote code written before
hf_compat.py (attn2ssm d4824a1, the code every student saved until transformers 5.24 came out:
``tests/fixtures/remote_code_d4824a1.tar.xz``). Under transformers >= 5.24 that code decodes every
token without its recurrent state; refreshed, the checkpoint decodes exactly, in a process that
cannot import attn2ssm."""

import json
import tarfile
from pathlib import Path

import pytest
import torch

from attn2ssm.cli import main
from attn2ssm.hf_compat import CACHE_KWARG, TESTED_TRANSFORMERS
from cache_forms import greedy_by_full_forwards, run_remote
from tiny_models import tiny_student

OLD_CODE = Path(__file__).parents[1] / "fixtures" / "remote_code_d4824a1.tar.xz"

# Full forward vs prefill + one token at a time through the cache, and greedy generate.
REMOTE = r"""
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
ids = torch.load(d + "/ids.pt")
with torch.no_grad():
    full = m(input_ids=ids, use_cache=False).logits
    out = m(input_ids=ids[:, :4], use_cache=True)
    cache = out.cache if hasattr(out, "cache") and "cache" in out else out.past_key_values
    steps = [out.logits]
    for t in range(4, ids.shape[1]):
        steps.append(m(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    greedy = m.generate(input_ids=ids[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
print(json.dumps({"gap": float((torch.cat(steps, 1) - full).abs().max()), "greedy": greedy.tolist(), "module": type(m).__module__}))
"""


def _old_checkpoint(tmp_path, kind):
    student = tiny_student("llama", kind)
    student.save_pretrained(tmp_path)
    for path in tmp_path.glob("attn2ssm_*.py"):
        path.unlink()
    with tarfile.open(OLD_CODE) as tar:
        tar.extractall(tmp_path, filter="data")
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    torch.save(ids, tmp_path / "ids.pt")
    return student, ids


@pytest.mark.parametrize("kind", ["linear_attention", "mamba2"])
def test_upgrade_makes_an_old_checkpoint_decode_exactly(kind, tmp_path):
    student, ids = _old_checkpoint(tmp_path, kind)
    weights = (tmp_path / "model.safetensors").read_bytes()
    before = run_remote(REMOTE, tmp_path)
    if CACHE_KWARG == "cache":  # transformers >= 5.24: the old code loses its state without a word
        assert before["gap"] > 1e-2
    assert main(["upgrade", str(tmp_path)]) == 0
    assert (tmp_path / "model.safetensors").read_bytes() == weights  # weights untouched
    assert "TESTED_TRANSFORMERS" in (tmp_path / "attn2ssm_hf_compat.py").read_text()
    after = run_remote(REMOTE, tmp_path)
    assert after["module"].startswith("transformers_modules")
    assert after["gap"] < 1e-4
    expected = greedy_by_full_forwards(student, ids[:, :4], 6)
    assert after["greedy"] == expected.tolist()


def test_upgrade_refuses_what_is_not_a_student(tmp_path, capsys):
    assert main(["upgrade", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["upgrade", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not an attn2ssm student" in err and len(err.strip().splitlines()) == 1
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "llama"}  # nothing written


def test_upgrade_drops_stale_files_and_keeps_auto_map(tmp_path):
    tiny_student("llama", "mamba").save_pretrained(tmp_path)
    (tmp_path / "attn2ssm_old_module.py").write_text("raise ImportError\n")
    main(["upgrade", str(tmp_path)])
    assert not (tmp_path / "attn2ssm_old_module.py").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "attn2ssm_student_modeling.Attn2SSMForCausalLM"
    assert not list(tmp_path.glob(".upgrade-*"))  # the staging folder is gone
    low, high = TESTED_TRANSFORMERS
    assert f'TESTED_TRANSFORMERS = ("{low}", "{high}")' in (tmp_path / "attn2ssm_hf_compat.py").read_text()

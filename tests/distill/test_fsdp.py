"""FSDP through accelerate: configs/accelerate/fsdp.yaml, and the trainer sharding its student on two
CPU processes (gloo) with the same loss curve as one process, checkpoints of the full student, and
a resume under FSDP after SIGKILL.

accelerate turns ``distributed_type: FSDP`` on only for GPU-like devices (accelerate/state.py: on a
CPU the processes run as MULTI_CPU, plain data parallel, and the FSDP settings are ignored). torch's
``fully_shard`` itself runs on gloo, so the launched script below flips accelerate's state to FSDP
with the plugin that ``accelerate launch --config_file configs/accelerate/fsdp.yaml`` put in the
environment; everything after that — accelerate's FSDP2 preparation, the trainer — runs as on GPUs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accelerate_launch import accelerate_launch
from attn2ssm.distill.checkpoints import fold_lora, index_keyed, latest_checkpoint, name_keyed
from attn2ssm.distill.lora import attach_lora, merge_lora
from tiny_models import BASE_RECIPE

CONFIG = Path(__file__).parents[2] / "configs" / "accelerate" / "fsdp.yaml"

FORCED_FSDP = r"""
import os, runpy, signal, sys
import accelerate
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
import attn2ssm.distill.trainer as T

original_init = accelerate.Accelerator.__init__

def init(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    if self.state.distributed_type == DistributedType.MULTI_CPU:  # what accelerate does on GPUs (state.py)
        # in PartialState too: every AcceleratorState() (an optimizer wrapper makes one) copies it over
        PartialState().distributed_type = self.state.distributed_type = DistributedType.FSDP
        self.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* environment

accelerate.Accelerator.__init__ = init
original_setup, original_save, saves = T.Distiller._setup_stage, T.Distiller._save_checkpoint, {"n": 0}

def setup(self, *args, **kwargs):
    run = original_setup(self, *args, **kwargs)
    if self.is_main:
        print(f"stage {run.index}: sharded={run.sharded} {type(run.model).__name__} {type(run.params[0]).__name__}", flush=True)
    return run

def save(self, *args, **kwargs):
    original_save(self, *args, **kwargs)
    saves["n"] += 1
    if saves["n"] == int(os.environ.get("KILL_AFTER_SAVES", "0")) and self.is_main:
        os.kill(os.getpid(), signal.SIGKILL)  # after a complete checkpoint; the launcher ends the other process

T.Distiller._setup_stage, T.Distiller._save_checkpoint = setup, save
sys.argv = ["attn2ssm", *sys.argv[1:]]
runpy.run_module("attn2ssm", run_name="__main__")
"""


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_config_parses_as_fsdp2_at_the_decoder_layer():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(CONFIG))
    assert config.distributed_type == DistributedType.FSDP and config.mixed_precision == "bf16"
    assert (
        config.fsdp_config["fsdp_version"] == 2
        and config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    )
    # the student's _no_split_modules: its decoder layer
    assert "fsdp_transformer_layer_cls_to_wrap" not in config.fsdp_config
    from tiny_models import tiny_student

    assert tiny_student("llama", "mamba2")._no_split_modules == {"LlamaDecoderLayer"}


def test_two_fsdp_processes_train_like_one_and_resume_after_sigkill(run_overrides, tmp_path):
    """One process (reference) against two FSDP processes killed in the LoRA stage and resumed under
    FSDP: the same loss at every step, the same student."""
    sets = [a for s in run_overrides() for a in ("--set", s)]
    one = tmp_path / "one"
    r1 = subprocess.run(
        [sys.executable, "-m", "attn2ssm", "distill", BASE_RECIPE, "--out", str(one), "--no-progress", *sets],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r1.returncode == 0, r1.stderr[-2000:]
    script = tmp_path / "forced_fsdp.py"
    script.write_text(FORCED_FSDP)
    launch = accelerate_launch(script, config_file=CONFIG)
    two = tmp_path / "two"
    killed = subprocess.run(
        [*launch, "distill", BASE_RECIPE, "--out", str(two), "--no-progress", *sets],
        env=_env(KILL_AFTER_SAVES="8"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert (
        killed.returncode != 0 and "stage 2: sharded=True FSDPAttn2SSMForCausalLM DTensor" in killed.stdout
    ), killed.stdout[-2000:] + killed.stderr[-3000:]
    assert "stage 0: sharded=True FSDPAttn2SSMForCausalLM DTensor" in killed.stdout
    # inside the LoRA stage: adapters beside the plain student
    assert latest_checkpoint(two).name == "stage2-step000002"
    payload = torch.load(latest_checkpoint(two) / "optimizer.pt", weights_only=False)
    # full, position-keyed: as without FSDP
    assert set(payload["optimizer"]["state"]) == set(range(16)) and "lora" in payload
    ckpt = load_file(latest_checkpoint(two) / "model.safetensors")
    # the full student, no shard, no adapter
    assert ckpt.keys() == load_file(one / "student/model.safetensors").keys()
    resumed = subprocess.run(
        [*launch, "distill", "--out", str(two), "--resume", "--no-progress"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    m1, m2 = _records(one), _records(two)
    assert {r["processes"] for r in m2} == {2} and len(m1) == len(m2) == 21
    assert [r["loss"] for r in m2] == pytest.approx([r["loss"] for r in m1], rel=1e-4, abs=1e-5)
    # every process ran the sharded eval forward
    evals = [[(r["step"], r["eval_loss"]) for r in m if "eval_loss" in r] for m in (m1, m2)]
    assert [s for s, _ in evals[1]] == [s for s, _ in evals[0]] and [e for _, e in evals[1]] == pytest.approx(
        [e for _, e in evals[0]], rel=1e-5
    )
    a, b = load_file(one / "student/model.safetensors"), load_file(two / "student/model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-4, msg=name)
    assert json.loads((two / "results.json").read_text())["processes"] == 2


def test_fold_lora_is_merge_lora_on_a_state_dict():
    lin = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False))
    with torch.no_grad():
        lin[0].weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]]))
    attach_lora(lin, ["0"], r=1, alpha=2.0)
    with torch.no_grad():
        lin.lora["0"].A.copy_(torch.tensor([[1.0, 2.0, 3.0]]))
        lin.lora["0"].B.copy_(torch.tensor([[0.5], [-1.0]]))
    folded = fold_lora(lin.state_dict(), 2.0 / 1)
    # by hand: W + (α/r)·B·A = W + 2·[[0.5, 1, 1.5], [-1, -2, -3]]
    assert folded.keys() == {"0.weight"}
    torch.testing.assert_close(folded["0.weight"], torch.tensor([[2.0, 2.0, 5.0], [-2.0, -3.0, -7.0]]))
    merge_lora(lin)
    torch.testing.assert_close(lin.state_dict()["0.weight"], folded["0.weight"])


def test_optimizer_state_keys_round_trip():
    names = ["a.weight", "b.weight", "c.bias"]
    by_name = {
        "state": {"b.weight": {"step": torch.tensor(3.0)}, "a.weight": {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": ["a.weight", "b.weight", "c.bias"]}],
    }
    by_index = index_keyed(by_name, names)
    assert (
        set(by_index["state"]) == {0, 1}
        and by_index["param_groups"][0]["params"] == [0, 1, 2]
        and by_index["param_groups"][0]["lr"] == 0.1
    )
    assert name_keyed(by_index, names) == by_name

"""configs/accelerate/fsdp_multinode.yaml (docs/multi_node.md): it parses as accelerate's config with
the multi-node settings and fsdp.yaml's sharding, and a launch from it, with one node's flags on the
command line (one machine, two gloo processes on the CPU), reaches attn2ssm's accelerator setup
with the FSDP plugin in the environment, where only global rank 0 takes the run directory's lock."""

import os
import re
import socket
import subprocess
from pathlib import Path

import yaml

from accelerate_launch import accelerate_launch

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"
MULTI = CONFIGS / "fsdp_multinode.yaml"

LAUNCHED = r"""
import os, sys
from pathlib import Path
from attn2ssm.distill.accelerator import setup_accelerator
from attn2ssm.distill.recipe import Recipe
from attn2ssm.distill.run_dir import hold_run_dir, release_run_dir

setup = setup_accelerator(Recipe(device="cpu"), teacher_passed=False)
acc = setup.acc
lock, made = hold_run_dir(Path(sys.argv[1]), acc)
acc.wait_for_everyone()
print(f"rank {acc.process_index} of {acc.num_processes}: lock={lock is not None} "
      f"fsdp={os.environ.get('ACCELERATE_USE_FSDP')} version={os.environ.get('FSDP_VERSION')} "
      f"node={os.environ.get('GROUP_RANK', '?')}", flush=True)
acc.wait_for_everyone()
release_run_dir(Path(sys.argv[1]), lock, made)
"""


def test_the_multinode_config_parses_with_fsdp_yaml_s_sharding():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(MULTI))
    assert config.distributed_type == DistributedType.FSDP and config.mixed_precision == "bf16"
    assert (config.num_machines, config.num_processes, config.machine_rank) == (2, 16, 0)
    assert config.main_process_ip == "10.0.0.1" and config.main_process_port == 29500
    assert config.rdzv_backend == "static" and config.same_network
    # the same sharding as the one-machine config, so the two cannot drift apart
    single = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())
    assert config.fsdp_config == single["fsdp_config"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_launch_from_it_reaches_the_trainer_s_setup_and_rank_0_holds_the_run_dir(tmp_path):
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    launch = accelerate_launch(script, config_file=MULTI)
    node = ["--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1"]
    node += ["--main_process_port", str(_free_port())]
    argv = [*launch[:5], *node, *launch[5:], str(tmp_path / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # two processes share one stdout: their lines may interleave without a newline between them
    lines = sorted(
        re.findall(r"rank \d of \d: lock=\w+ fsdp=\w+ version=\w+ node=\S+?(?=rank |\s|$)", r.stdout)
    )
    assert lines == [
        "rank 0 of 2: lock=True fsdp=true version=2 node=0",
        "rank 1 of 2: lock=False fsdp=true version=2 node=0",
    ], r.stdout[-2000:]
    # on a CPU accelerate runs the FSDP config as plain data parallel, and the trainer says so
    assert "the FSDP config does not shard on CPU" in r.stderr

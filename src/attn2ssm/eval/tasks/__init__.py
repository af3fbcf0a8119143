"""The offline lm-eval task pack: stock lm-eval 0.4.13 task configs over locally shipped data.

The YAML files here are lm-eval task configs (pass this folder as ``include_path``); their
documents come from ``sources.load`` (see ``sources.py``) and README.md lists tasks, splits and
the few differences from stock. ``STOCK_CONFIGS`` names, for each task and group of the pack, the
built-in lm-eval config it reproduces (relative to ``lm_eval/tasks/``); the tests hold each pack
config equal to it in everything but the data source.
"""

from attn2ssm.eval.tasks.sources import MMLU_SUBJECTS

STOCK_CONFIGS: dict[str, str] = {
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "cb": "super_glue/cb/default.yaml",
    "copa": "super_glue/copa/default.yaml",
    "sglue_rte": "super_glue/rte/default.yaml",
    "rte": "glue/rte/default.yaml",
    "mrpc": "glue/mrpc/default.yaml",
    "sst2": "glue/sst2/default.yaml",
    "sciq": "sciq/sciq.yaml",
    "social_iqa": "siqa/siqa.yaml",
    "commonsense_qa": "commonsense_qa/default.yaml",
    "nq_open": "nq_open/nq_open.yaml",
    "triviaqa": "triviaqa/default.yaml",
    "mmlu": "mmlu/default/_mmlu.yaml",
    "mmlu_stem": "mmlu/default/_mmlu_stem.yaml",
    "mmlu_other": "mmlu/default/_mmlu_other.yaml",
    "mmlu_social_sciences": "mmlu/default/_mmlu_social_sciences.yaml",
    "mmlu_humanities": "mmlu/default/_mmlu_humanities.yaml",
    **{f"mmlu_{s}": f"mmlu/default/mmlu_{s}.yaml" for s in MMLU_SUBJECTS},
}

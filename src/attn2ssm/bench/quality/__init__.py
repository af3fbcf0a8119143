"""``attn2ssm bench quality``: a fixed grid of student families × token budgets on one teacher.

A *family* is a recipe (built-in name or YAML path) plus a rule for scaling it to a budget: the
cell's training tokens are split over the recipe's stages in proportion to their ``tokens``
fields, each share rounded to whole optimizer steps (``batch_size`` × ``data.block_len``, or
× ``data.max_len`` for stages with their own dataset), and passed as
``--set stages.<i>.tokens=<n>``. A stage that runs for ``epochs`` is turned into a token stage
of its share (``--set stages.<i>.epochs=null``) when the recipe gives it a ``tokens`` field to
weigh it by; without one its share is unknown and the family is refused.

Each cell is a real ``attn2ssm distill RECIPE --out GRID/<family>-<tokens> --resume --set …
--teacher T`` in its own process, so a killed grid resumes: a cell whose ``cell.json`` holds
results for the current evaluation settings is not touched, a finished run is only evaluated,
a half-run continues from its checkpoint. After the run the student is evaluated here, one
student in memory at a time, against references the teacher computes once per grid
(``GRID/teacher/``): held-out perplexity at every window (stride = window / 2) on each corpus,
the teacher's, their ratio and teacher-forced top-1 agreement on the same windows; greedy
continuation agreement on held-out prompts of the first corpus; passkey accuracy per length; and,
with ``--suite`` (default ``quick``), every row of the evaluation suite (:mod:`attn2ssm.eval.suite`:
perplexity on five corpora, core tasks, MMLU 0/5-shot, RULER-form needles, TriviaQA), the teacher's
units cached once per grid in ``GRID/teacher/suite-*.json``. A cell scored before the suite existed
(or with another suite) keeps its numbers and is rescored for the suite alone, without retraining.
``cell.json`` (atomic) keeps the cell's command and results; the grid JSON, the plot and the
markdown table are rebuilt from every cached cell of the grid on each invocation, plus the cells
of the grid JSON already there that this grid directory lacks (same teacher and evaluation
settings): a grid is filled over several sessions on machines that do not share their ``runs/``,
and a session's new cells must not erase the cells an earlier one committed.

The package, one job a module (each imports only those before it):
- ``grid``: the family table, budgets and their split over stages, the cells and their status;
- ``scoring``: the teacher's cached references and a student's scores beside them;
- ``report``: the grid JSON, its markdown table and plot, and the ``--plan`` listing;
- ``runner``: each cell distilled in its own process, scored and cached, then the outputs.
"""

from attn2ssm.bench.quality.grid import (
    DEFAULT_BUDGETS,
    DEFAULT_TEACHER,
    FAMILIES,
    MAX_BUDGET,
    Cell,
    EvalSettings,
    GridSettings,
    budget_overrides,
    family_sets,
    load_family,
    parse_budgets,
    parse_family_table,
    parse_tokens,
    plan_cells,
    read_cell,
    select_cells,
    stage_step_tokens,
    training_data,
)
from attn2ssm.bench.quality.report import (
    collect_cells,
    earlier_cells,
    format_markdown,
    format_plan,
    format_suite_columns,
    plot_quality,
    write_outputs,
)
from attn2ssm.bench.quality.runner import fill_cell, run_cell, run_grid, training_stats
from attn2ssm.bench.quality.scoring import TeacherReference, evaluate_student, rescore_suite, suite_record

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_TEACHER",
    "FAMILIES",
    "MAX_BUDGET",
    "Cell",
    "EvalSettings",
    "GridSettings",
    "TeacherReference",
    "budget_overrides",
    "collect_cells",
    "earlier_cells",
    "evaluate_student",
    "family_sets",
    "fill_cell",
    "format_markdown",
    "format_plan",
    "format_suite_columns",
    "load_family",
    "parse_budgets",
    "parse_family_table",
    "parse_tokens",
    "plan_cells",
    "plot_quality",
    "read_cell",
    "rescore_suite",
    "run_cell",
    "run_grid",
    "select_cells",
    "stage_step_tokens",
    "suite_record",
    "training_data",
    "training_stats",
    "write_outputs",
]

"""``attn2ssm recipes``: the built-in recipes listed, one printed as YAML the loader reads the same."""

from __future__ import annotations

import yaml
from cli_run import assert_one_line_error, result_of, run_cli


def test_unknown_recipe_for_recipes_command():
    assert_one_line_error(run_cli("recipes", "nonexistent"), "no built-in recipe 'nonexistent'", "quickstart")


def test_recipes_lists_quickstart(slow):
    r = result_of(slow, "recipes")
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("quickstart") for line in r.stdout.splitlines()), r.stdout


def test_recipe_prints_parseable_yaml(slow):
    r = result_of(slow, "recipe_quickstart")
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(r.stdout)
    assert data["name"] == "quickstart"
    assert {"teacher", "data", "student", "stages", "eval"} <= set(data)
    from attn2ssm.distill.recipe import load_recipe

    assert [st["kind"] for st in data["stages"]] == [st.kind for st in load_recipe("quickstart").stages]

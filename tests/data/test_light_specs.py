"""The corpus-spec grammar (``data.specs``) and the suite's settings (``eval.suite_settings``) parse
and check a spec or a flag without importing torch, as the command line does before anything heavy
loads."""

import subprocess
import sys

import pytest

CHECKS = {
    "attn2ssm.data.specs": (
        "m.check_spec('mix:general'); m.check_spec('sotu?field=text');"
        "assert m.parse_generated_spec('generated:10:sotu?batch=2').batch == 2;"
        "assert m.is_shards('shards:x') and m.expand_mixture('mix:corpora')[0] == ('sotu', 0.6);"
        "assert m.parse_hf_spec('org/ds:test') == ('org/ds', None, 'test')"
    ),
    "attn2ssm.eval.suite_settings": (
        "s = m.select_rows(m.suite_settings('standard', quick=True), 'perplexity');"
        "assert s.tasks == () and s.corpora"
    ),
    "attn2ssm.eval.stats": "assert m.binomial_se(0.5, 400) == 0.025",
}


@pytest.mark.parametrize("module", sorted(CHECKS))
def test_parses_without_torch(module):
    code = (
        f"import importlib, sys; m = importlib.import_module({module!r}); {CHECKS[module]};"
        "heavy = sorted(n for n in ('torch', 'transformers', 'numpy') if n in sys.modules);"
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_check_would_see_torch():
    """The check can fail: a module that imports torch is caught."""
    code = "import sys, attn2ssm.data.packing; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "AssertionError" in proc.stderr

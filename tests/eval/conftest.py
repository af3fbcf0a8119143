"""What the eval tests share: the evaluation suite shrunk to tiny sizes (``tiny_suite``)."""

import pytest


@pytest.fixture
def tiny_suite(monkeypatch):
    """A function: ``tiny_suite(corpora, windows=(32,))`` makes every ``suite_settings(name, quick)``
    answer the suite shrunk to tiny sizes (named "standard --quick": perplexity over ``corpora`` at
    ``windows`` on 200 tokens, PIQA on 2 items, one needle form at 400 tokens, one trial, batches of 2);
    it returns the list of the ``(name, quick)`` it is asked for."""
    from attn2ssm.eval import suite_settings
    from attn2ssm.eval.suite_settings import SuiteSettings, TaskSpec

    def install(corpora, windows=(32,)) -> list:
        tiny = SuiteSettings(
            name="standard --quick",
            corpora=tuple(str(c) for c in corpora),
            windows=tuple(windows),
            max_tokens=200,
            tasks=(TaskSpec("piqa", "acc", 0, 2, "PIQA"),),
            niah_forms=("niah_single_1",),
            niah_lengths=(400,),
            niah_trials=1,
            batch_size=2,
        )
        asked = []
        monkeypatch.setattr(
            suite_settings, "suite_settings", lambda name, quick=False: asked.append((name, quick)) or tiny
        )
        return asked

    return install

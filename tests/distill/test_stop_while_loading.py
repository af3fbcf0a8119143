"""A signal before a run's first step (loading the teacher, sampling its text, building the student:
minutes, with nothing to checkpoint) stops the run at once, with the one line a stopped run ends with,
instead of after whatever the loading still had to do."""

import os
import signal
import time

import pytest

import attn2ssm.distill.trainer as T
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import distill
from attn2ssm.errors import Interrupted
from tiny_models import BASE_RECIPE


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_loading_stops_at_once(signum, run_overrides, tmp_path, monkeypatch):
    loaded = T.Distiller._load_data
    reached = []

    def load_then_signal_then_keep_working(self):
        loaded(self)
        os.kill(os.getpid(), signum)
        start = time.monotonic()
        while time.monotonic() - start < 60:  # e.g. the teacher sampling its text: minutes of work
            time.sleep(0.01)
        reached.append("the loading's end")

    monkeypatch.setattr(T.Distiller, "_load_data", load_then_signal_then_keep_working)
    out = tmp_path / "run"
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]  # SIG_IGN under nohup
    start = time.monotonic()
    with pytest.raises(Interrupted) as info:
        distill(load_recipe(BASE_RECIPE, run_overrides()), out, progress=False)
    assert time.monotonic() - start < 30 and not reached  # it did not wait for the loading to end
    assert info.value.exit_code == 128 + signum
    assert str(info.value) == (
        f"stopped by {signal.Signals(signum).name} at stage 1/3 before its first step (loading): "
        f"nothing trained yet, no checkpoint — resume with: attn2ssm distill --out {out} --resume"
    )
    # nothing was written yet: --out is left as it was (no folder), the handlers are back
    assert not out.exists()
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers

"""``--device``: one resolution (devices.resolve_device) for the commands that run models, and every
evaluation mode loads its models there (the first GPU run scored its student on the device's CPU:
the report never asked for CUDA)."""

import pytest
import torch

from attn2ssm.devices import resolve_device
from attn2ssm.errors import ConfigError


def test_auto_is_cuda_where_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "gpus", "needle"),
    [
        ("gpu0", 0, "--device 'gpu0' is not a device — write cpu, cuda or cuda:N"),
        (
            "cuda",
            0,
            "--device cuda asks for a GPU and torch sees none — drop --device, or write --device cpu",
        ),
        ("cuda:3", 1, "--device cuda:3: this machine has 1 CUDA device(s) — use --device cuda:0 … cuda:0"),
        ("meta", 0, "--device meta: attn2ssm runs on cpu or cuda — write cpu, cuda or cuda:N"),
    ],
)
def test_a_device_that_cannot_be_used_is_one_line(monkeypatch, name, gpus, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError) as err:
        resolve_device(name)
    assert str(err.value) == needle


class _Loaded(Exception):
    pass


@pytest.mark.parametrize(
    "mode",
    [[], ["--report"], ["--suite", "standard", "--quick", "--rows", "perplexity"], ["--attention"]],
    ids=["perplexity", "report", "suite", "attention"],
)
def test_every_evaluation_loads_its_models_on_the_device(monkeypatch, mode, tmp_path):
    """The models of eval (perplexity), --report, --suite and --attention are loaded on --device:
    the loader is stopped at its first call, which must name the device."""
    import attn2ssm.student.loading as loading
    from attn2ssm.cli import main

    seen = []

    def loader(path, device=None):
        seen.append(device)
        raise _Loaded

    monkeypatch.setattr(loading, "load_model_and_tokenizer", loader)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(_Loaded):
        main(
            [
                "eval",
                str(tmp_path / "student"),
                "--out-dir",
                str(tmp_path / "out"),
                "--device",
                "cuda:1",
                *mode,
            ]
        )
    assert seen == [torch.device("cuda", 1)]
    seen.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(_Loaded):
        main(["eval", str(tmp_path / "student"), "--out-dir", str(tmp_path / "out"), *mode])
    assert seen == [torch.device("cpu")]  # auto, without a GPU


def test_eval_on_a_gpu_that_is_not_there_is_one_line(monkeypatch, capsys):
    from attn2ssm.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["eval", "/nope/model", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "asks for a GPU and torch sees none" in err[0], err

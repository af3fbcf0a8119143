"""A model argument that is neither a local folder nor a hub id the hub can be asked for now (a
mistyped ``runs/...`` path reads as an ``org/name`` hub id): one line at once, from one request
without retries, not after ~50 s of huggingface_hub's retries. A hub that answers is left to the
usual load, so real hub ids keep working."""

import huggingface_hub
import pytest
from huggingface_hub import constants
from transformers import AutoTokenizer

from attn2ssm.errors import CheckpointError
from attn2ssm.student.loading import load_model_and_tokenizer


class NoRoute(Exception):
    """What an HTTP client raises without a network (its class differs between huggingface_hub versions)."""


@pytest.fixture
def online_mode(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo_id, filename: None)


def test_a_missing_folder_without_a_reachable_hub_is_one_line_at_once(monkeypatch, online_mode):
    def unreachable(url, **kwargs):
        raise NoRoute("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("went on to the load, which retries")
    )
    with pytest.raises(CheckpointError) as info:
        load_model_and_tokenizer("runs/nonexistent")
    message = str(info.value)
    assert message == (
        "there is no local folder 'runs/nonexistent', and loading it as a hub id failed (the hub cannot be "
        "reached: [Errno -2] Name or service not known) — check the path if you meant a local folder; a hub "
        "id needs the network (or a copy in the Hugging Face cache)"
    )


def test_a_hub_that_answers_goes_on_to_the_usual_load(monkeypatch, online_mode):
    asked = []
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, **kwargs: asked.append(url))

    def load(location, **kwargs):
        asked.append(location)
        raise OSError("no such model")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", load)
    with pytest.raises(CheckpointError, match="there is no local folder 'org/model'"):
        load_model_and_tokenizer("org/model")
    assert (
        len(asked) == 2
        and asked[0].endswith("org/model/resolve/main/config.json")
        and asked[1] == "org/model"
    )

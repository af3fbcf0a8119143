"""sft and dpo stages: chat data formats, assistant-token masks, validation, the trainer end to end."""

import json
import math

import pytest
import torch
from chat_data import END_OF_TURN

from attn2ssm.data.chat import encode_conversation, load_preference_dataset, load_sft_dataset
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.stages import STAGE_KINDS
from attn2ssm.distill.trainer import distill
from attn2ssm.errors import ConfigError, DataError
from tiny_models import BASE_RECIPE, Crash, assert_same_student, crash_after


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _replies(record):
    """The text the loss mask must cover: each assistant turn's content and its end-of-turn."""
    if "messages" in record:
        return "".join(m["content"] + END_OF_TURN for m in record["messages"] if m["role"] == "assistant")
    return record.get("completion", record.get("response")) + END_OF_TURN


def _masked_text(tok, ids, mask):
    return tok.decode(ids[mask.bool()], skip_special_tokens=False)


@pytest.fixture
def data(chat_setup):
    return chat_setup[2]


# ------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("fmt", ["messages", "prompt_completion"])
def test_sft_mask_covers_exactly_the_assistant_tokens(fmt, data, chat_tokenizer):
    ds = load_sft_dataset(str(data[fmt]), chat_tokenizer, max_len=512)
    records = _records(data[fmt])
    assert len(ds) == len(records) == 12 and ds.meta["format"] == fmt and ds.meta["dropped"] == 0
    for ids, mask, record in zip(ds.ids, ds.loss_masks, records):
        assert _masked_text(chat_tokenizer, ids, mask) == _replies(record)
        assert (
            _masked_text(chat_tokenizer, ids, ~mask).count("<|assistant|>\n")
            == len(_replies(record).split(END_OF_TURN)) - 1
        )
        # the ids are what apply_chat_template gives for the whole conversation
        messages = record.get("messages") or [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": _replies(record)[: -len(END_OF_TURN)]},
        ]
        assert (
            ids.tolist()
            == chat_tokenizer(
                chat_tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False
            )["input_ids"]
        )


def test_sft_batches_are_right_padded(data, chat_tokenizer):
    ds = load_sft_dataset(str(data["messages"]), chat_tokenizer, max_len=512)
    batch = ds.collate([0, 1, 2])
    lengths = [len(ds.ids[i]) for i in range(3)]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for row, n in enumerate(lengths):
        assert batch["attention_mask"][row, :n].all() and not batch["loss_mask"][row, n:].any()
        assert (batch["input_ids"][row, n:] == chat_tokenizer.eos_token_id).all()
    assert ds.loss_tokens([0]) == int(ds.loss_masks[0].sum())


@pytest.mark.parametrize("name", ["preference", "preference_conversations"])
def test_preference_masks_cover_the_reply_only(name, data, chat_tokenizer):
    ds = load_preference_dataset(str(data[name]), chat_tokenizer, max_len=512)
    records = _records(data[name])
    assert len(ds) == 12
    for i, record in enumerate(records):
        for side in ("chosen", "rejected"):
            reply = record[side] if isinstance(record[side], str) else record[side][-1]["content"]
            part = getattr(ds, side)
            assert _masked_text(chat_tokenizer, part.ids[i], part.loss_masks[i]) == reply + END_OF_TURN
            assert record["prompt"] in _masked_text(chat_tokenizer, part.ids[i], ~part.loss_masks[i])
    batch = ds.collate([3, 4])
    assert set(batch) == {
        f"{s}_{k}" for s in ("chosen", "rejected") for k in ("input_ids", "attention_mask", "loss_mask")
    }


def test_both_preference_shapes_tokenize_alike(data, chat_tokenizer):
    a = load_preference_dataset(str(data["preference"]), chat_tokenizer)
    b = load_preference_dataset(str(data["preference_conversations"]), chat_tokenizer)
    for x, y in zip(a.chosen.ids + a.rejected.ids, b.chosen.ids + b.rejected.ids):
        assert torch.equal(x, y)


def test_long_examples_are_cut_and_unscorable_ones_dropped(data, chat_tokenizer):
    full = load_sft_dataset(str(data["messages"]), chat_tokenizer, max_len=512)
    cut = load_sft_dataset(str(data["messages"]), chat_tokenizer, max_len=40)
    assert max(len(x) for x in cut.ids) <= 40 and cut.meta["dropped"] + len(cut) == 12
    with pytest.raises(DataError, match="no example .* assistant token within max_len=8"):
        load_sft_dataset(str(data["messages"]), chat_tokenizer, max_len=8)
    assert (
        load_sft_dataset(str(data["messages"]), chat_tokenizer, max_examples=3).meta["examples"] == 3
        and len(full) == 12
    )


def test_template_that_rewrites_earlier_turns_trains_the_last_turn(chat_tokenizer):
    # earlier assistant turns are rendered without their content (as some reasoning templates do)
    chat_tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' and not loop.last %}...{% else %}"
        "{{ m['content'] }}{% endif %}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    messages = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "Two."},
    ]
    ids, mask = encode_conversation(chat_tokenizer, messages)
    assert _masked_text(chat_tokenizer, torch.tensor(ids), torch.tensor(mask)) == "Two." + END_OF_TURN


def test_no_chat_template_is_a_one_line_config_error(data, chat_tokenizer):
    chat_tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template") as err:
        load_sft_dataset(str(data["messages"]), chat_tokenizer, stage="sft1")
    msg = str(err.value)
    assert "\n" not in msg and "sft1" in msg and "chat_template" in err.value.fix
    with pytest.raises(ConfigError, match="has no chat template"):
        load_preference_dataset(str(data["preference"]), chat_tokenizer)


# ----------------------------------------------------------------------------- sources / formats


def test_json_parquet_and_hub_sources(data, chat_tokenizer, tmp_path, monkeypatch):
    records = _records(data["prompt_completion"])
    (tmp_path / "list.json").write_text(json.dumps(records))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": r["prompt"], "completion": _replies(r)[: -len(END_OF_TURN)]} for r in records]
        ),
        tmp_path / "pc.parquet",
    )
    reference = load_sft_dataset(str(data["prompt_completion"]), chat_tokenizer)
    for path in (tmp_path / "list.json", tmp_path / "pc.parquet"):
        ds = load_sft_dataset(str(path), chat_tokenizer)
        assert all(torch.equal(a, b) for a, b in zip(ds.ids, reference.ids)) and len(ds) == 12

    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_list(_records(data["preference_conversations"]))

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    ds = load_preference_dataset(
        "hf:HuggingFaceH4/ultrafeedback_binarized:train_prefs", chat_tokenizer, max_examples=5
    )
    assert calls == [("HuggingFaceH4/ultrafeedback_binarized", "train_prefs", "train")] and len(ds) == 5


def test_format_errors(data, chat_tokenizer, tmp_path):
    with pytest.raises(DataError, match="does not look like chat data"):
        load_sft_dataset(str(data["preference"]), chat_tokenizer)
    with pytest.raises(DataError, match="does not look like preference data"):
        load_preference_dataset(str(data["messages"]), chat_tokenizer)
    with pytest.raises(DataError, match="has no field 'messages'"):
        load_sft_dataset(str(data["prompt_completion"]), chat_tokenizer, format="messages")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match="lacks 'role' or 'content'"):
        load_sft_dataset(str(bad), chat_tokenizer)
    with pytest.raises(DataError, match="does not exist"):
        load_sft_dataset(str(tmp_path / "missing.jsonl"), chat_tokenizer)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported format"):
        load_sft_dataset(str(tmp_path / "x.csv"), chat_tokenizer)


@pytest.mark.parametrize(
    "stage, match",
    [
        ("{name: s, kind: sft}", "needs a dataset but the stage has no data.source"),
        ("{name: s, kind: dpo, data: {format: preference}}", "needs a dataset"),
        ("{name: s, kind: sft, data: {source: x.jsonl, format: chatml}}", "unknown data format 'chatml'"),
        ("{name: s, kind: sft, data: {source: x.jsonl, format: preference}}", "does not fit kind 'sft'"),
        ("{name: s, kind: dpo, data: {source: x.jsonl, format: messages}}", "does not fit kind 'dpo'"),
        ("{name: s, kind: kd, data: {source: x.jsonl}}", "takes no 'data'"),
        ("{name: s, kind: sft, data: {source: x.jsonl, max_len: 1}}", "max_len"),
        ("{name: s, kind: sft, epochs: 0, data: {source: x.jsonl}}", "epochs must be positive"),
        (
            "{name: s, kind: dpo, losses: {beta: 0.1, gamma: 1}, data: {source: x.jsonl}}",
            "unknown losses key",
        ),
        ("{name: s, kind: sft, data: {source: x.jsonl, shuffle: true}}", "unknown key 'shuffle'"),
    ],
)
def test_validation_errors(stage, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_recipe(BASE_RECIPE, [f"stages=[{stage}]"])
    assert "\n" not in str(err.value) and err.value.fix


# ----------------------------------------------------------------------------------- end to end


def test_data_problems_stop_the_run_before_the_first_stage(
    run_overrides, chat_overrides, chat_setup, tmp_path
):
    source = chat_setup[2]["messages"]
    stages = "[{{name: kd, kind: kd, tokens: 128, batch_size: 4}}, {{name: sft, kind: sft, data: {{source: '{}', max_len: {}}}}}]"
    with pytest.raises(ConfigError, match="has no chat template"):  # the plain tiny teacher has none
        distill(
            load_recipe(BASE_RECIPE, run_overrides(stages=stages.format(source, 96))),
            tmp_path / "a",
            progress=False,
        )
    with pytest.raises(DataError, match="exceeds the model's maximum of 128"):
        distill(
            load_recipe(BASE_RECIPE, chat_overrides(stages.format(source, 512))),
            tmp_path / "b",
            progress=False,
        )
    assert not (tmp_path / "a" / "metrics.jsonl").exists() and not (tmp_path / "b" / "metrics.jsonl").exists()


def _capture(monkeypatch, kind_name, store):
    kind = STAGE_KINDS[kind_name]
    original = type(kind).loss

    def recording(self, student, teacher, batch, cfg):
        store.append({k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in batch.items()})
        return original(self, student, teacher, batch, cfg)

    monkeypatch.setattr(type(kind), "loss", recording)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_kd_ce_sft_dpo_run(chat_setup, chat_overrides, tmp_path, monkeypatch):
    teacher_dir, _, data = chat_setup
    stages = (
        "[{name: stage1, kind: kd_ce, tokens: 256, batch_size: 4, trainable: [all], frozen: [mlps, embeddings, norms]},"
        f" {{name: sft, kind: sft, tokens: 768, batch_size: 4, grad_accum: 2, trainable: [all], losses: {{kl_weight: 0.1}},"
        f"   data: {{source: '{data['messages']}', max_len: 96}}}},"
        f" {{name: dpo, kind: dpo, epochs: 0.5, batch_size: 4, trainable: [all], data: {{source: '{data['preference_conversations']}', max_len: 96}}}}]"
    )
    sft_batches, dpo_batches = [], []
    _capture(monkeypatch, "sft", sft_batches)
    _capture(monkeypatch, "dpo", dpo_batches)
    out = tmp_path / "run"
    distill(load_recipe(BASE_RECIPE, chat_overrides(stages)), out, progress=False)
    records = _metrics(out)
    by_stage = {name: [r for r in records if r["stage"] == name] for name in ("stage1", "sft", "dpo")}
    assert [len(v) for v in by_stage.values()] == [2, 2, 2]  # 256/(4·32); 768/(4·96); ceil(0.5·12/4)
    assert {"train_ce", "train_kl"} <= set(by_stage["stage1"][0]) and {"train_ce", "train_kl"} <= set(
        by_stage["sft"][0]
    )
    assert {"train_reward_accuracy", "train_reward_margin", "train_reward_chosen"} <= set(by_stage["dpo"][0])
    # tokens count real tokens of the examples drawn
    assert by_stage["sft"][0]["tokens"] == sum(int(b["attention_mask"].sum()) for b in sft_batches[:2])

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    replies = [_replies(r) for r in _records(data["messages"])]
    assert len(sft_batches) == 4 and all(b["input_ids"].shape[0] == 2 for b in sft_batches)  # grad_accum 2
    for batch in sft_batches:
        assert batch["mean_loss_tokens"] > 0
        for ids, mask, attn in zip(batch["input_ids"], batch["loss_mask"], batch["attention_mask"]):
            text = _masked_text(tok, ids, mask)
            # cut conversations keep a prefix of the replies
            assert any(r.startswith(text) for r in replies) and text
            assert not (mask & ~attn.bool()).any()
    chosen = {r["chosen"][-1]["content"] + END_OF_TURN for r in _records(data["preference_conversations"])}
    for batch in dpo_batches:
        for ids, mask in zip(batch["chosen_input_ids"], batch["chosen_loss_mask"]):
            assert _masked_text(tok, ids, mask) in chosen


def test_dpo_starts_at_log2_when_student_is_teacher_and_learns(chat_setup, chat_overrides, tmp_path):
    data = chat_setup[2]
    stages = (  # four pairs, batch 4: every step sees the same pairs, so the loss must fall
        f"[{{name: dpo, kind: dpo, tokens: 1152, batch_size: 4, trainable: [all], losses: {{beta: 0.5}}, optim: {{lr: 0.003}},"
        f" schedule: {{kind: constant}}, data: {{source: '{data['preference']}', max_len: 96, max_examples: 4}}}}]"
    )
    out = tmp_path / "run"
    distill(
        load_recipe(BASE_RECIPE, chat_overrides(stages, **{"student.attention_ratio": 1.0})),
        out,
        progress=False,
    )
    losses = [r["loss"] for r in _metrics(out)]
    assert len(losses) == 3  # 1152 / (4 · 96)
    # attention kept everywhere: the student is the teacher
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert losses[-1] < losses[0] - 0.05 and losses == sorted(losses, reverse=True)


def test_resume_mid_sft_matches_uninterrupted(chat_setup, chat_overrides, tmp_path, monkeypatch):
    data = chat_setup[2]
    stages = (
        f"[{{name: sft, kind: sft, tokens: 576, batch_size: 2, grad_accum: 2, trainable: [all], save_every: 1, optim: {{lr: 0.01}},"
        f" data: {{source: '{data['prompt_completion']}', max_len: 96}}}}]"
    )
    sets = chat_overrides(stages)
    reference = tmp_path / "reference"
    distill(load_recipe(BASE_RECIPE, sets), reference, progress=False)

    crash_after(monkeypatch, 2)
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        distill(load_recipe(BASE_RECIPE, sets), crashed, progress=False)
    monkeypatch.undo()
    assert not (crashed / "student").exists()
    distill(load_recipe(BASE_RECIPE, sets), crashed, resume=True, progress=False)

    assert_same_student(reference, crashed)
    ref, got = _metrics(reference), _metrics(crashed)
    assert [r["step"] for r in got] == [1, 2, 3]  # 576 / (2 · 96); the crash came after step 2's checkpoint
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in ref]


def test_sft_loss_is_per_token_over_the_whole_step(data, chat_tokenizer):
    """Two micro-batches with the trainer's mean_loss_tokens average to the one-batch loss."""
    from transformers import AutoModelForCausalLM

    from attn2ssm.distill.recipe import StageConfig
    from tiny_models import tiny_config

    cfg = tiny_config("llama")
    cfg.vocab_size = len(chat_tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    ds = load_sft_dataset(str(data["messages"]), chat_tokenizer, max_len=128)
    kind, stage = STAGE_KINDS["sft"], StageConfig(kind="sft", losses={"kl_weight": 0.5})
    whole, metrics = kind.loss(model, teacher, ds.collate([0, 1, 2, 3]), stage)
    assert metrics["kl"] > 0.01
    mean = ds.loss_tokens([0, 1, 2, 3]) / 2
    halves = [
        kind.loss(model, teacher, {**ds.collate(idx), "mean_loss_tokens": mean}, stage)[0]
        for idx in ([0, 1], [2, 3])
    ]
    assert ds.loss_tokens([0, 1]) != ds.loss_tokens([2, 3])  # unequal halves: a plain mean would be off
    assert ((halves[0] + halves[1]) / 2).item() == pytest.approx(whole.item(), rel=1e-5)

"""Teacher-generated text at scale: the samples of a ``generated:`` spec come one batch at a time,
and go either to the corpus cache (as before) or straight to token shards, the same ids either way."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.data.shard_writer import generate_shards
from attn2ssm.data.shards import read_manifest, read_shards
from attn2ssm.data.specs import parse_generated_spec
from attn2ssm.data.teacher_samples import (
    MAX_AUTO_BATCH,
    TeacherSampler,
    auto_batch,
    generate_corpus,
    sampling_batch,
)
from tiny_models import tiny_config

SPEC = "generated:2000?length=40&batch=7&temperature=1.5"  # 52 samples, 2 of them held out (seed 0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher():
    config = tiny_config("llama")
    config.vocab_size = 300
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_shards_hold_the_cached_corpus_and_its_sampling_rate(teacher, tokenizer, tmp_path):
    corpus = generate_corpus(SPEC, teacher, tokenizer, progress=False)
    assert corpus.meta["n_heldout_docs"] > 0  # both sides exercised
    manifest = generate_shards(SPEC, teacher, tokenizer, tmp_path / "g", shard_tokens=512, progress=False)
    back = read_shards(tmp_path / "g", tokenizer, verify=True)
    assert torch.equal(back.train_ids, corpus.train_ids) and torch.equal(back.heldout_ids, corpus.heldout_ids)
    meta = read_manifest(tmp_path / "g")["meta"]
    assert (
        meta == manifest["meta"]
        and meta["settings"] == corpus.meta["settings"]
        and meta["tokens_per_second"] > 0
    )
    assert meta["n_samples"] == corpus.meta["n_samples"] and meta["batch"] == 7 and meta["device"] == "cpu"
    # files roll over every 512 ids
    assert len(manifest["sides"]["train"]) == -(-corpus.train_ids.numel() // 512)


def test_caps_cut_each_side_and_stop_sampling_early(teacher, tokenizer, tmp_path, monkeypatch):
    full = generate_corpus(SPEC, teacher, tokenizer, progress=False)
    calls, real = [], teacher.generate
    monkeypatch.setattr(teacher, "generate", lambda **kw: calls.append(1) or real(**kw))
    generate_shards(
        SPEC, teacher, tokenizer, tmp_path / "g", max_train_tokens=300, max_heldout_tokens=20, progress=False
    )
    back = read_shards(tmp_path / "g", tokenizer)
    assert torch.equal(back.train_ids, full.train_ids[:300]) and torch.equal(
        back.heldout_ids, full.heldout_ids[:20]
    )
    assert len(calls) < -(-full.meta["n_samples"] // 7)  # both sides full: no more batches sampled


def test_samples_come_one_batch_at_a_time(teacher, tokenizer, monkeypatch):
    calls, real = [], teacher.generate
    monkeypatch.setattr(
        teacher, "generate", lambda **kw: calls.append(kw["input_ids"].shape[0]) or real(**kw)
    )
    rng = torch.get_rng_state()
    sampler = TeacherSampler(SPEC, teacher, tokenizer, seed=0, progress=False)
    assert not calls and len(sampler.key) == 24  # the cache key is known before anything is sampled
    samples = iter(sampler)
    first = next(samples)
    assert calls == [7] and first.index == 0 and first.ids.dtype == torch.long
    rest = list(samples)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is untouched
    # ids + the EOS joins
    assert sum(s.ids.numel() for s in [first, *rest]) + sum(sampler.docs.values()) - 2 == 2000
    assert sampler.stats()["n_samples"] == len(rest) + 1 and sampler.tokens_per_second > 0


def test_an_interrupt_leaves_no_folder_and_the_teacher_as_it_was(teacher, tokenizer, tmp_path, monkeypatch):
    calls, real = [], teacher.generate

    def stopped_on_the_third_batch(**kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(**kw)

    monkeypatch.setattr(teacher, "generate", stopped_on_the_third_batch)
    teacher.train()
    try:
        with pytest.raises(KeyboardInterrupt):
            generate_shards(SPEC, teacher, tokenizer, tmp_path / "g", shard_tokens=64, progress=False)
        assert teacher.training  # restored
    finally:
        teacher.eval()
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging copy


def test_batch_size_the_spec_given_or_chosen_by_gpu_memory(teacher, monkeypatch):
    assert sampling_batch(parse_generated_spec("generated:10"), teacher, 272) == 16  # a CPU: the default
    assert sampling_batch(parse_generated_spec("generated:10?batch=3"), teacher, 272) == 3
    gib = 1 << 30
    # SmolLM2-135M in fp32: KV cache of 16 + 256 positions, logits
    smollm2 = 272 * 2 * 30 * 3 * 64 * 4 + 16 * 49152
    assert auto_batch(80 * gib, 540 << 20, smollm2) == MAX_AUTO_BATCH == 1024
    assert auto_batch(24 * gib, 540 << 20, smollm2) == 256  # a quarter of 23.5 GiB / 13.3 MB = 474
    # a 7B teacher in fp32: 13 GiB / 285 MB = 47
    assert auto_batch(80 * gib, 28 * gib, 272 * 512 * 1024 * 2) == 32
    assert auto_batch(gib, 2 * gib, 1) == 1

    from types import SimpleNamespace

    config = SimpleNamespace(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, vocab_size=49152
    )
    config.get_text_config = lambda: config
    # SmolLM2-135M, bf16, on a GPU
    weight = SimpleNamespace(device=torch.device("cuda"), numel=lambda: 135_000_000, element_size=lambda: 2)
    gpu_teacher = SimpleNamespace(parameters=lambda: iter([weight]), config=config)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * gib)
    )
    assert sampling_batch(parse_generated_spec("generated:100000000"), gpu_teacher, 272, 256) == 1024
    # given: kept
    assert sampling_batch(parse_generated_spec("generated:100000000?batch=64"), gpu_teacher, 272, 256) == 64
    # 157 samples' worth: no more rows
    assert sampling_batch(parse_generated_spec("generated:40000"), gpu_teacher, 272, 256) == 256
    # never below the default
    assert sampling_batch(parse_generated_spec("generated:3000"), gpu_teacher, 272, 256) == 16

"""Data beyond one corpus: weighted mixtures of sources, streamed hub datasets, teacher-generated text."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.data import (
    Document,
    block_indices,
    iter_hf_documents,
    load_documents,
    load_training_data,
    pack_blocks,
    packing,
    prepare_corpus,
    specs,
    split_documents,
    tokenize,
)
from attn2ssm.data.mixture import apportion, interleave, mix_blocks
from attn2ssm.data.teacher_samples import generate_corpus
from attn2ssm.distill.recipe import SourceConfig
from attn2ssm.errors import DataError
from attn2ssm.paths import cache_dir
from tiny_models import tiny_config

WORDS = {
    "a": ["apple", "anchor", "amber", "arrow", "atlas", "autumn"],
    "b": ["berry", "bishop", "bronze", "bridge", "butter", "basket"],
    "c": ["cedar", "copper", "candle", "canyon", "crystal", "cobalt"],
}


def write_corpus(root, letter, n_docs=30, words=60, seed=0):
    """A folder of documents written with one letter's words, so a block shows which corpus it came from."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for i in range(n_docs):
        (root / f"{letter}{i:03d}.txt").write_text(" ".join(rng.choice(WORDS[letter]) for _ in range(words)))
    return str(root)


pytestmark = pytest.mark.usefixtures("one_thread")


def as_rows(blocks):
    return {tuple(b.tolist()) for b in blocks}


@pytest.fixture
def three(tmp_path):
    return [write_corpus(tmp_path / k, k, n_docs=n) for k, n in (("a", 40), ("b", 12), ("c", 25))]


# ------------------------------------------------------------------------------ mixing


def test_apportion_is_exact_and_gives_every_source_a_block():
    assert apportion([0.5, 0.2, 0.3], 10) == [5, 2, 3]
    assert apportion([1 / 3] * 3, 10) == [4, 3, 3]  # the remainder goes to the earlier source
    assert apportion([0.998, 0.001, 0.001], 100) == [98, 1, 1]
    for n in (3, 7, 1000, 4097):
        assert sum(apportion([0.6, 0.25, 0.15], n)) == n


def test_interleave_keeps_the_rates_in_every_prefix():
    counts, rates = [500, 200, 300], [0.5, 0.2, 0.3]
    source, index = interleave(counts, rates)
    assert len(source) == 1000
    for s, c in enumerate(counts):  # each source's items appear once, in order
        assert index[source == s].tolist() == list(range(c))
    seen = torch.zeros(3)
    for p, s in enumerate(source.tolist(), 1):
        seen[s] += 1
        assert (seen - torch.tensor(rates) * p).abs().max() <= 1.0


def test_mixture_proportions_determinism_and_content(three, tokenizer):
    mix = [SourceConfig(three[0], 0.5), SourceConfig(three[1], 0.2), SourceConfig(three[2], 0.3)]
    data = load_training_data(mix, tokenizer, 16, seed=3, budget_blocks=3000, max_heldout_tokens=400)
    assert data.blocks.shape == (3000, 16) and data.blocks.dtype == torch.long
    assert torch.bincount(data.source_of).tolist() == [1500, 600, 900]
    # every block is a block of its own source
    for s, spec in enumerate(three):
        own = as_rows(pack_blocks(prepare_corpus(spec, tokenizer, max_heldout_tokens=400).train_ids, 16))
        assert as_rows(data.blocks[data.source_of == s]) <= own
    # what the trainer draws (block_indices over len(blocks), past one epoch) keeps the weights
    drawn = data.source_of[block_indices(len(data.blocks), 3, 0, 4000)]
    shares = torch.bincount(drawn, minlength=3).float() / len(drawn)
    assert (shares - torch.tensor([0.5, 0.2, 0.3])).abs().max() < 0.015
    assert all(s["from_cache"] is False for s in data.sources)
    again = load_training_data(mix, tokenizer, 16, seed=3, budget_blocks=3000, max_heldout_tokens=400)
    assert all(s["from_cache"] for s in again.sources)  # each source tokenized once
    assert torch.equal(again.blocks, data.blocks) and torch.equal(again.eval_blocks, data.eval_blocks)
    other = load_training_data(mix, tokenizer, 16, seed=4, budget_blocks=3000, max_heldout_tokens=400)
    assert not torch.equal(other.blocks, data.blocks) and torch.equal(other.source_of, data.source_of)
    large = load_training_data(mix, tokenizer, 16, seed=3, budget_blocks=20_000, max_heldout_tokens=400)
    # a part of one epoch: sampling noise only
    drawn = large.source_of[block_indices(len(large.blocks), 3, 0, 4000)]
    shares = torch.bincount(drawn, minlength=3).float() / len(drawn)
    assert (shares - torch.tensor([0.5, 0.2, 0.3])).abs().max() < 0.02


def test_a_source_repeats_only_after_all_its_blocks_were_used():
    def labelled(n, base):  # block i holds base + i
        return (base + torch.arange(n)).unsqueeze(1).repeat(1, 4)

    parts = [labelled(5000, 0), labelled(37, 10_000)]
    blocks, source = mix_blocks(parts, [1000, 1000], seed=0)
    big, small = blocks[source == 0, 0], blocks[source == 1, 0] - 10_000
    assert len(big.unique()) == 1000  # a large source is cut, never repeated
    uses = torch.bincount(small, minlength=37)
    # a small one goes round whole, again and again
    assert uses.min() == 1000 // 37 and uses.max() == 1000 // 37 + 1
    for k in range(1000 // 37):  # ... and each round uses every block once before the next begins
        assert sorted(small[k * 37 : (k + 1) * 37].tolist()) == list(range(37))
    assert torch.equal(mix_blocks(parts, [1000, 1000], seed=0)[0], blocks)
    assert not torch.equal(mix_blocks(parts, [1000, 1000], seed=1)[0], blocks)


def test_without_a_budget_the_mixture_is_as_large_as_its_sources(three, tokenizer):
    mix = [SourceConfig(three[0], 3.0), SourceConfig(three[2], 1.0)]
    data = load_training_data(mix, tokenizer, 16, max_heldout_tokens=400)
    assert len(data.blocks) == sum(s["blocks"] for s in data.sources)
    assert torch.bincount(data.source_of).tolist() == apportion([0.75, 0.25], len(data.blocks))


def test_heldout_blocks_come_from_each_source_in_weight_order(three, tokenizer):
    mix = [SourceConfig(three[0], 0.5), SourceConfig(three[1], 0.2), SourceConfig(three[2], 0.3)]
    data = load_training_data(mix, tokenizer, 16, budget_blocks=100, max_heldout_tokens=300)
    held = [pack_blocks(prepare_corpus(s, tokenizer, max_heldout_tokens=300).heldout_ids, 16) for s in three]
    assert [s["heldout_blocks"] for s in data.sources] == [len(h) for h in held]
    assert len(data.eval_blocks) == sum(len(h) for h in held)  # each held-out block once
    for s in range(3):
        assert torch.equal(data.eval_blocks[data.eval_source_of == s], held[s])
    first = torch.bincount(data.eval_source_of[:10], minlength=3).tolist()
    assert first == [5, 2, 3]
    assert torch.equal(data.corpus.heldout_ids, data.eval_blocks.reshape(-1))  # what the report scores


def test_one_source_is_the_corpus_as_before(three, tokenizer):
    data = load_training_data(
        [SourceConfig(three[0])],
        tokenizer,
        16,
        budget_blocks=10_000,
        max_train_tokens=2000,
        max_heldout_tokens=400,
    )
    corpus = prepare_corpus(three[0], tokenizer, max_train_tokens=2000, max_heldout_tokens=400)
    assert torch.equal(data.blocks, pack_blocks(corpus.train_ids, 16))
    assert torch.equal(data.eval_blocks, pack_blocks(corpus.heldout_ids, 16))
    assert torch.equal(data.corpus.heldout_ids, corpus.heldout_ids)


def test_token_caps_per_source(three, tokenizer):
    mix = [SourceConfig(three[0], 3.0), SourceConfig(three[2], 1.0, max_tokens=160)]
    data = load_training_data(mix, tokenizer, 16, max_train_tokens=800, max_heldout_tokens=400)
    # weight's share of max_train_tokens, or its own cap
    assert [s["max_tokens"] for s in data.sources] == [
        600,
        160,
    ]
    assert [s["blocks"] for s in data.sources] == [600 // 16, 10]


def test_mixture_errors(three, tmp_path, tokenizer):
    with pytest.raises(DataError, match="weights must be positive"):
        load_training_data([SourceConfig(three[0], 0.0), SourceConfig(three[1])], tokenizer, 16)
    with pytest.raises(DataError, match="fewer than one block"):
        load_training_data([SourceConfig(three[0]), SourceConfig(three[1], max_tokens=10)], tokenizer, 16)
    with pytest.raises(DataError, match="no source has 64 held-out tokens"):
        load_training_data(
            [SourceConfig(three[0]), SourceConfig(three[1])], tokenizer, 64, max_heldout_tokens=40
        )


# ------------------------------------------------------------------------------ streaming


def write_parquet_dataset(root, n_rows=300, seed=0):
    """A folder of parquet shards: what a hub dataset repository holds, readable offline."""
    import datasets

    rng = random.Random(seed)
    texts = [
        " ".join(rng.choice(WORDS["a"] + WORDS["b"]) for _ in range(rng.randint(5, 30)))
        for _ in range(n_rows)
    ]
    texts[7] = "   "  # a blank row is skipped but keeps its row number
    root.mkdir()
    half = n_rows // 2
    datasets.Dataset.from_dict({"text": texts[:half], "n": list(range(half))}).to_parquet(
        str(root / "train-00000-of-00002.parquet")
    )
    datasets.Dataset.from_dict({"text": texts[half:], "n": list(range(half, n_rows))}).to_parquet(
        str(root / "train-00001-of-00002.parquet")
    )
    return root, texts


@pytest.fixture
def streaming_calls(monkeypatch):
    """Spy on datasets.load_dataset (the real function still runs); returns the list of its kwargs."""
    import datasets

    calls, real = [], datasets.load_dataset

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    return calls


def test_hub_dataset_streams_rows_with_the_download_ids(tmp_path, streaming_calls):
    root, texts = write_parquet_dataset(tmp_path / "ds")
    docs = list(iter_hf_documents(f"hf:{root}"))
    assert streaming_calls and all(c["streaming"] is True for c in streaming_calls)
    assert [(d.id, d.text) for d in docs] == [(f"hf:{root}:{i}", t) for i, t in enumerate(texts) if t.strip()]
    sliced = list(iter_hf_documents(f"hf:{root}:train[40:60]"))
    assert [(d.id, d.text) for d in sliced] == [
        (f"hf:{root}:train[40:60]:{i}", texts[40 + i]) for i in range(20)
    ]
    assert specs.row_slice("train[:10%]") is None and not specs.can_stream(f"hf:{root}:train[:10%]")
    with pytest.raises(DataError, match="no column 'body'"):
        next(iter_hf_documents(f"hf:{root}?field=body"))


def test_streamed_corpus_equals_the_downloaded_one_and_stops_early(
    tmp_path, tokenizer, monkeypatch, streaming_calls
):
    import datasets

    root, texts = write_parquet_dataset(tmp_path / "ds", n_rows=600)
    spec = f"hf:{root}"
    streamed = prepare_corpus(spec, tokenizer, max_train_tokens=1500, max_heldout_tokens=200)
    assert streaming_calls and all(c["streaming"] is True for c in streaming_calls)
    assert streamed.meta["streamed"] and streamed.meta["rows_read"] < len(texts)  # read only what it needed
    assert streamed.train_ids.numel() == 1500 and streamed.heldout_ids.numel() == 200
    # what the download path does: every row, the hash split, then the caps
    docs = [Document(f"{spec}:{i}", t) for i, t in enumerate(texts) if t.strip()]
    train, held = split_documents(docs, spec)
    eos = tokenizer.eos_token_id
    assert torch.equal(streamed.train_ids, tokenize.tokenize_documents(train, tokenizer, eos, 1500, "train"))
    assert torch.equal(
        streamed.heldout_ids, tokenize.tokenize_documents(held, tokenizer, eos, 200, "held-out")
    )
    assert prepare_corpus(spec, tokenizer, max_train_tokens=1500, max_heldout_tokens=200).meta["from_cache"]

    saved = tmp_path / "saved"  # a save_to_disk folder, streamed and downloaded
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(saved))
    streamed = prepare_corpus(f"hf:{saved}", tokenizer, max_train_tokens=1500, max_heldout_tokens=200)
    monkeypatch.setattr(packing, "can_stream", lambda spec: False)
    downloaded = prepare_corpus(f"hf:{saved}", tokenizer, max_train_tokens=1500, max_heldout_tokens=200)
    assert streamed.meta["streamed"] and "streamed" not in downloaded.meta
    assert torch.equal(downloaded.train_ids, streamed.train_ids) and torch.equal(
        downloaded.heldout_ids, streamed.heldout_ids
    )


def test_connection_lost_while_streaming_is_one_line(monkeypatch, tokenizer):
    import datasets

    class Rows:
        column_names = ("text",)

        def __iter__(self):
            yield {"text": "one row"}
            yield {"text": "two rows"}
            raise ConnectionError("Connection reset by peer\nwith a long traceback-ish tail")

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: Rows())
    with pytest.raises(DataError, match="unreachable while streaming 'hf:org/big' at row 2") as info:
        prepare_corpus("hf:org/big", tokenizer, max_train_tokens=1000, max_heldout_tokens=10)
    assert "\n" not in str(info.value)


def test_offline_hub_is_a_one_line_error_when_streaming(monkeypatch, tokenizer):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="Hub is unreachable") as info:
        prepare_corpus("hf:attn2ssm-tests/surely-not-cached-anywhere", tokenizer, max_train_tokens=100)
    assert "\n" not in str(info.value)


def test_mixture_streams_only_the_hub_share_of_the_budget(three, tmp_path, tokenizer, streaming_calls):
    root, texts = write_parquet_dataset(tmp_path / "ds", n_rows=600)
    mix = [SourceConfig(three[0], 0.75), SourceConfig(f"hf:{root}", 0.25)]
    data = load_training_data(mix, tokenizer, 16, budget_blocks=200, max_heldout_tokens=160)
    hub = data.sources[1]
    # no block repeated
    assert hub["streamed"] and hub["max_tokens"] == 50 * 16 and hub["blocks"] == hub["draws"] == 50
    assert prepare_corpus(f"hf:{root}", tokenizer, max_train_tokens=800, max_heldout_tokens=160).meta[
        "rows_read"
    ] < len(texts)


# ------------------------------------------------------------------------------ generated


def test_generated_spec_parsing():
    g = specs.parse_generated_spec("generated:4096")
    assert (g.n_tokens, g.prompts, g.temperature, g.top_p, g.length, g.batch) == (
        4096,
        None,
        1.0,
        1.0,
        256,
        16,
    )
    g = specs.parse_generated_spec("generated:100:hf:org/ds:cfg?top_p=0.9&batch=4&field=body&length=32")
    assert (g.prompts, g.top_p, g.batch, g.field, g.length) == ("hf:org/ds:cfg", 0.9, 4, "body", 32)
    for bad, match in (
        ("generated:lots", "number of tokens"),
        ("generated:10?topp=1", "unknown option"),
        ("generated:10?batch=two", "not a int"),
        ("generated:10?top_p=0", "out of range"),
        ("generated:0", "out of range"),
        ("generated:10?field=x", "no prompt corpus"),
    ):
        with pytest.raises(DataError, match=match):
            specs.parse_generated_spec(bad)
    with pytest.raises(DataError, match="cannot be read without the teacher"):
        load_documents("generated:100")


@pytest.fixture(scope="module")
def teacher():
    """A tiny random Llama over the test tokenizer's 300 ids."""
    config = tiny_config("llama")
    config.vocab_size = 300
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_generated_corpus_is_seeded_cached_and_exact(teacher, tokenizer, monkeypatch):
    spec = "generated:300?length=16&batch=8"
    rng_before = torch.get_rng_state()
    a = generate_corpus(spec, teacher, tokenizer, seed=1, progress=False)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the run's own random stream is untouched
    assert a.train_ids.numel() + a.heldout_ids.numel() == 300 and not a.meta["from_cache"]
    # ≤ 16 new tokens each
    assert a.meta["n_train_docs"] + a.meta["n_heldout_docs"] == a.meta["n_samples"] >= 300 // 17
    [path] = (cache_dir() / "generated").glob("*.pt")
    assert a.meta["cache_path"] == str(path)

    def no_sampling(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    with monkeypatch.context() as m:
        m.setattr(teacher, "generate", no_sampling)
        b = generate_corpus(spec, teacher, tokenizer, seed=1, progress=False)
    assert (
        b.meta["from_cache"]
        and torch.equal(a.train_ids, b.train_ids)
        and torch.equal(a.heldout_ids, b.heldout_ids)
    )
    path.unlink()  # sampled again from scratch: the same tokens
    c = generate_corpus(spec, teacher, tokenizer, seed=1, progress=False)
    assert not c.meta["from_cache"] and torch.equal(a.train_ids, c.train_ids)
    d = generate_corpus(spec, teacher, tokenizer, seed=2, progress=False)
    assert not torch.equal(a.train_ids[:100], d.train_ids[:100])
    assert len(list((cache_dir() / "generated").glob("*.pt"))) == 2


def test_generated_from_corpus_prompts(teacher, tokenizer, three, monkeypatch):
    inputs, real = [], teacher.generate

    def spy(**kwargs):
        inputs.append(kwargs["input_ids"])
        return real(**kwargs)

    monkeypatch.setattr(teacher, "generate", spy)
    corpus = generate_corpus(
        f"generated:300:{three[1]}?length=12&batch=4&prompt_len=6&top_p=0.9",
        teacher,
        tokenizer,
        progress=False,
    )
    assert corpus.train_ids.numel() + corpus.heldout_ids.numel() == 300
    prompts = prepare_corpus(three[1], tokenizer, max_heldout_tokens=0).train_ids  # training text only
    windows = {tuple(prompts[i : i + 6].tolist()) for i in range(prompts.numel() - 5)}
    rows = torch.cat(inputs)
    assert rows.shape[1] == 6 and all(tuple(r.tolist()) in windows for r in rows)
    assert len(set(map(tuple, rows.tolist()))) > len(rows) // 2  # cut at many places
    first = (
        corpus.train_ids
        if not corpus.meta["n_heldout_docs"] or corpus.train_ids[:6].tolist() == rows[0].tolist()
        else corpus.heldout_ids
    )
    # a sample keeps its prompt: real text the continuation follows
    assert first[:6].tolist() == rows[0].tolist()


def test_generated_source_in_a_mixture(teacher, tokenizer, three):
    mix = [SourceConfig(three[0], 0.6), SourceConfig("generated:800?length=32&batch=8", 0.4)]
    data = load_training_data(
        mix, tokenizer, 16, budget_blocks=100, max_heldout_tokens=200, teacher=teacher, progress=False
    )
    assert torch.bincount(data.source_of).tolist() == [60, 40]
    gen = generate_corpus("generated:800?length=32&batch=8", teacher, tokenizer, seed=0, progress=False)
    assert as_rows(data.blocks[data.source_of == 1]) <= as_rows(pack_blocks(gen.train_ids, 16))
    with pytest.raises(DataError, match="none was given"):
        load_training_data(mix, tokenizer, 16, budget_blocks=100)

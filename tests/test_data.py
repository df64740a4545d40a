"""data.py (tokenizers, shards, loader) and prepare_fineweb.py, offline, on a few KB of generated
text."""

import json
import os
import random
import shutil
import socket

import numpy as np
import pytest
import torch
from conftest import write_shard

import data
import prepare_fineweb
from data import (
    EOT,
    VOCAB_SIZE,
    TokenLoader,
    doc_starts,
    get_tokenizer,
    open_shard,
    read_tokens,
    shard_paths,
    shard_tokenizer,
)
from infra.runtime import LOCK_NAME

SMALL = ["--tokenizer", "byte", "--shard_size", "1000", "--val_tokens", "500", "--gap_tokens", "0"]
WORDS = "the quick brown fox jumps over a lazy dog naïve café 日本語 🙂 <|endoftext|> 42\n".split(
    " "
)


def make_docs(n, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def write_jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


def prepare(out_dir, files, *extra, num_proc=1):
    return prepare_fineweb.main(
        [
            "--local_files",
            *files,
            "--out_dir",
            str(out_dir),
            "--num_proc",
            str(num_proc),
            *SMALL,
            *extra,
        ]
    )


def stream(out_dir):
    """All tokens of a prepared directory in stream order (val shard, then train shards), read from
    the files."""
    return np.concatenate(
        [
            np.asarray(open_shard(p))
            for p in shard_paths(out_dir, "val") + shard_paths(out_dir, "train")
        ]
    )


def split_docs(tokens, eot):
    """Documents of a token stream, each starting with eot."""
    starts = np.flatnonzero(tokens == eot)
    assert starts[0] == 0, "the stream must start with end-of-text"
    return np.split(tokens, starts[1:])


def shard_bytes(out_dir):
    return {
        f: open(os.path.join(out_dir, f), "rb").read()
        for f in sorted(os.listdir(out_dir))
        if f.endswith(".bin")
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~9K tokens of byte-tokenized text: one 500-token val shard and 1000-token train shards."""
    root = tmp_path_factory.mktemp("corpus")
    texts = make_docs(60)
    path = write_jsonl(root / "docs.jsonl", texts)
    prepare(root / "d", [path], num_proc=2)
    return dict(texts=texts, path=path, dir=str(root / "d"))


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------
def forbid_network(monkeypatch, who):
    """Any socket opened from now on fails the test, naming who must stay offline; the tokenizer
    cache is emptied so that the next get_tokenizer loads its tokenizer under this guard."""

    def no_network(*a, **k):
        raise AssertionError(f"{who} must not touch the network")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    get_tokenizer.cache_clear()


def test_byte_tokenizer_is_offline(monkeypatch):
    forbid_network(monkeypatch, "the byte tokenizer")
    enc = get_tokenizer("byte")
    assert enc is get_tokenizer("byte")  # cached
    assert (enc.eot_token, enc.n_vocab) == (EOT["byte"], VOCAB_SIZE["byte"]) == (256, 257)
    text = "naïve café 日本語 🙂 <|endoftext|>"
    # the literal string is not end-of-text
    assert enc.encode_ordinary(text) == list(text.encode("utf-8"))
    assert enc.decode(enc.encode_ordinary(text)) == text
    # a cut multi-byte character must not crash
    assert isinstance(enc.decode([0xE6, 0x97, 256, 0xFF]), str)


def test_mistral_tokenizer_is_offline_and_round_trips(monkeypatch):
    forbid_network(monkeypatch, "the mistral tokenizer")
    tok = get_tokenizer("mistral")
    assert (
        (tok.n_vocab, tok.doc_start, tok.eot_token, tok.doc_end)
        == (VOCAB_SIZE["mistral"], 1, 2, 2)
        == (32768, 1, 2, 2)
    )
    text = "The pass key is 12345. naïve café 日本語 🙂 3.14159\nnew line <s> </s> [INST]"
    ids = tok.encode_ordinary(text)
    assert tok.decode(ids) == text
    assert not {0, 1, 2, 3} & set(ids)  # special-token strings are plain text
    digits = tok.encode_ordinary(" 12345")  # one token per digit after one leading space token
    assert [tok.decode([t]) for t in digits] == [" ", "1", "2", "3", "4", "5"]
    assert tok.document("hi") == [1] + tok.encode_ordinary("hi") + [2]
    assert tok.token_bytes(tok.encode_ordinary("a\nb")[1]) == b"\n"  # byte fallback
    assert tok.word_boundary and not get_tokenizer("byte").word_boundary
    get_tokenizer.cache_clear()


def test_prepare_mistral_gap_and_documents(tmp_path):
    texts = make_docs(60, seed=3)
    path = write_jsonl(tmp_path / "m.jsonl", texts)
    meta = prepare_fineweb.main(
        [
            "--local_files",
            path,
            "--tokenizer",
            "mistral",
            "--out_dir",
            str(tmp_path / "m"),
            "--val_tokens",
            "300",
            "--gap_tokens",
            "0",
            "--shard_size",
            "100000",
            "--num_proc",
            "1",
        ]
    )
    full = stream(tmp_path / "m")
    tok = get_tokenizer("mistral")
    # BOS ... EOS, in stream order
    assert full.tolist() == [t for x in texts for t in tok.document(x)]
    assert meta["documents"] == len(texts) and meta["doc_start"] == 1
    gap = 250
    meta = prepare_fineweb.main(
        [
            "--local_files",
            path,
            "--tokenizer",
            "mistral",
            "--out_dir",
            str(tmp_path / "g"),
            "--val_tokens",
            "300",
            "--gap_tokens",
            str(gap),
            "--shard_size",
            "100000",
            "--num_proc",
            "1",
        ]
    )
    assert meta["settings"]["gap_tokens"] == gap and meta["tokens"] == len(full) - gap
    np.testing.assert_array_equal(
        stream(tmp_path / "g"), np.concatenate([full[:300], full[300 + gap :]])
    )
    loader = TokenLoader(str(tmp_path / "g"), "train", block_size=32, batch_size=2)
    x, _, starts = loader.get_batch(0)
    for row, st in zip(x.tolist(), starts.tolist()):  # the document mask starts at BOS
        assert all(row[s] == 1 for s in st if s > 0) and all(
            st[i] == i for i, t in enumerate(row) if t == 1
        )


def test_tokenizer_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown tokenizer .bpe.*gpt2.*byte.*mistral"):
        get_tokenizer("bpe")
    import tiktoken

    def offline(name):
        raise ConnectionError("Failed to resolve openaipublic.blob.core.windows.net")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    get_tokenizer.cache_clear()
    with pytest.raises(RuntimeError, match="--tokenizer byte"):
        get_tokenizer("gpt2")
    get_tokenizer.cache_clear()


# --------------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------------
def test_shard_round_trip_and_header_errors(tmp_path):
    path = str(tmp_path / "x_train_000001.bin")
    tokens = np.array([256, 0, 1, 255, 65535, 7])
    write_shard(path, tokens, "byte")
    assert os.listdir(tmp_path) == ["x_train_000001.bin"]  # no .tmp left behind
    m = open_shard(path, "byte")
    assert m.dtype == np.uint16 and not m.flags.writeable
    np.testing.assert_array_equal(m, tokens)
    assert shard_tokenizer(path) == "byte"

    with pytest.raises(ValueError, match=r"made with the 'byte' tokenizer, not 'gpt2'"):
        open_shard(path, "gpt2")
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(raw[:-3])
    with pytest.raises(ValueError, match=r"x_train_000001\.bin: truncated.*rerun"):
        open_shard(path)
    with open(path, "wb") as f:
        f.write(b"XXXX" + raw[4:])
    with pytest.raises(ValueError, match="not a bam-gpt token shard"):
        open_shard(path)
    with open(path, "wb") as f:
        f.write(raw[:100])
    with pytest.raises(ValueError, match="shorter than the 256-byte shard header"):
        open_shard(path)

    with pytest.raises(ValueError, match="65536"):
        write_shard(path, [1, 65536], "byte")
    with pytest.raises(ValueError, match="empty"):
        write_shard(path, [], "byte")


# --------------------------------------------------------------------------------------------------
# prepare_fineweb.py
# --------------------------------------------------------------------------------------------------
def test_prepare_round_trip(corpus):
    d = corpus["dir"]
    texts = corpus["texts"]
    meta = json.load(open(os.path.join(d, "meta.json")))
    val = shard_paths(d, "val")
    train = shard_paths(d, "train")
    assert [os.path.basename(p) for p in val] == ["docs_val_000000.bin"]
    assert os.path.basename(train[0]) == "docs_train_000001.bin"
    sizes = [len(open_shard(p, "byte")) for p in val + train]
    assert sizes[0] == 500 and all(n == 1000 for n in sizes[1:-1]) and 0 < sizes[-1] <= 1000
    tokens = stream(d)
    docs = split_docs(tokens, EOT["byte"])
    enc = get_tokenizer("byte")
    # documents and their boundaries survive
    assert [enc.decode(doc[1:].tolist()) for doc in docs] == texts
    assert meta["complete"] and meta["tokens"] == len(tokens) == sum(
        len(t.encode()) + 1 for t in texts
    )
    assert (meta["documents"], meta["tokenizer"], meta["eot"], meta["vocab_size"]) == (
        len(texts),
        "byte",
        256,
        257,
    )


def test_prepare_jsonl_and_txt(tmp_path):
    """A .txt file is one document; jsonl records are documents; files come in the order given
    (globs sorted)."""
    j = write_jsonl(tmp_path / "a.jsonl", ["first record", "second record\nwith two lines"])
    (tmp_path / "t2.txt").write_text("essay two\n\nparagraph two\n")
    (tmp_path / "t1.txt").write_text("essay one\n\nstill essay one")
    prepare(tmp_path / "d", [j, str(tmp_path / "t*.txt")], "--val_tokens", "20")
    enc = get_tokenizer("byte")
    docs = [enc.decode(doc[1:].tolist()) for doc in split_docs(stream(tmp_path / "d"), EOT["byte"])]
    assert docs == [
        "first record",
        "second record\nwith two lines",
        "essay one\n\nstill essay one",
        "essay two\n\nparagraph two\n",
    ]


def test_prepare_input_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file matches"):
        prepare(tmp_path / "d", [str(tmp_path / "missing*.jsonl")])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        prepare(tmp_path / "d", [str(tmp_path / "empty.jsonl")])
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(ValueError, match="no text"):
        prepare(tmp_path / "d1", [blank])
    (tmp_path / "other.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="--text_column"):
        prepare(tmp_path / "d2", [str(tmp_path / "other.jsonl")])
    assert os.listdir(tmp_path / "d2") == [LOCK_NAME]  # nothing written
    os.makedirs(tmp_path / "d3")
    # not ours: no meta.json
    write_shard(str(tmp_path / "d3" / "demo_train_000001.bin"), [256, 1], "byte")
    with pytest.raises(FileExistsError, match="no meta.json"):
        prepare(tmp_path / "d3", [write_jsonl(tmp_path / "ok.jsonl", ["text"])])


def interrupt_after_shards(monkeypatch, n):
    """Make prepare_fineweb raise KeyboardInterrupt (a ^C) when it is about to write shard n + 1;
    returns the function that puts the real write_shard back."""
    real_write = prepare_fineweb.write_shard
    written = []

    def write_or_interrupt(path, tokens, name):
        if len(written) == n:
            raise KeyboardInterrupt
        written.append(path)
        real_write(path, tokens, name)

    monkeypatch.setattr(prepare_fineweb, "write_shard", write_or_interrupt)
    return lambda: monkeypatch.setattr(prepare_fineweb, "write_shard", real_write)


def test_prepare_resume_is_byte_identical(corpus, tmp_path, monkeypatch, capsys):
    reference = shard_bytes(corpus["dir"])
    files = [corpus["path"]]

    # 1. interrupted after three shards: the rerun keeps them (same inode), skips their documents,
    # finishes the rest
    restore = interrupt_after_shards(monkeypatch, 3)
    d = tmp_path / "d"
    with pytest.raises(KeyboardInterrupt):
        prepare(d, files)
    restore()
    inodes = {f: os.stat(d / f).st_ino for f in os.listdir(d) if f.endswith(".bin")}
    assert len(inodes) == 3
    real_tokenize = prepare_fineweb.tokenize
    tokenized = []
    monkeypatch.setattr(
        prepare_fineweb,
        "tokenize",
        lambda name, text: tokenized.append(text) or real_tokenize(name, text),
    )
    prepare(d, files)
    assert shard_bytes(d) == reference
    assert {f: os.stat(d / f).st_ino for f in inodes} == inodes
    # the documents of the kept shards were not tokenized again
    assert 0 < len(tokenized) < len(corpus["texts"])

    # 2. the last shard deleted and a stray .tmp left behind
    last = sorted(reference)[-2]  # sorted: ..._train_NNNNNN, then ..._val_000000
    os.remove(d / last)
    (d / (last + ".tmp")).write_bytes(b"partial")
    prepare(d, files)
    assert shard_bytes(d) == reference and not [f for f in os.listdir(d) if f.endswith(".tmp")]

    # 3. nothing left to do
    capsys.readouterr()
    prepare(d, files)
    assert "nothing to do" in capsys.readouterr().out

    # 4. other settings in the same directory are refused
    with pytest.raises(ValueError, match="shard_size: 1000 there, 2000 now"):
        prepare(d, files, "--shard_size", "2000")


def test_prepare_resume_across_the_gap(corpus, tmp_path, monkeypatch):
    """Interrupted right after the val shard: the resumed run skips the gap again."""
    gap = ["--gap_tokens", "700"]
    prepare(tmp_path / "ref", [corpus["path"]], *gap)
    reference = shard_bytes(tmp_path / "ref")
    full = stream(corpus["dir"])  # the same corpus without a gap
    np.testing.assert_array_equal(
        stream(tmp_path / "ref"), np.concatenate([full[:500], full[1200:]])
    )
    restore = interrupt_after_shards(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "d", [corpus["path"]], *gap)
    restore()
    prepare(tmp_path / "d", [corpus["path"]], *gap)
    assert shard_bytes(tmp_path / "d") == reference
    with pytest.raises(ValueError, match="gap_tokens: 700 there, 0 now"):
        prepare(tmp_path / "d", [corpus["path"]])


def test_prepare_max_tokens_then_extend(corpus, tmp_path):
    d = tmp_path / "d"
    meta = prepare(d, [corpus["path"]], "--max_tokens", "2200")
    assert meta["tokens"] == 2200 and len(stream(d)) == 2200
    np.testing.assert_array_equal(stream(d), stream(corpus["dir"])[:2200])
    prepare(d, [corpus["path"]])  # a larger budget extends the preparation
    assert shard_bytes(d) == shard_bytes(corpus["dir"])
    # and a smaller one starts it over, without the shards past it
    prepare(d, [corpus["path"]], "--max_tokens", "1500")
    assert len(stream(d)) == 1500 and len(shard_paths(d, "train")) == 1


# --------------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------------
def test_doc_starts():
    e = 9
    x = torch.tensor(
        [[5, e, 1, 2, e, 3], [1, 2, 3, 4, 5, 6], [e, 1, e, e, 2, 3], [1, 2, 3, 4, 5, e]]
    )
    expected = torch.tensor(
        [[0, 1, 1, 1, 4, 4], [0, 0, 0, 0, 0, 0], [0, 0, 2, 3, 3, 3], [0, 0, 0, 0, 0, 5]]
    )
    assert torch.equal(doc_starts(x, e), expected)
    x = torch.randint(0, 4, (3, 50))
    ref = torch.zeros_like(x)
    for b in range(3):
        for t in range(50):
            hits = [s for s in range(t + 1) if x[b, s] == 3]
            ref[b, t] = hits[-1] if hits else 0
    assert torch.equal(doc_starts(x, 3), ref)


def test_loader_windows_and_determinism(corpus):
    d = corpus["dir"]
    T = 16  # block size
    B = 4  # batch size
    loader = TokenLoader(d, "train", block_size=T, batch_size=B, tokenizer="byte")
    assert (loader.tokenizer, loader.doc_start, loader.vocab_size) == ("byte", 256, 257)
    shards = [np.asarray(open_shard(p), dtype=np.int64) for p in shard_paths(d, "train")]
    # consecutive stride-T windows of T+1 tokens inside each shard, in shard order
    windows = [s[a : a + T + 1] for s in shards for a in range(0, len(s) - T, T)]
    assert (
        len(loader) == loader.num_windows == len(windows) == sum((len(s) - 1) // T for s in shards)
    )

    steps = list(range(len(windows) // B + 3))  # past the end: wraps around
    forward = {s: loader.get_batch(s) for s in steps}
    backward = {s: TokenLoader(d, "train", T, B).get_batch(s) for s in reversed(steps)}
    for s in steps:
        x, y, ds = forward[s]
        assert x.dtype == y.dtype == ds.dtype == torch.int64 and x.shape == y.shape == ds.shape == (
            B,
            T,
        )
        for a, b in zip(forward[s], backward[s]):
            assert torch.equal(a, b)
        for b in range(B):
            w = windows[(s * B + b) % len(windows)]
            assert torch.equal(x[b], torch.from_numpy(w[:-1])) and torch.equal(
                y[b], torch.from_numpy(w[1:])
            )
        assert torch.equal(ds, doc_starts(x, 256))

    # gradient accumulation: micro-step m of step s is global batch s * grad_accum + m
    x, _, _ = loader.get_batch(2, micro_step=1, grad_accum=3)
    assert torch.equal(x, loader.get_batch(7)[0])


def test_loader_ranks_are_disjoint(corpus):
    T = 16  # block size
    B = 3  # batch size
    ga = 2  # gradient accumulation steps
    ranks = [TokenLoader(corpus["dir"], "train", T, B, rank=r, world_size=2) for r in range(2)]
    n_steps = len(ranks[0]) // (B * ga * 2)
    seen = [set(), set()]
    for r, loader in enumerate(ranks):
        for step in range(n_steps):
            for m in range(ga):
                seen[r].update(loader.window_indices(step, m, ga).tolist())
                x, _, _ = loader.get_batch(step, m, ga)
                other = ranks[1 - r].get_batch(step, m, ga)[0]
                assert not any(torch.equal(a, b) for a in x for b in other)
    assert not seen[0] & seen[1]
    # together they cover the stream, no gaps
    assert seen[0] | seen[1] == set(range(n_steps * B * ga * 2))


def test_val_split(corpus, monkeypatch):
    d = corpus["dir"]
    loader = TokenLoader(d, "val", block_size=499, batch_size=2)
    assert len(loader) == 1
    with pytest.raises(
        ValueError, match=r"block_size 500 is longer than the validation split \(500 tokens\)"
    ):
        TokenLoader(d, "val", block_size=500, batch_size=2)
    np.testing.assert_array_equal(read_tokens(d, "val", 500), stream(d)[:500])
    monkeypatch.setattr(data, "VAL_TOKENS", 300)  # val is capped at the first VAL_TOKENS tokens
    with pytest.raises(ValueError, match="which has 300"):
        read_tokens(d, "val", 301)
    assert len(TokenLoader(d, "val", block_size=100, batch_size=1)) == 2


def test_read_tokens_crosses_shards(corpus):
    d = corpus["dir"]
    out = read_tokens(d, "train", 1500)
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, stream(d)[500:2000])
    with pytest.raises(ValueError, match="which has"):
        read_tokens(d, "train", len(stream(d)))


def test_missing_data_is_actionable(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"does not exist.*prepare_fineweb\.py.*prepare_demo\.py"
    ):
        TokenLoader(str(tmp_path / "nope"), "train", 16, 2)
    with pytest.raises(FileNotFoundError, match=r"no val shards.*prepare_fineweb\.py"):
        TokenLoader(str(tmp_path), "val", 16, 2)


def test_loader_tokenizer_checks(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"made with the 'byte' tokenizer, not 'gpt2'"):
        TokenLoader(corpus["dir"], "train", 16, 2, tokenizer="gpt2")
    d = tmp_path / "mixed"
    shutil.copytree(corpus["dir"], d)
    write_shard(str(d / "docs_train_000099.bin"), [50256, 1, 2], "gpt2")
    with pytest.raises(ValueError, match="different tokenizers"):
        TokenLoader(str(d), "train", 16, 2)

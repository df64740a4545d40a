"""eval_ppl.py: per-token scoring (one full-context forward), the windowed averaging, the data
paths, main(), resume."""

import csv
import json
import os
import sys
import types

import numpy as np
import pytest
import torch
from conftest import write_shard

import eval_ppl
from data import EOT
from eval_common import EvalError
from eval_ppl import full_token_losses, hf_sequences, window_sums
from infra.runtime import save_checkpoint
from model import GPT, GPTConfig


def tiny_model(pe="bam", ssmax=True, seed=0, block_size=32):
    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            vocab_size=257,
            tokenizer="byte",
            n_layer=2,
            n_head=2,
            n_embd=16,
            block_size=block_size,
            pos_encoding=pe,
            ssmax=ssmax,
        )
    )
    # a prior that actually depends on distance, so that context length matters
    with torch.no_grad():
        for block in model.blocks:
            if hasattr(block.attn, "theta_beta"):
                block.attn.theta_beta.copy_(torch.tensor([0.5, 1.0]))
                block.attn.theta_alpha.copy_(torch.tensor([-1.0, -0.5]))
    return model.eval()


def random_seq(n_targets, seed=1):
    return torch.randint(0, 257, (n_targets + 1,), generator=torch.Generator().manual_seed(seed))


def ce_by_hand(model, seq):
    """Per-target CE from the full logits, written out: -log softmax(logits)[target]."""
    with torch.no_grad():
        logits, _ = model(seq[None, :-1])
    logp = logits[0].double().log_softmax(-1)
    return -logp[torch.arange(seq.numel() - 1), seq[1:]]


# --------------------------------------------------------------------------------------------------
# scoring and averaging
# --------------------------------------------------------------------------------------------------
def window_losses(model, seq, window):
    """The curve for one sequence: the mean CE in each window of `window` targets."""
    _, sums, counts = window_sums(full_token_losses(model, seq), window)
    return torch.tensor(sums, dtype=torch.float64) / torch.tensor(counts, dtype=torch.float64)


def test_window_losses_match_direct_computation():
    model = tiny_model()
    seq = random_seq(50)
    ce = ce_by_hand(model, seq)
    assert torch.allclose(full_token_losses(model, seq).double(), ce, atol=1e-5)
    got = window_losses(model, seq, 16)
    want = torch.stack([ce[0:16].mean(), ce[16:32].mean(), ce[32:48].mean(), ce[48:50].mean()])
    assert torch.allclose(got, want, atol=1e-5)
    ends, sums, counts = window_sums(ce, 16)
    assert ends == [16, 32, 48, 50] and counts == [16, 16, 16, 2]
    assert np.allclose(sums, [float(ce[a : a + 16].sum()) for a in (0, 16, 32, 48)])


@pytest.mark.parametrize(
    "pe,ssmax", [("bam", True), ("alibi", False), ("rope", True), ("nope", False)]
)
def test_full_mode_equals_training_loss(pe, ssmax):
    model = tiny_model(pe, ssmax)
    seqs = torch.stack([random_seq(32, seed=s) for s in range(3)])  # length == block_size
    with torch.no_grad():
        _, train_loss = model(seqs[:, :-1], seqs[:, 1:])
    per_token = torch.stack([full_token_losses(model, s) for s in seqs])
    assert torch.allclose(per_token.mean(), train_loss, atol=1e-6)
    # and one window covering the whole sequence is that same number
    assert torch.allclose(window_losses(model, seqs[0], 32).float(), per_token[0].mean(), atol=1e-6)


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------
def test_hf_sequences_takes_first_long_enough_texts_in_order():
    from data import get_tokenizer

    tok = get_tokenizer("byte")
    texts = ["too short", "", None, "a" * 30, "b" * 19, "c" * 40, "d" * 25]
    rows, read = hf_sequences(iter(texts), tok, seq_len=20, num_seqs=2)
    assert rows.shape == (2, 21) and read == 6
    # each article starts with end-of-text
    assert rows[0, 0] == EOT["byte"] and rows[1, 0] == EOT["byte"]
    assert bytes(rows[0, 1:].tolist()) == b"a" * 20  # "b"*19 + eot = 20 tokens: too short
    assert bytes(rows[1, 1:].tolist()) == b"c" * 20
    rows, read = hf_sequences(iter(texts), tok, seq_len=20, num_seqs=10)
    assert rows.shape == (3, 21) and read == len(texts)
    with pytest.raises(EvalError, match="none of the 7 texts has seq_len"):
        hf_sequences(iter(texts), tok, seq_len=100, num_seqs=2)


def fake_datasets(monkeypatch, load_dataset):
    """A stand-in for the `datasets` package (streaming needs the network)."""
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_hf_streams_the_first_long_enough_texts(setup, monkeypatch):
    asked = []

    def load_dataset(name, config, split, streaming):
        asked.append((name, config, split, streaming))
        return iter([{"text": "short"}, {"text": "x" * 200}, {"text": "y" * 300}])

    fake_datasets(monkeypatch, load_dataset)
    spec = "hf:wikimedia/wikipedia:20231101.en"
    rows = eval_ppl.main(argv(setup)[:-2] + ["--data", spec, "--num_seqs", "2"])
    assert asked == [("wikimedia/wikipedia", "20231101.en", "train", True)]
    assert rows[-1]["data"] == spec and rows[-1]["n_seqs"] == 2


def test_hf_offline_is_a_clear_error(monkeypatch):
    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'wikimedia/wikipedia' on the Hub")

    fake_datasets(monkeypatch, offline)
    with pytest.raises(EvalError, match="network access"):
        list(eval_ppl.hf_texts("hf:wikimedia/wikipedia:20231101.en"))
    for spec in ("hf:", "wikipedia"):
        with pytest.raises(SystemExit):
            eval_ppl.main(["--ckpt", "x", "--data", spec])


# --------------------------------------------------------------------------------------------------
# main(): end to end, resume, short data, memory
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def setup(tmp_path):
    torch.manual_seed(0)
    ckpt = tmp_path / "run_a" / "ckpt_0.pt"
    save_checkpoint(
        str(ckpt),
        GPT(
            GPTConfig(
                vocab_size=257, tokenizer="byte", n_layer=1, n_head=2, n_embd=16, block_size=32
            )
        ),
    )
    rng = np.random.default_rng(0)
    docs = [
        np.concatenate([[EOT["byte"]], rng.integers(0, 256, rng.integers(20, 120))])
        for _ in range(40)
    ]
    tokens = np.concatenate(docs)
    data = tmp_path / "data"
    data.mkdir()
    write_shard(str(data / "t_val_000000.bin"), tokens, "byte")
    write_shard(str(data / "t_train_000001.bin"), tokens, "byte")
    return dict(ckpt=str(ckpt), data=str(data), out=str(tmp_path / "out"), tokens=tokens)


def argv(s, *extra):
    return [
        "--ckpt",
        s["ckpt"],
        "--data_dir",
        s["data"],
        "--out",
        s["out"],
        "--seq_len",
        "100",
        "--window",
        "32",
        "--num_seqs",
        "5",
        *extra,
    ]


def test_main_end_to_end(setup):
    rows = eval_ppl.main(argv(setup))
    for f in ("ppl_summary.json", "ppl_summary.csv", "ppl_vs_position.png", "ppl_samples.jsonl"):
        assert os.path.getsize(os.path.join(setup["out"], f)) > 0, f
    with open(os.path.join(setup["out"], "ppl_summary.json")) as f:
        assert json.load(f) == rows
    with open(os.path.join(setup["out"], "ppl_summary.csv")) as f:
        assert len(list(csv.DictReader(f))) == len(rows) == 4 + 1

    # independent recomputation: end-of-text removed, rows of 101 tokens, one forward each, exp(mean
    # CE)
    from model import load_model

    model, _ = load_model(setup["ckpt"])
    toks = torch.from_numpy(setup["tokens"][setup["tokens"] != EOT["byte"]].astype(np.int64))
    seqs = toks[: 5 * 101].view(5, 101)
    with torch.no_grad():
        _, loss = model(seqs[:, :-1], seqs[:, 1:])
    overall = rows[-1]
    assert overall["scope"] == "overall" and overall["n_tokens"] == 500
    assert overall["ppl"] == pytest.approx(float(loss.exp()), rel=1e-5)
    assert [r["window_end"] for r in rows[:-1]] == [32, 64, 96, 100]
    assert [r["n_tokens"] for r in rows[:-1]] == [160, 160, 160, 20]
    ce = torch.stack([ce_by_hand(model, s) for s in seqs])
    for r, (a, b) in zip(rows, [(0, 32), (32, 64), (64, 96), (96, 100)]):
        assert r["window_start"] == a and r["ppl"] == pytest.approx(
            float(ce[:, a:b].mean().exp()), rel=1e-5
        )


def test_resume_after_interruption(setup, monkeypatch):
    first = eval_ppl.main(argv(setup))
    jsonl = os.path.join(setup["out"], "ppl_samples.jsonl")
    with open(jsonl) as f:
        lines = f.readlines()
    assert len(lines) == 5
    with open(jsonl, "w") as f:  # as if killed while writing the 4th record
        f.writelines(lines[:3])
        f.write(lines[3][:20])

    calls = []
    real = eval_ppl.full_token_losses
    monkeypatch.setattr(eval_ppl, "full_token_losses", lambda m, s: calls.append(1) or real(m, s))
    second = eval_ppl.main(argv(setup))
    assert len(calls) == 2  # sequences 3 and 4 only (the cut line is redone)
    assert [r["ppl"] for r in second] == pytest.approx([r["ppl"] for r in first], rel=1e-12)

    calls.clear()  # a finished run recomputes nothing; a different window is a different evaluation
    eval_ppl.main(argv(setup))
    assert calls == []
    eval_ppl.main(argv(setup)[:-4] + ["--window", "50", "--num_seqs", "5"])
    assert len(calls) == 5


def test_fewer_sequences_than_asked_and_none_at_all(setup, capsys):
    rows = eval_ppl.main(argv(setup)[:-2] + ["--num_seqs", "1000"])
    n_avail = (setup["tokens"] != EOT["byte"]).sum() // 101
    assert rows[-1]["n_seqs"] == n_avail and rows[-1]["n_tokens"] == 100 * n_avail
    assert f"the data holds {n_avail}" in capsys.readouterr().out
    with pytest.raises(EvalError, match="do not make one sequence"):
        eval_ppl.main(argv(setup) + ["--seq_len", "100000"])


def test_a_forward_out_of_memory_is_skipped_with_its_reason(setup, monkeypatch):
    def out_of_memory(*args):
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 931 GiB.\nmore"
        )

    monkeypatch.setattr(eval_ppl, "full_token_losses", out_of_memory)
    rows = eval_ppl.main(argv(setup))
    assert [r["scope"] for r in rows] == ["skipped"]
    assert rows[0]["note"] == (
        "skipped: a forward over 100 tokens ran out of memory (DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 931 GiB.)"
    )
    assert not os.path.exists(os.path.join(setup["out"], "ppl_vs_position.png"))
    with open(os.path.join(setup["out"], "ppl_summary.json")) as f:
        assert json.load(f) == rows

"""eval_ppl.py: per-token scoring (full and sliding), the windowed averaging, the data paths, main() end to end, resume."""
import csv
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval_ppl
from data import EOT, write_shard
from eval_common import EvalError
from eval_ppl import full_token_losses, hf_sequences, sliding_losses, sliding_windows, window_sums
from model import GPT, GPTConfig, save_checkpoint


def tiny_model(pe="bam", ssmax=True, seed=0, block_size=32):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=257, tokenizer="byte", n_layer=2, n_head=2, n_embd=16, block_size=block_size,
                          pos_encoding=pe, ssmax=ssmax))
    with torch.no_grad():  # a prior that actually depends on distance, so that context length matters
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


# ---------------------------------------------------------------------------------------------------------
# scoring and averaging
# ---------------------------------------------------------------------------------------------------------
def window_losses(model, seq, window):
    """Full mode's curve for one sequence: the mean CE in each window of `window` targets."""
    _, sums, counts = window_sums(full_token_losses(model, seq), window)
    return torch.tensor(sums, dtype=torch.float64) / torch.tensor(counts, dtype=torch.float64)


def test_window_losses_match_direct_computation():
    model, seq = tiny_model(), random_seq(50)
    ce = ce_by_hand(model, seq)
    assert torch.allclose(full_token_losses(model, seq).double(), ce, atol=1e-5)
    got = window_losses(model, seq, 16)
    want = torch.stack([ce[0:16].mean(), ce[16:32].mean(), ce[32:48].mean(), ce[48:50].mean()])
    assert torch.allclose(got, want, atol=1e-5)
    ends, sums, counts = window_sums(ce, 16)
    assert ends == [16, 32, 48, 50] and counts == [16, 16, 16, 2]
    assert np.allclose(sums, [float(ce[a:a + 16].sum()) for a in (0, 16, 32, 48)])


@pytest.mark.parametrize("pe,ssmax", [("bam", True), ("alibi", False), ("rope", True), ("nope", False)])
def test_full_mode_equals_training_loss(pe, ssmax):
    model = tiny_model(pe, ssmax)
    seqs = torch.stack([random_seq(32, seed=s) for s in range(3)])  # length == block_size
    with torch.no_grad():
        _, train_loss = model(seqs[:, :-1], seqs[:, 1:])
    per_token = torch.stack([full_token_losses(model, s) for s in seqs])
    assert torch.allclose(per_token.mean(), train_loss, atol=1e-6)
    # and one window covering the whole sequence is that same number
    assert torch.allclose(window_losses(model, seqs[0], 32).float(), per_token[0].mean(), atol=1e-6)


def test_sliding_windows_tile_every_target_once():
    for n, w, s in [(50, 16, 16), (50, 16, 5), (50, 16, 1), (10, 16, 8), (16, 16, 3), (17, 16, 16)]:
        wins = sliding_windows(n, w, s)
        scored = np.concatenate([np.arange(a, e) for _, e, a in wins])
        assert np.array_equal(scored, np.arange(n)), (n, w, s)
        assert all(e - b <= w and b <= a < e for b, e, a in wins)


@pytest.mark.parametrize("stride", [1, 5, 16])
def test_sliding_scores_each_target_with_its_window_context(stride):
    """Brute force: target t is scored in the first window b = kS whose end b + W exceeds t, i.e. with context
    x[b:t+1]; recompute every target's loss from a forward over exactly that context."""
    model, seq, W = tiny_model(), random_seq(45), 16
    got = sliding_losses(model, seq, W, stride, batch_size=3)
    for t in range(45):
        b = 0 if t < W else ((t - W) // stride + 1) * stride
        with torch.no_grad():
            logits, _ = model(seq[None, b:t + 1])
        want = F.cross_entropy(logits[0, -1].double(), seq[t + 1])
        assert abs(float(got[t]) - float(want)) < 1e-5, (t, b)
    # the batching of windows changes nothing
    assert torch.allclose(got, sliding_losses(model, seq, W, stride, batch_size=1), atol=1e-6)


def test_sliding_stride_equal_window_is_full_mode_on_cut_sequences():
    """With stride = window = W, sliding mode scores window k of a sequence exactly as full mode scores the
    sequence cut at W boundaries (seq[kW : (k+1)W + 1]): equal per token, hence equal per curve window. Only
    window 0 also equals full mode on the long sequence; later windows of full mode see more context."""
    model, W = tiny_model(), 16
    seq = random_seq(4 * W)
    slide = sliding_losses(model, seq, W, W)
    cut = torch.cat([full_token_losses(model, seq[k * W:(k + 1) * W + 1]) for k in range(4)])
    assert torch.allclose(slide, cut, atol=1e-6)
    long = full_token_losses(model, seq)
    assert torch.allclose(slide[:W], long[:W], atol=1e-6)
    assert not torch.allclose(slide[W:], long[W:], atol=1e-4)  # the long context does change the later losses
    _, s_sums, _ = window_sums(slide, W)
    assert torch.allclose(torch.tensor(s_sums) / W, torch.stack([window_losses(model, seq[k * W:(k + 1) * W + 1], W)[0]
                                                                  for k in range(4)]).float(), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------
def test_hf_sequences_takes_first_long_enough_texts_in_order():
    from data import get_tokenizer
    tok = get_tokenizer("byte")
    texts = ["too short", "", None, "a" * 30, "b" * 19, "c" * 40, "d" * 25]
    rows, read = hf_sequences(iter(texts), tok, seq_len=20, num_seqs=2)
    assert rows.shape == (2, 21) and read == 6
    assert rows[0, 0] == EOT["byte"] and rows[1, 0] == EOT["byte"]   # each article starts with end-of-text
    assert bytes(rows[0, 1:].tolist()) == b"a" * 20                   # "b"*19 + eot = 20 tokens: too short
    assert bytes(rows[1, 1:].tolist()) == b"c" * 20
    rows, read = hf_sequences(iter(texts), tok, seq_len=20, num_seqs=10)
    assert rows.shape == (3, 21) and read == len(texts)


def test_hf_offline_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'wikimedia/wikipedia' on the Hub")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(EvalError, match="network access"):
        list(eval_ppl.hf_texts("wikimedia/wikipedia", "20231101.en"))
    with pytest.raises(EvalError, match="hf:NAME"):
        eval_ppl.parse_hf("hf:")


# ---------------------------------------------------------------------------------------------------------
# main(): end to end, resume, short data, memory
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def setup(tmp_path):
    torch.manual_seed(0)
    ckpt = tmp_path / "run_a" / "ckpt_0.pt"
    save_checkpoint(str(ckpt), GPT(GPTConfig(vocab_size=257, tokenizer="byte", n_layer=1, n_head=2, n_embd=16,
                                             block_size=32)))
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[EOT["byte"]], rng.integers(0, 256, rng.integers(20, 120))]) for _ in range(40)]
    tokens = np.concatenate(docs)
    data = tmp_path / "data"
    data.mkdir()
    write_shard(str(data / "t_val_000000.bin"), tokens, "byte")
    write_shard(str(data / "t_train_000001.bin"), tokens, "byte")
    return dict(ckpt=str(ckpt), data=str(data), out=str(tmp_path / "out"), tokens=tokens)


def argv(s, *extra):
    return ["--ckpt", s["ckpt"], "--data_dir", s["data"], "--out", s["out"], "--seq_len", "100", "--window", "32",
            "--num_seqs", "5", *extra]


def test_main_end_to_end(setup):
    rows = eval_ppl.main(argv(setup, "--mode", "full", "sliding", "--sliding_window", "24", "--stride", "8"))
    for f in ("ppl_summary.json", "ppl_summary.csv", "ppl_vs_position.png", "ppl_samples.jsonl"):
        assert os.path.getsize(os.path.join(setup["out"], f)) > 0, f
    with open(os.path.join(setup["out"], "ppl_summary.json")) as f:
        assert json.load(f) == rows
    with open(os.path.join(setup["out"], "ppl_summary.csv")) as f:
        assert len(list(csv.DictReader(f))) == len(rows) == 2 * (4 + 1)

    # independent recomputation: end-of-text removed, rows of 101 tokens, one forward each, exp(mean CE)
    from model import load_model
    model, _ = load_model(setup["ckpt"])
    toks = torch.from_numpy(setup["tokens"][setup["tokens"] != EOT["byte"]].astype(np.int64))
    seqs = toks[:5 * 101].view(5, 101)
    with torch.no_grad():
        _, loss = model(seqs[:, :-1], seqs[:, 1:])
    full = [r for r in rows if r["mode"] == "full"]
    overall = full[-1]
    assert overall["scope"] == "overall" and overall["n_tokens"] == 500
    assert overall["ppl"] == pytest.approx(float(loss.exp()), rel=1e-5)
    assert [r["window_end"] for r in full[:-1]] == [32, 64, 96, 100]
    assert [r["n_tokens"] for r in full[:-1]] == [160, 160, 160, 20]
    ce = torch.stack([ce_by_hand(model, s) for s in seqs])
    for r, (a, b) in zip(full, [(0, 32), (32, 64), (64, 96), (96, 100)]):
        assert r["window_start"] == a and r["ppl"] == pytest.approx(float(ce[:, a:b].mean().exp()), rel=1e-5)
    sliding = [r for r in rows if r["mode"] == "sliding"]
    assert all(r["context"] == 24 and r["stride"] == 8 for r in sliding)
    assert sliding[0]["ppl"] != pytest.approx(full[0]["ppl"], rel=1e-6)  # window 0 of sliding has < 32 context
    assert all(r["stride"] is None and r["context"] == 100 for r in full)


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


def test_memory_check_skips_before_starting(setup, monkeypatch):
    monkeypatch.setattr(eval_ppl, "memory_shortfall", lambda *a, **k: "needs ~931 GiB, more than 90% of the 1 GiB")
    monkeypatch.setattr(eval_ppl, "full_token_losses", lambda *a: pytest.fail("should not run"))
    rows = eval_ppl.main(argv(setup))
    assert [r["scope"] for r in rows] == ["skipped"] and "needs" in rows[0]["note"]
    assert not os.path.exists(os.path.join(setup["out"], "ppl_vs_position.png"))

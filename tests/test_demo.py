"""The CPU demo: its corpus (prepare_demo.py), the prior figure (analysis/plot_prior.py) and a
reduced `make demo` end to end (two variants, a few steps, two lengths; eval_passkey.py writes its
per-seed table)."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import eval_passkey as passkey
import prepare_demo
from analysis import plot_prior
from data import EOT, TokenLoader, get_tokenizer, open_shard
from eval_common import EvalError
from infra.runtime import save_checkpoint
from model import GPT, GPTConfig, load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_walk(text, closed=False):
    """True iff every adjacent pair of `text` is an edge of the demo's chain (and, if closed, also
    last -> first)."""
    pairs = list(zip(text, text[1:]))
    if closed and text:
        pairs.append((text[-1], text[0]))

    return all(a in prepare_demo.CHAIN and b in prepare_demo.CHAIN[a] for a, b in pairs)


ENC = get_tokenizer("byte")
# a demo document after its end-of-text: task, filler, needle, filler, question, answer
DOC_RE = re.compile(r"^@([a-t]*)#(\d{5})([a-t]*)\? (\d{5})$")


def _prepare(out, seed=3, windows=300, extra=()):
    prepare_demo.main(
        [
            "--out_dir",
            str(out),
            "--seed",
            str(seed),
            "--train_windows",
            str(windows),
            "--val_windows",
            "16",
            *extra,
        ]
    )


def test_demo_template_filler_is_a_closed_walk_of_the_chain():
    t = passkey.TEMPLATES["demo"]
    assert is_walk(t["filler"], closed=True)
    # a -> h -> e are edges, a -> b is not
    assert is_walk("ahe") and not is_walk("ab")
    assert not is_walk("bgn", closed=True)  # n -> b is not an edge


def test_corpus_windows_are_whole_documents_in_the_eval_format(tmp_path):
    _prepare(tmp_path)
    loader = TokenLoader(str(tmp_path), "train", 64, 300)
    assert len(loader) == 300  # every window of the shard, no remainder
    x, y, doc_start = loader.get_batch(0)
    eot = EOT["byte"]
    # each window starts and ends on a document boundary
    assert (x[:, 0] == eot).all() and (y[:, -1] == eot).all()
    docs_per_window = []
    for row in x.tolist():
        starts = [i for i, t in enumerate(row) if t == eot] + [len(row)]
        docs_per_window.append(len(starts) - 1)
        for a, b in zip(starts, starts[1:]):
            assert b - a >= 24  # --min_doc_len default
            m = DOC_RE.match(ENC.decode(row[a + 1 : b]))
            assert m, ENC.decode(row[a + 1 : b])
            assert m[2] == m[4]  # the answer is the key
            assert is_walk(m[1] + m[3])  # one walk of the chain, cut by the needle
    # documents of several lengths, so SSMax sees many values of n
    assert {1, 2} <= set(docs_per_window)
    # the evaluation prompt (+ answer) has the same layout, its filler a repetition of the closed
    # walk
    t = passkey.TEMPLATES["demo"]
    n = passkey.filler_units(ENC, t, 256)
    prompt, answer, info = passkey.build_prompt(ENC, t, 256, 12345, 7)
    # opens like a training document
    assert prompt[0] == eot and eot not in prompt[1:] and len(prompt) <= 256
    m = DOC_RE.match(ENC.decode(prompt[1:] + answer))
    assert (
        m and m[2] == m[4] == "12345" and m[1] == t["filler"] * 7 and m[3] == t["filler"] * (n - 7)
    )
    assert info["n_given"] == 1  # the space is given, the 5 digits are scored


def test_corpus_is_a_function_of_the_seed(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        _prepare(tmp_path / name, seed=seed, windows=50)
    shard = "demo_train_000001.bin"
    a, b, c = (np.asarray(open_shard(str(tmp_path / n / shard))) for n in "abc")
    assert np.array_equal(a, b)
    assert a.shape == c.shape and not np.array_equal(a, c)
    # one document per window when asked
    _prepare(tmp_path / "d", windows=20, extra=["--docs_per_window", "1"])
    d = np.asarray(open_shard(str(tmp_path / "d" / shard)))
    assert (d == EOT["byte"]).sum() == 21 and (d[:-1:64] == EOT["byte"]).all()


def test_plot_prior_draws_the_model_prior(tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=257,
        tokenizer="byte",
        n_layer=2,
        n_head=4,
        n_embd=16,
        block_size=32,
        bam_init="linear",
    )
    model = GPT(cfg)
    with torch.no_grad():
        model.blocks[1].attn.theta_beta[0] = -0.7  # one anti-local head
        model.blocks[1].attn.theta_alpha[0] = 1.5
    save_checkpoint(str(tmp_path / "run" / "ckpt_0000001.pt"), model, step=1)
    out = tmp_path / "fig" / "prior.png"
    plot_prior.main(["--ckpt", str(tmp_path / "run"), "--out", str(out)])
    assert out.stat().st_size > 10_000
    info = json.loads((tmp_path / "fig" / "prior.json").read_text())
    assert info["heads"] == 8 and info["heads_highlighted"] == 1 and info["prior"] == "ggd"
    assert [h["head"] for layer in info["layers"] for h in layer["heads"] if h["highlighted"]] == [
        0
    ]
    # to 64 training contexts
    assert info["distances"][0] == 1 and info["distances"][-1] == 64 * 32
    head = info["layers"][1]["heads"][0]
    assert head["theta_beta"] == pytest.approx(-0.7) and head["theta_alpha"] == pytest.approx(1.5)
    d = np.array(info["distances"], dtype=np.float64)
    np.testing.assert_allclose(head["bias"], -math.exp(1.5) * (d + 1e-5) ** -0.7, rtol=1e-5)
    assert head["bias_at_0"] < -1e3  # theta_beta < 0 blocks the query's own position
    h3 = info["layers"][0]["heads"][3]  # linear init: theta_beta = 1, theta_alpha = 0, i.e. -|d|
    np.testing.assert_allclose(h3["bias"], -(d + 1e-5), rtol=1e-5)
    rope = GPT(
        GPTConfig(
            vocab_size=257, tokenizer="byte", n_layer=1, n_head=2, n_embd=8, pos_encoding="rope"
        )
    )
    save_checkpoint(str(tmp_path / "rope" / "ckpt_0000001.pt"), rope, step=1)
    with pytest.raises(EvalError, match="no positional prior"):
        plot_prior.main(["--ckpt", str(tmp_path / "rope")])


def test_make_demo_reduced_end_to_end(tmp_path):
    """`make demo` itself with few steps, two variants and two lengths, into a temporary directory;
    then the same training command again gives the same weights (the same seed gives the same
    table)."""
    out = tmp_path / "out"
    results = tmp_path / "results"
    data = tmp_path / "data"
    train_args = (
        "--max_iters=20 --eval_interval=20 --eval_iters=2 --log_interval=10 --ckpt_interval=20"
    )
    cmd = [
        "make",
        "--no-print-directory",
        "-o",
        "deps",
        "demo",
        f"PYTHON={sys.executable}",
        "SEEDS=1",
        "DEMO_VARIANTS=bam_ssmax rope",
        "DEMO_LENGTHS=64 256",
        f"DEMO_OUT={out}",
        f"DEMO_RESULTS={results}",
        f"DEMO_DATA={data}",
        "DEMO_PREPARE_ARGS=--train_windows 800 --val_windows 64",
        f"DEMO_TRAIN_ARGS={train_args}",
        "DEMO_EVAL_ARGS=--samples 3",
    ]
    # a shared machine is slow
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model = check_demo_outputs(out, results, proc.stdout)
    check_training_is_repeatable(model, tmp_path / "again", data, train_args)
    check_content_stamp(cmd, out, data)


def check_demo_outputs(out, results, stdout):
    """The reduced make demo's tables, figures and checkpoints; returns the BAM + SSMax model."""
    summary = json.loads((results / "passkey_summary.json").read_text())
    assert sorted((r["label"], r["target_length"]) for r in summary) == [
        ("bam_ssmax-s1", 64),
        ("bam_ssmax-s1", 256),
        ("rope-s1", 64),
        ("rope-s1", 256),
    ]
    assert all(r["n"] == 3 and 0 <= r["accuracy"] <= 1 for r in summary)
    table = (results / "demo_table.md").read_text()
    assert (
        "| run | seed | 1× | 4× |" in table
        and "| bam_ssmax | 1 |" in table
        and "| rope | 1 |" in table
    )
    assert table.splitlines()[0] in stdout
    assert (results / "passkey_accuracy.png").exists() and (
        results / "prior_bam_ssmax-s1.png"
    ).exists()
    prior = json.loads((results / "prior_bam_ssmax-s1.json").read_text())
    # config/demo_cpu.py: 4 layers of 8 heads
    assert prior["heads"] == 4 * 8 and prior["block_size"] == 64
    model, ckpt = load_model(str(out / "bam_ssmax-s1"))
    assert ckpt["step"] == 20 and model.config.pos_encoding == "bam" and model.config.ssmax
    rope, _ = load_model(str(out / "rope-s1"))
    assert rope.config.pos_encoding == "rope" and not rope.config.ssmax
    return model


def check_training_is_repeatable(model, again, data, train_args):
    """The same training command again gives the same weights."""
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "config/demo_cpu.py",
            f"--out_dir={again}",
            f"--data_dir={data}/s1",
            "--pos_encoding=bam",
            "--ssmax=True",
            "--seed=1",
            *train_args.split(),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model2, _ = load_model(str(again))
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


def check_content_stamp(cmd, out, data):
    """prepare_demo.py run again writes the same bytes with a new date: nothing is retrained; other
    bytes change the content stamp that training depends on."""
    stamp = data / "s1" / "content.sha256"
    digest = stamp.read_text()
    _prepare(data / "s1", seed=1, windows=800, extra=["--val_windows", "64"])
    make = [a for a in cmd if a != "demo"]
    proc = subprocess.run(
        make + [str(out / "bam_ssmax-s1" / "done")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "training" not in proc.stdout, proc.stdout + proc.stderr
    assert stamp.read_text() == digest
    _prepare(data / "s1", seed=1, windows=700, extra=["--val_windows", "64"])
    subprocess.run(make + [str(stamp)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    assert stamp.read_text() != digest

"""The zoo of priors: a reduced `make zoo` end to end (two of its variants, a few steps, both demos:
passkey retrieval to 4x, perplexity to 4x, the per-seed tables and their figures, the learned
priors)."""

import json
import os
import subprocess
import sys

import pytest

from model import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# make test-all runs it: each script it drives has its own end-to-end test in the default run
@pytest.mark.slow
def test_make_zoo_reduced_end_to_end(tmp_path):
    """`make zoo` itself with T5's buckets under SSMax and Sandwich: each a registered prior run
    as pos_encoding=bam from its default init, on both demos' data."""
    out, data, results = tmp_path / "out", tmp_path / "data", tmp_path / "results"
    train_args = "--max_iters=3 --eval_interval=3 --eval_iters=2 --log_interval=1 --ckpt_interval=3"
    cmd = [
        "make", "--no-print-directory", "-o", "deps", "zoo", f"PYTHON={sys.executable}", "SEEDS=1",
        "ZOO_VARIANTS=t5_bucket_ssmax sandwich", f"ZOO_RESULTS={results}",
        f"DEMO_OUT={out}/demo", f"DEMO_DATA={data}/demo", "DEMO_LENGTHS=64 256",
        "DEMO_PREPARE_ARGS=--train_windows 800 --val_windows 64", f"DEMO_TRAIN_ARGS={train_args}",
        "DEMO_EVAL_ARGS=--samples 2", f"TEXT_OUT={out}/text", f"TEXT_DATA={data}/text",
        "TEXT_PREPARE_ARGS=--val_tokens 65536", f"TEXT_TRAIN_ARGS={train_args}",
        "TEXT_EVAL_ARGS=--seq_len 256 --window 64 --num_seqs 2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    for demo, steps in (("demo", 3), ("text", 3)):
        model, ckpt = load_model(str(out / demo / "t5_bucket_ssmax-s1"))
        cfg = model.config
        assert ckpt["step"] == steps and (cfg.pos_encoding, cfg.prior, cfg.ssmax) == (
            "bam",
            "t5_bucket",
            True,
        )
        assert model.blocks[0].attn.buckets.shape == (cfg.n_head, 32)
        model, _ = load_model(str(out / demo / "sandwich-s1"))
        assert (model.config.prior, model.config.ssmax) == ("sandwich", False)

    labels = ["sandwich-s1", "t5_bucket_ssmax-s1"]
    passkey = json.loads((results / "passkey_summary.json").read_text())
    assert sorted({r["label"] for r in passkey}) == labels
    assert sorted({r["target_length"] for r in passkey}) == [64, 256]
    ppl = [
        r for r in json.loads((results / "ppl_summary.json").read_text()) if r["scope"] == "window"
    ]
    assert sorted({r["label"] for r in ppl}) == labels and max(r["window_end"] for r in ppl) == 256
    for table in ("demo_table", "ppl_table"):
        assert "| t5_bucket_ssmax | 1 |" in (results / f"{table}.md").read_text()
        assert (results / f"{table}.png").exists()
    for demo in ("passkey", "text"):
        for run in labels:
            assert (results / f"prior_{demo}_{run}.png").exists()
    assert json.loads((results / "corpus.json").read_text())["documents"] == 66

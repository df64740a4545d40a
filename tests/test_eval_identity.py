"""Evaluation results belong to a checkpoint's identity (its weights), not to its path: when the
checkpoint at a path changes, every evaluation that resumes into the same --out evaluates it again
and reports the new numbers."""

import json

import numpy as np
import pytest
import torch
from conftest import write_shard

import eval_common as ec
import eval_passkey
import eval_ppl
import eval_ruler
from data import EOT
from infra.runtime import checkpoint_digest, save_checkpoint
from model import GPT, GPTConfig, load_checkpoint


def save_tiny(path, seed):
    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(vocab_size=257, tokenizer="byte", n_layer=1, n_head=2, n_embd=16, block_size=32)
    )
    save_checkpoint(str(path), model, step=seed)
    return model


def records(path, ckpt):
    """The records of the weights now at ckpt (the log keeps those of earlier ones beside them)."""
    digest = checkpoint_digest(load_checkpoint(ckpt))
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r["ckpt_sha256"] == digest]


# what each evaluation predicts per sample: the numbers that must follow the checkpoint
def passkey(ckpt, out, data):
    eval_passkey.main(
        ["--ckpt", ckpt, "--out", out, "--lengths", "300", "--samples", "3", "--no_progress"]
    )
    return [r["predicted"] for r in records(f"{out}/passkey_samples.jsonl", ckpt)]


def ruler(ckpt, out, data):
    eval_ruler.main(
        [
            "--ckpt",
            ckpt,
            "--out",
            out,
            "--tasks",
            "niah_single_1",
            "--lengths",
            "640",
            "--samples",
            "2",
            "--device",
            "cpu",
        ]
    )
    return [r["output"] for r in records(f"{out}/ruler_samples.jsonl", ckpt)]


def ppl(ckpt, out, data):
    eval_ppl.main(
        ["--ckpt", ckpt, "--out", out, "--data_dir", data, "--seq_len", "64", "--num_seqs", "2"]
    )
    return [r["loss_sums"] for r in records(f"{out}/ppl_samples.jsonl", ckpt)]


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(0)
    tokens = np.concatenate(
        [np.concatenate([[EOT["byte"]], rng.integers(0, 256, 80)]) for _ in range(10)]
    )
    (tmp_path / "data").mkdir()
    for split, i in (("val", 0), ("train", 1)):
        write_shard(str(tmp_path / "data" / f"t_{split}_{i:06d}.bin"), tokens, "byte")
    return str(tmp_path / "data")


@pytest.mark.parametrize("evaluate", [passkey, ruler, ppl])
def test_a_changed_checkpoint_is_evaluated_again(tmp_path, data, evaluate):
    ckpt = tmp_path / "run" / "ckpt_1.pt"
    save_tiny(ckpt, 1)
    out = str(tmp_path / "out")
    first = evaluate(str(ckpt), out, data)
    assert evaluate(str(ckpt), out, data) == first  # resumed: the same records, nothing added
    save_tiny(ckpt, 2)  # another model at the same path (retrained in place)
    again = evaluate(str(ckpt), out, data)
    fresh = evaluate(str(ckpt), str(tmp_path / "fresh"), data)
    assert again == fresh != first  # the new checkpoint's numbers, and only those


def test_digest_follows_the_weights_not_the_file(tmp_path):
    a = save_tiny(tmp_path / "a.pt", 1)
    save_checkpoint(str(tmp_path / "b.pt"), a, step=1, extra="another file, the same model")
    save_tiny(tmp_path / "c.pt", 2)
    runs, _ = ec.load_runs([str(tmp_path / n) for n in ("a.pt", "b.pt", "c.pt")], "cpu")
    assert runs[0]["ckpt_sha256"] == runs[1]["ckpt_sha256"] != runs[2]["ckpt_sha256"]
    assert runs[0]["ckpt_step"] == 1 and runs[2]["ckpt_step"] == 2

"""analysis/sample.py end to end: greedy (--top_k=1) is deterministic and equals decoding without
the cache, a seed fixes a sampled text, FILE: prompts, top-k sampling stays in the top k, and a
missing checkpoint is a one-line error."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import run_script_here
from test_eval_lm import greedy_without_cache

from analysis.sample import SEPARATOR, main
from data import get_tokenizer
from infra.runtime import save_checkpoint
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = get_tokenizer("byte")


def tiny_model(pe="bam"):
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=257,
            tokenizer="byte",
            n_layer=2,
            n_head=2,
            n_embd=16,
            block_size=32,
            pos_encoding=pe,
            bam_init="alibi" if pe == "bam" else "zero",
        )
    ).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "ckpt_0000001.pt"
    save_checkpoint(str(path), tiny_model(), step=1)
    return path.parent


def run_sample(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "analysis", "sample.py"), *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_greedy_prints_the_same_text_twice(ckpt):
    r = run_sample(
        "--ckpt",
        ckpt,
        "--start",
        "The sky is",
        "--top_k=1",
        "--num_samples",
        2,
        "--max_new_tokens",
        20,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    samples = r.stdout.split(SEPARATOR + "\n")
    assert len(samples) == 3 and samples[2] == "" and samples[0] == samples[1]
    ctx = [TOK.doc_start] + TOK.encode_ordinary("The sky is")
    assert (
        samples[0]
        == TOK.decode(ctx[1:] + greedy_without_cache(tiny_model(), ctx, 20, keep_eot=False)) + "\n"
    )


def test_seeded_samples_repeat_and_greedy_ignores_the_seed(ckpt, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time\n", encoding="utf-8")
    common = [
        "--ckpt",
        str(ckpt),
        "--start",
        f"FILE:{prompt}",
        "--num_samples",
        "3",
        "--max_new_tokens",
        "12",
    ]
    a, b, c = (
        main(common + ["--seed", str(s), "--temperature", "1.0", "--top_k", "50"])
        for s in (1, 1, 2)
    )
    assert (
        a == b and a != c and len(set(a)) > 1 and all(s.startswith("Once upon a time\n") for s in a)
    )
    g1, g2 = (main(common + ["--seed", str(s), "--top_k", "1"]) for s in (1, 2))
    assert g1 == g2 and len(set(g1)) == 1
    # temperature 0 is greedy too
    assert main(common + ["--temperature", "0", "--top_k", "200"]) == g1
    capsys.readouterr()


def test_top_k_sampling_stays_in_the_top_k():
    model = tiny_model()
    ctx = [TOK.doc_start] + TOK.encode_ordinary("abc")
    torch.manual_seed(3)
    new = model.generate(torch.tensor([ctx]), 10, temperature=5.0, top_k=3)
    for i, tok in enumerate(new):
        with torch.no_grad():
            logits, _ = model(torch.tensor([ctx + new[:i]]))
        assert tok in logits[0, -1, : model.config.vocab_size].topk(3).indices.tolist()


def test_missing_checkpoint_is_a_one_line_error(tmp_path):
    """The script's entry point: one line `sample.py: error: ...` on stderr, exit status 1."""
    r = run_script_here(
        os.path.join("analysis", "sample.py"), "--ckpt", tmp_path / "nothing", "--start", "x"
    )
    assert r.returncode == 1 and r.stdout == "", r.stderr[-2000:]
    assert r.stderr == (
        f"sample.py: error: no checkpoint at {str(tmp_path / 'nothing')!r}: pass a .pt file or "
        "a run directory written by train.py\n"
    )

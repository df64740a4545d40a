"""eval_passkey.py: prompt construction, scoring, the command line end to end, resume and
determinism (CPU, fast)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
import torch
import torch.nn as nn
from conftest import run_script_here

import attention_kernel as ak
import eval_common
import eval_passkey as ep
import model as model_mod
from data import get_tokenizer, tiktoken_tokenizer
from infra import kernel_check
from infra.runtime import save_checkpoint
from model import GPT, GPTConfig, load_model

PAPER = ep.TEMPLATES["paper"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def enc():
    return get_tokenizer("byte")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny byte-level checkpoints (different weights) in run directories runA/ and runB/."""
    root = tmp_path_factory.mktemp("ckpts")
    paths = []
    for i, name in enumerate(["runA", "runB"]):
        torch.manual_seed(i)
        cfg = GPTConfig(
            vocab_size=257, tokenizer="byte", n_layer=1, n_head=2, n_embd=16, block_size=32
        )
        save_checkpoint(str(root / name / "ckpt_10.pt"), GPT(cfg))
        paths.append(str(root / name))
    return paths


# differ between otherwise identical runs
TIMING_FIELDS = (
    "seconds",
    "seconds_per_sample",
    "peak_mem_mib",
)


def score_sample(model, tokens, answer_tokens, n_given=0):
    """One sample through eval_passkey.score_batch: (correct, predicted tokens)."""
    return ep.score_batch(model, [list(tokens)], [list(answer_tokens)], n_given)[0]


def run_main(out, ckpts, *extra):
    argv = [a for c in ckpts for a in ("--ckpt", c)] + ["--out", str(out), "--no_progress", *extra]
    return ep.main(argv)


def strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS + ("batch",)} for r in rows]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- the template and the length grids -----------------------------------------------------------
def test_paper_template_is_the_authors_verbatim():
    assert PAPER["task"] == (
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize them. I will quiz you about the important information there."
    )
    assert PAPER["filler"] == (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    )
    assert PAPER["needle"] == "The pass key is {pass_key}. Remember it. {pass_key} is the pass key."
    assert PAPER["question"] == "What is the pass key? The pass key is"
    assert PAPER["digits"] == 5


def test_length_grids():
    paper = [3640, 7281, 10922, 14563, 18204, 21845, 25486, 29127, 32768]
    assert ep.PRESETS["paper"] == dict(lengths=paper, samples=20)
    extreme = ep.PRESETS["extreme"]
    assert extreme["lengths"] == [10_000 * i for i in range(1, 11)] + [
        100_000 * i for i in range(2, 6)
    ]
    assert (extreme["samples"], extreme["template"], extreme["dtype"]) == (
        10,
        dict(digits=6, given_digits=1),
        "float32",
    )
    assert ep.default_lengths([32], 8192) == [32 * 2**i for i in range(9)]
    assert ep.default_lengths([512]) == [512 * 2**i for i in range(6)]  # 32 x the training length
    # several training lengths: the union of their grids, capped at max_length
    assert ep.default_lengths([384, 512], 2048) == [384, 512, 768, 1024, 1536, 2048]


# ---- prompts (byte tokenizer) --------------------------------------------------------------------
@pytest.mark.parametrize("target", [300, 512, 1000, 4096, 8192])
def test_prompt_layout_byte(enc, target):
    n = ep.filler_units(enc, PAPER, target)
    task = enc.encode_ordinary(PAPER["task"])
    filler = enc.encode_ordinary(" " + PAPER["filler"])
    question = enc.encode_ordinary(" " + PAPER["question"])
    for k in sorted({0, n // 3, n // 2, n}):
        tokens, answer, info = ep.build_prompt(enc, PAPER, target, 12345, k)
        assert len(tokens) == info["length"] <= target
        assert len(tokens) + len(filler) > target  # N is the most filler that fits
        assert (info["k"], info["n_filler"]) == (k, n)
        assert info["depth"] == (k / n if n else 0.0)
        # the needle sits after the task and exactly k filler units
        assert info["needle_start"] == len(task) + k * len(filler)
        assert tokens[: info["needle_start"]] == task + filler * k
        needle = " The pass key is 12345. Remember it. 12345 is the pass key."
        assert enc.decode(tokens[info["needle_start"] : info["needle_end"]]) == needle
        assert tokens[info["needle_start"] + len(needle) :] == filler * (n - k) + question
        assert enc.decode(tokens).endswith(". What is the pass key? The pass key is")
        # the answer: a space, then the five digit bytes; only the digits are scored
        assert answer == list(b" 12345") and info["n_given"] == 1


def test_prompt_too_short_is_an_error(enc):
    shortest = ep.min_prompt_length(enc, PAPER)
    ep.build_prompt(enc, PAPER, shortest, 12345, 0)
    with pytest.raises(ValueError, match="shorter than the prompt"):
        ep.build_prompt(enc, PAPER, shortest - 1, 12345, 0)
    with pytest.raises(ValueError, match="digits"):
        ep.build_prompt(enc, PAPER, 1000, 1234, 0)


def test_samples_are_seeded_and_per_length(enc):
    a = ep.make_samples(enc, PAPER, 2000, 8, seed=5)
    b = ep.make_samples(enc, PAPER, 2000, 8, seed=5)
    c = ep.make_samples(enc, PAPER, 2000, 8, seed=6)
    assert [x[0] for x in a] == [x[0] for x in b]
    keys = [x[2]["key"] for x in a]
    assert keys != [x[2]["key"] for x in c]
    assert all(10_000 <= k <= 99_999 for k in keys) and len(set(keys)) > 1
    depths = [x[2]["depth"] for x in a]
    assert depths[0] == 0.0 and depths[-1] == 1.0 and depths == sorted(depths)
    n = ep.filler_units(enc, PAPER, 2000)  # k = linspace(0, N, samples).long(), as the authors
    assert [x[2]["k"] for x in a] == torch.linspace(0, n, 8).long().tolist()
    # the same (seed, length) gives the same prompts whatever else is evaluated
    assert [x[2]["key"] for x in ep.make_samples(enc, PAPER, 2000, 8, seed=5)] == keys


def merging_tokenizer():
    """A small BPE where the space merges into digits (like gpt2: " 12345" -> " 123" + "45") and 9s
    merge, so that the widest key 99999 is the *shortest* needle: other keys must still fit the
    target."""
    ranks = {bytes([i]): i for i in range(256)}
    for tok in [b" 1", b"23", b" 123", b"99", b"9999", b"45"]:
        ranks[tok] = len(ranks)
    pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken_tokenizer(
        tiktoken.Encoding(
            "merge-test",
            pat_str=pat,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": len(ranks)},
        ),
        len(ranks),
    )


def test_prompt_with_merging_tokenizer():
    enc = merging_tokenizer()
    answer, n_given = ep.answer_tokens(enc, 12345)
    # all answer tokens scored
    assert [enc.decode([t]) for t in answer] == [
        " 123",
        "45",
    ] and n_given == 0
    reduced = 0
    for target in range(300, 1400, 13):
        n = ep.filler_units(enc, PAPER, target)
        for key in (12345, 45678, 99999):
            for k in (0, n):
                tokens, ans, info = ep.build_prompt(enc, PAPER, target, key, k)
                assert len(tokens) <= target
                assert info["n_filler"] <= n and info["k"] <= k
                reduced += info["n_filler"] < n
                text = enc.decode(tokens[info["needle_start"] :])
                assert text.startswith(
                    f" The pass key is {key}. Remember it. {key} is the pass key."
                )
                assert enc.decode(tokens).endswith("What is the pass key? The pass key is")
                assert enc.decode(ans) == f" {key}"
    # some keys tokenize longer than 99999, and filler was dropped to keep within the target
    assert reduced > 0


# ---- scoring on a stub model ---------------------------------------------------------------------
class StubModel(nn.Module):
    """Returns logits whose argmax at the last `logits_at` positions is `self.predict` (plus
    optional decoys)."""

    def __init__(self, predict, vocab=257, padded=320, decoy=None):
        super().__init__()
        self.config = type("C", (), {"vocab_size": vocab})()
        self.predict = predict
        self.padded = padded
        self.decoy = decoy
        self.calls = []

    def forward(self, idx, logits_at=None):
        self.calls.append((idx.clone(), logits_at))
        logits = torch.zeros(idx.shape[0], logits_at, self.padded)
        logits[:, torch.arange(logits_at), torch.tensor(self.predict)] = 5.0
        if self.decoy is not None:  # a padded-vocabulary entry above everything: never a prediction
            logits[..., self.decoy] = 50.0
        return logits, None


def test_score_sample_on_stub(enc):
    prompt, answer, info = ep.build_prompt(enc, PAPER, 600, 31415, 2)
    digits = answer[info["n_given"] :]
    assert digits == list(b"31415")

    right = StubModel(digits)
    assert score_sample(right, prompt, answer, info["n_given"]) == (True, digits)
    idx, m = right.calls[0]
    # teacher forcing; logits only at the 5 digits
    assert idx.tolist() == [prompt + answer[:-1]] and m == 5

    wrong = [d + 1 for d in digits]
    assert score_sample(StubModel(wrong), prompt, answer, info["n_given"]) == (False, wrong)

    one_off = list(digits)
    one_off[3] = ord("0") if one_off[3] != ord("0") else ord("1")
    correct, pred = score_sample(StubModel(one_off), prompt, answer, info["n_given"])
    assert not correct and pred == one_off

    # the padded vocabulary (ids >= vocab_size) is never predicted
    assert score_sample(StubModel(digits, decoy=300), prompt, answer, info["n_given"]) == (
        True,
        digits,
    )


def test_mistral_scores_exactly_the_five_digits():
    """The authors' tokenizer: " 12345" -> "▁▁" + one token per digit; the space token is given, the
    5 digit tokens are scored. Pieces start at a word boundary on their own, so no separator is
    added."""
    enc = get_tokenizer("mistral")
    prompt, answer, info = ep.build_prompt(enc, PAPER, 1000, 12345, 2)
    scored = answer[info["n_given"] :]
    assert info["n_given"] == 1 and [enc.decode([t]) for t in scored] == list("12345")
    assert answer == enc.encode_ordinary(" 12345") and enc.decode(answer[:1]) == " "
    text = enc.decode(prompt)
    assert text.startswith(
        PAPER["task"] + " " + PAPER["filler"] + " " + PAPER["filler"] + " The pass key is 12345."
    )
    assert text.endswith("again. " + PAPER["question"]) and "  " not in text
    assert len(prompt) <= 1000
    six = dict(PAPER, digits=6, given_digits=1)  # the extreme preset: the first digit is given too
    _, answer, info = ep.build_prompt(enc, six, 1000, 123456, 0)
    assert info["n_given"] == 2 and [enc.decode([t]) for t in answer[2:]] == list("23456")
    byte = get_tokenizer("byte")
    assert ep.answer_tokens(byte, 123456, 1) == (list(b" 123456"), 2)
    # " 123" merges the given digit: scored
    assert ep.answer_tokens(merging_tokenizer(), 123456, 1)[1] == 0


def test_score_batch_all_answer_tokens_when_space_merges():
    enc = merging_tokenizer()
    prompt, answer, info = ep.build_prompt(enc, PAPER, 700, 12345, 1)
    stub = StubModel(answer, vocab=300)
    assert score_sample(stub, prompt, answer, info["n_given"]) == (True, answer)
    assert stub.calls[0][1] == 2  # " 123" and "45": both scored
    bad = StubModel([answer[0], answer[1] + 1], vocab=300)
    assert score_sample(bad, prompt, answer, info["n_given"])[0] is False


# ---- end to end ----------------------------------------------------------------------------------
def test_end_to_end_two_checkpoints(tmp_path, ckpts, enc, capsys):
    out = tmp_path / "res"
    res = run_main(out, ckpts, "--lengths", "400,700", "--samples", "4")
    for f in [
        "passkey_samples.jsonl",
        "passkey_summary.json",
        "passkey_summary.csv",
        "passkey_by_depth.json",
        "passkey_by_depth.csv",
        "passkey_accuracy.png",
        "passkey_heatmap_runA.png",
        "passkey_heatmap_runB.png",
    ]:
        path = out / f
        assert path.stat().st_size > 0, f
        if f.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recs = read_jsonl(out / "passkey_samples.jsonl")
    assert len(recs) == 2 * 2 * 4
    # both checkpoints saw the same prompts (keys and depths) at each (length, sample)
    by = {(r["label"], r["target_length"], r["sample"]): r for r in recs}
    for L in (400, 700):
        for i in range(4):
            a = by[("runA", L, i)]
            b = by[("runB", L, i)]
            assert (a["key"], a["k"], a["length"]) == (b["key"], b["k"], b["length"]) and a[
                "length"
            ] <= L
    # each record's prediction equals an independent full-logits forward of the rebuilt prompt
    model, _ = load_model(ckpts[0])
    for r in (by[("runA", 400, 0)], by[("runA", 700, 3)]):
        prompt, answer, info = ep.build_prompt(enc, PAPER, r["target_length"], r["key"], r["k"])
        with torch.no_grad():
            logits, _ = model(torch.tensor([prompt + answer[:-1]]))
        pred = logits[0, len(prompt) - 1 + info["n_given"] :, :257].argmax(-1).tolist()
        assert r["predicted"] == pred and r["answer_tokens"] == answer[1:]
        assert r["correct"] == (pred == answer[1:])
    summary = json.loads((out / "passkey_summary.json").read_text())
    assert [(s["label"], s["target_length"]) for s in summary] == [
        ("runA", 400),
        ("runA", 700),
        ("runB", 400),
        ("runB", 700),
    ]
    for s in summary:
        cell = [
            r for r in recs if r["label"] == s["label"] and r["target_length"] == s["target_length"]
        ]
        assert (
            s["n"] == 4
            and s["accuracy"] == sum(r["correct"] for r in cell) / 4
            and s["train_length"] == 32
        )
    by_depth = json.loads((out / "passkey_by_depth.json").read_text())
    assert sum(d["n"] for d in by_depth) == 16
    assert res["summary"] == summary
    table = capsys.readouterr().out
    assert "| checkpoint | train len | 400 | 700 |" in table and "| runA | 32 |" in table


def oracle_forward(self, idx, targets=None, *, logits_at=None, **kwargs):
    """Stands in for GPT.forward: reads the key from the prompt and answers it, except for keys that
    are odd, where it gets the last digit wrong. Counts the samples it is asked about."""
    oracle_forward.samples += idx.shape[0]
    enc = get_tokenizer("byte")
    logits = torch.zeros(idx.shape[0], logits_at, self.config.padded_vocab_size)
    for b, row in enumerate(idx.tolist()):
        key = re.search(r"The pass key is (\d{5})\.", enc.decode(row)).group(1)
        digits = list(key.encode())
        if int(key) % 2:
            digits[-1] = ord("0") if digits[-1] != ord("0") else ord("1")
        logits[b, torch.arange(logits_at), torch.tensor(digits[-logits_at:])] = 1.0
    return logits, None


def test_end_to_end_accuracy_with_an_oracle(tmp_path, ckpts, monkeypatch):
    oracle_forward.samples = 0
    monkeypatch.setattr(model_mod.GPT, "forward", oracle_forward)
    out = tmp_path / "res"
    res = run_main(out, ckpts[:1], "--lengths", "400", "900", "--samples", "10")
    recs = read_jsonl(out / "passkey_samples.jsonl")
    assert oracle_forward.samples == 20 and len(recs) == 20
    for r in recs:
        assert r["correct"] == (r["key"] % 2 == 0)
    for s in res["summary"]:
        keys = [r["key"] for r in recs if r["target_length"] == s["target_length"]]
        assert s["accuracy"] == np.mean([k % 2 == 0 for k in keys])
    assert 0 < np.mean([r["correct"] for r in recs]) < 1  # the check above is not vacuous
    for d in res["by_depth"]:
        cell = [
            r
            for r in recs
            if r["target_length"] == d["target_length"]
            and min(int(r["depth"] * 10), 9) == round(d["depth_lo"] * 10)
        ]
        assert all(d["depth_lo"] <= r["depth"] <= d["depth_hi"] for r in cell)
        assert d["n"] == len(cell) and d["accuracy"] == np.mean([r["correct"] for r in cell])
    # per-digit accuracy: the oracle gets only the last digit of an odd key wrong
    for s in res["summary"]:
        even = np.mean(
            [r["key"] % 2 == 0 for r in recs if r["target_length"] == s["target_length"]]
        )
        assert s["digit_accuracy"] == [1.0, 1.0, 1.0, 1.0, even]
    # the CSV holds the list
    assert '"[1.0, 1.0, 1.0, 1.0, ' in (out / "passkey_summary.csv").read_text()


def test_digit_accuracy_reads_the_answer_character_by_character(enc):
    def right(key, predicted_text, scored):
        return ep.digits_right(
            dict(key=key, predicted_text=predicted_text, answer_tokens=scored), enc
        )

    # a digit dropped: every digit after it is misread
    assert right(48924, "4894!", list(b"48924")) == [True, True, True, False, False]
    assert right(66462, "6?462", list(b"66462")) == [True, False, True, True, True]
    # the extreme preset's byte answer gives the space and the first digit: that digit is not scored
    assert right(123456, "23956", list(b"23456")) == [None, True, True, False, True, True]
    # gpt2 scores every answer token: nothing is given, the predicted text starts with the space
    assert right(12345, " 12345", list(b" 12345")) == [True] * 5


def test_resume_scores_only_the_missing_samples(tmp_path, ckpts, monkeypatch):
    oracle_forward.samples = 0
    monkeypatch.setattr(model_mod.GPT, "forward", oracle_forward)
    out = tmp_path / "res"
    args = ("--lengths", "400", "700", "--samples", "5")
    first = run_main(out, ckpts, *args)
    assert oracle_forward.samples == 20
    jsonl = out / "passkey_samples.jsonl"
    lines = jsonl.read_text().splitlines(keepends=True)
    # an interruption: 7 records and a cut line
    jsonl.write_text("".join(lines[:7]) + lines[7][:25])

    oracle_forward.samples = 0
    second = run_main(out, ckpts, *args)
    assert oracle_forward.samples == 13  # only the missing ones
    assert strip_timing(second["summary"]) == strip_timing(first["summary"])
    assert strip_timing(second["by_depth"]) == strip_timing(first["by_depth"])
    recs = read_jsonl(jsonl)
    assert (
        len(recs) == 20 and len({(r["label"], r["target_length"], r["sample"]) for r in recs}) == 20
    )

    oracle_forward.samples = 0
    # a new length: only it is evaluated
    run_main(out, ckpts, *args, "--lengths", "400", "700", "1000")
    assert oracle_forward.samples == 10

    # other prompts: refuse to mix them into these results
    with pytest.raises(eval_common.EvalError, match="samples"):
        run_main(out, ckpts, *args, "--samples", "6")


def test_demo_table_per_run_then_median_and_minimum(tmp_path):
    acc = {
        "bam_ssmax": [[1, 0.9, 0.6, 0.55], [1, 0.7, 0.5, 0.1], [1, 1.0, 0.9, 0.8]],
        "rope": [[1, 0.3, 0.1, 0.0], [1, 0.6, 0.2, 0.0], [1, 0.2, 0.0, 0.3]],
    }
    rows = [
        dict(label=f"{variant}-s{s}", train_length=64, target_length=L, accuracy=a)
        for variant, per_seed in acc.items()
        for s, accs in enumerate(per_seed, start=1)
        for L, a in zip((64, 256, 512, 1024), accs)
    ]
    # skipped: no column
    rows.append(dict(label="rope-s2", train_length=64, target_length=128, accuracy=None))
    text = ep.demo_table(rows, str(tmp_path), 5)
    assert text == (tmp_path / "demo_table.md").read_text()
    lines = text.splitlines()
    assert lines[0] == "| run | seed | 1× | 4× | 8× | 16× |"
    assert "| bam_ssmax | 2 | 1.00 | 0.70 | 0.50 | 0.10 |" in lines
    assert (
        "| **bam_ssmax** | **median of 3** | **1.00** | **0.90** | **0.60** | **0.55** |" in lines
    )
    assert "| **bam_ssmax** | **min of 3** | **1.00** | **0.70** | **0.50** | **0.10** |" in lines
    assert "| **rope** | **min of 3** | **1.00** | **0.20** | **0.00** | **0.00** |" in lines
    assert len(lines) == 2 + 2 * (3 + 2) + 2
    table = json.loads((tmp_path / "demo_table.json").read_text())
    assert table[3] == {
        "variant": "bam_ssmax",
        "statistic": "median",
        "seed": None,
        "n_seeds": 3,
        "1x": 1,
        "4x": 0.9,
        "8x": 0.6,
        "16x": 0.55,
    }
    assert (tmp_path / "demo_table.csv").read_text().splitlines()[
        0
    ] == "variant,statistic,seed,n_seeds,1x,4x,8x,16x"
    # one seed: its row alone; names without a seed: no table
    assert len(ep.demo_table(rows[:4], str(tmp_path / "one"), 5).split("\n\n")[0].splitlines()) == 3
    assert (
        ep.demo_table([dict(r, label="runA") for r in rows[:4]], str(tmp_path / "none"), 5) is None
    )
    assert not (tmp_path / "none").exists()


def test_samples_below_one_is_one_line_and_exit_1(tmp_path, ckpts):
    proc = run_script_here(
        "eval_passkey.py", "--ckpt", ckpts[0], "--samples", "0", "--out", tmp_path
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert re.fullmatch(r"eval_passkey\.py: error: --samples .* at least 1.*\n", proc.stderr), (
        proc.stderr
    )
    assert not os.listdir(tmp_path)


def test_attn_impl_is_checked_by_the_kernels_decision_point(tmp_path, ckpts, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(eval_common.EvalError, match=r"--attn_impl triton: impl='triton'"):
        run_main(
            tmp_path,
            ckpts[:1],
            "--attn_impl",
            "triton",
            "--device",
            "cpu",
            "--lengths",
            "400",
            "--samples",
            "1",
        )
    assert run_main(
        tmp_path, ckpts[:1], "--attn_impl", "sdpa", "--lengths", "400", "--samples", "1"
    )["summary"]


def test_same_seed_same_numbers(tmp_path, ckpts, monkeypatch):
    args = ("--lengths", "500", "--samples", "3")
    a = run_main(tmp_path / "a", ckpts[:1], *args)
    b = run_main(tmp_path / "b", ckpts[:1], *args)
    assert strip_timing(a["records"]) == strip_timing(b["records"])
    assert strip_timing(a["summary"]) == strip_timing(b["summary"])
    monkeypatch.setattr(ep, "SEED", ep.SEED + 1)
    c = run_main(tmp_path / "c", ckpts[:1], *args)
    assert [r["key"] for r in c["records"]] != [r["key"] for r in a["records"]]


def test_batched_equals_one_by_one(tmp_path, ckpts, monkeypatch):
    args = ("--lengths", "600", "--samples", "4")
    batched = run_main(tmp_path / "a", ckpts[:1], *args)
    monkeypatch.setattr(ep, "BATCH_TOKENS", 1)
    single = run_main(tmp_path / "b", ckpts[:1], *args)
    assert {r["batch"] for r in batched["records"]} == {4} and {
        r["batch"] for r in single["records"]
    } == {1}
    assert strip_timing(batched["records"]) == strip_timing(single["records"])


def out_of_memory_above(tokens, calls=None):
    """A stand-in for eval_passkey.score_batch whose forward fails as the CPU allocator does when a
    batch holds more than `tokens` tokens; it records each batch's size in `calls`."""
    real = ep.score_batch

    def score_batch(model, prompts, answers, n_given=0):
        if calls is not None:
            calls.append(len(prompts))
        if sum(len(p) for p in prompts) > tokens:
            raise RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 "
                "bytes. Error code 12 (Cannot allocate memory)\nmore detail"
            )
        return real(model, prompts, answers, n_given)

    return score_batch


def test_a_length_out_of_memory_is_skipped_and_the_others_scored(tmp_path, ckpts, monkeypatch):
    """A forward that runs out of memory halves the batch down to one sample; a length where one
    sample does not fit is skipped with the error's first line, and the other lengths are
    scored."""
    calls = []
    monkeypatch.setattr(ep, "score_batch", out_of_memory_above(1500, calls))
    res = run_main(tmp_path / "res", ckpts[:1], "--lengths", "100", "300", "2000", "--samples", "4")
    status = {s["target_length"]: s for s in res["summary"]}
    assert status[300]["status"] == "ok" and status[300]["n"] == 4
    assert status[100]["status"].startswith("skipped: shorter than the prompt")
    assert status[2000]["accuracy"] is None
    assert status[2000]["status"] == (
        "skipped: out of memory (DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 8589934592 bytes. Error code 12 (Cannot allocate memory))"
    )
    assert calls == [4, 4, 2, 1]  # 300: one batch of 4; 2000: 4, then 2, then 1 sample
    assert {r["target_length"] for r in res["records"]} == {300}
    skipped = {(s["target_length"], s["reason"][:13]) for s in res["meta"]["skipped"]}
    assert skipped == {(100, "shorter than "), (2000, "out of memory")}
    assert (tmp_path / "res" / "passkey_accuracy.png").exists()


def test_a_batch_out_of_memory_is_halved_until_it_fits(tmp_path, ckpts, monkeypatch):
    reference = run_main(tmp_path / "a", ckpts[:1], "--lengths", "600", "--samples", "4")
    calls = []
    monkeypatch.setattr(ep, "score_batch", out_of_memory_above(1300, calls))
    halved = run_main(tmp_path / "b", ckpts[:1], "--lengths", "600", "--samples", "4")
    assert calls == [4, 2, 2] and {r["batch"] for r in halved["records"]} == {2}
    assert strip_timing(halved["records"]) == strip_timing(reference["records"])


def test_another_error_is_not_taken_for_a_lack_of_memory(tmp_path, ckpts, monkeypatch):
    def broken(*args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(ep, "score_batch", broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run_main(tmp_path / "res", ckpts[:1], "--lengths", "500", "--samples", "2")


def test_default_grid_from_the_training_length(tmp_path, ckpts, capsys):
    res = run_main(tmp_path / "res", ckpts[:1], "--max_length", "512", "--samples", "2")
    rows = {s["target_length"]: s for s in res["summary"]}
    # block_size 32 x 1, 2, 4, ... up to --max_length
    assert sorted(rows) == [
        32,
        64,
        128,
        256,
        512,
    ]
    shortest = ep.min_prompt_length(get_tokenizer("byte"), PAPER)
    for L, s in rows.items():
        assert (s["status"] == "ok") == (L >= shortest)
        assert s["n"] == (2 if L >= shortest else 0)
    assert "skipping length 32 for runA" in capsys.readouterr().err


def test_triton_evaluation_checks_the_kernel_first(tmp_path, ckpts, capsys, monkeypatch):
    """--attn_impl triton (here through Triton's interpreter): the kernel is compared with the
    reference on a problem shaped like the evaluation before the first length, and a kernel made
    wrong on purpose (its prior table read one distance off) stops the evaluation with an EvalError
    that names the reference."""
    args = ("--attn_impl", "triton", "--device", "cpu", "--lengths", "64", "--samples", "1")
    assert run_main(tmp_path / "right", ckpts[:1], *args)["summary"]
    line = next(x for x in capsys.readouterr().out.splitlines() if "attention kernel check" in x)
    assert line.startswith("runA: attention kernel check (float32, head_dim 8,"), line
    assert ": ok in " in line and "parameters" not in line, line  # no gradients in an evaluation

    right = ak._prior_tables

    def misread(*args):
        table, *rest = right(*args)
        return (table.roll(1, -1), *rest)

    monkeypatch.setattr(ak, "_prior_tables", misread)
    monkeypatch.setattr(
        kernel_check, "_checked", set()
    )  # the check runs once per configuration and process
    with pytest.raises(
        eval_common.EvalError, match=r"disagrees with the reference.*--attn_impl torch"
    ):
        run_main(tmp_path / "wrong", ckpts[:1], *args)
    assert not (tmp_path / "wrong").exists() or not os.listdir(tmp_path / "wrong")


def test_a_second_evaluation_into_a_busy_out_is_refused_in_one_line(tmp_path, ckpts):
    """An evaluation owns its --out for its lifetime (runtime.own_folder): a second one is refused
    in one line, exit 1, before it writes anything."""
    out = tmp_path / "res"
    hold = (
        "import sys; from infra import runtime; runtime.own_folder(sys.argv[1]); "
        "print('held', flush=True); input()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(out)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        args = ["--ckpt", ckpts[0], "--lengths", "400", "--samples", "1", "--out", str(out)]
        proc = subprocess.run(
            [sys.executable, "eval_passkey.py", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.communicate("\n", timeout=60)

    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert re.fullmatch(
        rf"eval_passkey\.py: error: {re.escape(str(out))} is in use by another process \(pid "
        rf"{holder.pid} on .+\); wait for it to end, or give this one another folder\n",
        proc.stderr,
    ), proc.stderr
    assert os.listdir(out) == [".lock"]

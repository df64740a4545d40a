"""analysis/eval_lm.py, offline: the bam-gpt adapter through lm_eval.simple_evaluate on the local
tasks of tests/lm_tasks (multiple choice, loglikelihood_rolling, generate_until), its scores against
the model's own cross-entropy and greedy decoding without the cache, batch-size invariance, and the
command line with its one-line errors."""

import csv
import json
import math
import os
import socket
import subprocess
import sys

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from analysis import eval_lm
from analysis.eval_lm import BamGPT, main
from data import get_tokenizer
from eval_common import EvalError
from infra.runtime import save_checkpoint
from model import GPT, POS_ENCODINGS, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "lm_tasks")
TOK = get_tokenizer("byte")


def tiny_model(pe="bam", ssmax=True, seed=0, block_size=32):
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=257,
        tokenizer="byte",
        n_layer=2,
        n_head=2,
        n_embd=16,
        block_size=block_size,
        pos_encoding=pe,
        ssmax=ssmax,
        bam_init="alibi" if pe == "bam" else "zero",
    )
    return GPT(cfg).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "ckpt_0000001.pt"
    save_checkpoint(str(path), tiny_model(), step=1)
    return path.parent


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


PAIRS = [
    ("The sky is", " blue"),
    ("", "hello"),
    ("Two and two make", " four"),
    ("x" * 50, " long context"),
    ("A", "B" * 31),
]


def direct_logprob(model, context, continuation, max_length):
    """log p(continuation | context) from the model's own per-token cross-entropy (GPT.forward,
    reduction none) over the last max_length + 1 tokens, and whether greedy decoding gives it."""
    ctx = [TOK.doc_start] + TOK.encode_ordinary(context)
    cont = TOK.encode_ordinary(context + continuation)[len(ctx) - 1 :]
    seq = torch.tensor([(ctx + cont)[-(max_length + 1) :]])
    with torch.no_grad():
        _, ce = model(seq[:, :-1], seq[:, 1:], reduction="none")
        logits, _ = model(seq[:, :-1])
    n = len(cont)
    greedy = bool((logits[0, -n:, : model.config.vocab_size].argmax(-1) == seq[0, -n:]).all())
    return -float(ce[0, -n:].sum()), greedy


@pytest.mark.parametrize("pe", POS_ENCODINGS)
def test_loglikelihood_is_the_models_cross_entropy(pe):
    model = tiny_model(pe)
    lm = BamGPT(model, batch_size=3, max_length=32)
    got = lm.loglikelihood(requests("loglikelihood", PAIRS))
    for (context, continuation), (logp, greedy) in zip(PAIRS, got):
        want, want_greedy = direct_logprob(model, context, continuation, 32)
        assert logp == pytest.approx(want, rel=1e-5, abs=1e-5) and greedy == want_greedy


def test_trailing_spaces_of_the_context_are_scored_with_the_continuation():
    lm = BamGPT(tiny_model())
    assert lm._encode_pair("make \n ", "four") == (
        [TOK.doc_start] + TOK.encode_ordinary("make"),
        TOK.encode_ordinary(" \n four"),
    )


def test_greedy_flag_is_true_for_the_greedy_continuation():
    model = tiny_model()
    ctx = [TOK.doc_start] + TOK.encode_ordinary("abc")
    new = model.generate(torch.tensor([ctx]), 4)
    assert all(t < model.config.vocab_size for t in new)  # never a padded id
    lm = BamGPT(model, max_length=32)
    ((_, greedy),) = lm._score([(ctx, new)], "test")
    assert greedy


def test_batch_sizes_1_and_8_agree():
    model = tiny_model()
    texts = [t for pair in PAIRS for t in pair if t] + ["y" * 90]
    one = BamGPT(model, batch_size=1)
    eight = BamGPT(model, batch_size=8)
    ll1, ll8 = (m.loglikelihood(requests("loglikelihood", PAIRS * 2)) for m in (one, eight))
    assert [g for _, g in ll1] == [g for _, g in ll8]
    assert [lp for lp, _ in ll1] == pytest.approx([lp for lp, _ in ll8], rel=1e-5, abs=1e-5)
    r1, r8 = (
        m.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
        for m in (one, eight)
    )
    assert r1 == pytest.approx(r8, rel=1e-5, abs=1e-5)


def test_rolling_beyond_the_training_length_is_one_forward():
    """max_length 4x the training length: a text that fits is scored in one window, i.e. the
    sequence's own cross-entropy; with the training length it is cut into windows of 32 targets that
    each start afresh, the last one with a full 32 tokens of input (the harness's rolling
    windows)."""
    model = tiny_model(block_size=32)
    text = "The grass is green. The sky is blue. " * 3  # 111 tokens
    tokens = [TOK.doc_start] + TOK.encode_ordinary(text)
    seq = torch.tensor([tokens])
    with torch.no_grad():
        _, ce = model(seq[:, :-1], seq[:, 1:], reduction="none")
    (long,) = BamGPT(model, max_length=128).loglikelihood_rolling(
        requests("loglikelihood_rolling", [(text,)])
    )
    assert long == pytest.approx(-float(ce.sum()), rel=1e-5)
    (short,) = BamGPT(model, max_length=32).loglikelihood_rolling(
        requests("loglikelihood_rolling", [(text,)])
    )
    windows = 0.0
    for a in range(1, len(tokens), 32):  # targets tokens[a:b], input the 32 tokens before b
        b = min(a + 32, len(tokens))
        w = torch.tensor([tokens[max(0, b - 33) : b]])
        with torch.no_grad():
            _, ce_w = model(w[:, :-1], w[:, 1:], reduction="none")
        windows -= float(ce_w[0, -(b - a) :].sum())
    assert short == pytest.approx(windows, rel=1e-5) and short != pytest.approx(long, rel=1e-6)


def greedy_without_cache(model, ctx, n, keep_eot=True):
    """Greedy decoding by a full forward per token (no KV cache), up to n tokens or end of text."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits, _ = model(torch.tensor([ctx + out]))
        out.append(int(logits[0, -1, : model.config.vocab_size].argmax()))
        if out[-1] == TOK.eot_token:
            return out if keep_eot else out[:-1]
    return out


@pytest.mark.parametrize("pe", ["bam", "rope", "sinusoidal"])
def test_generate_until_is_greedy_decoding_without_the_cache(pe):
    model = tiny_model(pe)
    lm = BamGPT(model, max_length=32)
    context = "The pass key is 12345. The pass key is"
    full = [TOK.doc_start] + TOK.encode_ordinary(context)
    # left-truncated to leave 12 tokens
    free = TOK.decode(greedy_without_cache(model, full[-(32 - 12) :], 12))
    stop = next(c for c in free[2:] if c.isascii())  # a stop string that the greedy text meets
    got = lm.generate_until(
        requests(
            "generate_until",
            [
                (context, dict(until=[stop], max_gen_toks=12)),
                (context, dict(until=["\x00never"], max_gen_toks=12)),
                (context, dict(max_gen_toks=5)),
            ],
        )
    )
    assert got == [
        free.split(stop)[0],
        free,
        TOK.decode(greedy_without_cache(model, full[-27:], 5)),
    ]


def test_simple_evaluate_runs_the_three_request_types(ckpt, monkeypatch):
    """lm_eval.simple_evaluate with the adapter, offline: the harness reads only tests/lm_tasks."""
    attempts = []  # recorded, in case some library catches the error and goes on

    def no_network(sock, address):
        attempts.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    tm = TaskManager(include_path=TASKS, include_defaults=False)
    lm = BamGPT(str(ckpt), batch_size=4)
    res = lm_eval.simple_evaluate(
        model=lm,
        tasks=["tiny_mc", "tiny_rolling", "tiny_gen"],
        task_manager=tm,
        log_samples=False,
        bootstrap_iters=0,
    )["results"]
    assert 0 <= res["tiny_mc"]["acc,none"] <= 1 and 0 <= res["tiny_gen"]["exact_match,none"] <= 1
    assert not attempts
    assert res["tiny_rolling"]["byte_perplexity,none"] > 1 and math.isfinite(
        res["tiny_rolling"]["bits_per_byte,none"]
    )
    # the multiple-choice accuracy is the share of documents whose gold choice has the highest
    # loglikelihood
    docs = [json.loads(line) for line in open(os.path.join(TASKS, "tiny.jsonl"))]
    scores = [
        [
            lp
            for lp, _ in lm.loglikelihood(
                requests("loglikelihood", [(d["question"], " " + c) for c in d["choices"]])
            )
        ]
        for d in docs
    ]
    assert res["tiny_mc"]["acc,none"] == pytest.approx(
        sum(s.index(max(s)) == d["answer"] for s, d in zip(scores, docs)) / len(docs)
    )


def test_registered_as_bam_gpt(ckpt):
    """lm-eval builds the adapter from its name and a model_args string, as
    `simple_evaluate(model="bam-gpt")`."""
    tm = TaskManager(include_path=TASKS, include_defaults=False)
    res = lm_eval.simple_evaluate(
        model="bam-gpt",
        model_args=f"ckpt={ckpt},max_length=48",
        tasks=["tiny_mc"],
        batch_size=2,
        task_manager=tm,
        log_samples=False,
    )
    assert res["config"]["max_length"] == 48 and 0 <= res["results"]["tiny_mc"]["acc,none"] <= 1


def test_demo_passkey_task_is_the_demo_format():
    """The demo task's prompts are prepare_demo.py's documents: end-of-text (put by the adapter) +
    prompt + key."""
    tm = TaskManager(include_path=TASKS, include_defaults=False)
    task = tm.load(["demo_passkey_64"])["tasks"]["demo_passkey_64"]
    doc = task.test_docs()[0]
    assert len(TOK.encode_ordinary(doc["prompt"] + " " + doc["key"])) == 63
    assert (
        doc["prompt"].startswith("@")
        and doc["prompt"].endswith("?")
        and f"#{doc['key']}" in doc["prompt"]
    )
    assert len(doc["choices"]) == 4 and doc["choices"][doc["answer"]] == doc["key"]


def test_cli_writes_results_per_checkpoint_and_the_table(ckpt, tmp_path):
    out = tmp_path / "out"
    rows = main(
        [
            "--ckpt",
            str(ckpt),
            "--ckpt",
            str(ckpt),
            "--tasks",
            "tiny_mc,tiny_rolling",
            "--include_path",
            TASKS,
            "--max_length",
            "64",
            "--out",
            str(out),
        ]
    )
    labels = {r["label"] for r in rows}
    assert len(labels) == 2  # the same run twice: told apart by index
    for label in labels:
        res = json.load(open(out / f"{label}.json"))
        assert res["results"]["tiny_mc"]["acc,none"] == next(
            r["value"] for r in rows if r["label"] == label and r["metric"] == "acc"
        )
        assert (
            res["bam_gpt"]["ckpt_sha256"] == rows[0]["ckpt_sha256"]
            and res["config"]["max_length"] == 64
        )
    with open(out / "lm_eval_summary.csv") as f:
        table = list(csv.DictReader(f))
    assert {(r["task"], r["metric"]) for r in table} >= {
        ("tiny_mc", "acc"),
        ("tiny_rolling", "bits_per_byte"),
    }
    assert all(r["ckpt_sha256"] and r["ckpt_step"] == "1" and r["limit"] == "" for r in table)
    md = (out / "lm_eval_summary.md").read_text()
    assert md.startswith("| task | metric | " + " | ".join(sorted(labels)))


def test_no_room_for_the_continuation_or_the_context():
    lm = BamGPT(tiny_model(), max_length=4)
    with pytest.raises(
        EvalError,
        match="a continuation of 5 tokens leaves no room for its context within --max_length 4",
    ):
        lm.loglikelihood(requests("loglikelihood", [("The sky is", " blue")]))
    with pytest.raises(
        EvalError, match="max_gen_toks 4 leaves no room for the context within --max_length 4"
    ):
        lm.generate_until(requests("generate_until", [("The sky is", dict(max_gen_toks=4))]))


def test_unknown_task_names_close_matches(ckpt, tmp_path, monkeypatch):
    """In-process, with lm-eval's own tasks left out of the index (indexing them takes seconds; the
    slow test below runs the command with them)."""

    def local(include_path=None, include_defaults=True):
        return TaskManager(include_path=include_path, include_defaults=False)

    monkeypatch.setattr(eval_lm, "TaskManager", local)
    with pytest.raises(EvalError, match="unknown task 'tiny_mcq'; did you mean tiny_mc"):
        main(
            [
                "--ckpt",
                str(ckpt),
                "--tasks",
                "tiny_mc,tiny_mcq",
                "--include_path",
                TASKS,
                "--out",
                str(tmp_path),
            ]
        )
    with pytest.raises(EvalError, match="is not a directory"):
        main(
            [
                "--ckpt",
                str(ckpt),
                "--tasks",
                "tiny_mc",
                "--include_path",
                str(tmp_path / "no"),
                "--out",
                str(tmp_path),
            ]
        )


def run_script(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "analysis", "eval_lm.py"), *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"),
    )


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("unknown task", marks=pytest.mark.slow),
        "missing checkpoint",
        "no room for the continuation",
    ],
)
def test_bad_inputs_are_one_line_errors(case, ckpt, tmp_path):
    """One line `eval_lm.py: error: ...`, exit 1, no traceback (after the harness's own progress
    lines when the failure comes from a request)."""
    args = dict(ckpt=ckpt, tasks="tiny_mc", max_length=4)
    if case == "unknown task":
        args["tasks"] = "tiny_mcq"
    elif case == "missing checkpoint":
        args["ckpt"] = tmp_path / "nothing"
    needle = {
        "unknown task": "unknown task 'tiny_mcq'; did you mean tiny_mc",
        "missing checkpoint": "no checkpoint at",
        "no room for the continuation": "leaves no room for its context within --max_length 4",
    }[case]
    r = run_script(
        *[x for k, v in args.items() for x in (f"--{k}", v)],
        "--include_path",
        TASKS,
        "--out",
        tmp_path / "out",
    )
    lines = r.stderr.strip().splitlines()
    assert (
        r.returncode == 1 and lines[-1].startswith("eval_lm.py: error: ") and needle in lines[-1]
    ), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and (
        len(lines) == 1 or case == "no room for the continuation"
    )

"""eval_ruler.py: RULER's NIAH generators, templates, length fitting, metric, and an end-to-end run
(CPU, byte tokenizer, tiny checkpoints)."""

import csv
import json
import os
import random
import re
import uuid
from collections import Counter

import pytest
import torch
from conftest import run_script_here, write_shard

import eval_ruler as R
import model as model_mod
from data import get_tokenizer
from eval_common import EvalError
from infra.runtime import save_checkpoint
from model import GPT, GPTConfig

ENC = get_tokenizer("byte")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Strings copied from the spec (§9), which copies them from NVIDIA/RULER @ c3f5e3b.
SPEC_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
SPEC_ANSWER_PREFIX = (
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
SPEC_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
SPEC_NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
SPEC_TABLE = """
| niah_single_1 | noise | words | numbers | 1 | 1 | 1 |
| niah_single_2 | essay | words | numbers | 1 | 1 | 1 |
| niah_single_3 | essay | words | uuids | 1 | 1 | 1 |
| niah_multikey_1 | essay | words | numbers | 4 | 1 | 1 |
| niah_multikey_2 | needle | words | numbers | 1 | 1 | 1 |
| niah_multikey_3 | needle | uuids | uuids | 1 | 1 | 1 |
| niah_multivalue | essay | words | numbers | 1 | 4 | 1 |
| niah_multiquery | essay | words | numbers | 1 (raised to 4) | 1 | 4 |
"""
# The template with the singular rewrite applied by hand ('Some'->'A', 'are all'->'is',
# 'are'->'is').
SINGULAR_FULL = (
    "A special magic {type_needle_v} is hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What is the special magic {type_needle_v} for {query} mentioned in the provided text? "
    "The special magic {type_needle_v} for {query} mentioned in the provided text is"
)

_SENTS = [
    "Mr. Brown walked to the old mill at dawn.",
    "He carried a lantern, a map and two apples!",
    "Was the river higher than last year?",
    "Nobody knew... Some said the U.S. survey was wrong.",
    "The miller, Dr. Grey, kept notes in a ledger (mostly about flour).",
    '"We grind on Tuesdays," she said.',
    "Prices rose by 3.5 percent in 1998.",
    "the children ran along the bank e.g. near the bridge.",
    "Rain fell for nine days; the road washed out.",
    "Then the sun returned and everyone went back to work.",
]
ESSAY_TEXT = "\n\n".join(" ".join(random.Random(i).sample(_SENTS, 7)) for i in range(60))
ESSAY = R.Essay(ESSAY_TEXT, "essay:test")
NUM = re.compile(r"^\d{7}$")
ADJS, NOUNS = R.word_lists()
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def check_type(value, kind):
    if kind == "numbers":
        assert NUM.match(value), value
    elif kind == "uuids":
        assert UUID4.match(value) and str(uuid.UUID(value)) == value, value
    else:
        hyphens = [i for i, c in enumerate(value) if c == "-"]
        assert any(value[:i] in ADJS and value[i + 1 :] in NOUNS for i in hyphens), value


def context_of(sample, cfg):
    template, tv = R.task_template(cfg)
    head = template.split("{context}")[0].format(type_needle_v=tv)
    text = sample["input_text"]
    assert text.startswith(head)
    return text[len(head) : text.rindex("\nWhat ")]


# ---- strings and the task table ------------------------------------------------------------------
def test_strings_are_rulers_verbatim():
    assert R.TEMPLATE == SPEC_TEMPLATE
    assert R.ANSWER_PREFIX == SPEC_ANSWER_PREFIX
    assert R.NEEDLE == SPEC_NEEDLE
    assert R.NOISE == SPEC_NOISE
    assert R.MODEL_TEMPLATE.format(task_template="X") == "X"
    assert R.TOKENS_TO_GENERATE == 128
    assert R.DEPTHS[:4] == [0, 3, 5, 8] and R.DEPTHS[-1] == 100 and len(R.DEPTHS) == 40


def test_task_table_matches_spec():
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in SPEC_TABLE.strip().splitlines()
    ]
    assert [r[0] for r in rows] == list(R.TASKS)
    for name, hay, k, v, nk, nv, nq in rows:
        cfg = R.TASKS[name]
        assert (cfg["type_haystack"], cfg["type_needle_k"], cfg["type_needle_v"]) == (hay, k, v)
        assert (cfg["num_needle_k"], cfg["num_needle_v"], cfg["num_needle_q"]) == (
            int(nk.split()[0]),
            int(nv),
            int(nq),
        )


def test_singular_rewrite():
    single, tv = R.task_template(R.TASKS["niah_single_3"])
    assert single == SINGULAR_FULL and tv == "uuid"
    assert R.task_template(R.TASKS["niah_single_1"]) == (SINGULAR_FULL, "number")
    for task in ("niah_multivalue", "niah_multiquery"):
        assert R.task_template(R.TASKS[task]) == (SPEC_TEMPLATE + SPEC_ANSWER_PREFIX, "numbers")
    s = R.generate_sample("niah_single_2", 1500, ENC, ESSAY, index=3)
    assert s["input_text"].startswith("A special magic number is hidden within the following text.")
    assert s["input_text"].endswith(
        f"\nWhat is the special magic number for {s['queries'][0]} mentioned in the "
        f"provided text? The special magic number for {s['queries'][0]} mentioned in "
        "the provided text is"
    )
    # the needle keeps RULER's plural type
    assert s["needles"][0].startswith("One of the special magic numbers for ")


# ---- the generators ------------------------------------------------------------------------------
@pytest.mark.parametrize("task", list(R.TASKS))
def test_generator(task):
    cfg = R.TASKS[task]
    L = 2500
    num_k = max(cfg["num_needle_k"], cfg["num_needle_q"])
    for index in range(3):
        s = R.generate_sample(task, L, ENC, ESSAY, index=7 + index)
        text = s["input_text"]
        # length budget, and the ids are [end-of-text] + the prompt
        assert s["input_tokens"] + R.TOKENS_TO_GENERATE <= L
        assert s["input_ids"] == [ENC.eot_token] + ENC.encode_ordinary(text)
        assert s["input_tokens"] == len(s["input_ids"])
        # needles: right count, each once, in RULER's form, with distinct keys of the right type
        assert len(s["keys"]) == num_k == len(set(s["keys"])) and all(
            len(v) == cfg["num_needle_v"] for v in s["values"]
        )
        assert len(s["needles"]) == num_k * cfg["num_needle_v"]
        expected = {
            R.NEEDLE.format(type_needle_v=cfg["type_needle_v"], key=k, value=v)
            for k, vs in zip(s["keys"], s["values"])
            for v in vs
        }
        assert set(s["needles"]) == expected
        for n in s["needles"]:
            assert text.count(n) == 1
        for k in s["keys"]:
            check_type(k, cfg["type_needle_k"])
        for vs in s["values"]:
            for v in vs:
                check_type(v, cfg["type_needle_v"])
        # queries and answers
        assert len(s["queries"]) == cfg["num_needle_q"] and set(s["queries"]) <= set(s["keys"])
        assert s["answers"] == [v for q in s["queries"] for v in s["values"][s["keys"].index(q)]]
        q = s["queries"]
        query = q[0] if len(q) == 1 else ", ".join(q[:-1]) + ", and " + q[-1]
        template, tv = R.task_template(cfg)
        head, tail = template.split("{context}")
        assert text.endswith(tail.format(type_needle_v=tv, query=query))
        assert text.startswith(head.format(type_needle_v=tv))
        if len(q) > 1:
            assert f"for {q[0]}, {q[1]}, {q[2]}, and {q[3]} mentioned" in text
        check_haystack(s, cfg)
        # the haystack fills the budget: one more back-off step would have been wasted room
        assert s["input_tokens"] + R.TOKENS_TO_GENERATE > L - 900


def check_haystack(s, cfg):
    """The haystack around the needles: noise lines, distractor needles or essay sentences."""
    ctx = context_of(s, cfg)
    if cfg["type_haystack"] == "noise":
        lines = ctx.split("\n")
        assert Counter(lines)[R.NOISE] == s["num_haystack"]
        assert len(lines) == s["num_haystack"] + len(s["needles"])
    elif cfg["type_haystack"] == "needle":
        lines = ctx.split("\n")
        assert len(lines) == s["num_haystack"] + len(s["needles"])
        pat = re.compile(
            r"One of the special magic " + cfg["type_needle_v"] + r" for (\S+) is: (\S+)\.$"
        )
        for line in lines:
            m = pat.match(line)
            assert m, line
            check_type(m.group(1), cfg["type_needle_k"])
            check_type(m.group(2), cfg["type_needle_v"])
            if line not in s["needles"]:
                assert m.group(1) not in s["keys"]  # distractors never reuse a real key
    else:
        assert s["num_haystack"] > 0 and ESSAY.sentences(s["num_haystack"])[0] in ctx


def expected_essay_context(sents, sample):
    """RULER's essay context rebuilt independently: the sentence runs between the needle depths,
    joined by spaces."""
    pos = [0] + [int(len(sents) * (d / 100)) for d in sample["depths"]] + [len(sents)]
    parts = []
    for i in range(1, len(pos)):
        parts.append(" ".join(sents[pos[i - 1] : pos[i]]))
        if i - 1 < len(sample["needles"]):
            parts.append(sample["needles"][i - 1])
    return " ".join(parts)


def test_essay_needles_sit_at_sentence_boundaries_from_depths():
    for task in ("niah_single_2", "niah_multikey_1", "niah_multiquery"):
        for index in range(4):
            s = R.generate_sample(task, 3000, ENC, ESSAY, index=11 + index)
            sents = ESSAY.sentences(s["num_haystack"])
            assert len(s["depths"]) == len(s["needles"]) and set(s["depths"]) <= set(R.DEPTHS)
            assert context_of(s, R.TASKS[task]) == expected_essay_context(sents, s)


def test_essay_context_with_empty_sentence_runs():
    """Tiny haystacks put needles at depth 0 or together: RULER's " ".join then keeps the empty runs
    (a leading space, double spaces), and so must we."""
    for task in ("niah_multikey_1", "niah_multivalue", "niah_single_3"):
        for n in (0, 3, 40):
            for seed in range(3):
                s = R.build_input(task, n, random.Random(seed), ESSAY)
                sents = ESSAY.sentences(n)
                assert context_of(s, R.TASKS[task]) == expected_essay_context(sents, s)
    assert context_of(
        R.build_input("niah_multikey_1", 0, random.Random(0), ESSAY), R.TASKS["niah_multikey_1"]
    ).startswith(" One of the special magic numbers for ")


def test_keys_are_distinct_and_distractors_avoid_them(monkeypatch):
    """With a small word list a distractor could repeat the queried key; keys are redrawn until they
    differ."""
    monkeypatch.setattr(R, "word_lists", lambda: (["big", "cold", "odd", "red", "tall"], ["owl"]))
    for seed in range(5):
        s = R.build_input("niah_multikey_2", 60, random.Random(seed))
        lines = s["input_text"].split("\n")[1:-1]
        needle = r"One of the special magic numbers for (\S+) is"
        keys = [re.match(needle, line).group(1) for line in lines]
        assert keys.count(s["keys"][0]) == 1 and len(set(keys)) == 5
        s = R.build_input("niah_multikey_1", 0, random.Random(seed), ESSAY)
        assert len(set(s["keys"])) == 4


def test_word_keys_are_an_adjective_then_a_noun():
    """A word key is drawn as an adjective, then a noun, from wonderwords' lists sorted and without
    repeats (912 adjectives, 2 of them twice), so every key of RULER's list is equally likely."""
    from wonderwords import random_word

    raw_adjs = random_word._get_words_from_text_file("adjectivelist.txt")
    raw_nouns = random_word._get_words_from_text_file("nounlist.txt")
    assert (len(raw_adjs), len(raw_nouns)) == (912, 6782)
    assert (ADJS, NOUNS) == (sorted(set(raw_adjs)), sorted(set(raw_nouns)))
    rng = random.Random(3)
    expected = f"{rng.choice(ADJS)}-{rng.choice(NOUNS)}"
    assert R.random_value("words", random.Random(3)) == expected
    keys = [R.random_value("words", random.Random(i)) for i in range(200)]
    assert len(set(keys)) > 190
    for key in keys:
        check_type(key, "words")


@pytest.mark.slow
def test_word_keys_are_rulers_keys_each_once():
    """Every adjective-noun pair is a distinct key, and together they are RULER's list."""
    from wonderwords import random_word

    adjs = random_word._get_words_from_text_file("adjectivelist.txt")
    nouns = random_word._get_words_from_text_file("nounlist.txt")
    # RULER's niah.py
    ref = sorted(list(set([f"{adj}-{noun}" for adj in adjs for noun in nouns])))
    pairs = sorted(f"{adj}-{noun}" for adj in ADJS for noun in NOUNS)
    assert len(ref) == len(ADJS) * len(NOUNS) == 6_171_620 and pairs == ref


def test_paper_preset(tmp_path):
    r = run_script_here("eval_ruler.py", "--ckpt", tmp_path / "none", "--preset", "paper")
    assert (
        r.returncode == 1
        and r.stderr.count("\n") == 1
        and r.stderr.startswith("eval_ruler.py: error:")
    )
    assert "download_paulgraham_essay.py" in r.stderr and "--haystack_file" in r.stderr
    args = R.parse_args(["--ckpt", "x", "--preset", "paper", "--haystack_file", "pg.json"])
    assert args.samples == 500 and args.lengths == [4096, 8192, 16384, 32768, 65536, 131072]
    # no essay task
    args = R.parse_args(["--ckpt", "x", "--preset", "paper", "--tasks", "niah_single_1"])
    assert args.lengths[-1] == 131072


def test_needles_are_shuffled_with_a_fresh_random_seed(monkeypatch):
    monkeypatch.setattr(R, "SEED", 5)
    s = R.generate_sample("niah_multivalue", 3000, ENC, ESSAY, index=2)
    needles = [
        R.NEEDLE.format(type_needle_v="numbers", key=s["keys"][0], value=v) for v in s["values"][0]
    ]
    random.Random(5).shuffle(needles)
    assert s["needles"] == needles


def test_samples_are_reproducible_and_independent(monkeypatch):
    a = R.generate_sample("niah_multikey_2", 1800, ENC, ESSAY, index=3)
    b = R.generate_sample("niah_multikey_2", 1800, ENC, ESSAY, index=3)
    c = R.generate_sample("niah_multikey_2", 1800, ENC, ESSAY, index=4)
    monkeypatch.setattr(R, "SEED", 43)
    d = R.generate_sample("niah_multikey_2", 1800, ENC, ESSAY, index=3)
    assert a == b
    assert a["input_text"] != c["input_text"] and a["input_text"] != d["input_text"]


def test_fit_is_the_largest_that_fits():
    """niah_single_1 with bytes: keys vary by < one noise line (90 bytes) in the three places they
    appear, so any sample two lines above the fitted size overflows, and every sample fits at the
    fitted size or below."""
    for L in (900, 2000, 5000):
        fit = R.fit_haystack("niah_single_1", L, ENC)
        n = fit["num_haystack"]
        for seed in range(5):
            over = R.build_input("niah_single_1", n + 2, random.Random(seed))
            assert len(ENC.encode_ordinary(over["input_text"])) + 1 + R.TOKENS_TO_GENERATE > L
            s = R.generate_sample("niah_single_1", L, ENC, index=seed, fit=fit)
            assert s["input_tokens"] + 128 <= L and s["num_haystack"] >= n - fit["step"]
    assert (
        R.haystack_step("niah_single_1", 4095) == 5
        and R.haystack_step("niah_multikey_2", 4096) == 25
    )
    assert R.haystack_step("niah_single_2", 4096) == 500


def test_too_short_lengths_are_refused():
    fit = R.fit_haystack("niah_multiquery", 400, ENC, ESSAY)
    assert fit["num_haystack"] is None and fit["prompt_tokens_at_min"] > 400 - 128


# ---- sentences -----------------------------------------------------------------------------------
def split_sentences(text):
    """The essay's sentences as RULER splits them (sent_tokenize, here ends_sentence): what
    Essay.sentences gives."""
    words = text.split()
    out = []
    start = 0  # the first word of the current sentence
    for i, w in enumerate(words):
        if i + 1 == len(words) or R.ends_sentence(w, words[i + 1]):
            out.append(" ".join(words[start : i + 1]))
            start = i + 1
    return out


def test_sentence_splitter():
    text = (
        'Mr. Brown met Dr. Grey in the U.S. yesterday. It rained!  Did it?\n"Yes." Wait... '
        "and then nothing... Then it stopped. prices rose 3.5 percent. (See Fig. 2.) The end"
    )
    # initials ("U.S.") hold a sentence together; an abbreviation ("Mr.", "Fig.") ends one, where
    # punkt would read on
    assert split_sentences(text) == [
        "Mr.",
        "Brown met Dr.",
        "Grey in the U.S. yesterday.",
        "It rained!",
        "Did it?",
        '"Yes."',
        "Wait... and then nothing...",
        "Then it stopped.",
        "prices rose 3.5 percent.",
        "(See Fig.",
        "2.)",
        "The end",
    ]
    assert split_sentences("J. R. R. Tolkien wrote it, e.g. here. Next") == [
        "J. R. R. Tolkien wrote it, e.g. here.",
        "Next",
    ]
    assert split_sentences("") == [] and split_sentences("   no period here ") == ["no period here"]


def test_essay_sentences_match_splitting_the_prefix():
    words = ESSAY_TEXT.split()
    for n in (0, 1, 5, 37, len(words) - 1, len(words), len(words) + 13, 3 * len(words) + 2):
        prefix = " ".join((words * (n // len(words) + 1))[:n])
        assert ESSAY.sentences(n) == split_sentences(prefix), n


# ---- scoring -------------------------------------------------------------------------------------
def test_string_match_all():
    refs = [["1234567"], ["1111111", "2222222", "3333333", "4444444"], ["Blue-Lake"]]
    assert (
        R.string_match_all(
            ["It is 1234567.", "1111111, 2222222, 3333333 and 4444444", "blue-lake"], refs
        )
        == 100.0
    )
    # (1 + .5 + 0) / 3
    assert R.string_match_all(["1234567", "2222222 and 4444444", "nothing"], refs) == 50.0
    assert R.string_match_all(["123456", "none", "blue lake"], refs) == 0.0
    # rounded to 2 decimals
    assert R.string_match_all(["x", "1111111"], [["y"], ["1111111", "9", "8"]]) == 16.67
    assert R.string_match_all(["THE ANSWER IS BLUE-LAKE"], [["blue-LAKE"]]) == 100.0
    assert R.sample_score("2222222 and 4444444", refs[1]) == 0.5


def test_postprocess_and_decoding():
    assert R.postprocess_pred("  12\x0034\t5 \n") == "12\n34\n5"
    ids = ENC.encode_ordinary(" 1234567.\nmore 7654321")
    newline = R.newline_tokens(ENC)
    assert newline == {10}
    assert R.decode_output(ids, ENC, newline) == (" 1234567.", "newline")
    assert R.decode_output(ids, ENC, None) == (" 1234567.\nmore 7654321", "budget")
    assert R.decode_output(ENC.encode_ordinary(" 42") + [ENC.eot_token, 65], ENC, newline) == (
        " 42",
        "eot",
    )
    # padded-vocabulary ids drop out
    assert R.decode_output([65, 300, 66], ENC, newline) == (
        "AB",
        "budget",
    )


def test_haystack_files(tmp_path):
    (tmp_path / "pg.json").write_text(json.dumps({"text": "One essay.\n\nTwo  essay."}))
    (tmp_path / "plain.txt").write_text("Plain text here.")
    assert R.load_haystack_file(str(tmp_path / "pg.json")) == "One essay.\n\nTwo  essay."
    assert R.load_haystack_file(str(tmp_path / "plain.txt")) == "Plain text here."
    (tmp_path / "bad.json").write_text(json.dumps(["a list"]))
    with pytest.raises(EvalError, match="plain text"):
        R.load_haystack_file(str(tmp_path / "bad.json"))
    # the default: documents decoded from the validation shard
    docs = ["First document. It has two sentences.", "Second document here!"]
    toks = [t for d in docs for t in [ENC.eot_token] + ENC.encode_ordinary(d)]
    write_shard(str(tmp_path / "demo_val_000000.bin"), toks, "byte")
    essay = R.load_essay(None, str(tmp_path), 10_000)
    assert essay.label.startswith(f"essay:val:{tmp_path}@") and " ".join(essay.words) == " ".join(
        docs
    )
    with pytest.raises(EvalError, match="--haystack_file"):
        R.load_essay(None, str(tmp_path / "missing"), 1000)


# ---- end to end ----------------------------------------------------------------------------------
def tiny_ckpt(path, seed, **kw):
    torch.manual_seed(seed)
    save_checkpoint(
        str(path),
        GPT(
            GPTConfig(
                vocab_size=257,
                tokenizer="byte",
                n_layer=1,
                n_head=2,
                n_embd=16,
                block_size=32,
                **kw,
            )
        ),
    )
    return str(path.parent)


def test_end_to_end(tmp_path):
    a = tiny_ckpt(tmp_path / "runA" / "ckpt_0.pt", 0)
    b = tiny_ckpt(tmp_path / "runB" / "ckpt_0.pt", 1, pos_encoding="rope", ssmax=False)
    (tmp_path / "essay.txt").write_text(ESSAY_TEXT)
    out = tmp_path / "res"
    argv = ["--ckpt", a, "--ckpt", b, "--tasks", "niah_single_1,niah_single_2"]
    argv += [
        "--lengths",
        "256,640",
        "--samples",
        "2",
        "--haystack_file",
        str(tmp_path / "essay.txt"),
    ]
    argv += ["--out", str(out), "--device", "cpu"]
    rows = R.main(argv)
    recs = [json.loads(line) for line in open(out / "ruler_samples.jsonl")]
    assert len(recs) == 2 * 2 * 2  # runs x tasks x samples; 256 is too short for both prompts
    for r in recs:
        assert r["target_length"] == 640 and r["input_tokens"] + 128 <= 640 and 0 <= r["score"] <= 1
        assert r["haystack"] == ("noise" if r["task"] == "niah_single_1" else ESSAY_LABEL(tmp_path))
        assert r["stop"] in ("eot", "newline", "budget") and r["gen_tokens"] <= 128
        fields = ("task", "target_length", "sample", "input_tokens", "needles", "answers", "output")
        assert {*fields, "score"} <= set(r)
    # both checkpoints were asked the very same questions
    by_run = {
        run: {
            (r["task"], r["sample"]): (r["input_tokens"], r["needles"], r["answers"])
            for r in recs
            if r["label"] == run
        }
        for run in ("runA", "runB")
    }
    assert by_run["runA"] == by_run["runB"]
    check_summary(out, rows, recs)

    # resuming redoes nothing; other settings into the same file are refused
    R.main(argv)
    assert len(open(out / "ruler_samples.jsonl").readlines()) == len(recs)
    with pytest.raises(EvalError, match="other settings"):
        R.main(argv + ["--preset", "paper"])


def check_summary(out, rows, recs):
    """ruler_summary.{json,csv} and the figure of test_end_to_end's run."""
    summary = json.load(open(out / "ruler_summary.json"))
    assert summary == json.loads(json.dumps(rows))
    assert len(summary) == 2 * 2 * 3  # runs x lengths x (2 tasks + average)
    skipped = [r for r in summary if r["target_length"] == 256 and r["task"] != "average"]
    assert all(
        r["score"] is None and r["status"].startswith("skipped: the prompt") for r in skipped
    )
    scored = [r for r in summary if r["target_length"] == 640 and r["task"] != "average"]
    for r in scored:
        mine = [x for x in recs if x["label"] == r["label"] and x["task"] == r["task"]]
        assert r["status"] == "ok" and r["samples"] == 2
        assert r["score"] == R.string_match_all(
            [x["pred"] for x in mine], [x["answers"] for x in mine]
        )
    with open(out / "ruler_summary.csv") as f:
        assert len(list(csv.DictReader(f))) == len(summary)
    assert (out / "ruler_scores.png").stat().st_size > 10_000


def ESSAY_LABEL(tmp_path):
    return R.load_essay(str(tmp_path / "essay.txt"), None, 0).label


def oracle_generate(answers_to_give):
    """A stand-in for GPT.generate that reads the prompt and answers with the queried keys' values
    (the first `answers_to_give` of them), then a newline and more text that the newline stop must
    cut off."""

    def generate(self, idx, max_new_tokens, stop_tokens=(), temperature=0.0):
        text = ENC.decode(idx[0, 1:].tolist())
        values = {}
        for k, v in re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", text):
            values.setdefault(k, []).append(v)
        query = re.search(
            r"The special magic \w+ for (.+) mentioned in the provided text (?:are|is)$", text
        ).group(1)
        answers = [v for k in re.split(r", and |, ", query) for v in values[k]][:answers_to_give]
        return ENC.encode_ordinary(" " + ", ".join(answers) + ".\nAnd also 0000000")

    return generate


def test_scores_with_an_oracle_model(tmp_path, monkeypatch):
    a = tiny_ckpt(tmp_path / "run" / "ckpt_0.pt", 0)
    (tmp_path / "essay.txt").write_text(ESSAY_TEXT)
    base = [
        "--ckpt",
        a,
        "--tasks",
        "all",
        "--lengths",
        "1100",
        "--samples",
        "2",
        "--haystack_file",
        str(tmp_path / "essay.txt"),
        "--device",
        "cpu",
    ]
    monkeypatch.setattr(model_mod.GPT, "generate", oracle_generate(99))
    rows = R.main(base + ["--out", str(tmp_path / "full")])
    assert {r["task"]: r["score"] for r in rows} == {t: 100.0 for t in list(R.TASKS) + ["average"]}
    monkeypatch.setattr(model_mod.GPT, "generate", oracle_generate(1))
    rows = R.main(base + ["--out", str(tmp_path / "first")])
    scores = {r["task"]: r["score"] for r in rows}
    assert scores["niah_multivalue"] == scores["niah_multiquery"] == 25.0
    assert scores["niah_single_1"] == scores["niah_multikey_3"] == 100.0
    assert scores["average"] == round((6 * 100 + 25 + 25) / 8, 2)
    recs = [json.loads(line) for line in open(tmp_path / "first" / "ruler_samples.jsonl")]
    assert all(r["stop"] == "newline" and "0000000" not in r["output"] for r in recs)

    # --preset paper reads on past the newline, as RULER does
    rows = R.main(base + ["--preset", "paper", "--out", str(tmp_path / "paper")])
    recs = [json.loads(line) for line in open(tmp_path / "paper" / "ruler_samples.jsonl")]
    assert all(r["stop_rule"] == "eot" and "0000000" in r["output"] for r in recs)


def test_a_run_out_of_memory_at_a_length_is_skipped_there(tmp_path, monkeypatch):
    """A generation that runs out of memory skips that run at that length, every task, with the
    error's first line; the other run, and the shorter length, are scored."""
    a = tiny_ckpt(tmp_path / "runA" / "ckpt_0.pt", 0)
    b = tiny_ckpt(tmp_path / "runB" / "ckpt_0.pt", 1)
    real_generate = model_mod.GPT.generate
    real_start = R.start

    def generate(self, idx, *args, **kwargs):
        if self.label == "runB" and idx.shape[1] > 700:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return real_generate(self, idx, *args, **kwargs)

    def start(args):
        runs, enc, device, dtype = real_start(args)
        for run in runs:
            run["model"].label = run["label"]
        return runs, enc, device, dtype

    monkeypatch.setattr(model_mod.GPT, "generate", generate)
    monkeypatch.setattr(R, "start", start)
    argv = ["--ckpt", a, "--ckpt", b, "--tasks", "niah_single_1,niah_multikey_2", "--lengths"]
    argv += ["640,1100", "--samples", "2", "--out", str(tmp_path / "res"), "--device", "cpu"]
    rows = R.main(argv)
    status = {(r["label"], r["task"], r["target_length"]): r["status"] for r in rows}
    why = "skipped: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
    for task in ("niah_single_1", "niah_multikey_2"):
        assert status[("runA", task, 1100)] == status[("runB", task, 640)] == "ok"
        assert status[("runB", task, 1100)] == why
    assert status[("runB", "average", 1100)] == "0/2 tasks"
    recs = [json.loads(line) for line in open(tmp_path / "res" / "ruler_samples.jsonl")]
    assert len(recs) == 2 * 2 * 2 + 2 * 2  # runA at both lengths, runB at 640 only

"""
RULER's 8 needle-in-a-haystack subtasks (NVIDIA/RULER @ c3f5e3b, scripts/data/synthetic/niah.py,
constants.py, synthetic.yaml) with RULER's strings, key types and haystack search; greedy decoding
with the KV cache, scored with RULER's string_match_all. Its departures from RULER sit beside the
code that makes them: a word key is an adjective and a noun drawn one after the other (RULER draws
one of their 6.2M pairs: the same keys, each as likely), from a random stream per sample.

    python eval_ruler.py --ckpt out/run1 [--tasks all|niah_single_1,...] [--lengths 1024,2048]
    python eval_ruler.py --ckpt out/run1 --preset paper --haystack_file PaulGrahamEssays.json

Writes ruler_samples.jsonl (a rerun resumes it), ruler_summary (.json/.csv) and ruler_scores.png.
"""

import argparse
import functools
import hashlib
import json
import os
import random
import re
import time
import uuid

import numpy as np
import torch
from tqdm import tqdm

from data import VAL_TOKENS, get_tokenizer, open_shard, read_tokens, shard_paths, shard_tokenizer
from eval_common import (
    EvalError,
    ResultLog,
    add_common_args,
    check_settings,
    claim_out,
    geometric_lengths,
    load_runs,
    memory_shortfall,
    pick_device,
    plot_curves,
    resolve_dtype,
    run_script,
    training_data_dir,
    write_table,
)
from runtime import autocast

# RULER's strings (scripts/data/synthetic/constants.py and niah.py), verbatim
TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
MODEL_TEMPLATE = "{task_template}"  # scripts/data/template.py 'base': no chat wrapper
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# singular forms when one value is asked for, applied in this order
SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))
TOKENS_TO_GENERATE = 128
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]

# scripts/synthetic.yaml. num_needle_k is raised to max(num_k, num_q) when a sample is built
# (multiquery: 4).
_TASK_FIELDS = (
    "type_haystack", "type_needle_k", "type_needle_v",
    "num_needle_k", "num_needle_v", "num_needle_q",
)  # fmt: skip
_TASK_ROWS = {
    "niah_single_1":   ("noise",  "words", "numbers", 1, 1, 1),
    "niah_single_2":   ("essay",  "words", "numbers", 1, 1, 1),
    "niah_single_3":   ("essay",  "words", "uuids",   1, 1, 1),
    "niah_multikey_1": ("essay",  "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids",   1, 1, 1),
    "niah_multivalue": ("essay",  "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay",  "words", "numbers", 1, 1, 4),
}  # fmt: skip
TASKS = {name: dict(zip(_TASK_FIELDS, row)) for name, row in _TASK_ROWS.items()}
KEY_FIELDS = ("label", "ckpt", "ckpt_sha256", "task", "target_length", "sample", "haystack")
RULER_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)  # RULER's SEQ_LENGTHS (scripts/run.sh)
MAX_LENGTH = 32768  # without --lengths: the training length x 1, 2, 4, ... up to this
SEED = 42  # RULER's
MAX_ATTEMPTS = 1000


def task_template(cfg):
    """(template, type_needle_v): the base template + answer prefix, singular when one value is
    asked for."""
    template = MODEL_TEMPLATE.format(task_template=TEMPLATE) + ANSWER_PREFIX

    type_needle_v = cfg["type_needle_v"]
    if cfg["num_needle_q"] * cfg["num_needle_v"] == 1:
        for old, new in SINGULAR:
            template = template.replace(old, new)
        # numbers -> number, uuids -> uuid (needles keep the plural)
        type_needle_v = type_needle_v[:-1]
    return template, type_needle_v


# ---- sentences -----------------------------------------------------------------------------------
_CLOSERS = "\"')]}\u201d\u2019\u00bb"
_OPENERS = "\"'([{\u201c\u2018\u00ab"
_INITIALS = re.compile(r"(?:[A-Za-z]\.)*[A-Za-z]")  # "J", "U.S", "e.g", "i.e"


def ends_sentence(word, next_word):
    """Does a sentence end after `word`? A rule-based stand-in for RULER's NLTK punkt (no nltk
    dependency): ! or ? end one, so does a period except after an initial ("J.", "U.S.", "e.g."),
    an ellipsis only before a capital. Where it differs from punkt, only where a needle may go
    moves, never what is inserted. Unlike punkt it knows no abbreviations ("Mr.", "Fig."): on
    RULER's Paul Graham essays that moves 3 of 5,484 sentence ends."""
    core = word.rstrip(_CLOSERS)
    if not core or core[-1] not in ".!?":
        return False

    if core[-1] in "!?":
        return True

    if core.endswith(".."):
        nxt = next_word.lstrip(_OPENERS)
        return bool(nxt) and nxt[0].isupper()

    stem = core[:-1].lstrip(_OPENERS)
    return not _INITIALS.fullmatch(stem)


class Essay:
    """An essay's words and sentence ends, found once: sentences(n) (the first n words, cycling)
    re-splits nothing."""

    def __init__(self, text, label):
        # RULER's re.sub(r"\s+", " ", text).split(" ") without the empty ends
        self.words = text.split()
        if not self.words:
            raise ValueError(f"the essay haystack {label} has no words")
        self.label = label

        n = len(self.words)
        ends = [i + 1 for i in range(n) if ends_sentence(self.words[i], self.words[(i + 1) % n])]
        self.ends = np.array(ends, dtype=np.int64)

    def sentences(self, n):
        n_words = len(self.words)
        # the essay repeated to hold n words
        copies = max(1, -(-n // n_words))
        ends = (self.ends[None, :] + n_words * np.arange(copies)[:, None]).ravel()
        ends = ends[ends < n].tolist() + ([n] if n else [])

        words = self.words * copies if copies > 1 else self.words
        return [" ".join(words[a:b]) for a, b in zip([0] + ends[:-1], ends)]


# ---- keys and values -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def word_lists():
    """(adjectives, nouns): the lists RULER's niah.py reads from the wonderwords package, sorted and
    without repeats. Each adjective-noun pair is then one of RULER's word keys (its 910 x 6,782 =
    6,171,620 keys, sorted(set(f"{adj}-{noun}"))), exactly once."""
    from wonderwords import random_word

    adjs = random_word._get_words_from_text_file("adjectivelist.txt")
    nouns = random_word._get_words_from_text_file("nounlist.txt")
    return sorted(set(adjs)), sorted(set(nouns))


def words_digest():
    """Identifies the word keys (their lists and how they are drawn) in a results file's
    settings."""
    adjs, nouns = word_lists()
    text = "\n".join(["adjective then noun"] + adjs + ["--"] + nouns)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def random_value(kind, rng):
    """A needle's key or value: 7 digits, a word key (adjective-noun) or a uuid4."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))

    if kind == "words":
        adjs, nouns = word_lists()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"

    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_key(kind, rng, taken):
    """A key not in `taken`: unlike RULER, a distractor never repeats a real key (among 6.2M,
    practically never)."""
    while True:
        key = random_value(kind, rng)
        if key not in taken:
            return key


# ---- one input, RULER's generate_input_output ----------------------------------------------------
def min_haystack(task):
    """Line haystacks need a line per needle to insert at."""
    cfg = TASKS[task]
    n_needles = max(cfg["num_needle_k"], cfg["num_needle_q"]) * cfg["num_needle_v"]
    return 0 if cfg["type_haystack"] == "essay" else n_needles


def build_input(task, num_haystack, rng, essay=None, seed=42):
    """RULER's generate_input_output, drawing from `rng` in RULER's order: a dict of input_text
    (answer prefix included), needles, keys, values, queries, answers, depths, num_haystack."""
    cfg = TASKS[task]
    num_k = max(cfg["num_needle_k"], cfg["num_needle_q"])
    num_v = cfg["num_needle_v"]
    num_q = cfg["num_needle_q"]
    type_k = cfg["type_needle_k"]
    type_v = cfg["type_needle_v"]

    keys = []
    values = []
    needles = []
    for _ in range(num_k):
        keys.append(random_key(type_k, rng, keys))
        value = []
        for _ in range(num_v):
            value.append(random_value(type_v, rng))
            needles.append(NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value[-1]))
        values.append(value)
    # RULER: a fresh Random(seed), the same permutation for every sample
    random.Random(seed).shuffle(needles)

    if cfg["type_haystack"] == "essay":
        context, depths = essay_context(essay, num_haystack, needles, rng)
    else:
        context, depths = line_context(cfg, num_haystack, needles, keys, rng)

    indices = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in indices]
    answers = [a for i in indices for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    template, type_needle_v = task_template(cfg)
    return dict(
        input_text=template.format(type_needle_v=type_needle_v, context=context, query=query),
        needles=needles,
        keys=keys,
        values=values,
        queries=queries,
        answers=answers,
        depths=depths,
        num_haystack=num_haystack,
    )


def essay_context(essay, num_haystack, needles, rng):
    """RULER's essay context, num_haystack words with the needles at sorted random DEPTHS:
    (context, depths)."""
    sentences = essay.sentences(num_haystack)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    positions = [0] + [int(len(sentences) * (d / 100)) for d in depths] + [len(sentences)]

    # RULER's document_sents_list: sentence runs and needles
    parts = []
    for i in range(1, len(positions)):
        parts.append(" ".join(sentences[positions[i - 1] : positions[i]]))
        if i - 1 < len(needles):
            parts.append(needles[i - 1])
    return " ".join(parts), depths


def line_context(cfg, num_haystack, needles, keys, rng):
    """RULER's line haystacks (noise lines or distractor needles), needles at random lines:
    (context, depths)."""
    type_k = cfg["type_needle_k"]
    type_v = cfg["type_needle_v"]
    if cfg["type_haystack"] == "noise":
        lines = [NOISE] * num_haystack
    else:
        # distractors: needles of other keys
        lines = []
        for _ in range(num_haystack):
            key = random_key(type_k, rng, keys)
            value = random_value(type_v, rng)
            lines.append(NEEDLE.format(type_needle_v=type_v, key=key, value=value))

    indexes = sorted(rng.sample(range(num_haystack), len(needles)), reverse=True)
    for index, element in zip(indexes, needles):
        lines.insert(index, element)
    # needle i went in at line indexes[i]
    depths = [round(100 * i / num_haystack) for i in indexes]
    return "\n".join(lines), depths


# ---- the haystack size ---------------------------------------------------------------------------
def haystack_step(task, max_len):
    """RULER's `incremental` back-off: 500 essay words, 25 lines, 5 lines below 4096 tokens; below
    4096, 100 essay words (RULER never runs essays that short; 500 words would empty a 1K
    prompt)."""
    if TASKS[task]["type_haystack"] == "essay":
        return 500 if max_len >= 4096 else 100
    return 5 if max_len < 4096 else 25


def fit_haystack(task, max_len, enc, essay=None, seed=42):
    """RULER's binary search for the largest num_haystack whose probe prompt fits (its ~20
    tokenizations cost little beside the samples'); unlike RULER's endless loop, the haystack may
    shrink to min_haystack, else num_haystack is None. Also returns step, probes,
    prompt_tokens_at_min."""
    step = haystack_step(task, max_len)
    rng = random.Random(f"{seed}/{task}/{max_len}/search")
    # less the document-start token (RULER: no BOS)
    budget = max_len - TOKENS_TO_GENERATE - 1
    probes = 0
    # num_haystack -> tokens of its probe prompt
    prompt_tokens = {}

    def tokens(n):
        nonlocal probes
        probes += 1
        text = build_input(task, n, rng, essay, seed)["input_text"]
        prompt_tokens[n] = len(enc.encode_ordinary(text))
        return prompt_tokens[n]

    # RULER: estimate, then search up to 3x the estimated maximum
    per_unit = tokens(step) / step
    lo = min_haystack(task)
    hi = max(int(max_len / per_unit * 3), step * 2)

    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if tokens(mid) <= budget:
            best = mid
            lo = mid + 1
        else:
            hi = mid - 1

    return dict(
        num_haystack=best,
        step=step,
        min_haystack=min_haystack(task),
        probes=probes,
        prompt_tokens_at_min=prompt_tokens.get(min_haystack(task)),
    )


def generate_sample(task, max_len, enc, essay=None, seed=42, index=0, fit=None):
    """Sample `index`: the fitted haystack, backed off a step (RULER) while the real tokenization
    does not fit. Each attempt draws from Random(seed/task/length/index/attempt), not RULER's one
    stream, so --samples N gives the same first N samples. build_input's dict + input_ids,
    input_tokens, attempts, answer_token_pos (RULER's)."""
    # evaluate() skips a length where the fitted num_haystack is None
    fit = fit or fit_haystack(task, max_len, enc, essay, seed)

    used = fit["num_haystack"]
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"{seed}/{task}/{max_len}/{index}/{attempt}")
        sample = build_input(task, used, rng, essay, seed)
        ids = [enc.doc_start] + enc.encode_ordinary(sample["input_text"])
        if len(ids) + TOKENS_TO_GENERATE <= max_len:
            break
        used = max(fit["min_haystack"], used - fit["step"])
    else:
        raise RuntimeError(f"{task} at {max_len}: no sample fit after {MAX_ATTEMPTS} attempts")

    answer_at = sample["input_text"].find(sample["answers"][0])
    return dict(
        sample,
        input_ids=ids,
        input_tokens=len(ids),
        attempts=attempt + 1,
        answer_token_pos=1 + len(enc.encode_ordinary(sample["input_text"][:answer_at])),
    )


# ---- decoding and scoring ------------------------------------------------------------------------
def newline_tokens(enc):
    """Ids of every token whose bytes contain a newline (a hole in the vocabulary has none)."""

    def has_newline(t):
        try:
            return b"\n" in enc.token_bytes(t)
        except KeyError:
            return False

    return set(filter(has_newline, range(enc.n_vocab)))


def decode_output(tokens, enc, newline_ids=None):
    """(text, stop): cut before end-of-text ("eot") or at a newline of newline_ids ("newline"), else
    "budget". Ids beyond the tokenizer (the padded vocabulary) decode to nothing."""
    cut = len(tokens)

    stop = "budget"
    for j, t in enumerate(tokens):
        if t == enc.eot_token or t in (newline_ids or ()):
            cut = j
            stop = "eot" if t == enc.eot_token else "newline"
            break

    # a newline token is decoded, then the text cut at its newline: the token may carry text first
    kept = tokens[: cut + (stop == "newline")]
    text = enc.decode([t for t in kept if t < enc.n_vocab])
    return (text.split("\n", 1)[0] if stop == "newline" else text), stop


def postprocess_pred(text):
    """RULER's scripts/eval/evaluate.py postprocess_pred: strip, control characters -> newline,
    strip."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def sample_score(pred, refs):
    """Fraction of the references found (case-insensitive) in one prediction."""
    return sum(1.0 if r.lower() in pred.lower() else 0.0 for r in refs) / len(refs)


def string_match_all(preds, refs):
    """RULER's metric (scripts/eval/synthetic/constants.py): mean sample_score x 100, rounded to 2
    decimals."""
    total = sum(sample_score(pred, ref) for pred, ref in zip(preds, refs))
    return round(total / len(preds) * 100, 2)


# ---- the haystack --------------------------------------------------------------------------------
def load_haystack_file(path):
    """Text of a haystack file: RULER's PaulGrahamEssays.json ({"text": ...}), or plain text."""
    if path.endswith(".json"):
        with open(path) as f:
            obj = json.load(f)
        if not (isinstance(obj, dict) and isinstance(obj.get("text"), str)):
            raise EvalError(
                f'{path}: expected RULER\'s {{"text": ...}}; pass any other haystack as plain text'
            )
        return obj["text"]

    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def val_text(data_dir, n_tokens):
    """Up to n_tokens of the validation stream, decoded document by document with the tokenizer that
    wrote it."""
    paths = shard_paths(data_dir, "val")
    available = sum(len(open_shard(p)) for p in paths)
    tokens = read_tokens(data_dir, "val", min(VAL_TOKENS, n_tokens, available))

    enc = get_tokenizer(shard_tokenizer(paths[0]))
    docs = np.split(tokens, np.flatnonzero(tokens == enc.doc_start))
    marks = {enc.doc_start, enc.eot_token}
    return "\n\n".join(enc.decode([int(t) for t in d if t not in marks]) for d in docs)


def load_essay(haystack_file, data_dir, max_len):
    """The essay haystack: --haystack_file, else the validation text of data_dir."""
    if haystack_file:
        text = load_haystack_file(haystack_file)
        where = f"file:{os.path.abspath(haystack_file)}"
    else:
        try:
            text = val_text(data_dir, 2 * max_len)
        except (FileNotFoundError, ValueError) as e:
            raise EvalError(
                f"the essay tasks need a haystack: pass --haystack_file (RULER uses Paul Graham's "
                f"essays, PaulGrahamEssays.json) or prepared data in --data_dir ({e})"
            ) from e
        where = f"val:{os.path.abspath(data_dir)}"

    digest = hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()[:8]
    return Essay(text, f"essay:{where}@{digest}")


def haystack_label(task, essay):
    """Part of every record's key: the essay's label, or the kind of line haystack."""
    kind = TASKS[task]["type_haystack"]
    return essay.label if kind == "essay" else kind


# ---- summary and figure --------------------------------------------------------------------------
def summarize(records, runs, tasks, lengths, n_samples, skipped):
    """Rows (label, task, target_length) with RULER's score, and an "average" row per (label,
    length) over tasks. `skipped` maps (run label or None, task or None, length) to why."""
    by_cell = {}
    for r in records:
        if r["sample"] < n_samples:
            by_cell.setdefault((r["label"], r["task"], r["target_length"]), []).append(r)

    rows = []
    for run in runs:
        for length in lengths:
            task_rows = []
            for task in tasks:
                recs = sorted(
                    by_cell.get((run["label"], task, length), []), key=lambda r: r["sample"]
                )
                why = skipped.get((run["label"], None, length)) or skipped.get((None, task, length))
                task_rows.append(task_row(run, task, length, recs, n_samples, why))

            scored = [row["score"] for row in task_rows if row["score"] is not None]
            average = dict(
                label=run["label"],
                task="average",
                target_length=length,
                train_length=run["block_size"],
                haystack=None,
                samples=None,
                score=round(sum(scored) / len(scored), 2) if scored else None,
                mean_input_tokens=None,
                status=f"{len(scored)}/{len(tasks)} tasks",
                ckpt=run["ckpt_path"],
            )
            rows += task_rows + [average]
    return rows


def task_row(run, task, length, recs, n_samples, why):
    """The summary row of one checkpoint, task and length from its records (sorted by sample)."""
    row = dict(
        label=run["label"],
        task=task,
        target_length=length,
        train_length=run["block_size"],
        haystack=recs[0]["haystack"] if recs else None,
        samples=len(recs),
        score=None,
        mean_input_tokens=None,
        status=why or "missing",
    )
    if recs:
        score = string_match_all([r["pred"] for r in recs], [r["answers"] for r in recs])
        mean_input_tokens = sum(r["input_tokens"] for r in recs) / len(recs)
        row.update(
            score=score,
            mean_input_tokens=round(mean_input_tokens, 1),
            status="ok" if len(recs) == n_samples else "partial",
        )

    return dict(row, ckpt=run["ckpt_path"])


def plot_scores(rows, runs, path):
    """RULER's average over the tasks against the length, a curve per checkpoint (each task:
    ruler_summary.csv)."""
    series = {}
    for run in runs:
        points = []
        for r in rows:
            if r["label"] == run["label"] and r["task"] == "average" and r["score"] is not None:
                points.append((r["target_length"], r["score"]))
        if points:
            series[run["label"]] = tuple(zip(*sorted(points)))

    if series:
        plot_curves(
            series,
            [r["block_size"] for r in runs],
            path,
            "sequence length (tokens)",
            "string_match_all (%), mean over the tasks",
            "RULER NIAH",
            ylim=(-3, 103),
        )


def print_table(rows, runs, tasks, lengths):
    for run in runs:
        print(f"\n{run['label']} (train length {run['block_size']}): string_match_all, % by length")
        print(f"{'task':<18}" + "".join(f"{L:>9}" for L in lengths))

        for task in tasks + ["average"]:
            mine = [r for r in rows if r["label"] == run["label"] and r["task"] == task]
            scores = {r["target_length"]: r["score"] for r in mine}
            cells = ["-" if scores.get(L) is None else scores[L] for L in lengths]
            print(f"{task:<18}" + "".join(f"{cell:>9}" for cell in cells))


# ---- main ----------------------------------------------------------------------------------------
def build_parser():
    p = argparse.ArgumentParser(description="RULER needle-in-a-haystack (8 NIAH subtasks)")
    add_common_args(p, default_out="results/ruler")
    p.add_argument("--tasks", default="all", help=f"'all' or a comma list of: {', '.join(TASKS)}")
    p.add_argument(
        "--preset",
        choices=["paper"],
        default=None,
        help="paper: RULER's protocol: Paul Graham's essays (--haystack_file required), "
        "no newline stop, 500 samples, lengths 4K-128K",
    )
    p.add_argument(
        "--lengths",
        help="comma list of total lengths (prompt + 128 answer tokens); default: train "
        f"length x 1, 2, 4, ... up to {MAX_LENGTH}",
    )
    p.add_argument(
        "--samples", type=int, default=500, help="samples per task and length (RULER: 500)"
    )
    p.add_argument(
        "--haystack_file",
        help="RULER's PaulGrahamEssays.json, or plain text (default: --data_dir's val)",
    )
    p.add_argument(
        "--data_dir",
        help="prepared data for the essay haystack; default: the checkpoint's training data",
    )
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    if args.preset == "paper":
        args.lengths = args.lengths or ",".join(map(str, RULER_LENGTHS))

    if args.tasks == "all":
        args.tasks = list(TASKS)
    else:
        args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        p.error(f"unknown task(s) {unknown}; choose from {list(TASKS)} or 'all'")

    if args.lengths:
        args.lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    if args.samples < 1:
        p.error("--samples must be >= 1")

    essay_tasks = any(TASKS[t]["type_haystack"] == "essay" for t in args.tasks)
    if args.preset == "paper" and essay_tasks and not args.haystack_file:
        raise SystemExit(
            "eval_ruler.py: error: --preset paper needs RULER's essay haystack: run RULER's "
            "scripts/data/synthetic/json/download_paulgraham_essay.py (github.com/NVIDIA/RULER; "
            "it writes PaulGrahamEssays.json) and pass --haystack_file PaulGrahamEssays.json"
        )
    return args


def essay_haystack(args, runs, lengths):
    """The essay of the essay tasks (None if no task asked for needs one)."""
    if not any(TASKS[t]["type_haystack"] == "essay" for t in args.tasks):
        return None

    data_dir = None if args.haystack_file else training_data_dir(runs, args.data_dir)
    essay = load_essay(args.haystack_file, data_dir, max(lengths))
    n_sentences = len(essay.ends)
    print(f"essay haystack: {essay.label} ({len(essay.words)} words, {n_sentences} sentences)")
    return essay


def memory_skips(runs, lengths, device):
    """{(run label, None, length): why} for the lengths whose generation would not fit."""
    skipped = {}
    for run in runs:
        for L in lengths:
            why = memory_shortfall(run["model"], L, device, kv_cache=True)
            if why:
                skipped[(run["label"], None, L)] = f"skipped: {why}"
                print(f"[{run['label']}] skipping length {L}: skipped: {why}")
    return skipped


def records_asked_for(log, args, runs, lengths, essay):
    """The records of these tasks, lengths, haystacks and checkpoints (the log may hold more)."""
    checkpoints = {(run["label"], run["ckpt_path"]) for run in runs}
    return [
        r
        for r in log.records
        if r["task"] in args.tasks
        and r["target_length"] in lengths
        and r["haystack"] == haystack_label(r["task"], essay)
        and (r["label"], r["ckpt"]) in checkpoints
    ]


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    device = pick_device(args.device)
    dtype = resolve_dtype(device)
    runs, enc = load_runs(args.ckpt, device, args.attn_impl, dtype)
    shortest_training = min(run["block_size"] for run in runs)
    lengths = args.lengths or geometric_lengths(shortest_training, MAX_LENGTH)
    essay = essay_haystack(args, runs, lengths)

    with claim_out(args.out):
        # RULER's base-model runs stop only at end-of-text (config_tasks.sh STOP_WORDS=""), and so
        # does --preset paper; by default generation also stops at a newline (the answer is one
        # line: it saves most of the 128 steps), where RULER reads on.
        stop_rule = "eot" if args.preset == "paper" else "eot_or_newline"
        newline_ids = None if args.preset == "paper" else newline_tokens(enc)
        jsonl = os.path.join(args.out, "ruler_samples.jsonl")
        settings = dict(
            seed=SEED,
            stop_rule=stop_rule,
            dtype=dtype,
            tokenizer=runs[0]["tokenizer"],
            tokens_to_generate=TOKENS_TO_GENERATE,
            words=words_digest(),
        )
        check_settings(jsonl, settings)
        log = ResultLog(jsonl, KEY_FIELDS, runs)

        skipped = memory_skips(runs, lengths, device)
        for task in args.tasks:
            for L in lengths:
                active = [r for r in runs if (r["label"], None, L) not in skipped]
                why = evaluate(
                    task, L, active, enc, essay, args.samples, log, device, dtype, newline_ids
                )
                if why:
                    skipped[(None, task, L)] = why
                    print(f"{task} @ {L}: {why}")

        records = records_asked_for(log, args, runs, lengths, essay)
        rows = summarize(records, runs, args.tasks, lengths, args.samples, skipped)
        summary_prefix = os.path.join(args.out, "ruler_summary")
        figure = os.path.join(args.out, "ruler_scores.png")
        write_table(rows, summary_prefix)
        plot_scores(rows, runs, figure)
        print_table(rows, runs, args.tasks, lengths)
        print(
            f"\nwrote {log.path}, {summary_prefix}.{{json,csv}} and {figure} "
            f"in {time.time() - t_start:.1f}s"
        )
        return rows


def evaluate(task, L, runs, enc, essay, samples, log, device, dtype, newline_ids):
    """Generate and score every missing sample of one task at one length into `log`; returns why it
    was skipped."""
    hay = haystack_label(task, essay)

    def key(run, i):
        return (run["label"], run["ckpt_path"], run["ckpt_sha256"], task, L, i, hay)

    # sample index -> the runs that have not scored it yet
    todo = {i: [r for r in runs if key(r, i) not in log.done] for i in range(samples)}
    todo = {i: pending for i, pending in todo.items() if pending}
    if not todo:
        return None

    fit = fit_haystack(task, L, enc, essay, SEED)
    if fit["num_haystack"] is None:
        needed = fit["prompt_tokens_at_min"] + 1
        return (
            f"skipped: the prompt without haystack needs {needed} tokens, "
            f"> {L} - {TOKENS_TO_GENERATE}"
        )

    bar = tqdm(total=sum(map(len, todo.values())), desc=f"{task} @ {L}", dynamic_ncols=True)
    for i, pending in todo.items():
        sample = generate_sample(task, L, enc, essay, SEED, i, fit=fit)
        for run in pending:
            record = generate_answer(run, sample, enc, device, dtype, newline_ids)
            log.add(dict(zip(KEY_FIELDS, key(run, i)), **record))
            bar.update(1)
    bar.close()
    return None


def generate_answer(run, sample, enc, device, dtype, newline_ids):
    """One checkpoint's greedy answer to one sample, scored: the fields of its record after the
    key."""
    idx = torch.tensor([sample["input_ids"]], dtype=torch.long, device=device)
    stop_ids = {enc.eot_token} | (newline_ids or set())

    t0 = time.time()
    with autocast(device, dtype):
        out = run["model"].generate(idx, TOKENS_TO_GENERATE, stop_tokens=stop_ids)
    text, stop = decode_output(out, enc, newline_ids)
    pred = postprocess_pred(text)

    return dict(
        ckpt_step=run["ckpt_step"],
        seed=SEED,
        input_tokens=sample["input_tokens"],
        num_haystack=sample["num_haystack"],
        attempts=sample["attempts"],
        needles=sample["needles"],
        queries=sample["queries"],
        answers=sample["answers"],
        depths=sample["depths"],
        answer_token_pos=sample["answer_token_pos"],
        output=text,
        pred=pred,
        stop=stop,
        stop_rule="eot" if newline_ids is None else "eot_or_newline",
        gen_tokens=len(out),
        score=sample_score(pred, sample["answers"]),
        seconds=round(time.time() - t0, 3),
    )


if __name__ == "__main__":
    run_script(main, "eval_ruler.py")

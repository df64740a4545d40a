"""
RULER's 8 needle-in-a-haystack subtasks (NVIDIA/RULER @ c3f5e3b, scripts/data/synthetic/niah.py,
constants.py, synthetic.yaml) with its strings, key types and haystack search; greedy decoding with
the KV cache, scored by RULER's string_match_all. Departures from RULER are noted at the code.

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
    EXPECTED_ERRORS,
    FULL_DISK_REMEDY,
    EvalError,
    Evaluation,
    add_common_args,
    check_resume_settings,
    counting_work,
    curves,
    default_lengths,
    markdown_table,
    parse_lengths,
    plot_curves,
    skip_note,
    start,
    training_data_dir,
    work_fraction,
    work_share,
    write_table,
)
from infra import runtime

# ---- prompts
# RULER's strings, verbatim (scripts/data/synthetic/constants.py, niah.py)
TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
MODEL_TEMPLATE = "{task_template}"  # scripts/data/template.py 'base': no chat wrapper
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# singular forms when one value is asked, applied in order
SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))
TOKENS_TO_GENERATE = 128
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]

# scripts/synthetic.yaml; build_input raises num_needle_k to num_needle_q (multiquery: 4)
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
RULER_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)  # RULER's SEQ_LENGTHS (scripts/run.sh)
MAX_LENGTH = 32768  # default lengths: training length x 1, 2, 4, ... up to this
SEED = 42  # RULER's
MAX_ATTEMPTS = 1000


def task_template(cfg):
    """(template, type_needle_v), singular when one value is asked."""
    template = MODEL_TEMPLATE.format(task_template=TEMPLATE) + ANSWER_PREFIX

    type_needle_v = cfg["type_needle_v"]
    if cfg["num_needle_q"] * cfg["num_needle_v"] == 1:
        for old, new in SINGULAR:
            template = template.replace(old, new)
        # numbers -> number, uuids -> uuid (needles keep the plural)
        type_needle_v = type_needle_v[:-1]
    return template, type_needle_v


# ---- sentences
_CLOSERS = "\"')]}\u201d\u2019\u00bb"
_OPENERS = "\"'([{\u201c\u2018\u00ab"
_INITIALS = re.compile(r"(?:[A-Za-z]\.)*[A-Za-z]")  # "J", "U.S", "e.g", "i.e"


def ends_sentence(word, next_word):
    """Does a sentence end after `word`? A rule-based stand-in for RULER's NLTK punkt: ! or ? ends
    one, a period too unless after an initial ("J.", "U.S.", "e.g."), an ellipsis only before a
    capital. No abbreviations ("Mr."): that moves where a needle may go (3 of 5,484 sentence ends
    in RULER's essays), never what is inserted."""
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
    """An essay's words and sentence ends, found once."""

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


# ---- keys and values
@functools.lru_cache(maxsize=None)
def word_lists():
    """(adjectives, nouns) of RULER's niah.py (wonderwords), sorted, deduplicated: each pair is
    one of RULER's 6,171,620 word keys, sorted(set(f"{adj}-{noun}")), exactly once."""
    from wonderwords import random_word

    adjs = random_word._get_words_from_text_file("adjectivelist.txt")
    nouns = random_word._get_words_from_text_file("nounlist.txt")
    return sorted(set(adjs)), sorted(set(nouns))


def words_digest():
    """Identifies the word keys in a results file's settings."""
    adjs, nouns = word_lists()
    text = "\n".join(["adjective then noun"] + adjs + ["--"] + nouns)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def random_value(kind, rng):
    """A needle's key or value: 7 digits, a uuid4, or adjective-noun (RULER draws one of the
    pairs: the same keys, equally likely)."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))

    if kind == "words":
        adjs, nouns = word_lists()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"

    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_key(kind, rng, taken):
    """A key not in `taken`: unlike RULER's, a distractor never repeats a real key."""
    while True:
        key = random_value(kind, rng)
        if key not in taken:
            return key


# ---- one input, RULER's generate_input_output
def build_input(task, num_haystack, rng, essay=None):
    """RULER's generate_input_output (its rng draw order); input_text ends in the answer prefix."""
    cfg = TASKS[task]
    num_k = max(cfg["num_needle_k"], cfg["num_needle_q"])
    type_v = cfg["type_needle_v"]

    keys = []
    values = []
    needles = []
    for _ in range(num_k):
        keys.append(random_key(cfg["type_needle_k"], rng, keys))
        values.append([random_value(type_v, rng) for _ in range(cfg["num_needle_v"])])
        for value in values[-1]:
            needles.append(NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value))
    # RULER: a fresh Random(SEED), one permutation for all samples
    random.Random(SEED).shuffle(needles)

    if cfg["type_haystack"] == "essay":
        context, depths = essay_context(essay, num_haystack, needles, rng)
    else:
        context, depths = line_context(cfg, num_haystack, needles, keys, rng)

    indices = rng.sample(range(num_k), cfg["num_needle_q"])
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
    """(context, depths): RULER's essay with needles at random DEPTHS."""
    sentences = essay.sentences(num_haystack)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    positions = [0] + [int(len(sentences) * (d / 100)) for d in depths] + [len(sentences)]

    # RULER's document_sents_list: the sentence runs, a needle after each but the last
    runs = [" ".join(sentences[a:b]) for a, b in zip(positions, positions[1:])]
    parts = [runs[0]] + [part for pair in zip(needles, runs[1:]) for part in pair]
    return " ".join(parts), depths


def line_context(cfg, num_haystack, needles, keys, rng):
    """(context, depths): RULER's line haystacks, needles at random lines."""
    type_v = cfg["type_needle_v"]
    if cfg["type_haystack"] == "noise":
        lines = [NOISE] * num_haystack
    else:
        # distractors: needles of other keys
        lines = []
        for _ in range(num_haystack):
            key = random_key(cfg["type_needle_k"], rng, keys)
            value = random_value(type_v, rng)
            lines.append(NEEDLE.format(type_needle_v=type_v, key=key, value=value))

    indexes = sorted(rng.sample(range(num_haystack), len(needles)), reverse=True)
    for index, element in zip(indexes, needles):
        lines.insert(index, element)
    # needle i went in at line indexes[i]
    depths = [round(100 * i / num_haystack) for i in indexes]
    return "\n".join(lines), depths


# ---- the haystack size
def haystack_step(task, max_len):
    """RULER's `incremental` back-off: 500 essay words or 25 lines; under 4096 tokens 100 words or
    5 lines (RULER runs no essays that short; 500 words would empty a 1K prompt)."""
    if TASKS[task]["type_haystack"] == "essay":
        return 500 if max_len >= 4096 else 100
    return 5 if max_len < 4096 else 25


def fit_haystack(task, max_len, enc, essay=None):
    """RULER's binary search for the largest num_haystack whose probe prompt fits; unlike RULER's
    endless loop, it stops at min_haystack (then num_haystack is None)."""
    step = haystack_step(task, max_len)
    rng = random.Random(f"{SEED}/{task}/{max_len}/search")
    # less the document-start token (RULER: no BOS)
    budget = max_len - TOKENS_TO_GENERATE - 1
    # num_haystack -> tokens of its probe prompt
    prompt_tokens = {}

    def tokens(n):
        text = build_input(task, n, rng, essay)["input_text"]
        prompt_tokens[n] = len(enc.encode_ordinary(text))
        return prompt_tokens[n]

    # RULER: estimate, then search up to 3x the estimated maximum
    per_unit = tokens(step) / step
    # line haystacks need a line per needle to insert at
    cfg = TASKS[task]
    n_needles = max(cfg["num_needle_k"], cfg["num_needle_q"]) * cfg["num_needle_v"]
    smallest = 0 if cfg["type_haystack"] == "essay" else n_needles
    lo = smallest
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
        min_haystack=smallest,
        prompt_tokens_at_min=prompt_tokens.get(smallest),
    )


def generate_sample(task, max_len, enc, essay=None, index=0, fit=None):
    """Sample `index`: the fitted haystack (score() skips a length where none fits), backed off a
    step (RULER) until it fits. Each attempt has its own Random, not RULER's one stream, so
    --samples N gives the same first N samples. build_input's dict + input_ids."""
    fit = fit or fit_haystack(task, max_len, enc, essay)

    used = fit["num_haystack"]
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"{SEED}/{task}/{max_len}/{index}/{attempt}")
        sample = build_input(task, used, rng, essay)
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


# ---- the haystack
def load_haystack_file(path):
    """Text of RULER's PaulGrahamEssays.json ({"text": ...}), which RULER's
    scripts/data/synthetic/json/download_paulgraham_essay.py writes (it needs the internet), or
    of a plain text file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not path.endswith(".json"):
        return text

    obj = json.loads(text)
    if not (isinstance(obj, dict) and isinstance(obj.get("text"), str)):
        raise EvalError(f'{path}: expected RULER\'s {{"text": ...}}; pass others as plain text')
    return obj["text"]


def val_text(data_dir, n_tokens):
    """Up to n_tokens of the validation split, decoded per document."""
    paths = shard_paths(data_dir, "val")
    available = sum(len(open_shard(p)) for p in paths)
    tokens = read_tokens(data_dir, "val", min(VAL_TOKENS, n_tokens, available))

    enc = get_tokenizer(shard_tokenizer(paths[0]))
    docs = np.split(tokens, np.flatnonzero(tokens == enc.doc_start))
    marks = {enc.doc_start, enc.eot_token}
    return "\n\n".join(enc.decode([int(t) for t in d if t not in marks]) for d in docs)


def load_essay(haystack_file, data_dir, max_len):
    """The essay haystack: --haystack_file, else data_dir's validation text."""
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


def needs_essay(tasks):
    return any(TASKS[t]["type_haystack"] == "essay" for t in tasks)


# ---- score
KEY_FIELDS = ("label", "ckpt", "ckpt_sha256", "task", "target_length", "sample", "haystack")


def record_key(run, task, length, i, essay):
    """KEY_FIELDS of sample i: the question and the checkpoint answering it."""
    kind = TASKS[task]["type_haystack"]
    haystack = essay.label if kind == "essay" else kind
    return (run["label"], run["ckpt_path"], run["ckpt_sha256"], task, length, i, haystack)


def newline_tokens(enc):
    """Ids of tokens whose bytes contain a newline (every id below n_vocab is a token)."""
    return {t for t in range(enc.n_vocab) if b"\n" in enc.token_bytes(t)}


def decode_output(tokens, enc, newline_ids=None):
    """(text, stop): cut before end-of-text ("eot") or at a newline of newline_ids ("newline"),
    else "budget". Ids beyond the tokenizer (padded vocabulary) decode to nothing."""
    stops = dict.fromkeys(newline_ids or (), "newline") | {enc.eot_token: "eot"}
    cut = next((j for j, t in enumerate(tokens) if t in stops), len(tokens))
    stop = stops[tokens[cut]] if cut < len(tokens) else "budget"

    # a newline token may carry text before its newline: decode it, then cut
    kept = tokens[: cut + (stop == "newline")]
    text = enc.decode([t for t in kept if t < enc.n_vocab])
    return (text.split("\n", 1)[0] if stop == "newline" else text), stop


def postprocess_pred(text):
    """RULER's postprocess_pred (scripts/eval/evaluate.py): control characters -> newline."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def sample_score(pred, refs):
    """Fraction of refs found (case-insensitive) in one prediction."""
    return sum(1.0 if r.lower() in pred.lower() else 0.0 for r in refs) / len(refs)


def string_match_all(preds, refs):
    """RULER's metric: mean sample_score x 100, to 2 decimals."""
    total = sum(sample_score(pred, ref) for pred, ref in zip(preds, refs))
    return round(total / len(preds) * 100, 2)


def score(ev, length, tasks, samples, essay, newline_ids):
    """Generate and score, at one length, each task's samples that ev.log misses: {(run label or
    None, task or None): why} of what is skipped: a task whose prompt does not fit, a run out of
    memory (then at every task)."""
    skipped = {}
    for task in tasks:
        # sample index -> runs yet to score it
        todo = {}
        for i in range(samples):
            pending = [
                r for r in ev.runs if record_key(r, task, length, i, essay) not in ev.log.records
            ]
            if pending:
                todo[i] = pending
        if not todo:
            continue

        fit = fit_haystack(task, length, ev.enc, essay)
        if fit["num_haystack"] is None:
            needed = fit["prompt_tokens_at_min"] + 1
            why = f"skipped: the prompt without haystack needs {needed} tokens, > {length} - 128"
            skipped[(None, task)] = why
            print(f"{task} @ {length}: {why}")
            continue

        bar = tqdm(
            total=sum(map(len, todo.values())), desc=f"{task} @ {length}", dynamic_ncols=True
        )
        for i, pending in todo.items():
            sample = generate_sample(task, length, ev.enc, essay, i, fit)
            for run in pending:
                if (run["label"], None) in skipped:
                    continue
                key = record_key(run, task, length, i, essay)
                reason = runtime.fits(ev.device, generate_answer, ev, run, sample, key, newline_ids)
                if reason:
                    skipped[(run["label"], None)] = f"skipped: {reason}"
                    skip_note(run["label"], length, reason)
                bar.update(1)
        bar.close()
    return skipped


def generate_answer(ev, run, sample, key, newline_ids):
    """One checkpoint's greedy answer to a sample, scored, into ev.log under `key`."""
    idx = torch.tensor([sample["input_ids"]], dtype=torch.long, device=ev.device)
    stop_ids = {ev.enc.eot_token} | (newline_ids or set())

    t0 = time.time()
    with runtime.autocast(ev.device, ev.dtype), counting_work() as work:
        out = run["model"].generate(idx, TOKENS_TO_GENERATE, stop_tokens=stop_ids)
    text, stop = decode_output(out, ev.enc, newline_ids)
    pred = postprocess_pred(text)

    fields = ("input_tokens", "num_haystack", "attempts", "needles", "queries", "answers")
    record = dict(zip(KEY_FIELDS, key), ckpt_step=run["ckpt_step"], seed=SEED)
    record.update({k: sample[k] for k in fields + ("depths", "answer_token_pos")})
    record.update(
        output=text,
        pred=pred,
        stop=stop,
        stop_rule="eot" if newline_ids is None else "eot_or_newline",
        gen_tokens=len(out),
        score=sample_score(pred, sample["answers"]),
        seconds=round(time.time() - t0, 3),
        attention_work=work_fraction(work),
    )
    ev.log.add(record)


# ---- summarise
def summarise(ev, args, lengths, essay, skipped):
    """RULER's score per run, task and length, then the mean over tasks; skipped: score()'s, per
    length."""
    rows = []
    for run in ev.runs:
        for length in lengths:
            task_rows = []
            for task in args.tasks:
                keys = [record_key(run, task, length, i, essay) for i in range(args.samples)]
                recs = [ev.log.records[k] for k in keys if k in ev.log.records]
                why = skipped[length].get((run["label"], None)) or skipped[length].get((None, task))
                task_rows.append(task_row(run, task, length, recs, args.samples, why))

            scored = [row["score"] for row in task_rows if row["score"] is not None]
            average = round(sum(scored) / len(scored), 2) if scored else None
            status = f"{len(scored)}/{len(task_rows)} tasks"
            rows += task_rows
            rows.append(task_row(run, "average", length, [], args.samples, status))
            rows[-1].update(samples=None, score=average, attention_work=work_share(task_rows))

    write_table(rows, os.path.join(args.out, "ruler_summary"))
    series = curves([r for r in rows if r["task"] == "average"], "target_length", "score")
    if series:
        path = os.path.join(args.out, "ruler_scores.png")
        ylabel = "string_match_all (%), mean over the tasks"
        axes = dict(xlabel="sequence length (tokens)", ylabel=ylabel, title="RULER NIAH")
        train_lengths = [r["block_size"] for r in ev.runs]
        plot_curves(series, train_lengths, path, ylim=(-3, 103), **axes)

    for run in ev.runs:
        mine = [r for r in rows if r["label"] == run["label"]]
        scores = {(r["task"], r["target_length"]): r["score"] for r in mine}
        table = [[task] + [scores[(task, L)] for L in lengths] for task in args.tasks + ["average"]]
        work = {r["target_length"]: r["attention_work"] for r in mine if r["task"] == "average"}
        table.append(["attention work"] + [f"{work[n]:.1%}" if work[n] else None for n in lengths])
        print(f"\n{run['label']} (train length {run['block_size']}): string_match_all, %")
        print(markdown_table(["task", *lengths], table).replace("None", "-"))
    return rows


def task_row(run, task, length, recs, n_samples, why):
    """Summary row of one checkpoint, task and length from its records (sorted by sample)."""
    row = dict(label=run["label"], task=task, target_length=length, train_length=run["block_size"])
    row.update(haystack=None, samples=len(recs), score=None, mean_input_tokens=None)
    row.update(attention_work=None, status=why or "missing", ckpt=run["ckpt_path"])
    if recs:
        row.update(
            haystack=recs[0]["haystack"],
            score=string_match_all([r["pred"] for r in recs], [r["answers"] for r in recs]),
            mean_input_tokens=round(sum(r["input_tokens"] for r in recs) / len(recs), 1),
            attention_work=work_share(recs),
            status="ok" if len(recs) == n_samples else "partial",
        )
    return row


# ---- main
def build_parser():
    p = argparse.ArgumentParser(description="RULER needle-in-a-haystack (8 NIAH subtasks)")
    add_common_args(p, default_out="results/ruler")

    p.add_argument("--tasks", default="all", help=f"'all' or a comma list of: {', '.join(TASKS)}")
    p.add_argument(
        "--preset",
        choices=["paper"],
        help="paper: RULER's protocol: Paul Graham's essays (--haystack_file required), "
        "no newline stop, 500 samples, lengths 4K-128K",
    )
    p.add_argument(
        "--lengths",
        nargs="+",
        help="total lengths (prompt + 128 answer tokens); default: training length x 1, 2, 4, "
        f"... up to {MAX_LENGTH}",
    )
    p.add_argument("--samples", type=int, default=500, help="per task and length (RULER: 500)")
    p.add_argument("--haystack_file", help="PaulGrahamEssays.json, or plain text (default: val)")
    p.add_argument("--data_dir", help="data of the essay haystack; default: the training data")
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)

    args.tasks = list(TASKS) if args.tasks == "all" else args.tasks.replace(",", " ").split()
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown or not args.tasks:
        p.error(f"unknown task(s) {unknown}; choose from {list(TASKS)} or 'all'")
    if args.samples < 1:
        p.error("--samples must be >= 1")

    if args.lengths:
        args.lengths = parse_lengths(args.lengths)
    elif args.preset == "paper":
        args.lengths = list(RULER_LENGTHS)

    if args.preset == "paper" and needs_essay(args.tasks) and not args.haystack_file:
        raise EvalError(
            "--preset paper needs RULER's essay haystack: run RULER's "
            "scripts/data/synthetic/json/download_paulgraham_essay.py (github.com/NVIDIA/RULER; "
            "it writes PaulGrahamEssays.json) and pass --haystack_file PaulGrahamEssays.json"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    runs, enc, device, dtype = start(args)
    lengths = args.lengths or default_lengths([min(r["block_size"] for r in runs)], MAX_LENGTH)

    essay = None
    if needs_essay(args.tasks):
        data_dir = None if args.haystack_file else training_data_dir(runs, args.data_dir)
        essay = load_essay(args.haystack_file, data_dir, max(lengths))
        print(f"essay haystack: {essay.label} ({len(essay.words)} words, {len(essay.ends)} ends)")
    runtime.own_folder(args.out)

    # RULER's base-model runs stop only at end-of-text (config_tasks.sh STOP_WORDS=""), as does
    # --preset paper; by default also at a newline: the answer is one line, most steps are saved.
    paper = args.preset == "paper"
    newline_ids = None if paper else newline_tokens(enc)
    settings = dict(
        seed=SEED,
        stop_rule="eot" if paper else "eot_or_newline",
        dtype=dtype,
        tokenizer=runs[0]["tokenizer"],
        tokens_to_generate=TOKENS_TO_GENERATE,
        words=words_digest(),
    )
    log_path = os.path.join(args.out, "ruler_samples.jsonl")
    check_resume_settings(log_path, settings)
    ev = Evaluation(runs, enc, device, dtype, runtime.ResultLog(log_path, KEY_FIELDS))

    skipped = {L: score(ev, L, args.tasks, args.samples, essay, newline_ids) for L in lengths}
    rows = summarise(ev, args, lengths, essay, skipped)
    seconds = time.time() - t_start
    print(f"\nwrote {log_path}, ruler_summary.{{json,csv}} and ruler_scores.png in {seconds:.1f}s")
    return rows


if __name__ == "__main__":
    runtime.return_large_allocations()
    runtime.errors_in_one_line("eval_ruler.py", EXPECTED_ERRORS, FULL_DISK_REMEDY)
    main()

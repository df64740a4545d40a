"""
The CPU demo's data: a synthetic passkey corpus of shards, a passkey prompt per document (byte
tokenizer, eval_passkey.py's "demo" template: evaluation matches training exactly):

    <|endoftext|> task  filler...  needle("#12345")  filler...  question("?")  " 12345"

The filler is a random walk on a fixed sparse 20-letter graph (CHAIN; ~0.9 nats/letter), the
needle at a uniform random depth, the key a uniform 5-digit number. The stream is cut into
TokenLoader's block_size windows of one or more whole documents of varying length: SSMax's n
restarts in each document, so the question is seen at many n (with --docs_per_window 1, BAM+SSMax
did not extrapolate: results/demo/README.md). The data is a pure function of the arguments.

    python prepare_demo.py --seed 1 --out_dir data/demo/s1
"""

import argparse
import json
import os

import numpy as np

import eval_passkey
from data import EOT, get_tokenizer, shard_name, write_shard
from infra.runtime import FolderBusy, atomic_file, errors_in_one_line, own_folder

TOKENIZER = "byte"
TEMPLATE = "demo"
# The filler language: letter -> its three successors, with probabilities SUCCESSOR_P. Fixed (not
# seeded): the "demo" passkey template's filler must walk it too.
CHAIN = {
    "a": "heq", "b": "gnk", "c": "bjl", "d": "ipl", "e": "lps",
    "f": "mnt", "g": "nda", "h": "eaf", "i": "obm", "j": "nlg",
    "k": "oap", "l": "dph", "m": "hbn", "n": "fko", "o": "iqk",
    "p": "bir", "q": "ckh", "r": "kco", "s": "fco", "t": "jdr",
}  # fmt: skip
SUCCESSOR_P = (0.6, 0.3, 0.1)
LETTERS = sorted(CHAIN)


def random_walks(rng, n, length):
    """(n, length): n independent letter walks (byte values) from uniform random starts."""
    # (20, 3): each letter's successors' indices
    successors = np.array([[LETTERS.index(b) for b in CHAIN[a]] for a in LETTERS])
    state = rng.integers(len(LETTERS), size=n)

    walks = np.empty((n, length), dtype=np.int64)
    # each step's successor, 0 .. 2: the last takes every draw past the others' cumulative p
    choice = np.searchsorted(np.cumsum(SUCCESSOR_P)[:-1], rng.random((n, length)), side="right")
    for t in range(length):
        walks[:, t] = state
        state = successors[state, choice[:, t]]
    return np.array([ord(letter) for letter in LETTERS], dtype=np.int64)[walks]


def min_document_length():
    """A document's tokens without filler: end-of-text, task, needle, question, widest answer."""
    enc = get_tokenizer(TOKENIZER)
    template = eval_passkey.TEMPLATES[TEMPLATE]

    answer, _ = eval_passkey.answer_tokens(enc, eval_passkey.widest_key(template))
    return eval_passkey.min_prompt_length(enc, template) + len(answer)


def make_documents(rng, lengths):
    """A token list per entry of `lengths` (tokens, with the leading end-of-text). A uniform random
    number of filler letters (0 .. all) precedes the needle. Pieces are eval_passkey.py's, the
    filler a random walk, not repeated units: the demo template has no separator, so a walk joins
    pieces as filler units do."""
    enc = get_tokenizer(TOKENIZER)
    template = eval_passkey.TEMPLATES[TEMPLATE]
    parts = eval_passkey.pieces(enc, template)

    lengths = np.asarray(lengths, dtype=np.int64)
    n_fill = lengths - min_document_length()
    if len(lengths) and n_fill.min() < 0:
        raise ValueError(
            f"a document of {lengths.min()} tokens cannot hold the {TEMPLATE!r} template's "
            f"pieces ({min_document_length()} tokens without filler)"
        )

    # the draws' order (keys, needle places, walks) defines the corpus
    keys = eval_passkey.random_keys(rng, template, len(lengths))
    letters_before = rng.integers(0, n_fill + 1)
    walks = random_walks(rng, len(lengths), int(n_fill.max(initial=0)))

    docs = []
    for i in range(len(lengths)):
        key = int(keys[i])
        before = walks[i, : letters_before[i]].tolist()
        after = walks[i, letters_before[i] : n_fill[i]].tolist()

        needle = eval_passkey.needle_tokens(enc, template, key)
        answer, _ = eval_passkey.answer_tokens(enc, key)
        doc = eval_passkey.join(parts, before, needle, after) + answer

        assert len(doc) == lengths[i], "every piece has a fixed length"
        docs.append(doc)
    return docs


def window_layouts(rng, n_windows, block_size, min_len, docs_per_window):
    """Document lengths per training window: k documents (k drawn with probabilities
    docs_per_window = (p1, p2, ...)) summing to block_size, each >= min_len, split uniformly."""
    probs = np.asarray(docs_per_window, dtype=np.float64)
    # >= 1: parse_args holds block_size >= min_len
    most_docs = min(len(probs), block_size // min_len)
    probs = probs[:most_docs] / probs[:most_docs].sum()
    docs_in_window = rng.choice(np.arange(1, most_docs + 1), size=n_windows, p=probs)

    layouts = []
    for k in docs_in_window:
        # tokens beyond the minimum, split by k - 1 uniform cut points
        extra = block_size - k * min_len
        cuts = np.sort(rng.integers(0, extra + 1, size=k - 1))
        parts = np.diff(np.concatenate([[0], cuts, [extra]]))
        layouts.append((min_len + parts).tolist())
    return layouts


def build_parser():
    ap = argparse.ArgumentParser(
        description="Write the CPU demo's synthetic passkey corpus (byte tokenizer)."
    )
    ap.add_argument("--out_dir", default="data/demo")
    ap.add_argument("--seed", type=int, default=0, help="the corpus is a function of it and sizes")
    ap.add_argument("--block_size", type=int, default=64, help="train.py's training context")
    ap.add_argument("--train_windows", type=int, default=65536, help="one per training row")
    ap.add_argument("--val_windows", type=int, default=512)
    ap.add_argument("--min_doc_len", type=int, default=24, help="tokens, with end-of-text")
    ap.add_argument(
        "--docs_per_window",
        default="0.5,0.3,0.2",
        help="probabilities of 1, 2, 3, ... documents per window "
        "('1' = every document fills a window)",
    )
    return ap


def parse_args(argv=None):
    """The arguments and parsed --docs_per_window; a bad value is a one-line usage error."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        docs_per_window = [float(x) for x in args.docs_per_window.split(",")]
    except ValueError:
        ap.error(
            f"--docs_per_window takes comma-separated probabilities, got {args.docs_per_window!r}"
        )

    shortest = min_document_length()
    if min(args.train_windows, args.val_windows) < 1:
        ap.error("--train_windows and --val_windows must be >= 1")
    if args.seed < 0:
        ap.error("--seed must be >= 0")
    if min(docs_per_window) < 0 or sum(docs_per_window) <= 0:
        ap.error("--docs_per_window needs non-negative probabilities with a positive sum")
    if args.min_doc_len <= shortest:
        ap.error(f"--min_doc_len must be > {shortest} (the template's pieces)")
    if args.block_size < args.min_doc_len:
        ap.error("--block_size must be at least --min_doc_len")

    return args, docs_per_window


def main(argv=None):
    args, docs_per_window = parse_args(argv)
    own_folder(args.out_dir)

    written = {}
    for split, index, n_windows in (("val", 0, args.val_windows), ("train", 1, args.train_windows)):
        # independent streams per split
        rng = np.random.default_rng([args.seed, index])
        layouts = window_layouts(rng, n_windows, args.block_size, args.min_doc_len, docs_per_window)
        docs = make_documents(rng, [length for layout in layouts for length in layout])
        # whole-document windows (exactly TokenLoader's), then an end-of-text: the last target
        tokens = np.concatenate(docs + [[EOT[TOKENIZER]]])

        path = os.path.join(args.out_dir, shard_name("demo", split, index))
        with atomic_file(path) as f:
            write_shard(f, tokens, TOKENIZER)
        written[split] = dict(
            path=path,
            windows=n_windows,
            tokens=int(tokens.size),
            documents=len(docs),
        )

    meta = dict(
        seed=args.seed,
        block_size=args.block_size,
        min_doc_len=args.min_doc_len,
        docs_per_window=docs_per_window,
        tokenizer=TOKENIZER,
        template=TEMPLATE,
        template_strings=eval_passkey.TEMPLATES[TEMPLATE],
        chain=CHAIN,
        successor_p=SUCCESSOR_P,
        splits=written,
    )
    with atomic_file(os.path.join(args.out_dir, "demo_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)

    for split, shard in written.items():
        print(
            f"{split}: {shard['windows']} windows x {args.block_size} tokens, "
            f"{shard['documents']} documents -> {shard['path']}"
        )


if __name__ == "__main__":
    errors_in_one_line("prepare_demo.py", FolderBusy, "free some and run it again")
    main()

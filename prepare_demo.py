"""
The CPU demo's data: a synthetic passkey corpus in the repo's shard format, one passkey prompt per document
(byte tokenizer, the "demo" template of data.py, so that the model is evaluated on exactly what it was trained on):

    <|endoftext|> task  filler...  needle("#12345")  filler...  question("?")  " 12345"

The filler is a random walk on a fixed sparse graph over 20 letters (CHAIN; about 0.9 nats per letter), the needle
sits at a uniformly random depth, and the key is uniform over the 5-digit numbers. The stream is cut into windows of
block_size tokens as TokenLoader reads them, each holding one or more whole documents of varying length: SSMax's n
restarts in every document, so the question is seen at many n (with --docs_per_window 1, BAM+SSMax did not
extrapolate: results/demo/README.md). The data is a pure function of the arguments.

    python prepare_demo.py --seed 1 --out_dir data/demo/s1
"""
import argparse
import json
import os

import numpy as np

from data import EOT, PASSKEY_TEMPLATES, PIECE_SEP, get_tokenizer, shard_name, write_shard

TOKENIZER = "byte"
TEMPLATE = "demo"
# The filler language: letter -> its three successors, taken with probabilities SUCCESSOR_P. Fixed (not drawn
# from the seed), because the "demo" passkey template's filler must be a walk of this same graph.
CHAIN = {"a": "heq", "b": "gnk", "c": "bjl", "d": "ipl", "e": "lps", "f": "mnt", "g": "nda", "h": "eaf",
         "i": "obm", "j": "nlg", "k": "oap", "l": "dph", "m": "hbn", "n": "fko", "o": "iqk", "p": "bir",
         "q": "ckh", "r": "kco", "s": "fco", "t": "jdr"}
SUCCESSOR_P = (0.6, 0.3, 0.1)
LETTERS = sorted(CHAIN)


def template():
    t = PASSKEY_TEMPLATES[TEMPLATE]
    return t, t.get("sep", PIECE_SEP)


def is_walk(text, closed=False):
    """True iff every adjacent pair of `text` is an edge of CHAIN (and, if closed, also last -> first)."""
    pairs = list(zip(text, text[1:])) + ([(text[-1], text[0])] if closed and text else [])
    return all(a in CHAIN and b in CHAIN[a] for a, b in pairs)


def random_walks(rng, n, length):
    """n independent walks of `length` letters (byte values), each from a uniformly random start: (n, length)."""
    succ = np.array([[LETTERS.index(b) for b in CHAIN[a]] for a in LETTERS])  # (20, 3) letter indices
    cum = np.cumsum(SUCCESSOR_P)
    state = rng.integers(len(LETTERS), size=n)
    out = np.empty((n, length), dtype=np.int64)
    u = rng.random((n, length))
    for t in range(length):
        out[:, t] = state
        choice = np.minimum(np.searchsorted(cum, u[:, t], side="right"), len(SUCCESSOR_P) - 1)
        state = succ[state, choice]
    return np.frombuffer("".join(LETTERS).encode("ascii"), dtype=np.uint8).astype(np.int64)[out]


def piece_tokens(enc, t, sep):
    """The key-independent pieces as eval_passkey.build_prompt tokenizes them: task, sep, question, and the lengths
    of the needle (with the widest key) and of the answer."""
    d = t["digits"]
    return dict(task=enc.encode_ordinary(t["task"]), sep=enc.encode_ordinary(sep),
                question=enc.encode_ordinary(sep + t["question"]),
                needle_len=len(enc.encode_ordinary(sep + t["needle"].format(pass_key=10 ** d - 1))),
                answer_len=len(enc.encode_ordinary(" " + "9" * d)))


def min_document_length(t=None, sep=None):
    """Tokens of a document without filler: end-of-text, task, needle, question and answer."""
    if t is None:
        t, sep = template()
    p = piece_tokens(get_tokenizer(TOKENIZER), t, sep)
    return 1 + len(p["task"]) + 2 * len(p["sep"]) + p["needle_len"] + len(p["question"]) + p["answer_len"]


def make_documents(rng, lengths, t=None, sep=None):
    """One document per entry of `lengths` (tokens, including the leading end-of-text): a list of token lists.
    The filler before the needle has a uniformly random number of letters (0 .. all of it)."""
    if t is None:
        t, sep = template()
    enc = get_tokenizer(TOKENIZER)
    p = piece_tokens(enc, t, sep)
    lengths = np.asarray(lengths, dtype=np.int64)
    n_fill = lengths - min_document_length(t, sep)
    if len(lengths) and n_fill.min() < 0:
        raise ValueError(f"a document of {lengths.min()} tokens cannot hold the {TEMPLATE!r} template's pieces "
                         f"({min_document_length(t, sep)} tokens without filler)")
    d = t["digits"]
    keys = rng.integers(10 ** (d - 1), 10 ** d, size=len(lengths))
    before = rng.integers(0, n_fill + 1)  # letters of filler before the needle, uniform over 0 .. n_fill
    walks = random_walks(rng, len(lengths), int(n_fill.max(initial=0)))
    head = [EOT[TOKENIZER]] + p["task"] + p["sep"]
    docs = []
    for i in range(len(lengths)):
        key, k, n = int(keys[i]), int(before[i]), int(n_fill[i])
        doc = (head + walks[i, :k].tolist() + enc.encode_ordinary(sep + t["needle"].format(pass_key=key))
               + p["sep"] + walks[i, k:n].tolist() + p["question"] + enc.encode_ordinary(" " + str(key)))
        assert len(doc) == lengths[i], "every piece has a fixed length"
        docs.append(doc)
    return docs


def window_layouts(rng, n_windows, block_size, min_len, docs_per_window):
    """Document lengths for each training window: a window holds k documents (k drawn with the probabilities
    docs_per_window = (p1, p2, ...)) whose lengths sum to block_size, each at least min_len, split uniformly."""
    probs = np.asarray(docs_per_window, dtype=np.float64)
    k_max = min(len(probs), block_size // min_len)
    if k_max < 1:
        raise ValueError(f"block_size {block_size} is shorter than a document ({min_len} tokens)")
    probs = probs[:k_max] / probs[:k_max].sum()
    ks = rng.choice(np.arange(1, k_max + 1), size=n_windows, p=probs)
    layouts = []
    for k in ks:
        extra = block_size - k * min_len  # tokens beyond the minimum, shared out by k - 1 uniform cut points
        cuts = np.sort(rng.integers(0, extra + 1, size=k - 1))
        parts = np.diff(np.concatenate([[0], cuts, [extra]]))
        layouts.append((min_len + parts).tolist())
    return layouts


def make_stream(rng, n_windows, block_size, min_len, docs_per_window):
    """n_windows * block_size + 1 tokens: windows of whole documents (TokenLoader's windows exactly), then a final
    end-of-text so that the last window has its next-token target."""
    layouts = window_layouts(rng, n_windows, block_size, min_len, docs_per_window)
    docs = make_documents(rng, [L for lay in layouts for L in lay])
    tokens = np.fromiter((tok for doc in docs for tok in doc), dtype=np.int64,
                         count=n_windows * block_size)
    return np.concatenate([tokens, [EOT[TOKENIZER]]])


def build_parser():
    ap = argparse.ArgumentParser(description="Write the CPU demo's synthetic passkey corpus (byte tokenizer).")
    ap.add_argument("--out_dir", default="data/demo")
    ap.add_argument("--seed", type=int, default=0, help="the corpus is a pure function of the seed and the sizes")
    ap.add_argument("--block_size", type=int, default=64, help="window length = the training context of train.py")
    ap.add_argument("--train_windows", type=int, default=65536, help="training windows (one per training row)")
    ap.add_argument("--val_windows", type=int, default=512, help="validation windows")
    ap.add_argument("--min_doc_len", type=int, default=24, help="shortest document (tokens, with end-of-text)")
    ap.add_argument("--docs_per_window", default="0.5,0.3,0.2",
                    help="probabilities of 1, 2, 3, ... documents per window ('1' = every document fills a window)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        docs_per_window = [float(x) for x in args.docs_per_window.split(",")]
    except ValueError:
        ap.error(f"--docs_per_window takes comma-separated probabilities, got {args.docs_per_window!r}")
    shortest = min_document_length()
    for bad, why in ((min(args.train_windows, args.val_windows) < 1, "--train_windows and --val_windows must be >= 1"),
                     (args.seed < 0, "--seed must be >= 0"),
                     (min(docs_per_window) < 0 or sum(docs_per_window) <= 0,
                      "--docs_per_window needs non-negative probabilities with a positive sum"),
                     (args.min_doc_len <= shortest, f"--min_doc_len must be > {shortest} (the template's pieces)"),
                     (args.block_size < args.min_doc_len, "--block_size must be at least --min_doc_len")):
        if bad:
            ap.error(why)
    t, _ = template()
    os.makedirs(args.out_dir, exist_ok=True)
    written = {}
    for split, index, n in (("val", 0, args.val_windows), ("train", 1, args.train_windows)):
        rng = np.random.default_rng([args.seed, index])  # independent streams per split
        tokens = make_stream(rng, n, args.block_size, args.min_doc_len, docs_per_window)
        path = os.path.join(args.out_dir, shard_name("demo", split, index))
        write_shard(path, tokens, TOKENIZER)
        written[split] = dict(path=path, windows=n, tokens=int(tokens.size),
                              documents=int((tokens[:-1] == EOT[TOKENIZER]).sum()))
    meta = dict(seed=args.seed, block_size=args.block_size, min_doc_len=args.min_doc_len,
                docs_per_window=docs_per_window, tokenizer=TOKENIZER, template=TEMPLATE, template_strings=t,
                chain=CHAIN, successor_p=SUCCESSOR_P, splits=written)
    with open(os.path.join(args.out_dir, "demo_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for split, w in written.items():
        print(f"{split}: {w['windows']} windows x {args.block_size} tokens, {w['documents']} documents -> {w['path']}")


if __name__ == "__main__":
    main()

"""
Tokenize a text corpus into bam-gpt shards (format: data.py).

    python prepare_fineweb.py                  # FineWeb sample-10BT, gpt2 -> data/fineweb10B (needs network)
    python prepare_fineweb.py --local_files my.jsonl --tokenizer byte --out_dir data/mytext   # fully offline

Every document is prefixed with end-of-text and the documents are concatenated in stream order. The first
--val_tokens tokens (default 3,932,160, spec §0) form the validation shard {prefix}_val_000000.bin; the rest
is cut into training shards of --shard_size tokens, {prefix}_train_000001.bin, ...

--local_files takes .jsonl/.json (one document per record, in --text_column), .parquet (same) or .txt files,
paths or globs, read in the order given (globs sorted). A .txt file is ONE document (its whole text): that keeps
long texts (books, essays) in one piece for long-context training. To get several documents, use several
files or jsonl. Text files are read with universal newlines, so "\\r\\n" becomes "\\n".

Resumable: meta.json in out_dir is a ledger of the finished shards and where in the source stream each one
ends. A rerun with the same settings keeps the shards that are listed and still valid, skips the source
documents they cover (without tokenizing them) and continues; the result is byte-identical to an uninterrupted
run as long as the source stream is deterministic. A larger --max_tokens extends a finished preparation.
"""
import argparse
import functools
import glob
import itertools
import json
import multiprocessing as mp
import os
import re
import time

import numpy as np
from tqdm import tqdm

from data import EOT, TOKENIZERS, VAL_TOKENS, VOCAB_SIZE, get_tokenizer, open_shard, write_shard

SHARD_RE = re.compile(r"^.+_(train|val)_\d{6}\.bin$")
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="HuggingFaceFW/fineweb", help="Hugging Face dataset (streamed)")
    p.add_argument("--name", default="sample-10BT", help="dataset config name")
    p.add_argument("--split", default="train")
    p.add_argument("--local_files", nargs="+", help="local .jsonl/.json/.parquet/.txt paths or globs (replaces --dataset)")
    p.add_argument("--text_column", default="text")
    p.add_argument("--tokenizer", default="gpt2", choices=TOKENIZERS)
    p.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per training shard")
    p.add_argument("--val_tokens", type=int, default=VAL_TOKENS, help="tokens in the validation shard")
    p.add_argument("--max_tokens", type=int, default=None, help="stop after this many tokens in total (val + train)")
    p.add_argument("--num_proc", type=int, default=os.cpu_count(), help="tokenizer processes")
    p.add_argument("--out_dir", default=None, help="default: data/fineweb10B for FineWeb, else data/<prefix>")
    p.add_argument("--prefix", default=None, help="shard name prefix; default: derived from the dataset or first file")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for k in ("shard_size", "val_tokens", "max_tokens", "num_proc"):
        v = getattr(args, k)
        if v is not None and v < 1:
            p.error(f"--{k} must be at least 1, got {v}")
    if args.local_files:
        args.files = expand_files(args.local_files)
    if args.prefix is None:
        stem = os.path.basename(args.files[0]).split(".")[0] if args.local_files else args.dataset.split("/")[-1]
        args.prefix = re.sub(r"[^a-z0-9]+", "", stem.lower()) or "data"
    if args.out_dir is None:
        default_fineweb = not args.local_files and (args.dataset, args.name) == ("HuggingFaceFW/fineweb", "sample-10BT")
        args.out_dir = "data/fineweb10B" if default_fineweb else os.path.join("data", args.prefix)
    return args


def expand_files(patterns):
    files = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        if not hits or not all(os.path.isfile(f) for f in hits):
            raise FileNotFoundError(f"--local_files: no file matches {pat!r}")
        for f in hits:
            if file_format(f) is None:
                raise ValueError(f"--local_files: {f} is not one of {sorted(LOCAL_FORMATS)} (optionally .gz/.zst/.bz2/.xz)")
            if os.path.getsize(f) == 0:  # caught here: datasets' json builder fails on it with a bare StopIteration
                raise ValueError(f"--local_files: {f} is empty")
        files += hits
    return files


def file_format(path):
    """The datasets builder for a local file, looking past a compression suffix."""
    name = re.sub(r"\.(gz|zst|bz2|xz)$", "", path.lower())
    return LOCAL_FORMATS.get(os.path.splitext(name)[1])


def source_rows(args):
    """The documents' texts (None for a row without text), in a deterministic order."""
    from datasets import load_dataset

    if args.local_files:
        # consecutive files of one format go through one builder, so many small files stay cheap
        parts = [(fmt, list(fs)) for fmt, fs in itertools.groupby(args.files, key=file_format)]
        streams = [(load_dataset(fmt, data_files=fs, split="train", streaming=True,
                                 **({"sample_by": "document"} if fmt == "text" else {})),
                    "text" if fmt == "text" else args.text_column) for fmt, fs in parts]
    else:
        streams = [(load_dataset(args.dataset, name=args.name, split=args.split, streaming=True), args.text_column)]
    for ds, column in streams:
        for row in ds:
            if column not in row:
                raise KeyError(f"no column {column!r} in the data (columns: {sorted(row)}); use --text_column")
            yield row[column]


def tokenize(tokenizer_name, text):
    """[eot] + tokens of one document as uint16 (empty for a document without text)."""
    if not text:
        return np.zeros(0, dtype=np.uint16)
    enc = get_tokenizer(tokenizer_name)
    toks = np.array([enc.eot_token] + enc.encode_ordinary(text), dtype=np.int64)
    if toks.max() >= 65536:
        raise ValueError(f"token id {toks.max()} does not fit the uint16 shards (tokenizer {tokenizer_name})")
    return toks.astype(np.uint16)


def shard_name(args, index):
    return f"{args.prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def planned_size(args, index):
    return args.val_tokens if index == 0 else args.shard_size


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def reusable_shards(args, settings, meta_path):
    """The ledger entries of a previous run that can be kept: a prefix of full, valid shards, ending no later
    than --max_tokens (a finished run's shorter last shard is kept only by a rerun with the same --max_tokens)."""
    if not os.path.exists(meta_path):
        stray = [f for f in os.listdir(args.out_dir) if SHARD_RE.match(f)]
        if stray:
            raise FileExistsError(f"{args.out_dir} holds shards ({stray[0]}, ...) but no meta.json, so they are not "
                                  "this script's to resume; delete them or choose another --out_dir")
        return [], None
    with open(meta_path) as f:
        meta = json.load(f)
    old = meta["settings"]
    differ = {k: (old.get(k), v) for k, v in settings.items() if k != "max_tokens" and old.get(k) != v}
    if differ:
        raise ValueError(f"{args.out_dir} holds a preparation with other settings ("
                         + ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
                         + "); choose another --out_dir, or delete its shards and meta.json to start over")
    keep, end = [], 0
    same_end = meta["complete"] and old.get("max_tokens") == args.max_tokens
    for i, entry in enumerate(meta["shards"]):
        try:
            ok = len(open_shard(os.path.join(args.out_dir, entry["file"]), args.tokenizer)) == entry["tokens"]
        except (OSError, ValueError):
            ok = False
        full = entry["tokens"] == planned_size(args, i)
        last = i == len(meta["shards"]) - 1
        if not ok or not (full or (same_end and last)) or (args.max_tokens and end + entry["tokens"] > args.max_tokens):
            break
        keep.append(entry)
        end += entry["tokens"]
    return keep, meta


def main(argv=None):
    args = parse_args(argv)
    get_tokenizer(args.tokenizer)  # fail now, not in a worker after the download started
    os.makedirs(args.out_dir, exist_ok=True)
    source = {"local_files": [os.path.abspath(f) for f in args.files]} if args.local_files else \
        {"dataset": args.dataset, "name": args.name, "split": args.split}
    settings = dict(source=source, text_column=args.text_column, tokenizer=args.tokenizer, prefix=args.prefix,
                    shard_size=args.shard_size, val_tokens=args.val_tokens, max_tokens=args.max_tokens)
    meta_path = os.path.join(args.out_dir, "meta.json")
    shards, old_meta = reusable_shards(args, settings, meta_path)
    if old_meta and old_meta["complete"] and len(shards) == len(old_meta["shards"]) \
            and old_meta["settings"]["max_tokens"] == args.max_tokens:
        print(f"{args.out_dir}: all {len(shards)} shards are already complete and valid; nothing to do")
        return old_meta
    meta = dict(settings=settings, tokenizer=args.tokenizer, vocab_size=VOCAB_SIZE[args.tokenizer],
                eot=EOT[args.tokenizer], complete=False, shards=shards)
    write_json(meta_path, meta)  # first, so that shards never exist without the ledger that vouches for them
    for f in os.listdir(args.out_dir):  # leftovers of an interrupted write
        if f.startswith(args.prefix + "_") and f.endswith(".bin.tmp"):
            os.remove(os.path.join(args.out_dir, f))

    done = sum(e["tokens"] for e in shards)
    start_doc, start_offset = (shards[-1]["next_doc"], shards[-1]["next_offset"]) if shards else (0, 0)
    if shards:
        print(f"resuming after {len(shards)} complete shards ({done:,} tokens): skipping {start_doc:,} source rows")
    index = len(shards)
    buf, fill = np.empty(planned_size(args, index), dtype=np.uint16), 0
    total, docs, t0, t_first = done, 0, time.time(), None

    def flush(next_doc, next_offset):
        nonlocal buf, fill, index
        name = shard_name(args, index)
        write_shard(os.path.join(args.out_dir, name), buf[:fill], args.tokenizer)
        shards.append(dict(file=name, tokens=fill, documents=int(np.count_nonzero(buf[:fill] == EOT[args.tokenizer])),
                           next_doc=next_doc, next_offset=next_offset))
        write_json(meta_path, meta)
        index += 1
        buf, fill = np.empty(planned_size(args, index), dtype=np.uint16), 0

    rows = itertools.islice(source_rows(args), start_doc, None)
    work = functools.partial(tokenize, args.tokenizer)
    pool = mp.Pool(args.num_proc) if args.num_proc > 1 else None
    try:
        results = pool.imap(work, rows, chunksize=16) if pool else map(work, rows)
        bar = tqdm(total=args.max_tokens, initial=done, unit="tok", unit_scale=True, desc=f"tokenizing -> {args.out_dir}")
        for row, toks in enumerate(results, start=start_doc):
            if total == args.max_tokens:
                break
            t_first = t_first or time.time()
            if row == start_doc:
                toks = toks[start_offset:]  # the part of this document already in the kept shards
            if len(toks) == 0:
                continue
            docs += 1
            pos = 0
            while pos < len(toks):
                take = min(len(toks) - pos, len(buf) - fill, (args.max_tokens or np.inf) - total)
                buf[fill:fill + take] = toks[pos:pos + take]
                fill, pos, total = fill + take, pos + take, total + take
                bar.update(take)
                nxt = (row, pos) if pos < len(toks) else (row + 1, 0)  # where the stream continues
                if fill == len(buf):
                    flush(*nxt)
                if total == args.max_tokens:
                    break
            if docs % 1000 == 0:
                bar.set_postfix(docs=f"{docs:,}", refresh=False)
        bar.set_postfix(docs=f"{docs:,}")
        bar.close()
    finally:
        if pool:
            pool.terminate()
    if fill:
        flush(*nxt)  # the source ended (or --max_tokens was reached) inside this shard
    if not shards:
        raise ValueError(f"the source has no text: no tokens were written ({source}); check the input and --text_column")
    ours = {s["file"] for s in shards}
    for f in os.listdir(args.out_dir):  # shards of an earlier, longer preparation that this one no longer reaches
        if SHARD_RE.match(f) and f.startswith(args.prefix + "_") and f not in ours:
            os.remove(os.path.join(args.out_dir, f))
    dt = time.time() - t0
    new = total - done
    meta.update(complete=True, tokens=total, val_tokens=shards[0]["tokens"], train_tokens=total - shards[0]["tokens"],
                documents=sum(e["documents"] for e in shards), source_rows=shards[-1]["next_doc"])
    write_json(meta_path, meta)
    setup = f", {t_first - t0:.1f} s of it opening the source" if t_first else ""
    print(f"wrote {new:,} tokens from {docs:,} documents in {dt:.1f} s ({new / max(dt, 1e-9):,.0f} tokens/s{setup}); "
          f"{args.out_dir} now holds {len(shards)} shards, {total:,} tokens ({meta['val_tokens']:,} val)")
    if len(shards) == 1:
        print("note: the data ended inside the validation split, so there are no training shards; "
              "lower --val_tokens or add data")
    return meta


if __name__ == "__main__":
    main()

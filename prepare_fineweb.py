"""
Tokenize a text corpus into bam-gpt shards (format: data.py), resumably.

    python prepare_fineweb.py
    python prepare_fineweb.py --tokenizer gpt2
    python prepare_fineweb.py --local_files my.jsonl --tokenizer mistral --out_dir data/mytext

The first writes 11.9B mistral tokens of FineWeb sample-100BT to data/fineweb_mistral, the second
the same with gpt2 tokens to data/fineweb_gpt2 (both stream from the network), the third works
fully offline.

Documents are tokenized with the tokenizer's document tokens and concatenated in stream order. The
first --val_tokens (3,932,160) form {prefix}_val_000000.bin, the next --gap_tokens (1,000,000, the
authors' gap) are skipped, the rest is cut into training shards of --shard_size. --local_files takes
.jsonl/.json/.parquet (one document per record) or .txt (one document per file, so long texts stay
whole) paths or globs, in order.
"""

import argparse
import functools
import glob
import itertools
import json
import multiprocessing as mp
import os
import re
import sys
import time

import numpy as np
from tqdm import tqdm

from data import (
    DOC_START,
    EOT,
    GAP_TOKENS,
    SHARD_RE,
    TOKENIZERS,
    VAL_TOKENS,
    VOCAB_SIZE,
    DataError,
    atomic_file,
    disk_full,
    get_tokenizer,
    no_space_left,
    open_shard,
    remove_stale_temporaries,
    shard_name,
    write_shard,
)

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
# config/bam_120m.py reads 20,000 steps x 589,824 = 11.8B tokens, more than sample-10BT holds (the
# authors' "roughly one epoch" repeats data): stream sample-100BT and stop at 11.9B (validation +
# training + spare).
FINEWEB_MAX_TOKENS = 11_900_000_000


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dataset", default="HuggingFaceFW/fineweb", help="Hugging Face dataset (streamed)"
    )
    p.add_argument("--name", default="sample-100BT", help="dataset config name")
    p.add_argument("--split", default="train")
    p.add_argument(
        "--local_files",
        nargs="+",
        help="local .jsonl/.json/.parquet/.txt paths or globs (replaces --dataset)",
    )
    p.add_argument("--text_column", default="text")
    p.add_argument(
        "--tokenizer", default="mistral", choices=TOKENIZERS, help="mistral: the authors' tokenizer"
    )
    p.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per training shard")
    p.add_argument(
        "--val_tokens", type=int, default=VAL_TOKENS, help="tokens in the validation shard"
    )
    p.add_argument(
        "--gap_tokens", type=int, default=GAP_TOKENS, help="tokens skipped between val and train"
    )
    p.add_argument(
        "--max_tokens",
        type=int,
        default=None,
        help="stop after this many tokens in total (val + train; default "
        f"{FINEWEB_MAX_TOKENS:,} for a Hugging Face dataset, everything for --local_files)",
    )
    p.add_argument("--num_proc", type=int, default=os.cpu_count(), help="tokenizer processes")
    p.add_argument(
        "--out_dir",
        default=None,
        help="default: data/fineweb_<tokenizer> for FineWeb, else data/<prefix>",
    )
    p.add_argument(
        "--prefix",
        default=None,
        help="shard name prefix; default: derived from the dataset or first file",
    )
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for k, least in (
        ("shard_size", 1),
        ("val_tokens", 1),
        ("max_tokens", 1),
        ("num_proc", 1),
        ("gap_tokens", 0),
    ):
        if getattr(args, k) is not None and getattr(args, k) < least:
            p.error(f"--{k} must be at least {least}, got {getattr(args, k)}")

    if args.max_tokens is None and not args.local_files:
        args.max_tokens = FINEWEB_MAX_TOKENS
    if args.local_files:
        args.files = expand_files(args.local_files)

    if args.prefix is None:
        stem = (
            os.path.basename(args.files[0]).split(".")[0]
            if args.local_files
            else args.dataset.split("/")[-1]
        )
        args.prefix = re.sub(r"[^a-z0-9]+", "", stem.lower()) or "data"

    if args.out_dir is None:
        fineweb = not args.local_files and args.dataset == "HuggingFaceFW/fineweb"
        args.out_dir = (
            f"data/fineweb_{args.tokenizer}" if fineweb else os.path.join("data", args.prefix)
        )
    return args


def expand_files(patterns):
    files = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        if not hits or not all(os.path.isfile(f) for f in hits):
            raise FileNotFoundError(f"--local_files: no file matches {pat!r}")
        for f in hits:
            if file_format(f) is None:
                raise DataError(
                    f"--local_files: {f} is not one of {sorted(LOCAL_FORMATS)} "
                    "(optionally .gz/.zst/.bz2/.xz)"
                )
            # caught here: datasets' json builder fails on it with a bare StopIteration
            if os.path.getsize(f) == 0:
                raise DataError(f"--local_files: {f} is empty")
        files += hits
    return files


def file_format(path):
    """The datasets builder for a local file, looking past a compression suffix."""
    name = re.sub(r"\.(gz|zst|bz2|xz)$", "", path.lower())
    return LOCAL_FORMATS.get(os.path.splitext(name)[1])


def source_rows(args):
    """The documents' texts (None for a row without text), in a deterministic order."""
    from datasets import load_dataset

    streams = []  # (dataset, its text column)
    if args.local_files:
        # consecutive files of one format go through one builder, so many small files stay cheap
        for fmt, files in itertools.groupby(args.files, key=file_format):
            # a .txt file is one document, not one per line
            options = {"sample_by": "document"} if fmt == "text" else {}
            dataset = load_dataset(
                fmt, data_files=list(files), split="train", streaming=True, **options
            )
            streams.append((dataset, "text" if fmt == "text" else args.text_column))
    else:
        dataset = load_dataset(args.dataset, name=args.name, split=args.split, streaming=True)
        streams.append((dataset, args.text_column))

    for dataset, column in streams:
        for row in dataset:
            if column not in row:
                raise DataError(
                    f"no column {column!r} in the data (columns: {sorted(row)}); use --text_column"
                )
            yield row[column]


def tokenize(tokenizer_name, text):
    """The tokens of one document (Tokenizer.document) as uint16 (every vocabulary in
    data.VOCAB_SIZE fits)."""
    return np.array(get_tokenizer(tokenizer_name).document(text) if text else [], dtype=np.uint16)


def planned_size(args, index):
    return args.val_tokens if index == 0 else args.shard_size


def write_json(path, obj):
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=1)


def reusable_shards(args, settings, meta_path):
    """The ledger meta.json's shards that a rerun keeps: a prefix of full, valid shards ending by
    --max_tokens (a finished run's shorter last shard only with the same --max_tokens). The rerun
    skips the source rows they cover, byte-identical to an uninterrupted run; a larger --max_tokens
    extends a finished preparation."""
    if not os.path.exists(meta_path):
        stray = [f for f in os.listdir(args.out_dir) if SHARD_RE.match(f)]
        if stray:
            raise FileExistsError(
                f"{args.out_dir} holds shards ({stray[0]}, ...) but no meta.json, so they are not "
                "this script's to resume; delete them or choose another --out_dir"
            )
        return [], None

    with open(meta_path) as f:
        meta = json.load(f)
    old = meta["settings"]

    differ = {}  # setting -> (there, now)
    for name, value in settings.items():
        if name != "max_tokens" and old.get(name) != value:
            differ[name] = (old.get(name), value)

    if differ:
        listed = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
        raise DataError(
            f"{args.out_dir} holds a preparation with other settings ({listed}); choose another "
            "--out_dir, or delete its shards and meta.json to start over"
        )

    keep = []
    end = 0  # tokens in the kept shards
    same_end = meta["complete"] and old.get("max_tokens") == args.max_tokens
    for i, entry in enumerate(meta["shards"]):
        path = os.path.join(args.out_dir, entry["file"])
        try:
            valid = len(open_shard(path, args.tokenizer)) == entry["tokens"]
        except (OSError, ValueError):
            valid = False
        full = entry["tokens"] == planned_size(args, i)
        last = i == len(meta["shards"]) - 1
        too_long = args.max_tokens and end + entry["tokens"] > args.max_tokens
        if not valid or not (full or (same_end and last)) or too_long:
            break
        keep.append(entry)
        end += entry["tokens"]
    return keep, meta


class ShardWriter:
    """Fills the shards in order, recording each in the ledger with where in the source the next one
    starts."""

    def __init__(self, args, meta, meta_path):
        self.args = args
        self.meta = meta
        self.meta_path = meta_path
        self.index = len(meta["shards"])
        self._new_shard()

    def _new_shard(self):
        self.buf = np.empty(planned_size(self.args, self.index), dtype=np.uint16)
        self.fill = 0  # tokens in buf
        # the gap follows the validation shard
        self.skip = self.args.gap_tokens if self.index == 1 else 0

    def add(self, tokens, limit):
        """Copy as much of tokens as fits the current shard and `limit` more tokens. Returns the
        count copied."""
        take = min(len(tokens), len(self.buf) - self.fill, limit)
        self.buf[self.fill : self.fill + take] = tokens[:take]
        self.fill += take
        return take

    def flush(self, next_doc, next_offset):
        args = self.args
        name = shard_name(args.prefix, "val" if self.index == 0 else "train", self.index)
        tokens = self.buf[: self.fill]
        write_shard(os.path.join(args.out_dir, name), tokens, args.tokenizer)

        self.meta["shards"].append(
            dict(
                file=name,
                tokens=self.fill,
                documents=int(np.count_nonzero(tokens == DOC_START[args.tokenizer])),
                next_doc=next_doc,
                next_offset=next_offset,
            )
        )

        write_json(self.meta_path, self.meta)
        self.index += 1
        self._new_shard()


def tokenized_documents(args, start_doc):
    """(the tokens of each source row from start_doc on, the worker pool or None). The source is
    opened here, so that a missing column fails before the progress bar."""
    rows = itertools.islice(source_rows(args), start_doc, None)
    first = next(rows, StopIteration)
    rows = iter(()) if first is StopIteration else itertools.chain([first], rows)

    work = functools.partial(tokenize, args.tokenizer)
    pool = mp.Pool(args.num_proc) if args.num_proc > 1 else None
    documents = pool.imap(work, rows, chunksize=16) if pool else map(work, rows)
    return documents, pool


def tokenize_into(args, writer, start_doc, start_offset, done):
    """Tokenize the source from row start_doc (less the first start_offset tokens of that row,
    which the kept shards hold) into the writer, up to --max_tokens. Returns (tokens in total,
    documents read)."""
    total = done
    docs = 0
    # where the stream continues after the last shard
    resume_at = (start_doc, start_offset)
    documents, pool = tokenized_documents(args, start_doc)
    bar = tqdm(
        total=args.max_tokens,
        initial=done,
        unit="tok",
        unit_scale=True,
        desc=f"tokenizing -> {args.out_dir}",
    )

    try:
        for row, tokens in enumerate(documents, start=start_doc):
            if total == args.max_tokens:
                break

            # the part of the first document that the kept shards do not hold
            if row == start_doc:
                tokens = tokens[start_offset:]
            if len(tokens) == 0:
                continue

            docs += 1
            pos = 0
            while pos < len(tokens) and total != args.max_tokens:
                # the gap between validation and training, in no split
                if writer.skip:
                    skipped = min(len(tokens) - pos, writer.skip)
                    pos += skipped
                    writer.skip -= skipped
                    continue

                taken = writer.add(tokens[pos:], (args.max_tokens or np.inf) - total)
                pos += taken
                total += taken
                bar.update(taken)

                resume_at = (row, pos) if pos < len(tokens) else (row + 1, 0)
                if writer.fill == len(writer.buf):
                    writer.flush(*resume_at)

            if docs % 1000 == 0:
                bar.set_postfix(docs=f"{docs:,}", refresh=False)
    finally:
        bar.close()
        if pool:
            pool.terminate()

    # the source ended (or --max_tokens was reached) inside this shard
    if writer.fill:
        writer.flush(*resume_at)
    return total, docs


def settings_of(args):
    """What a preparation is a function of (a rerun with other settings is refused)."""
    if args.local_files:
        source = {"local_files": [os.path.abspath(f) for f in args.files]}
    else:
        source = {"dataset": args.dataset, "name": args.name, "split": args.split}

    return dict(
        source=source,
        text_column=args.text_column,
        tokenizer=args.tokenizer,
        prefix=args.prefix,
        shard_size=args.shard_size,
        val_tokens=args.val_tokens,
        gap_tokens=args.gap_tokens,
        max_tokens=args.max_tokens,
    )


def remove_leftovers(args, shards):
    """Shards of a longer earlier preparation (main removes dead writers' temporary files first)."""
    ours = {s["file"] for s in shards}

    for name in os.listdir(args.out_dir):
        if name.startswith(args.prefix + "_") and SHARD_RE.match(name) and name not in ours:
            os.remove(os.path.join(args.out_dir, name))


def report(args, meta, new, docs, seconds):
    """What this call wrote, and what the directory now holds."""
    shards = meta["shards"]
    rate = new / max(seconds, 1e-9)
    print(
        f"wrote {new:,} tokens from {docs:,} documents in {seconds:.1f} s ({rate:,.0f} tokens/s); "
        f"{args.out_dir} now holds {len(shards)} shards, {meta['tokens']:,} tokens "
        f"({meta['val_tokens']:,} val)"
    )

    if len(shards) == 1:
        print(
            "note: the data ended inside the validation split, so there are no training shards; "
            "lower --val_tokens or add data"
        )


def start_ledger(args, settings, shards, meta_path):
    """Write meta.json, incomplete, before any shard: shards never exist without the ledger that
    vouches for them. Its "shards" is the list `shards`, to which the writer appends."""
    meta = dict(
        settings=settings,
        tokenizer=args.tokenizer,
        vocab_size=VOCAB_SIZE[args.tokenizer],
        eot=EOT[args.tokenizer],
        doc_start=DOC_START[args.tokenizer],
        complete=False,
        shards=shards,
    )
    write_json(meta_path, meta)
    return meta


def finish(meta_path, meta, total):
    """Mark the ledger complete, with the totals of its shards."""
    shards = meta["shards"]
    meta.update(
        complete=True,
        tokens=total,
        val_tokens=shards[0]["tokens"],
        train_tokens=total - shards[0]["tokens"],
        documents=sum(e["documents"] for e in shards),
        source_rows=shards[-1]["next_doc"],
    )
    write_json(meta_path, meta)


def main(argv=None):
    args = parse_args(argv)
    # fail now, not in a worker after the download started
    get_tokenizer(args.tokenizer)

    os.makedirs(args.out_dir, exist_ok=True)
    for name in remove_stale_temporaries(args.out_dir):
        print(f"removed {name}, left in {args.out_dir} by a writer that has ended")

    settings = settings_of(args)
    meta_path = os.path.join(args.out_dir, "meta.json")

    shards, old_meta = reusable_shards(args, settings, meta_path)
    finished = old_meta and old_meta["complete"] and len(shards) == len(old_meta["shards"])
    if finished and old_meta["settings"]["max_tokens"] == args.max_tokens:
        print(
            f"{args.out_dir}: all {len(shards)} shards are already complete and valid; "
            "nothing to do"
        )
        return old_meta

    meta = start_ledger(args, settings, shards, meta_path)

    done = sum(e["tokens"] for e in shards)
    start_doc = shards[-1]["next_doc"] if shards else 0
    start_offset = shards[-1]["next_offset"] if shards else 0
    if shards:
        print(
            f"resuming after {len(shards)} complete shards ({done:,} tokens): "
            f"skipping {start_doc:,} source rows"
        )

    t0 = time.time()
    writer = ShardWriter(args, meta, meta_path)

    total, docs = tokenize_into(args, writer, start_doc, start_offset, done)

    if not shards:
        raise DataError(
            f"the source has no text: no tokens were written ({settings['source']}); check the "
            "input and --text_column"
        )

    remove_leftovers(args, shards)
    seconds = time.time() - t0
    new = total - done
    finish(meta_path, meta, total)

    report(args, meta, new, docs, seconds)
    return meta


def error_line(error):
    """An expected failure in one line; None for a bug (its traceback is shown)."""
    if disk_full(error):
        return (
            f"{no_space_left(error.filename)}; free some and run it again: it resumes after the "
            "last complete shard"
        )
    if isinstance(error, (DataError, FileNotFoundError, FileExistsError)):
        return str(error)
    return None


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        line = error_line(e)
        if line is None:
            raise
        sys.exit(f"prepare_fineweb.py: error: {line}")

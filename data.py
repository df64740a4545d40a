"""
Tokenizers, the token shard format and the batch loader.

Tokenizers: "mistral" (the authors' Mistral v3 SentencePiece model, offline from mistral-common),
tiktoken "gpt2", "byte" (256 byte values + <|endoftext|> = 256, offline). A document is BOS ... EOS
with mistral (as the authors store it), else end-of-text + text. A shard is a 256-byte header then
uint16 tokens, named {prefix}_{split}_{i:06d}.bin. Batches are a pure function of (step,
micro_step, rank): a resumed run sees the batches an uninterrupted one would.
"""

import functools
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np
import torch

TOKENIZERS = ("gpt2", "byte", "mistral")
# known without a tokenizer: offline, the model is sized from a shard
VOCAB_SIZE = {"gpt2": 50257, "byte": 257, "mistral": 32768}
# ends a text: end-of-text or SentencePiece's EOS
EOT = {"gpt2": 50256, "byte": 256, "mistral": 2}
# opens each document; drives the document mask
DOC_START = {"gpt2": 50256, "byte": 256, "mistral": 1}
# closes each document (the authors' BOS ... EOS)
DOC_END = {"gpt2": None, "byte": None, "mistral": 2}
# validation: the stream's first tokens (the authors' split)
VAL_TOKENS = 3_932_160
MISTRAL_MODEL = ("mistral_common", "data/mistral_instruct_tokenizer_240323.model.v3")

MAGIC = 0x42414D31  # "BAM1"
VERSION = 1
HEADER_BYTES = 256
# magic, version, token count, tokenizer name (null-padded ASCII)
_HEADER = struct.Struct("<IIq32s")
SHARD_RE = re.compile(r"^(.+)_(train|val)_(\d{6})\.bin$")  # prefix, split, index
RERUN = "rerun the preparation script that wrote it"


class DataError(ValueError):
    """An unusable data directory or shard; the message says what to do."""


def shard_name(prefix, split, index):  # SHARD_RE parses it back
    return f"{prefix}_{split}_{index:06d}.bin"


# ---- Tokenizers
@dataclass(frozen=True)
class Tokenizer:
    """What callers need of a tokenizer, tiktoken or SentencePiece."""

    name: str
    n_vocab: int
    eot_token: int  # ends a text: generation stops at it
    doc_start: int  # first token of each document
    doc_end: Optional[int]  # last token of each document (None: not closed)
    # each separately encoded text starts a word (SentencePiece's dummy prefix)
    word_boundary: bool
    encode_ordinary: Callable[[str], List[int]]  # text -> ids; special-token strings are plain text
    decode: Callable[[List[int]], str]  # ids -> text; a cut multi-byte character becomes U+FFFD
    token_bytes: Callable[[int], bytes]  # a token's bytes (b"" for a control token)

    def document(self, text):
        """One document as the shards hold it: doc_start + tokens (+ doc_end)."""
        end = [] if self.doc_end is None else [self.doc_end]
        return [self.doc_start] + self.encode_ordinary(text) + end


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str) -> Tokenizer:
    """gpt2 (needs the network once), byte or mistral. Decode with tok.decode(tokens), not
    bytes.decode(): a byte-level window can cut a character."""
    if name == "mistral":
        return _sentencepiece(name)

    import tiktoken

    if name == "gpt2":
        try:
            enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # tiktoken downloads the gpt2 ranks on first use
            raise RuntimeError(
                f"could not load the tiktoken 'gpt2' encoding ({type(e).__name__}: {e}). It is "
                "downloaded on first use, so this needs network access once; offline, use "
                "--tokenizer mistral (the authors') or --tokenizer byte"
            ) from e
    elif name == "byte":
        # no merges: the split pattern cannot change the result; short chunks are fastest
        enc = tiktoken.Encoding(
            "byte",
            pat_str=r"[\s\S]{1,64}",
            mergeable_ranks={bytes([i]): i for i in range(256)},
            special_tokens={"<|endoftext|>": EOT["byte"]},
        )
    else:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {TOKENIZERS}")
    return tiktoken_tokenizer(enc, EOT[name])


def tiktoken_tokenizer(enc, eot):
    """A tiktoken Encoding as a Tokenizer with eot + text documents."""
    return Tokenizer(
        name=enc.name,
        n_vocab=enc.n_vocab,
        eot_token=eot,
        doc_start=eot,
        doc_end=None,
        word_boundary=False,
        encode_ordinary=enc.encode_ordinary,
        decode=enc.decode,
        token_bytes=enc.decode_single_token_bytes,
    )


def _sentencepiece(name):
    """The model file ships in the mistral-common wheel: nothing is downloaded."""
    import importlib.resources

    package, path = MISTRAL_MODEL
    try:
        import sentencepiece

        proto = importlib.resources.files(package).joinpath(path).read_bytes()
    except (ImportError, OSError) as e:
        raise RuntimeError(
            f"the {name} tokenizer needs the sentencepiece and mistral-common packages "
            f"({type(e).__name__}: {e}); pip install -r requirements.txt"
        ) from e

    sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
    expected = (VOCAB_SIZE[name], EOT[name], DOC_START[name])
    found = (sp.get_piece_size(), sp.eos_id(), sp.bos_id())
    if found != expected:
        raise RuntimeError(
            f"{package}/{path} has vocab, EOS, BOS = {found}, expected {expected}: another "
            "mistral-common release?"
        )

    def token_bytes(t):
        if sp.is_byte(t):  # byte fallback pieces "<0x0A>"
            return bytes([int(sp.id_to_piece(t)[3:5], 16)])
        if sp.is_control(t) or sp.is_unknown(t):
            return b""
        return sp.id_to_piece(t).replace("\u2581", " ").encode("utf-8")

    return Tokenizer(
        name=name,
        n_vocab=sp.get_piece_size(),
        eot_token=EOT[name],
        doc_start=DOC_START[name],
        doc_end=DOC_END[name],
        word_boundary=True,
        encode_ordinary=lambda text: sp.encode(text),
        decode=lambda ids: sp.decode([int(t) for t in ids]),
        token_bytes=token_bytes,
    )


# ---- Shards
def write_shard(f, tokens, tokenizer_name):
    """Write tokens (any integer array) as a shard to the binary file f; the prepare scripts pass
    an infra.runtime.atomic_file, so that a shard is never partial."""
    tokens = np.asarray(tokens)
    if tokens.size == 0:
        raise ValueError(f"refusing to write an empty shard: {f.name}")

    if tokens.min() < 0 or tokens.max() >= 65536:
        raise ValueError(
            f"token ids must lie in [0, 65536) to be stored as uint16; got min {tokens.min()}, "
            f"max {tokens.max()} for {f.name}"
        )

    header = _HEADER.pack(MAGIC, VERSION, tokens.size, tokenizer_name.encode("ascii"))
    f.write(header.ljust(HEADER_BYTES, b"\0"))
    f.write(tokens.astype("<u2", copy=False).tobytes())


def _read_header(path):
    """(token count, tokenizer name), magic, version and file size checked."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)

    if len(raw) < HEADER_BYTES:
        raise DataError(
            f"{path}: file is shorter than the {HEADER_BYTES}-byte shard header; {RERUN}"
        )

    magic, version, count, name = _HEADER.unpack_from(raw)
    if (magic, version) != (MAGIC, VERSION):
        raise DataError(
            f"{path}: not a bam-gpt token shard of version {VERSION} (magic {magic:#x}, version "
            f"{version}); {RERUN}"
        )

    size = os.path.getsize(path)
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        raise DataError(
            f"{path}: truncated or corrupt shard ({size} bytes, the header promises {count} "
            f"tokens = {expected} bytes); {RERUN}"
        )
    return count, name.rstrip(b"\0").decode("ascii")


def _check_tokenizer(what, name, tokenizer):
    """A DataError if the asked-for tokenizer (None: any) is not name, the one `what` used."""
    if tokenizer is not None and tokenizer != name:
        raise DataError(
            f"{what} made with the {name!r} tokenizer, not {tokenizer!r}; use --tokenizer {name} "
            f"or prepare the data again with --tokenizer {tokenizer}"
        )


def open_shard(path, tokenizer=None):
    """The shard's tokens as a read-only uint16 memmap; header (and tokenizer) checked."""
    count, name = _read_header(path)
    _check_tokenizer(f"{path} was", name, tokenizer)

    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))


def shard_tokenizer(path):
    return _read_header(path)[1]


def shard_paths(data_dir, split):
    """Sorted shard paths of a split; if none, an error saying how to make them."""
    how = (
        "create them with `python prepare_fineweb.py` (FineWeb, mistral tokens, writes "
        "data/fineweb_mistral), `python prepare_demo.py` (the CPU demo data), or "
        "`python prepare_fineweb.py --local_files FILE.jsonl "
        f"--tokenizer byte --out_dir {data_dir}` for your own text"
    )
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data directory {data_dir} does not exist; {how}")

    matches = [SHARD_RE.match(name) for name in sorted(os.listdir(data_dir))]
    found = [m for m in matches if m and m.group(2) == split]
    if not found:
        raise FileNotFoundError(f"no {split} shards (*_{split}_NNNNNN.bin) in {data_dir}; {how}")

    prefixes = sorted({m.group(1) for m in found})
    if len(prefixes) > 1:  # else two datasets would be silently mixed
        raise DataError(
            f"{data_dir} holds {split} shards of several datasets (prefixes {prefixes}); "
            "keep one dataset per directory"
        )
    return [os.path.join(data_dir, m.group(0)) for m in found]


def _split_extents(data_dir, split, tokenizer=None):
    """[(path, tokens used)] of a split, and its shards' tokenizer. val is capped at VAL_TOKENS:
    every consumer measures the same tokens, whatever --val_tokens wrote."""
    extents = []
    names = {}  # tokenizer -> first shard made with it
    budget = VAL_TOKENS if split == "val" else math.inf
    for path in shard_paths(data_dir, split):
        count, name = _read_header(path)
        names.setdefault(name, path)
        count = min(count, budget - sum(n for _, n in extents))
        if count > 0:
            extents.append((path, count))

    if len(names) > 1:
        raise DataError(
            f"the shards in {data_dir} were made with different tokenizers: "
            + ", ".join(f"{n!r} ({os.path.basename(p)})" for n, p in names.items())
            + "; keep one dataset per directory"
        )

    name = next(iter(names))
    _check_tokenizer(f"the shards in {data_dir} were", name, tokenizer)
    return extents, name


def read_tokens(data_dir, split, n_tokens):
    """The first n_tokens of a split's stream, as int64."""
    extents, _ = _split_extents(data_dir, split)
    total = sum(n for _, n in extents)
    if not 0 <= n_tokens <= total:
        raise ValueError(
            f"asked for {n_tokens} tokens of the {split} split in {data_dir}, which has {total}"
        )

    out = []
    left = n_tokens
    for path, n in extents:
        out.append(np.asarray(open_shard(path)[: min(n, left)], dtype=np.int64))
        left -= len(out[-1])
    return np.concatenate(out)


# ---- Batches
def doc_starts(x, start_token):
    """Per position t, the last s <= t with x[s] == start_token (the tokenizer's DOC_START),
    else 0. Query i sees key j iff doc_start[i] <= j <= i."""
    pos = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x == start_token, pos, torch.zeros_like(pos)).cummax(dim=-1).values


class TokenLoader:
    """Windows of block_size + 1 tokens at stride block_size (y is x shifted by one), in stream
    order as the authors read it, wrapping at the end; none straddles two shards."""

    def __init__(
        self, data_dir, split, block_size, batch_size, rank=0, world_size=1, tokenizer=None
    ):
        self.block_size = block_size
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.data_dir = data_dir
        self.extents, self.tokenizer = _split_extents(data_dir, split, tokenizer)
        self.doc_start = DOC_START[self.tokenizer]
        self.vocab_size = VOCAB_SIZE[self.tokenizer]

        windows = np.array([(n - 1) // block_size for _, n in self.extents], dtype=np.int64)
        self.num_windows = int(windows.sum())
        if self.num_windows == 0:
            longest = max(n for _, n in self.extents)
            if split == "val":
                raise DataError(
                    f"block_size {block_size} is longer than the validation split "
                    f"({longest} tokens)"
                )
            raise DataError(
                f"block_size {block_size} is longer than every train shard in {data_dir} "
                f"(the longest has {longest} tokens); prepare more data (prepare_fineweb.py "
                "--max_tokens) or use a smaller block_size"
            )

        self.cum_windows = np.cumsum(windows)  # shard s holds windows [cum[s-1], cum[s])

    def __len__(self):
        return self.num_windows

    def check_enough(self, steps, tokens_per_step):
        """A DataError if `steps` steps would wrap around this split, reading data twice."""
        needed = steps * tokens_per_step
        have = self.num_windows * self.block_size
        if needed <= have:
            return

        # for prepare_fineweb.py: + validation, + what shard ends lose
        total = math.ceil((VAL_TOKENS + 1.001 * needed) / 1e8) * 1e8
        raise DataError(
            f"the run reads {needed:,} training tokens ({steps} steps x {tokens_per_step:,}) but "
            f"{self.data_dir} holds {have:,} in whole {self.block_size}-token windows: "
            f"{needed - have:,} missing, so data would repeat. Get them with `python "
            f"prepare_fineweb.py --name sample-100BT --tokenizer {self.tokenizer} --max_tokens "
            f"{int(total)} --out_dir {self.data_dir}` (resumes and extends), lower max_iters, or "
            "pass --allow_data_repeat=True"
        )

    def window_indices(self, step, micro_step=0, grad_accum=1):
        """The windows of one batch (a micro step of a rank)."""
        first = ((step * grad_accum + micro_step) * self.world_size + self.rank) * self.batch_size
        return (first + np.arange(self.batch_size, dtype=np.int64)) % self.num_windows

    def get_batch(self, step, micro_step=0, grad_accum=1):
        """(x, y, doc_start), each an int64 CPU tensor (batch_size, block_size)."""
        windows = self.window_indices(step, micro_step, grad_accum)

        shard_of = np.searchsorted(self.cum_windows, windows, side="right")
        first_window = np.concatenate([[0], self.cum_windows[:-1]])[shard_of]

        T = self.block_size
        buf = torch.empty(self.batch_size, T + 1, dtype=torch.int64)
        for shard in np.unique(shard_of):
            # a fresh memmap per batch (as nanoGPT): a long-lived one keeps all pages resident
            path, n = self.extents[shard]
            tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))
            for row in np.flatnonzero(shard_of == shard):
                start = (windows[row] - first_window[row]) * T
                buf[row] = torch.from_numpy(tokens[start : start + T + 1].astype(np.int64))

        x = buf[:, :-1].contiguous()
        y = buf[:, 1:].contiguous()
        return x, y, doc_starts(x, self.doc_start)

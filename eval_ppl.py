"""
Perplexity along the position axis (the paper's protocol): where a model stops extrapolating.

    python eval_ppl.py --ckpt out/run1 --ckpt out/run2 --seq_len 32768 [--window 1024]
        [--data val | hf:wikimedia/wikipedia:20231101.en] [--num_seqs 64]

Every target of a sequence is scored by one forward over the whole sequence; the curve pools each
--window positions over all sequences. Writes ppl_samples.jsonl (a rerun resumes it), ppl_summary
(.json/.csv) and ppl_vs_position.png to --out; with seeded run names also ppl_table.
"""

import argparse
import hashlib
import math
import os
import time

import numpy as np
import torch
from tqdm import tqdm

from data import DOC_END, DOC_START, VAL_TOKENS, get_tokenizer, open_shard, read_tokens, shard_paths
from eval_common import (
    EvalError,
    ResultLog,
    add_common_args,
    checkpoint_fields,
    claim_out,
    load_runs,
    markdown_table,
    memory_shortfall,
    model_device,
    peak_memory_bytes,
    pick_device,
    plot_curves,
    reset_peak_memory,
    resolve_dtype,
    run_script,
    seed_table,
    training_data_dir,
    write_table,
)
from runtime import autocast

HF_DEFAULT_SEQS = 128  # the authors' public CLI
KEY_FIELDS = ("ckpt", "ckpt_sha256", "data", "seq_len", "window", "dtype", "seq")


# ---- Scoring: per-target cross-entropy of one sequence -------------------------------------------
@torch.no_grad()
def full_token_losses(model, seq):
    """The CE of each target of seq (seq_len + 1 tokens) from ONE forward over seq[:-1], (seq_len,)
    fp32."""
    seq = torch.as_tensor(seq, dtype=torch.long, device=model_device(model))

    _, losses = model(seq[None, :-1], seq[None, 1:], reduction="none")
    return losses[0].float().cpu()


def window_sums(losses, window):
    """(window_ends, loss_sums in float64, counts) of the losses in windows of `window`
    positions."""
    chunks = torch.as_tensor(losses).double().split(window)
    counts = [c.numel() for c in chunks]
    return np.cumsum(counts).tolist(), [float(c.sum()) for c in chunks], counts


# ---- Data ----------------------------------------------------------------------------------------
def val_sequences(data_dir, tokenizer_name, seq_len):
    """(rows (N, seq_len + 1), description) from the validation split's first VAL_TOKENS tokens,
    document tokens removed so that documents run together with no document mask, as the authors did
    on FineWeb."""
    available = sum(len(open_shard(p, tokenizer_name)) for p in shard_paths(data_dir, "val"))
    if available < VAL_TOKENS:
        print(
            f"note: the validation split in {data_dir} holds {available} tokens, fewer than the "
            f"{VAL_TOKENS} of the protocol; using all of them"
        )

    tokens = read_tokens(data_dir, "val", min(VAL_TOKENS, available))
    document_tokens = [DOC_START[tokenizer_name], DOC_END[tokenizer_name]]
    tokens = tokens[~np.isin(tokens, [t for t in document_tokens if t])]

    rows = len(tokens) // (seq_len + 1)
    if rows == 0:
        raise EvalError(
            f"{len(tokens)} validation tokens in {data_dir} do not make one sequence of "
            f"seq_len + 1 = {seq_len + 1} tokens; use a smaller --seq_len or more validation data"
        )

    sequences = tokens[: rows * (seq_len + 1)].reshape(rows, seq_len + 1)
    return sequences, f"val:{os.path.abspath(data_dir)}:no_eot"


def parse_hf(spec):
    """'hf:NAME[:CONFIG]' -> (NAME, CONFIG or None)."""
    parts = spec[len("hf:") :].split(":")
    if not spec.startswith("hf:") or not parts[0] or len(parts) > 2:
        raise EvalError(
            f"--data {spec!r}: expected val, hf:NAME or hf:NAME:CONFIG (e.g. "
            "hf:wikimedia/wikipedia:20231101.en)"
        )
    return parts[0], (parts[1] if len(parts) == 2 and parts[1] else None)


def hf_texts(name, config):
    """The "text" column of a streamed Hugging Face dataset's train split, in dataset order."""
    try:
        from datasets import load_dataset

        stream = iter(load_dataset(name, config, split="train", streaming=True))
        first = next(stream, None)
    except Exception as e:
        raise EvalError(
            f"could not stream the Hugging Face dataset {name!r} (config {config!r}): "
            f"{type(e).__name__}: {e}; this needs network access to huggingface.co; offline, use "
            "--data val (the prepared validation split)"
        ) from e
    if first is None:
        return

    if "text" not in first:
        raise EvalError(f"{name!r} has no column 'text' (columns: {sorted(first)})")
    yield first["text"]
    yield from (row["text"] for row in stream)


def hf_sequences(texts, tokenizer, seq_len, num_seqs):
    """(rows, texts read): the first num_seqs texts with >= seq_len + 1 tokens ([doc_start] + text),
    truncated."""
    rows = []
    read = 0
    for text in texts:
        read += 1
        tokens = [tokenizer.doc_start] + tokenizer.encode_ordinary(text) if text else []
        if len(tokens) >= seq_len + 1:
            rows.append(np.asarray(tokens[: seq_len + 1], dtype=np.int64))
            if len(rows) == num_seqs:
                break

    if not rows:
        raise EvalError(
            f"none of the {read} texts has seq_len + 1 = {seq_len + 1} tokens; "
            "use a smaller --seq_len"
        )
    return np.stack(rows), read


def load_sequences(args, runs):
    """(rows (N, seq_len + 1), data description) for --data, at most --num_seqs rows."""
    tokenizer_name = runs[0]["tokenizer"]
    if args.data == "val":
        data_dir = training_data_dir(runs, args.data_dir)
        rows, desc = val_sequences(data_dir, tokenizer_name, args.seq_len)
        wanted = args.num_seqs
    else:
        name, config = parse_hf(args.data)
        wanted = args.num_seqs or HF_DEFAULT_SEQS
        tokenizer = get_tokenizer(tokenizer_name)
        rows, _ = hf_sequences(hf_texts(name, config), tokenizer, args.seq_len, wanted)
        desc = f"hf:{name}:{config}"

    if wanted is not None and len(rows) < wanted:
        print(
            f"note: asked for {wanted} sequences of {args.seq_len + 1} tokens, "
            f"the data holds {len(rows)}: using all {len(rows)}"
        )
    return rows[:wanted], desc


# ---- Evaluation ----------------------------------------------------------------------------------
def memory_needed(args, run, device):
    """Why one forward over --seq_len tokens does not fit, or None."""
    # the loss head on top of the forward: fp32 logits, log-softmax, autocast copy over <= 8192
    # positions
    head_bytes = 3 * 4 * min(args.seq_len, 8192) * run["model"].config.padded_vocab_size
    return memory_shortfall(run["model"], args.seq_len, device, extra_bytes=head_bytes)


def evaluate(args, run, seqs, data_desc, dtype, device, log):
    """Score every sequence with one checkpoint (resuming from `log`). Returns its summary rows."""
    name = run["label"]
    base = dict(
        label=name,
        **checkpoint_fields(run),
        window=args.window,
        data=data_desc,
        seq_len=args.seq_len,
        n_seqs=len(seqs),
        dtype=dtype,
        train_length=run["block_size"],
    )

    why = memory_needed(args, run, device)
    if why:
        message = f"skipped: a forward over {args.seq_len} tokens {why}"
        print(f"{name}: {message}")
        return [dict(base, scope="skipped", note=message)]

    key = dict(
        checkpoint_fields(run),
        data=data_desc,
        seq_len=args.seq_len,
        window=args.window,
        dtype=dtype,
    )

    t0 = time.time()
    reset_peak_memory(device)
    records, resumed = score_all(args, run, seqs, key, device, dtype, log)
    if resumed:
        print(f"{name}: {resumed} of {len(seqs)} sequences resumed from {log.path}")

    out = summarize(records, base)

    # compute time summed over every sitting; peak memory of this sitting (CPU: the process's
    # peak RSS)
    out[-1].update(
        seconds=round(sum(r["seconds"] for r in records), 3),
        peak_mem_bytes=peak_memory_bytes(device) if resumed < len(seqs) else None,
    )

    overall = out[-1]
    print(
        f"{name}: overall ppl {overall['ppl']:.4f} over {overall['n_tokens']} tokens "
        f"({time.time() - t0:.1f}s)"
    )
    return out


def score_all(args, run, seqs, key, device, dtype, log):
    """(records, how many were resumed): every sequence's record, from `log` where it holds one for
    these tokens, else scored now and added to it."""
    by_key = {log.key(r): r for r in log.records}
    records = []
    resumed = 0
    for i in tqdm(range(len(seqs)), desc=run["label"], unit="seq"):
        tokens = np.ascontiguousarray(seqs[i], dtype="<i8").tobytes()
        digest = hashlib.sha1(tokens).hexdigest()[:16]

        rec = by_key.get(log.key(dict(key, seq=i)))
        if rec is None:
            rec = score_sequence(run["model"], seqs[i], args.window, device, dtype)
            rec = dict(key, seq=i, tokens_sha1=digest, **rec)
            log.add(rec)
        elif rec["tokens_sha1"] != digest:
            raise EvalError(
                f"{log.path} holds a result for sequence {i} computed on other tokens (the data "
                "changed since); use a fresh --out or delete that file"
            )
        else:
            resumed += 1
        records.append(rec)
    return records, resumed


def score_sequence(model, seq, window, device, dtype):
    """One sequence's window sums of the losses, as its record stores them."""
    t0 = time.time()
    with autocast(device, dtype):
        losses = full_token_losses(model, seq)

    ends, sums, counts = window_sums(losses, window)
    return dict(window_ends=ends, loss_sums=sums, counts=counts, seconds=round(time.time() - t0, 3))


def summarize(records, base):
    """Summary rows: per window, ppl = exp(mean CE over that window in every sequence), then
    'overall'."""
    ends = records[0]["window_ends"]
    sums = np.sum([r["loss_sums"] for r in records], axis=0)
    counts = np.sum([r["counts"] for r in records], axis=0)

    rows = [
        dict(
            base,
            scope="window",
            window_start=ends[k - 1] if k else 0,
            window_end=end,
            n_tokens=int(counts[k]),
            loss=float(sums[k] / counts[k]),
            ppl=math.exp(sums[k] / counts[k]),
        )
        for k, end in enumerate(ends)
    ]

    loss = float(sums.sum() / counts.sum())
    return rows + [
        dict(
            base,
            scope="overall",
            window_start=0,
            window_end=ends[-1],
            n_tokens=int(counts.sum()),
            loss=loss,
            ppl=math.exp(loss),
        )
    ]


def ppl_seed_table(rows, args, data_desc, n_seqs):
    """For runs named <variant>-s<seed>: the perplexity at 1, 2, 4, ... times the training length L
    per run, then the median and the worst seed per variant (eval_common.seed_table):
    <out>/ppl_table.{md,csv,json,png}. None without seeded names.

    The cell at k x L pools every window that ends in (k L / 2, k L] (in (0, L] for k = 1): an
    octave of positions, as wide as the step to the next column on the log axis, and long ranges get
    the many tokens that a small --num_seqs leaves each window."""
    # (label, k) -> [sum of losses, tokens]
    pooled = {}
    for r in rows:
        if r["scope"] != "window":
            continue

        k = 2 ** max(0, math.ceil(math.log2(r["window_end"] / r["train_length"])))
        # whole octaves only
        if k * r["train_length"] <= args.seq_len:
            cell = pooled.setdefault((r["label"], k), [0.0, 0])
            cell[0] += r["loss"] * r["n_tokens"]
            cell[1] += r["n_tokens"]

    cells = {}
    for (label, k), (loss_sum, n_tokens) in pooled.items():
        cells.setdefault(label, {})[k] = math.exp(loss_sum / n_tokens)

    lengths = ", ".join(str(t) for t in sorted({r["train_length"] for r in rows}))
    caption = (
        f"Perplexity at k times the training length ({lengths} tokens): every target at a position "
        f"in (k/2, k] times that length (in (0, 1] for k = 1); {n_seqs} sequences of "
        f"{args.seq_len} tokens ({data_desc.split(':')[0]})."
    )
    figure = dict(
        ylabel="perplexity (log scale)",
        title="Perplexity at each octave of positions: median seed, band from best to worst seed",
        logy=True,
    )
    path = os.path.join(args.out, "ppl_table")
    return seed_table(cells, path, caption, worst=("max", max), figure=figure)


# ---- Command line --------------------------------------------------------------------------------
def build_parser():
    p = argparse.ArgumentParser(description="Perplexity along the position axis.")
    add_common_args(p, default_out="results/ppl")
    p.add_argument(
        "--seq_len",
        type=int,
        default=32768,
        help="targets per sequence (a row has seq_len + 1 tokens)",
    )
    p.add_argument(
        "--num_seqs",
        type=int,
        help=f"sequences to score (default: all of val, {HF_DEFAULT_SEQS} for hf:)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=1024,
        help="averaging window along the position axis (the curve)",
    )
    p.add_argument(
        "--data",
        default="val",
        help="val (the prepared validation split, document tokens removed), or "
        "hf:NAME[:CONFIG] (streamed, the first texts with seq_len + 1 tokens; the paper's: "
        "hf:wikimedia/wikipedia:20231101.en)",
    )
    p.add_argument(
        "--data_dir", help="prepared shards for --data val; default: the checkpoint's training data"
    )
    return p


def report(args, runs, rows, data_desc, n_seqs):
    """Print the curves and the overall perplexity of every evaluated checkpoint, and draw them."""
    # label -> (window ends, ppl per window), and its overall ppl
    series = {}
    overall = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        if mine[-1]["scope"] != "overall":
            continue
        series[label] = ([r["window_end"] for r in mine[:-1]], [r["ppl"] for r in mine[:-1]])
        overall[label] = mine[-1]["ppl"]
    if not series:
        return None

    # the same windows for every checkpoint
    ends = next(iter(series.values()))[0]
    table = [[end, *(f"{ppl[k]:.4f}" for _, ppl in series.values())] for k, end in enumerate(ends)]
    table.append(["overall", *(f"{ppl:.4f}" for ppl in overall.values())])
    print(markdown_table(["window end", *series], table))

    figure = os.path.join(args.out, "ppl_vs_position.png")
    data_name = data_desc.split(":")[0]
    plot_curves(
        series,
        [r["block_size"] for r in runs],
        figure,
        ylabel="perplexity",
        logy=True,
        xlabel=f"position (end of {args.window}-token window)",
        title=f"Perplexity vs position: {data_name}, {n_seqs} x {args.seq_len} tokens",
    )
    return figure


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("seq_len", "window", "num_seqs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, got {value}")

    device = pick_device(args.device)
    dtype = resolve_dtype(device)
    runs, _ = load_runs(args.ckpt, device, args.attn_impl, dtype)
    seqs, data_desc = load_sequences(args, runs)
    print(
        f"data: {data_desc}: {len(seqs)} sequences of {args.seq_len} targets; curve windows of "
        f"{args.window} tokens; device {device}, {dtype}"
    )

    with claim_out(args.out):
        log = ResultLog(os.path.join(args.out, "ppl_samples.jsonl"), KEY_FIELDS, runs)
        rows = []
        for run in runs:
            rows += evaluate(args, run, seqs, data_desc, dtype, device, log)

        prefix = os.path.join(args.out, "ppl_summary")
        write_table(rows, prefix)
        table = ppl_seed_table(rows, args, data_desc, len(seqs))
        if table:
            print(table)

        figure = report(args, runs, rows, data_desc, len(seqs))
        if figure:
            print(f"wrote {prefix}.json, {prefix}.csv, {figure}")
        else:
            print(f"wrote {prefix}.json, {prefix}.csv (no figure: nothing was evaluated)")
        return rows


if __name__ == "__main__":
    run_script(main, "eval_ppl.py")

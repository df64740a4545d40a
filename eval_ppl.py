"""
Perplexity along the position axis (the paper's protocol): where a model stops extrapolating.

    python eval_ppl.py --ckpt out/run1 --ckpt out/run2 --seq_len 32768 [--window 1024]
        [--data val | hf:wikimedia/wikipedia:20231101.en] [--num_seqs 64]

One forward over a whole sequence scores all its targets; the curve pools each --window positions
over all sequences. Writes ppl_samples.jsonl (a rerun resumes it), ppl_summary (.json/.csv) and
ppl_vs_position.png to --out; with seeded run names also ppl_table.
"""

import argparse
import hashlib
import math
import os
import time

import numpy as np
import torch
from tqdm import tqdm

from data import DOC_END, DOC_START, VAL_TOKENS, open_shard, read_tokens, shard_paths
from eval_common import (
    EXPECTED_ERRORS,
    FULL_DISK_REMEDY,
    EvalError,
    Evaluation,
    add_common_args,
    checkpoint_fields,
    counting_work,
    curves,
    markdown_table,
    model_device,
    plot_curves,
    seed_table,
    start,
    training_data_dir,
    work_fraction,
    work_share,
    write_table,
)
from infra import runtime

HF_DEFAULT_SEQS = 128  # the authors' public CLI
KEY_FIELDS = ("ckpt", "ckpt_sha256", "data", "seq_len", "window", "dtype", "seq")


# ---- prompts: sequences of seq_len + 1 tokens
def val_sequences(data_dir, tokenizer_name, seq_len):
    """(rows (N, seq_len + 1), description) of the validation split's first VAL_TOKENS without
    document tokens: documents run together unmasked, as the authors did on FineWeb."""
    available = sum(len(open_shard(p, tokenizer_name)) for p in shard_paths(data_dir, "val"))
    if available < VAL_TOKENS:
        print(f"note: {data_dir}'s validation split holds {available} tokens, < {VAL_TOKENS}")

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


def hf_texts(spec):
    """The "text" column of hf:NAME[:CONFIG]'s train split, streamed from Hugging Face."""
    name, _, config = spec[len("hf:") :].partition(":")
    try:
        from datasets import load_dataset

        stream = load_dataset(name, config or None, split="train", streaming=True)
    except Exception as e:
        raise EvalError(
            f"could not stream {spec!r} ({type(e).__name__}: {e}): it needs network access to "
            "huggingface.co; offline, use --data val"
        ) from e

    return (row["text"] for row in stream)


def hf_sequences(texts, tokenizer, seq_len, num_seqs):
    """(rows, texts read): the first num_seqs long enough texts, truncated."""
    rows = []
    read = 0
    for read, text in enumerate(texts, 1):
        tokens = [tokenizer.doc_start] + tokenizer.encode_ordinary(text) if text else []
        if len(tokens) >= seq_len + 1:
            rows.append(np.asarray(tokens[: seq_len + 1], dtype=np.int64))
            if len(rows) == num_seqs:
                break

    if not rows:
        raise EvalError(f"none of the {read} texts has seq_len + 1 = {seq_len + 1} tokens")
    return np.stack(rows), read


def prompts(args, runs, enc):
    """(rows (N, seq_len + 1), data description) of --data, up to --num_seqs rows."""
    wanted = args.num_seqs
    if args.data == "val":
        data_dir = training_data_dir(runs, args.data_dir)
        rows, desc = val_sequences(data_dir, runs[0]["tokenizer"], args.seq_len)
    else:
        wanted = wanted or HF_DEFAULT_SEQS
        rows, _ = hf_sequences(hf_texts(args.data), enc, args.seq_len, wanted)
        desc = args.data

    if wanted is not None and len(rows) < wanted:
        print(f"note: asked for {wanted} sequences, the data holds {len(rows)}: using all of them")
    return rows[:wanted], desc


# ---- score: per-target cross-entropy of one sequence
@torch.no_grad()
def full_token_losses(model, seq):
    """CE of each target of seq (seq_len + 1 tokens) from ONE forward: (seq_len,) fp32."""
    seq = torch.as_tensor(seq, dtype=torch.long, device=model_device(model))
    _, losses = model(seq[None, :-1], seq[None, 1:], reduction="none")
    return losses[0].float().cpu()


def window_sums(losses, window):
    """(window ends, float64 loss sums, counts) per `window` positions."""
    chunks = torch.as_tensor(losses).double().split(window)
    counts = [c.numel() for c in chunks]

    return np.cumsum(counts).tolist(), [float(c.sum()) for c in chunks], counts


def score(ev, run, seqs, args, data_desc):
    """One checkpoint's summary rows (one per window, then 'overall'), resuming from ev.log; one
    "skipped" row if a forward over --seq_len tokens runs out of memory."""
    key = dict(checkpoint_fields(run), data=data_desc, seq_len=args.seq_len, window=args.window)
    key["dtype"] = ev.dtype
    base = dict(label=run["label"], **key, n_seqs=len(seqs), train_length=run["block_size"])

    t0 = time.time()
    runtime.reset_peak_memory(ev.device)
    n_logged = len(ev.log.records)
    reason = runtime.fits(ev.device, score_all, ev, run, seqs, key)
    if reason:
        note = f"skipped: a forward over {args.seq_len} tokens ran {reason}"
        print(f"{run['label']}: {note}")
        return [dict(base, scope="skipped", note=note)]

    resumed = len(seqs) - (len(ev.log.records) - n_logged)
    if resumed:
        print(f"{run['label']}: {resumed} of {len(seqs)} sequences resumed from {ev.log.path}")

    records = [ev.log.records[ev.log.key(dict(key, seq=i))] for i in range(len(seqs))]
    rows = window_rows(records, base)
    # compute time summed over sittings; peak memory of this one (CPU: peak RSS)
    rows[-1].update(
        seconds=round(sum(r["seconds"] for r in records), 3),
        attention_work=work_share(records),
        peak_mem_bytes=runtime.peak_memory_bytes(ev.device) if resumed < len(seqs) else None,
    )
    overall = rows[-1]
    work = overall["attention_work"]
    work = f"; attention work: {work:.1%} of full" if work is not None else ""
    print(f"{run['label']}: overall ppl {overall['ppl']:.4f} ({time.time() - t0:.1f}s{work})")
    return rows


def score_all(ev, run, seqs, key):
    """Each sequence's record in ev.log: there already (from the same tokens), or scored now."""
    for i in tqdm(range(len(seqs)), desc=run["label"], unit="seq"):
        tokens = np.ascontiguousarray(seqs[i], dtype="<i8").tobytes()
        digest = hashlib.sha1(tokens).hexdigest()[:16]
        rec = ev.log.records.get(ev.log.key(dict(key, seq=i)))
        if rec is not None and rec["tokens_sha1"] != digest:
            raise EvalError(
                f"{ev.log.path} holds a result for sequence {i} computed on other tokens (the data "
                "changed since); use a fresh --out or delete that file"
            )
        if rec is None:
            t0 = time.time()
            with runtime.autocast(ev.device, ev.dtype), counting_work() as work:
                losses = full_token_losses(run["model"], seqs[i])
            ends, sums, counts = window_sums(losses, key["window"])

            rec = dict(key, seq=i, tokens_sha1=digest, window_ends=ends, loss_sums=sums)
            rec.update(counts=counts, seconds=round(time.time() - t0, 3))
            rec.update(attention_work=work_fraction(work))
            ev.log.add(rec)


# ---- summarise
def window_rows(records, base):
    """Per window ppl = exp(mean CE over the window in all sequences), then 'overall'."""
    ends = records[0]["window_ends"]
    sums = np.sum([r["loss_sums"] for r in records], axis=0)
    counts = np.sum([r["counts"] for r in records], axis=0)
    starts = [0] + ends[:-1]

    def row(scope, start, end, loss_sum, n_tokens):
        loss = float(loss_sum / n_tokens)
        span = dict(scope=scope, window_start=start, window_end=end, n_tokens=int(n_tokens))
        return dict(base, **span, loss=loss, ppl=math.exp(loss))

    rows = [row("window", *cell) for cell in zip(starts, ends, sums, counts)]
    return rows + [row("overall", 0, ends[-1], sums.sum(), counts.sum())]


def ppl_table(rows, args, data_desc, n_seqs):
    """<out>/ppl_table: per seeded run the perplexity at k = 1, 2, 4, ... x training length L,
    pooled over windows ending in (k L / 2, k L] (in (0, L] for k = 1): an octave of positions, as
    wide as the step to the next column."""
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
        yscale="log",
    )
    path = os.path.join(args.out, "ppl_table")
    return seed_table(cells, path, caption, ("max", max), figure)


def summarise(args, runs, rows, data_desc, n_seqs):
    """ppl_summary, the per-seed table and curves, printed and drawn."""
    prefix = os.path.join(args.out, "ppl_summary")
    write_table(rows, prefix)
    table = ppl_table(rows, args, data_desc, n_seqs)
    if table:
        print(table)

    series = curves([r for r in rows if r["scope"] == "window"], "window_end", "ppl")
    overall = [f"{r['ppl']:.4f}" for r in rows if r["scope"] == "overall"]
    if not series:
        print(f"wrote {prefix}.json, {prefix}.csv (no figure: nothing was evaluated)")
        return

    # the same windows for every checkpoint
    ends = next(iter(series.values()))[0]
    table = [[end, *(f"{ppl[k]:.4f}" for _, ppl in series.values())] for k, end in enumerate(ends)]
    print(markdown_table(["window end", *series], table + [["overall", *overall]]))

    figure = os.path.join(args.out, "ppl_vs_position.png")
    xlabel = f"position (end of {args.window}-token window)"
    title = f"Perplexity vs position: {data_desc.split(':')[0]}, {n_seqs} x {args.seq_len} tokens"
    train_lengths = [r["block_size"] for r in runs]
    plot_curves(
        series, train_lengths, figure, xlabel=xlabel, ylabel="perplexity", title=title, yscale="log"
    )
    print(f"wrote {prefix}.json, {prefix}.csv, {figure}")


# ---- main
def build_parser():
    p = argparse.ArgumentParser(description="Perplexity along the position axis.")
    add_common_args(p, default_out="results/ppl")

    p.add_argument("--seq_len", type=int, default=32768, help="targets per sequence")
    p.add_argument("--num_seqs", type=int, help=f"default: all of val, {HF_DEFAULT_SEQS} of hf:")
    p.add_argument("--window", type=int, default=1024, help="positions per point of the curve")
    p.add_argument(
        "--data",
        default="val",
        help="val (the prepared validation split, document tokens removed), or hf:NAME[:CONFIG] "
        "(streamed, the first texts with seq_len + 1 tokens; the paper's: "
        "hf:wikimedia/wikipedia:20231101.en)",
    )
    p.add_argument("--data_dir", help="data of --data val; default: the training data")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("seq_len", "window", "num_seqs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    if args.data != "val" and not (args.data.startswith("hf:") and args.data[3:]):
        p.error(f"--data {args.data!r}: expected val or hf:NAME[:CONFIG]")

    runs, enc, device, dtype = start(args)
    seqs, data_desc = prompts(args, runs, enc)
    print(f"data: {data_desc}: {len(seqs)} x {args.seq_len} targets; {device}, {dtype}")
    runtime.own_folder(args.out)

    log = runtime.ResultLog(os.path.join(args.out, "ppl_samples.jsonl"), KEY_FIELDS)
    ev = Evaluation(runs, enc, device, dtype, log)
    rows = [row for run in runs for row in score(ev, run, seqs, args, data_desc)]

    summarise(args, runs, rows, data_desc, len(seqs))
    return rows


if __name__ == "__main__":
    runtime.return_large_allocations()
    runtime.errors_in_one_line("eval_ppl.py", EXPECTED_ERRORS, FULL_DISK_REMEDY)
    main()

"""
Perplexity along the position axis (the paper's protocol): where a model stops extrapolating.

    python eval_ppl.py --ckpt out/run1 --ckpt out/run2 --seq_len 32768 [--mode full sliding] [--window 1024]
        [--data val | hf:wikimedia/wikipedia:20231101.en] [--num_seqs 64]

Each target of a sequence (seq_len + 1 tokens) gets its cross-entropy from one forward over the whole sequence
(full, the paper's) or from strided windows of the training length (sliding); the curve pools each --window
positions over all sequences, ppl = exp(mean CE). Writes to --out: ppl_samples.jsonl (per checkpoint x mode x
sequence; a rerun resumes it), ppl_summary.{json,csv} (per window, and "overall") and ppl_vs_position.png.
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
from eval_common import (EvalError, ResultLog, add_common_args, identity, load_runs, markdown_table, memory_shortfall,
                         model_device, peak_memory_bytes, pick_device, plot_curves, reset_peak_memory, resolve_dtype,
                         run_script, training_data_dir, write_table)
from model import autocast

MODES = ("full", "sliding")
HF_DEFAULT_SEQS = 128  # the authors' public CLI


# ---- Scoring: per-target cross-entropy of one sequence ---------------------------------------------------------
@torch.no_grad()
def full_token_losses(model, seq):
    """Full mode: the CE of each target of seq (seq_len + 1 tokens) from ONE forward over seq[:-1], (seq_len,) fp32."""
    seq = torch.as_tensor(seq, dtype=torch.long, device=model_device(model))
    _, losses = model(seq[None, :-1], seq[None, 1:], reduction="none")
    return losses[0].float().cpu()


def sliding_windows(n, window, stride):
    """The Hugging Face perplexity guide's strided windows over n targets: (begin, end, score_from) per window, a
    fresh forward over x[begin:end] scoring targets [score_from, end): each target once, with >= W - S + 1 context."""
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + window, n)
        out.append((begin, end, prev_end))
        if end == n:
            return out
        prev_end, begin = end, begin + stride


@torch.no_grad()
def sliding_losses(model, seq, window, stride, batch_size=16):
    """Sliding mode: each target's CE in its sliding_windows() window, batch_size windows a forward; (seq_len,) fp32."""
    seq = torch.as_tensor(seq, dtype=torch.long, device=model_device(model))
    x, y = seq[:-1], seq[1:]
    out = torch.empty(x.numel(), dtype=torch.float32)
    wins = sliding_windows(x.numel(), window, stride)
    full = [w for w in wins if w[1] - w[0] == window]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    groups += [[w] for w in wins if w[1] - w[0] != window]  # only the last window can be shorter
    for group in groups:
        _, losses = model(torch.stack([x[b:e] for b, e, _ in group]), torch.stack([y[b:e] for b, e, _ in group]),
                          reduction="none")
        for row, (b, e, s) in zip(losses.float().cpu(), group):
            out[s:e] = row[s - b:]
    return out


def window_sums(losses, window):
    """(window_ends, loss_sums in float64, counts) of the losses in windows of `window` positions."""
    losses = torch.as_tensor(losses).double()
    starts = range(0, losses.numel(), window)
    chunks = [losses[a:a + window] for a in starts]
    counts = [c.numel() for c in chunks]
    return [a + n for a, n in zip(starts, counts)], [float(c.sum()) for c in chunks], counts


# ---- Data ------------------------------------------------------------------------------------------------------
def val_sequences(data_dir, tokenizer_name, seq_len):
    """(rows (N, seq_len + 1), description, notes) from the validation split's first VAL_TOKENS tokens, document
    tokens removed so that documents run together with no document mask, as the authors did on FineWeb."""
    available = sum(len(open_shard(p, tokenizer_name)) for p in shard_paths(data_dir, "val"))
    notes = [] if available >= VAL_TOKENS else [
        f"the validation split in {data_dir} holds {available} tokens, fewer than the {VAL_TOKENS} of the "
        "protocol; using all of them"]
    tokens = read_tokens(data_dir, "val", min(VAL_TOKENS, available))
    tokens = tokens[~np.isin(tokens, [t for t in (DOC_START[tokenizer_name], DOC_END[tokenizer_name]) if t])]
    rows = len(tokens) // (seq_len + 1)
    if rows == 0:
        raise EvalError(f"{len(tokens)} validation tokens in {data_dir} do not make one sequence of seq_len + 1 = "
                        f"{seq_len + 1} tokens; use a smaller --seq_len or more validation data")
    desc = f"val:{os.path.abspath(data_dir)}:no_eot"
    return tokens[:rows * (seq_len + 1)].reshape(rows, seq_len + 1), desc, notes


def parse_hf(spec):
    """'hf:NAME[:CONFIG]' -> (NAME, CONFIG or None)."""
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 2:
        raise EvalError(f"--data {spec!r}: expected hf:NAME or hf:NAME:CONFIG, e.g. hf:wikimedia/wikipedia:20231101.en")
    return parts[0], (parts[1] if len(parts) == 2 and parts[1] else None)


def hf_texts(name, config):
    """The "text" column of a streamed Hugging Face dataset's train split, in dataset order."""
    try:
        from datasets import load_dataset
        it = iter(load_dataset(name, config, split="train", streaming=True))
        first = next(it, None)
    except Exception as e:
        raise EvalError(f"could not stream the Hugging Face dataset {name!r} (config {config!r}): "
                        f"{type(e).__name__}: {e}; this needs network access to huggingface.co; offline, use "
                        "--data val (the prepared validation split)") from e
    if first is None:
        return
    if "text" not in first:
        raise EvalError(f"{name!r} has no column 'text' (columns: {sorted(first)})")
    yield first["text"]
    for row in it:
        yield row["text"]


def hf_sequences(texts, tokenizer, seq_len, num_seqs):
    """(rows, texts read): the first num_seqs texts with >= seq_len + 1 tokens ([doc_start] + text), truncated."""
    rows, read = [], 0
    for text in texts:
        read += 1
        toks = [tokenizer.doc_start] + tokenizer.encode_ordinary(text) if text else []
        if len(toks) >= seq_len + 1:
            rows.append(np.asarray(toks[:seq_len + 1], dtype=np.int64))
            if len(rows) == num_seqs:
                break
    return (np.stack(rows) if rows else np.zeros((0, seq_len + 1), dtype=np.int64)), read


def load_sequences(args, runs):
    """(rows (N, seq_len + 1), data description, notes) for --data, at most --num_seqs rows."""
    tokenizer_name = runs[0]["tokenizer"]
    if args.data == "val":
        rows, desc, notes = val_sequences(training_data_dir(runs, args.data_dir), tokenizer_name, args.seq_len)
        wanted = args.num_seqs
    elif args.data.startswith("hf:"):
        name, config = parse_hf(args.data)
        wanted = args.num_seqs or HF_DEFAULT_SEQS
        rows, read = hf_sequences(hf_texts(name, config), get_tokenizer(tokenizer_name), args.seq_len, wanted)
        desc, notes = f"hf:{name}:{config}", []
        if len(rows) == 0:
            raise EvalError(f"none of the {read} texts of {name} ({config}) has seq_len + 1 = {args.seq_len + 1} "
                            "tokens; use a smaller --seq_len")
    else:
        raise EvalError(f"--data must be 'val' or 'hf:NAME[:CONFIG]', got {args.data!r}")
    if wanted is not None and len(rows) < wanted:
        notes.append(f"asked for {wanted} sequences of {args.seq_len + 1} tokens, the data holds {len(rows)}: "
                     f"using all {len(rows)}")
    return rows[:wanted], desc, notes


# ---- Evaluation ------------------------------------------------------------------------------------------------
def fitting_batch(args, run, mode, device, context):
    """(batch, memory_shortfall's reason or None): sliding mode halves --batch_size until a forward and the loss head
    (fp32 logits, log-softmax, autocast copy over <= 8192 positions) fit."""
    batch = 1 if mode == "full" else args.batch_size
    while True:
        head = 3 * 4 * batch * min(context, 8192) * run["model"].config.padded_vocab_size
        why = memory_shortfall(run["model"], context, device, args.memory_fraction, batch=batch, extra_bytes=head)
        if not why or batch == 1:
            return batch, why
        batch //= 2


def evaluate_mode(args, run, mode, seqs, data_desc, dtype, device, log):
    """Score every sequence with one checkpoint in one mode (resuming from `log`). Returns (summary rows, name)."""
    context = args.seq_len if mode == "full" else min(args.sliding_window or run["block_size"], args.seq_len)
    stride = None if mode == "full" else min(args.stride or max(1, context // 2), context)
    name = f"{run['label']} full" if mode == "full" else f"{run['label']} sliding (W={context}, S={stride})"
    base = dict(label=run["label"], **identity(run), mode=mode, context=context, stride=stride, window=args.window,
                data=data_desc, seq_len=args.seq_len, n_seqs=len(seqs), dtype=dtype, train_length=run["block_size"])
    batch, why = fitting_batch(args, run, mode, device, context)
    if why:
        msg = f"skipped: a forward over {context} tokens {why}"
        print(f"{name}: {msg}")
        return [dict(base, scope="skipped", note=msg)], name
    key = dict(identity(run), mode=mode, data=data_desc, seq_len=args.seq_len, window=args.window,
               context=context, stride=stride, dtype=dtype)
    by_key = {log.key(r): r for r in log.records}
    records, t0, resumed = [], time.time(), 0
    reset_peak_memory(device)
    for i in tqdm(range(len(seqs)), desc=name, unit="seq"):
        digest = hashlib.sha1(np.ascontiguousarray(seqs[i], dtype="<i8").tobytes()).hexdigest()[:16]
        rec = by_key.get(log.key(dict(key, seq=i)))
        if rec is not None and rec["tokens_sha1"] != digest:
            raise EvalError(f"{log.path} holds a result for sequence {i} computed on other tokens (the data "
                            "changed since); use a fresh --out or delete that file")
        resumed += rec is not None
        if rec is None:
            t = time.time()
            with autocast(device, dtype):
                losses = (full_token_losses(run["model"], seqs[i]) if mode == "full" else
                          sliding_losses(run["model"], seqs[i], context, stride, batch))
            ends, sums, counts = window_sums(losses, args.window)
            rec = dict(key, seq=i, tokens_sha1=digest, window_ends=ends, loss_sums=sums, counts=counts,
                       seconds=round(time.time() - t, 3))
            log.add(rec)
        records.append(rec)
    if resumed:
        print(f"{name}: {resumed} of {len(seqs)} sequences resumed from {log.path}")
    out = summarize(records, base)
    # compute time summed over every sitting; peak memory of this sitting (CPU: the process's peak RSS)
    out[-1].update(seconds=round(sum(r["seconds"] for r in records), 3),
                   peak_mem_bytes=peak_memory_bytes(device) if resumed < len(seqs) else None)
    print(f"{name}: overall ppl {out[-1]['ppl']:.4f} over {out[-1]['n_tokens']} tokens ({time.time() - t0:.1f}s)")
    return out, name


def summarize(records, base):
    """Summary rows: per window, ppl = exp(mean CE over that window in every sequence), then 'overall'."""
    ends = records[0]["window_ends"]
    sums = np.sum([r["loss_sums"] for r in records], axis=0)
    counts = np.sum([r["counts"] for r in records], axis=0)
    rows = [dict(base, scope="window", window_start=ends[k - 1] if k else 0, window_end=end,
                 n_tokens=int(counts[k]), loss=float(sums[k] / counts[k]), ppl=math.exp(sums[k] / counts[k]))
            for k, end in enumerate(ends)]
    loss = float(sums.sum() / counts.sum())
    return rows + [dict(base, scope="overall", window_start=0, window_end=ends[-1], n_tokens=int(counts.sum()),
                        loss=loss, ppl=math.exp(loss))]


# ---- Command line ----------------------------------------------------------------------------------------------
def build_parser():
    p = argparse.ArgumentParser(description="Perplexity along the position axis.")
    add_common_args(p, default_out="results/ppl")
    p.add_argument("--seq_len", type=int, default=32768, help="targets per sequence (a row has seq_len + 1 tokens)")
    p.add_argument("--num_seqs", type=int, help=f"sequences to score (default: all of val, {HF_DEFAULT_SEQS} for hf:)")
    p.add_argument("--window", type=int, default=1024, help="averaging window along the position axis (the curve)")
    p.add_argument("--mode", nargs="+", choices=MODES, default=["full"], help="full, sliding, or both")
    p.add_argument("--sliding_window", type=int, help="sliding mode: tokens per forward (default: training length)")
    p.add_argument("--stride", type=int, default=None, help="sliding mode: the stride; default sliding_window // 2")
    p.add_argument("--batch_size", type=int, default=16, help="sliding mode: windows per forward (halved to fit)")
    p.add_argument("--data", default="val",
                   help="val (the prepared validation split, document tokens removed), or hf:NAME[:CONFIG] (streamed, "
                        "the first texts with seq_len + 1 tokens; the paper's: hf:wikimedia/wikipedia:20231101.en)")
    p.add_argument("--data_dir", help="prepared shards for --data val; default: the checkpoint's training data")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for k in ("seq_len", "window", "batch_size", "sliding_window", "stride", "num_seqs"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            p.error(f"--{k} must be at least 1, got {getattr(args, k)}")
    if args.stride is not None and args.sliding_window is not None and args.stride > args.sliding_window:
        p.error(f"--stride {args.stride} is larger than --sliding_window {args.sliding_window}: tokens are skipped")
    args.mode = list(dict.fromkeys(args.mode))
    return args


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    dtype = resolve_dtype(device, args.dtype)
    runs, _ = load_runs(args.ckpt, device, args.attn_impl)
    seqs, data_desc, notes = load_sequences(args, runs)
    for note in notes:
        print(f"note: {note}")
    print(f"data: {data_desc}: {len(seqs)} sequences of {args.seq_len} targets; curve windows of {args.window} tokens; "
          f"device {device}, {dtype}")
    log = ResultLog(os.path.join(args.out, "ppl_samples.jsonl"), ("ckpt", "ckpt_sha256", "mode", "data", "seq_len",
                                                                  "window", "context", "stride", "dtype", "seq"), runs)
    rows, series, table = [], {}, {}  # table: window end -> {series name: ppl}
    for run in runs:
        for mode in args.mode:
            out, name = evaluate_mode(args, run, mode, seqs, data_desc, dtype, device, log)
            rows += out
            curve = [r for r in out if r["scope"] == "window"]
            if curve:
                series[name] = ([r["window_end"] for r in curve], [r["ppl"] for r in curve])
            for r in curve + out[-1:] * bool(curve):
                table.setdefault("overall" if r["scope"] == "overall" else r["window_end"], {})[name] = f"{r['ppl']:.4f}"
    prefix = os.path.join(args.out, "ppl_summary")
    write_table(rows, prefix)
    names = list(series)
    if names:
        print(markdown_table(["window end", *names], [[end, *(v.get(n, "-") for n in names)]
                                                      for end, v in table.items()]))
        fig = os.path.join(args.out, "ppl_vs_position.png")
        plot_curves(series, [r["block_size"] for r in runs], fig, xlabel=f"position (end of {args.window}-token window)",
                    ylabel="perplexity", logy=True,
                    title=f"Perplexity vs position: {data_desc.split(':')[0]} data, {len(seqs)} x {args.seq_len} tokens")
    print(f"wrote {prefix}.json, {prefix}.csv" + (f", {fig}" if names else " (no figure: nothing was evaluated)"))
    return rows


if __name__ == "__main__":
    run_script(main, "eval_ppl.py")

"""
Perplexity along the position axis (the paper's protocol): the view that shows where a model stops extrapolating,
next to the single number that hides it.

    python eval_ppl.py --ckpt out/run1 --ckpt out/run2 --seq_len 32768 --mode full sliding

Two ways to score a long sequence of seq_len + 1 tokens (inputs x = seq[:-1], targets y = seq[1:]):
  full     one forward pass over the whole sequence (the paper's protocol): the prediction of y[t] sees all
           t + 1 tokens before it, however far that is beyond the training length.
  sliding  the usual strided evaluation (as in the Hugging Face perplexity guide) with a context window W
           (default: the checkpoint's training length) and a stride S (default W // 2): windows
           x[b:b+W] at b = 0, S, 2S, ...; the first window scores all its tokens, each later one only the
           tokens the previous window did not reach (its last S). Every target is scored exactly once, with
           between W - S + 1 and W tokens of context. Each window is a fresh forward from position 0.
Either way the result is one cross-entropy per target, which is then averaged the same way:

  curve    targets are grouped by position into non-overlapping windows of --window tokens (default 1024):
           window k holds targets t in [k*window, (k+1)*window), i.e. the predictions made with kw+1 ...
           (k+1)*window tokens of context in full mode; "window_end" = (k+1)*window (the last window may be
           shorter and ends at seq_len). ppl(window) = exp(mean CE over every target of that window in every
           sequence), pooled over tokens (all sequences have the same length, so this equals the mean of the
           per-sequence window means).
  overall  exp(mean CE over all targets of all sequences).

Data (--data):
  val      (default) the validation split of the prepared data (data.py): its first VAL_TOKENS tokens, with
           the document tokens (end-of-text; BOS and EOS with mistral) REMOVED so that documents run together
           with no document mask, as the authors did for FineWeb-10B, cut into consecutive rows of seq_len + 1.
           --keep_eot keeps them (still no document mask: at inference a sequence is one document).
  hf:NAME[:CONFIG]  a Hugging Face dataset, streamed (needs network), e.g. hf:wikimedia/wikipedia:20231101.en
           (the paper's): the first articles in dataset order that have at least seq_len + 1 tokens when
           tokenized with the checkpoint's tokenizer (its document-start token first: BOS with mistral, as the
           authors, end-of-text with gpt2 and byte), truncated to seq_len + 1.
If the data holds fewer than --num_seqs sequences, all of them are used and the output says so.

Outputs in --out: ppl_samples.jsonl (one record per checkpoint x mode x sequence: per-window CE sums and
counts; a rerun resumes from it, and evaluates again a checkpoint whose weights changed at the same path), ppl_summary.json/.csv (per checkpoint x mode x window: ppl, n_tokens, and
an "overall" row; each row names the mode, context window and stride that produced it) and ppl_vs_position.png.
"""
import argparse
import hashlib
import math
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from data import DOC_END, DOC_START, VAL_TOKENS, get_tokenizer, open_shard, read_tokens, shard_paths
from eval_common import (EXPECTED_ERRORS, EvalError, ResultLog, add_common_args, fits_in_memory, fmt_bytes, identity,
                         load_runs, model_device, peak_memory_bytes, pick_device, plot_curves, reset_peak_memory,
                         resolve_dtype, return_freed_memory_to_os, save_attention_checks, training_data_dir,
                         write_table)
from model import autocast

MODES = ("full", "sliding")
HF_DEFAULT_SEQS = 128  # the authors' public CLI (their Evaluator class used 256)


# ----------------------------------------------------------------------------------------------------------
# Scoring: per-target cross-entropy of one sequence
# ----------------------------------------------------------------------------------------------------------
def _as_tensor(seq, device):
    if isinstance(seq, np.ndarray):
        seq = torch.from_numpy(seq.astype(np.int64))
    return seq.to(device=device, dtype=torch.long)


@torch.no_grad()
def full_token_losses(model, seq):
    """Full mode: CE of each target of seq (seq_len + 1 tokens) from ONE forward over seq[:-1]. Returns a float32
    CPU tensor of seq_len losses; the chunked loss head (reduction="none") never builds a T x vocab tensor."""
    seq = _as_tensor(seq, model_device(model))
    _, losses = model(seq[None, :-1], seq[None, 1:], reduction="none")
    return losses[0].float().cpu()


def sliding_windows(n, window, stride):
    """The strided evaluation's windows over n targets: a list of (begin, end, score_from). The forward sees
    x[begin:end] and scores targets [score_from, end). The spans [score_from, end) tile [0, n) exactly once."""
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"need 1 <= stride <= window, got window={window}, stride={stride}")
    out, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + window, n)
        out.append((begin, end, prev_end))
        if end == n:
            return out
        prev_end, begin = end, begin + stride


@torch.no_grad()
def sliding_losses(model, seq, window, stride, batch_size=16):
    """Sliding mode: CE of each target of seq (seq_len + 1 tokens), each scored once in the window
    sliding_windows() assigns it. Windows of full length run batch_size at a time. float32 CPU tensor (seq_len,)."""
    seq = _as_tensor(seq, model_device(model))
    x, y = seq[:-1], seq[1:]
    n = x.numel()
    out = torch.empty(n, dtype=torch.float32)
    wins = sliding_windows(n, window, stride)
    full = [w for w in wins if w[1] - w[0] == window]
    short = [w for w in wins if w[1] - w[0] != window]  # only the last window can be shorter than `window`
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in short]
    for group in groups:
        xb = torch.stack([x[b:e] for b, e, _ in group])
        yb = torch.stack([y[b:e] for b, e, _ in group])
        _, losses = model(xb, yb, reduction="none")
        losses = losses.float().cpu()
        for row, (b, e, s) in zip(losses, group):
            out[s:e] = row[s - b:]
    return out


def window_sums(losses, window):
    """Group per-target losses by position into windows of `window` targets.
    Returns (window_ends, loss_sums, counts) as Python lists (sums in float64)."""
    losses = torch.as_tensor(losses).double()
    n = losses.numel()
    ends, sums, counts = [], [], []
    for a in range(0, n, window):
        chunk = losses[a:a + window]
        ends.append(a + chunk.numel())
        sums.append(float(chunk.sum()))
        counts.append(chunk.numel())
    return ends, sums, counts


def window_losses(model, seq, window):
    """Full mode's curve for one sequence: the mean CE in each non-overlapping window of `window` targets."""
    _, sums, counts = window_sums(full_token_losses(model, seq), window)
    return torch.tensor(sums, dtype=torch.float64) / torch.tensor(counts, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------
def val_sequences(data_dir, tokenizer_name, seq_len, keep_eot=False):
    """Rows of seq_len + 1 tokens from the first VAL_TOKENS tokens of the validation split (fewer if the split is
    smaller), end-of-text removed unless keep_eot. Returns (rows (N, seq_len + 1) int64, description, notes)."""
    paths = shard_paths(data_dir, "val")
    available = sum(len(open_shard(p, tokenizer_name)) for p in paths)  # also checks each shard's tokenizer
    n = min(VAL_TOKENS, available)
    notes = []
    if n < VAL_TOKENS:
        notes.append(f"the validation split in {data_dir} holds {available} tokens, fewer than the "
                     f"{VAL_TOKENS} of the protocol; using all of them")
    tokens = read_tokens(data_dir, "val", n)
    if not keep_eot:  # the document tokens: end-of-text (gpt2, byte), BOS and EOS (mistral)
        marks = [t for t in (DOC_START[tokenizer_name], DOC_END[tokenizer_name]) if t is not None]
        tokens = tokens[~np.isin(tokens, marks)]
    rows = len(tokens) // (seq_len + 1)
    what = f"{len(tokens)} validation tokens{'' if keep_eot else ' (end-of-text removed)'} in {data_dir}"
    if rows == 0:
        raise EvalError(f"{what} do not make one sequence of seq_len + 1 = {seq_len + 1} tokens; "
                        "use a smaller --seq_len or more validation data")
    desc = f"val:{os.path.abspath(data_dir)}:{'eot' if keep_eot else 'no_eot'}"
    return tokens[:rows * (seq_len + 1)].reshape(rows, seq_len + 1), desc, notes


def parse_hf(spec):
    """'hf:NAME[:CONFIG]' -> (NAME, CONFIG or None)."""
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 2:
        raise EvalError(f"--data {spec!r}: expected hf:NAME or hf:NAME:CONFIG, e.g. hf:wikimedia/wikipedia:20231101.en")
    return parts[0], (parts[1] if len(parts) == 2 and parts[1] else None)


def hf_texts(name, config, split="train", text_column="text"):
    """The texts of a streamed Hugging Face dataset, in dataset order. A clear error when it cannot be reached."""
    try:
        from datasets import load_dataset
        ds = load_dataset(name, config, split=split, streaming=True)
        it = iter(ds)
        first = next(it)
    except StopIteration:
        return
    except Exception as e:
        raise EvalError(f"could not stream the Hugging Face dataset {name!r} (config {config!r}): "
                        f"{type(e).__name__}: {e}; this needs network access to huggingface.co; offline, use "
                        "--data val (the prepared validation split)") from e
    if text_column not in first:
        raise EvalError(f"{name!r} has no column {text_column!r} (columns: {sorted(first)}); use --text_column")
    yield first[text_column]
    for row in it:
        yield row[text_column]


def hf_sequences(texts, tokenizer, seq_len, num_seqs):
    """The first num_seqs texts (in order) that tokenize ([doc_start] + text) to at least seq_len + 1 tokens, each
    truncated to seq_len + 1. Returns (rows (N, seq_len + 1) int64, number of texts read)."""
    rows, read = [], 0
    bar = tqdm(total=num_seqs, desc=f"finding texts of >= {seq_len + 1} tokens", leave=False)
    for text in texts:
        read += 1
        if not text:
            continue
        toks = [tokenizer.doc_start] + tokenizer.encode_ordinary(text)  # whole text: a cut could change tokens
        if len(toks) >= seq_len + 1:
            rows.append(np.asarray(toks[:seq_len + 1], dtype=np.int64))
            bar.update(1)
            if len(rows) == num_seqs:
                break
    bar.close()
    return (np.stack(rows) if rows else np.zeros((0, seq_len + 1), dtype=np.int64)), read


def load_sequences(args, runs):
    """(rows (N, seq_len + 1), data description, notes) for --data, at most --num_seqs rows."""
    tokenizer_name = runs[0]["tokenizer"]
    if args.data == "val":
        data_dir = training_data_dir(runs, args.data_dir)
        rows, desc, notes = val_sequences(data_dir, tokenizer_name, args.seq_len, args.keep_eot)
        wanted = args.num_seqs
    elif args.data.startswith("hf:"):
        name, config = parse_hf(args.data)
        wanted = args.num_seqs or HF_DEFAULT_SEQS
        rows, read = hf_sequences(hf_texts(name, config, text_column=args.text_column),
                                  get_tokenizer(tokenizer_name), args.seq_len, wanted)
        desc, notes = f"hf:{name}:{config}", []
        if len(rows) == 0:
            raise EvalError(f"none of the {read} texts of {name} ({config}) has seq_len + 1 = {args.seq_len + 1} "
                             "tokens; use a smaller --seq_len")
    else:
        raise EvalError(f"--data must be 'val' or 'hf:NAME[:CONFIG]', got {args.data!r}")
    if wanted is not None and len(rows) < wanted:
        notes.append(f"asked for {wanted} sequences of {args.seq_len + 1} tokens, the data holds {len(rows)}: "
                     f"using all {len(rows)}")
    if wanted is not None:
        rows = rows[:wanted]
    return rows, desc, notes


# ----------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------
def loss_head_bytes(model, length, batch):
    """The chunked loss head (model._token_losses, 8192 positions at a time): fp32 logits, their log-softmax and
    the autocast copy, over batch x min(length, 8192) positions. Not in eval_common.estimate_forward_bytes,
    which is for evaluations that only take the last logits."""
    return 3 * 4 * batch * min(length, 8192) * model.config.padded_vocab_size


def check_memory(model, length, batch, device, fraction):
    ok, need, free = fits_in_memory(model, length, device, fraction, batch=batch)
    need += loss_head_bytes(model, length, batch)
    return need <= fraction * free, need, free


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------
def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_out="results/ppl")
    p.add_argument("--seq_len", type=int, default=32768, help="targets per sequence (each row has seq_len + 1 tokens)")
    p.add_argument("--num_seqs", type=int, default=None,
                   help=f"sequences to score; default: all of the validation region, {HF_DEFAULT_SEQS} for hf:")
    p.add_argument("--window", type=int, default=1024, help="averaging window along the position axis (the curve)")
    p.add_argument("--mode", nargs="+", choices=MODES, default=["full"], help="full, sliding, or both")
    p.add_argument("--sliding_window", type=int, default=None,
                   help="sliding mode: the context window (tokens per forward); default the checkpoint's training length")
    p.add_argument("--stride", type=int, default=None, help="sliding mode: the stride; default sliding_window // 2")
    p.add_argument("--batch_size", type=int, default=16,
                   help="sliding mode: windows per forward (halved until it fits in memory)")
    p.add_argument("--data", default="val", help="val, or hf:NAME[:CONFIG] (e.g. hf:wikimedia/wikipedia:20231101.en)")
    p.add_argument("--data_dir", default=None,
                   help="prepared shards for --data val; default: the training data the checkpoint records")
    p.add_argument("--keep_eot", action="store_true", help="--data val: keep the end-of-text tokens (default: removed)")
    p.add_argument("--text_column", default="text", help="--data hf:...: the column holding the text")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for k in ("seq_len", "window", "batch_size", "sliding_window", "stride", "num_seqs"):
        v = getattr(args, k)
        if v is not None and v < 1:
            p.error(f"--{k} must be at least 1, got {v}")
    if args.stride is not None and args.sliding_window is not None and args.stride > args.sliding_window:
        p.error(f"--stride {args.stride} is larger than --sliding_window {args.sliding_window}: tokens would be skipped")
    args.mode = list(dict.fromkeys(args.mode))
    return args


def mode_settings(args, run, mode):
    """(context, stride) of a mode for one checkpoint: full mode sees the whole sequence (stride None)."""
    if mode == "full":
        return args.seq_len, None
    context = min(args.sliding_window or run["block_size"], args.seq_len)
    stride = min(args.stride or max(1, context // 2), context)
    return context, stride


def series_name(run, mode, context, stride):
    return f"{run['label']} full" if mode == "full" else f"{run['label']} sliding (W={context}, S={stride})"


def seq_digest(row):
    return hashlib.sha1(np.ascontiguousarray(row, dtype="<i8").tobytes()).hexdigest()[:16]


def summarize(records, base):
    """Pool per-sequence window sums into summary rows (one per window, plus 'overall')."""
    ends = records[0]["window_ends"]
    sums = np.sum([r["loss_sums"] for r in records], axis=0)
    counts = np.sum([r["counts"] for r in records], axis=0)
    rows = []
    for k, end in enumerate(ends):
        loss = sums[k] / counts[k]
        rows.append(dict(base, scope="window", window_start=ends[k - 1] if k else 0, window_end=end,
                         n_tokens=int(counts[k]), loss=float(loss), ppl=float(math.exp(loss))))
    loss = sums.sum() / counts.sum()
    rows.append(dict(base, scope="overall", window_start=0, window_end=ends[-1], n_tokens=int(counts.sum()),
                     loss=float(loss), ppl=float(math.exp(loss))))
    return rows


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    dtype = resolve_dtype(device, args.dtype)
    if torch.device(device).type == "cpu":
        return_freed_memory_to_os()  # keeps a long CPU forward's resident memory linear in the length
    torch.manual_seed(args.seed)  # nothing here is random; seeded so that nothing ever silently becomes so
    np.random.seed(args.seed)
    runs, _ = load_runs(args.ckpt, device, args.attn_impl, args.dtype)
    save_attention_checks(runs, args.out)
    seqs, data_desc, notes = load_sequences(args, runs)
    for note in notes:
        print(f"note: {note}")
    print(f"data: {data_desc}: {len(seqs)} sequences of {args.seq_len} targets; curve windows of {args.window} tokens; "
          f"device {device}, {dtype}")
    os.makedirs(args.out, exist_ok=True)
    log = ResultLog(os.path.join(args.out, "ppl_samples.jsonl"),
                    ("ckpt", "ckpt_sha256", "mode", "data", "seq_len", "window", "context", "stride", "dtype", "seq"),
                    runs)
    rows, series = [], {}
    for run in runs:
        for mode in args.mode:
            out, name = evaluate_mode(args, run, mode, seqs, data_desc, dtype, device, log)
            rows += out
            curve = [r for r in out if r["scope"] == "window"]
            if curve:
                series[name] = ([r["window_end"] for r in curve], [r["ppl"] for r in curve])

    prefix = os.path.join(args.out, "ppl_summary")
    write_table(rows, prefix)
    print_table(rows)
    if series:
        fig = os.path.join(args.out, "ppl_vs_position.png")
        plot_curves(series, [r["block_size"] for r in runs], fig, xlabel=f"position (end of {args.window}-token window)",
                    ylabel="perplexity", logy=True,
                    title=f"Perplexity vs position: {data_desc.split(':')[0]} data, {len(seqs)} x {args.seq_len} tokens")
        print(f"wrote {prefix}.json, {prefix}.csv, {fig}")
    else:
        print(f"wrote {prefix}.json, {prefix}.csv (no figure: nothing was evaluated)")
    return rows


def fitting_batch(args, run, mode, device):
    """(batch, ok, needed bytes, free bytes): sliding mode halves --batch_size until a forward fits."""
    batch = 1 if mode == "full" else args.batch_size
    length = args.seq_len if mode == "full" else mode_settings(args, run, mode)[0]
    ok, need, free = check_memory(run["model"], length, batch, device, args.memory_fraction)
    while not ok and batch > 1:
        batch //= 2
        ok, need, free = check_memory(run["model"], length, batch, device, args.memory_fraction)
    return batch, ok, need, free


def evaluate_mode(args, run, mode, seqs, data_desc, dtype, device, log):
    """Score every sequence with one checkpoint in one mode (resuming from `log`). Returns (summary rows, name)."""
    context, stride = mode_settings(args, run, mode)
    name = series_name(run, mode, context, stride)
    base = dict(label=run["label"], **identity(run), mode=mode, context=context, stride=stride, window=args.window,
                data=data_desc, seq_len=args.seq_len, n_seqs=len(seqs), dtype=dtype, train_length=run["block_size"])
    batch, ok, need, free = fitting_batch(args, run, mode, device)
    if not ok:
        length = args.seq_len if mode == "full" else context
        msg = (f"skipped: a forward over {length} tokens needs ~{fmt_bytes(need)}, "
               f"{args.memory_fraction:.0%} of free memory is {fmt_bytes(args.memory_fraction * free)}")
        print(f"{name}: {msg}")
        return [dict(base, scope="skipped", note=msg)], name
    key = dict(identity(run), mode=mode, data=data_desc, seq_len=args.seq_len, window=args.window,
               context=context, stride=stride, dtype=dtype)
    by_key = {log.key(r): r for r in log.records}
    records, t0, done_before = [], time.time(), 0
    reset_peak_memory(device)
    bar = tqdm(range(len(seqs)), desc=name, unit="seq")
    for i in bar:
        digest = seq_digest(seqs[i])
        rec = by_key.get(log.key(dict(key, seq=i)))
        if rec is not None:
            if rec["tokens_sha1"] != digest:
                raise EvalError(f"{log.path} holds a result for sequence {i} computed on other tokens "
                                "(the data changed since); use a fresh --out or delete that file")
            done_before += 1
        else:
            t = time.time()
            with autocast(device, dtype):
                if mode == "full":
                    losses = full_token_losses(run["model"], seqs[i])
                else:
                    losses = sliding_losses(run["model"], seqs[i], context, stride, batch)
            ends, sums, counts = window_sums(losses, args.window)
            rec = dict(key, seq=i, tokens_sha1=digest, window_ends=ends, loss_sums=sums, counts=counts,
                       seconds=round(time.time() - t, 3))
            log.add(rec)
        records.append(rec)
        total = sum(sum(r["loss_sums"]) for r in records) / sum(sum(r["counts"]) for r in records)
        bar.set_postfix(ppl=f"{math.exp(total):.3f}")
    bar.close()
    if done_before:
        print(f"{name}: {done_before} of {len(seqs)} sequences resumed from {log.path}")
    out = summarize(records, base)
    # compute time summed over every sitting; peak memory of this sitting (CPU: the process's peak RSS)
    out[-1]["seconds"] = round(sum(r["seconds"] for r in records), 3)
    out[-1]["peak_mem_bytes"] = peak_memory_bytes(device) if done_before < len(seqs) else None
    print(f"{name}: overall ppl {out[-1]['ppl']:.4f} over {out[-1]['n_tokens']} tokens ({time.time() - t0:.1f}s)")
    return out, name


def print_table(rows):
    """Window ends down, one column per checkpoint x mode."""
    names, table = [], {}
    for r in rows:
        if r["scope"] == "skipped":
            continue
        name = f"{r['label']} {r['mode']}" + (f" W={r['context']} S={r['stride']}" if r["mode"] == "sliding" else "")
        if name not in names:
            names.append(name)
        table.setdefault("overall" if r["scope"] == "overall" else str(r["window_end"]), {})[name] = r["ppl"]
    if not names:
        return
    width = max(12, *(len(n) for n in names))
    print("window end".rjust(10) + "".join(n.rjust(width + 2) for n in names))
    for end, vals in table.items():
        print(end.rjust(10) + "".join(f"{vals[n]:.4f}".rjust(width + 2) if n in vals else "-".rjust(width + 2)
                                      for n in names))


if __name__ == "__main__":
    try:
        main()
    except EXPECTED_ERRORS as e:  # expected failures: one line, no traceback
        sys.exit(f"eval_ppl.py: error: {e}")

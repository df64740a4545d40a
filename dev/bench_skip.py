"""
Skipping's cost on the CPU, in one process on one thread, for each checkpoint:
- scoring: eval_ppl.py's scoring of one validation sequence at each length, with skipping
  (attention.first_keys) and without it, alternately; beside each ratio the work share measured and
  the one the priors alone predict, the perplexity, and the peak memory of each scoring.
- decoding (--decode_contexts): ms per generated token after a prompt of each length, greedy, with
  the KV cache, with and without skipping; the tokens must be the same.

    python dev/bench_skip.py --ckpt out/text/bam-s1 --ckpt out/text/alibi-s1 [--lengths 8192 32768]
    python dev/bench_skip.py --ckpt out/text/bam-s1 --lengths 64 128 ... 262144 --full_lengths 64 \
        128 ... 32768 131072
    python dev/bench_skip.py --ckpt out/text/bam-s1 --lengths --decode_contexts 1024 4096 16384

A length past the validation split is cut to it. The prediction is the bound with no content term:
head h reads at most the W_h nearest keys, W_h the smallest n where b(0) - max_{m >= n} b(m) >= tau
(every row's window is at least that wide). Writes bench_skip (.json, .csv, .png: seconds against
length, log-log, with the slopes) and bench_decode (the same) to --out.
"""

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval_common import counting_work, curve_styles, pyplot, save_figure, write_table  # noqa: E402
from eval_ppl import full_token_losses, val_sequences, window_sums  # noqa: E402
from infra import runtime  # noqa: E402
from model import load_model  # noqa: E402


@torch.no_grad()
def predicted_share(model, length):
    """The share of visible scores the priors alone leave over the layers and heads (SSMax's row
    scale s_h log n_i included where it scales the prior), and the heads that read every key."""
    tau = math.log(length) + 24 * math.log(2) + 1
    n = torch.arange(1, length + 1, dtype=torch.float64)
    read = 0.0
    full_heads = 0
    for block in model.blocks:
        layer = block.attn
        log_prior = layer.bound_prior().table(-torch.arange(length)).double()
        suffix_max = log_prior.flip(-1).cummax(-1).values.flip(-1)
        gap = log_prior[:, :1] - suffix_max
        for h, head_gap in enumerate(gap):
            w = torch.ones_like(n)
            if layer.scale_prior:
                w = float(layer.ssmax_s[h]) * n.log()
            need = (tau / w).masked_fill(w <= 0, float("inf"))
            window = torch.searchsorted(head_gap.contiguous(), need).clamp_min(1)
            full_heads += bool(window[-1] >= length)
            read += float(torch.minimum(n, window).sum() / n.sum())
    return read / (len(model.blocks) * model.config.n_head), full_heads


def timed(model, seq):
    """(seconds, losses, work share, peak resident bytes) of one scoring; the work is counted in
    it (a few first_keys calls more)."""
    runtime.reset_peak_memory("cpu")
    started = time.perf_counter()
    with counting_work() as work:
        losses = full_token_losses(model, seq)
    seconds = time.perf_counter() - started
    return seconds, losses, work[0] / work[1], runtime.peak_memory_bytes("cpu")


def bench(path, data_dir, lengths, full_lengths):
    """One row per length: scoring with skipping, and without it at full_lengths."""
    model, _ = load_model(path)
    full_model, _ = load_model(path, skip=False)
    label = os.path.basename(os.path.normpath(path))
    tokens = val_sequences(data_dir, model.config.tokenizer, 1)[0].reshape(-1)
    timed(model, tokens[:1025])  # warm-up
    rows = []
    for length in sorted({min(n, len(tokens) - 1) for n in lengths}):
        seq = tokens[: length + 1]
        on, losses_on, share, peak_on = timed(model, seq)
        predicted, full_heads = predicted_share(model, length)
        row = dict(label=label, length=length, seconds_skip=round(on, 3), work_share=share)
        row.update(predicted_share=round(predicted, 5), full_range_heads=full_heads)
        row.update(ppl=math.exp(float(losses_on.double().mean())), peak_mib_skip=peak_on / 2**20)
        note = ""
        if length in full_lengths:
            off, losses_off, _, peak_off = timed(full_model, seq)
            sums_on = torch.tensor(window_sums(losses_on, 1024)[1])
            sums_off = torch.tensor(window_sums(losses_off, 1024)[1])
            relative = float(((sums_on - sums_off) / sums_off).abs().max())
            row.update(seconds_full=round(off, 3), speedup=round(off / on, 2))
            row.update(peak_mib_full=peak_off / 2**20)
            row.update(max_relative_window_loss_difference=relative)
            note = (
                f"; every key {off:.2f} s ({off / on:.1f}x); 1,024-windows agree to {relative:.1e}"
            )
        rows.append(row)
        print(
            f"{label} @ {length}: {on:.2f} s skipping, ppl {row['ppl']:.3f}, work {share:.1%} "
            f"(priors alone: {predicted:.1%}, {full_heads} heads read every key), "
            f"{peak_on / 2**20:.0f} MiB"
            f"{note}",
            flush=True,
        )
    return rows


@torch.no_grad()
def decode_bench(path, data_dir, contexts, new_tokens=64):
    """ms per generated token after each prompt length, skipping and not; the same greedy tokens."""
    label = os.path.basename(os.path.normpath(path))
    models = {skip: load_model(path, skip=skip)[0] for skip in (True, False)}
    tokens = val_sequences(data_dir, models[True].config.tokenizer, 1)[0].reshape(-1)
    rows = []
    for context in contexts:
        prompt = torch.as_tensor(tokens[:context], dtype=torch.long)[None]
        ms = {}
        generated = {}
        for skip, model in models.items():
            model.generate(prompt[:, -64:], 4)  # warm-up
            started = time.perf_counter()
            model.generate(prompt, 1)
            prefill = time.perf_counter() - started
            started = time.perf_counter()
            generated[skip] = model.generate(prompt, new_tokens)
            ms[skip] = 1000 * (time.perf_counter() - started - prefill) / (new_tokens - 1)
        if generated[True] != generated[False]:
            raise RuntimeError(f"{label} @ {context}: greedy tokens differ with skipping")
        rows.append(dict(label=label, context=context, ms_per_token_skip=round(ms[True], 3)))
        rows[-1].update(
            ms_per_token_full=round(ms[False], 3), speedup=round(ms[False] / ms[True], 2)
        )
        print(
            f"{label} decoding after {context} tokens: {ms[False]:.2f} -> {ms[True]:.2f} ms a "
            f"token ({ms[False] / ms[True]:.1f}x), the same {new_tokens} greedy tokens",
            flush=True,
        )
    return rows


def slope(xs, ys):
    """The log-log slope over the upper half of the points (the asymptotic exponent)."""
    half = len(xs) // 2
    return float(np.polyfit(np.log(xs[half:]), np.log(ys[half:]), 1)[0])


# each table's figure: x, {column: (linestyle, name)}, (x label, y label, title)
FIGURES = {
    "bench_skip": (
        "length",
        {"seconds_full": (":", "every key"), "seconds_skip": ("-", "skipping")},
        ("sequence length (tokens)", "seconds", "One sequence scored on one thread"),
    ),
    "bench_decode": (
        "context",
        {"ms_per_token_full": (":", "every key"), "ms_per_token_skip": ("-", "skipping")},
        ("context (tokens)", "ms per generated token", "Greedy decoding on one thread"),
    ),
}


def plot(rows, x, series, labels, path):
    """Log-log lines per checkpoint, series = {column: (linestyle, name)}, slopes in the legend."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    names = list(dict.fromkeys(r["label"] for r in rows))
    for label, style in curve_styles(names).items():
        for column, (linestyle, name) in series.items():
            mine = [r for r in rows if r["label"] == label and r.get(column) is not None]
            if not mine:
                continue
            xs = [r[x] for r in mine]
            ys = [r[column] for r in mine]
            legend = f"{label} {name}" + (f" (slope {slope(xs, ys):.2f})" if len(xs) > 1 else "")
            ax.plot(
                xs,
                ys,
                linestyle=linestyle,
                color=style["color"],
                marker=style["marker"],
                label=legend,
            )
    ax.set(xscale="log", yscale="log", xlabel=labels[0], ylabel=labels[1], title=labels[2])
    ax.legend(fontsize=7)
    save_figure(fig, path)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", action="append", required=True, help="checkpoint or run directory")
    p.add_argument("--lengths", type=int, nargs="*", default=[8192, 16384, 32768])
    p.add_argument(
        "--full_lengths",
        type=int,
        nargs="*",
        help="lengths to score without skipping too (default: all)",
    )
    p.add_argument("--decode_contexts", type=int, nargs="*", default=[], help="prompt lengths")
    p.add_argument("--data_dir", default="data/text", help="the validation split to score")
    p.add_argument("--out", default="dev/results/skip")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    torch.set_num_threads(1)
    full_lengths = set(args.lengths if args.full_lengths is None else args.full_lengths)
    rows = []
    decode_rows = []
    for path in args.ckpt:
        rows += bench(path, args.data_dir, args.lengths, full_lengths)
        decode_rows += decode_bench(path, args.data_dir, args.decode_contexts)
    os.makedirs(args.out, exist_ok=True)
    for name, table in (("bench_skip", rows), ("bench_decode", decode_rows)):
        if table:
            write_table(table, os.path.join(args.out, name))
            plot(table, *FIGURES[name], os.path.join(args.out, name + ".png"))
            print(f"wrote {args.out}/{name}.json, .csv and .png")
    return rows, decode_rows


if __name__ == "__main__":
    main()

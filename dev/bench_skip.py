"""
Skipping's speed on the CPU: eval_ppl.py's scoring of one validation sequence at each length, with
and without skipping (attention.first_keys), in one process on one thread, for each checkpoint;
beside each ratio, the work share measured and the one the priors alone predict.

    python dev/bench_skip.py --ckpt out/text/bam-s1 --ckpt out/text/alibi-s1 [--lengths 8192 32768]

The prediction is the bound with no content term: head h reads at most the W_h nearest keys, W_h
the smallest n where b(0) - max_{m >= n} b(m) >= tau (every row's window is at least that wide).
Writes bench_skip.json, .csv and .png to --out.
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval_common import counting_work, curve_styles, pyplot, save_figure, write_table  # noqa: E402
from eval_ppl import full_token_losses, val_sequences, window_sums  # noqa: E402
from model import load_model  # noqa: E402


def predicted_share(model, length):
    """The share of visible scores the priors alone leave over the layers and heads (SSMax's row
    scale s_h log n_i included where it scales the prior), and the heads that read every key."""
    tau = math.log(length) + 24 * math.log(2) + 1
    n = torch.arange(1, length + 1, dtype=torch.float64)
    read = 0.0
    full_heads = 0
    for block in model.blocks:
        layer = block.attn
        with torch.no_grad():
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
    """(seconds, losses) of one scoring."""
    started = time.perf_counter()
    losses = full_token_losses(model, seq)
    return time.perf_counter() - started, losses


def work_share(model, seq):
    """The share of visible scores the model's first keys keep on seq (a scoring of its own)."""
    with counting_work() as work:
        full_token_losses(model, seq)
    return work[0] / work[1]


def bench(path, data_dir, lengths):
    model, _ = load_model(path)
    full_model, _ = load_model(path, skip=False)
    label = os.path.basename(os.path.normpath(path))
    rows = []
    for length in lengths:
        seq = val_sequences(data_dir, model.config.tokenizer, length)[0][0]
        timed(model, seq[:1025])  # warm-up
        on, losses_on = timed(model, seq)
        off, losses_off = timed(full_model, seq)
        share = work_share(model, seq)
        sums_on = torch.tensor(window_sums(losses_on, 1024)[1])
        sums_off = torch.tensor(window_sums(losses_off, 1024)[1])
        relative = float(((sums_on - sums_off) / sums_off).abs().max())
        predicted, full_heads = predicted_share(model, length)
        rows.append(
            dict(label=label, length=length, seconds_skip=round(on, 3), seconds_full=round(off, 3))
        )
        rows[-1].update(speedup=round(off / on, 2), work_share=round(share, 5))
        rows[-1].update(predicted_share=round(predicted, 5), full_range_heads=full_heads)
        rows[-1].update(max_relative_window_loss_difference=relative)
        print(
            f"{label} @ {length}: {off:.2f} s -> {on:.2f} s ({off / on:.1f}x); work {share:.1%} "
            f"(priors alone: {predicted:.1%}, {full_heads} heads read every key); "
            f"losses per 1,024 positions agree to {relative:.1e}",
            flush=True,
        )
    return rows


def plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for label, style in curve_styles(labels).items():
        mine = [r for r in rows if r["label"] == label]
        x = [r["length"] for r in mine]
        style = dict(color=style["color"], marker=style["marker"])
        ax.plot(x, [r["seconds_full"] for r in mine], linestyle=":", **style)
        ax.plot(x, [r["seconds_skip"] for r in mine], label=label, **style)
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="seconds")
    ax.set_title("One sequence scored on one thread: every key (dotted), skipping (solid)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", action="append", required=True, help="checkpoint or run directory")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--data_dir", default="data/text", help="the validation split to score")
    p.add_argument("--out", default="dev/results/skip")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    torch.set_num_threads(1)
    rows = []
    for path in args.ckpt:
        rows += bench(path, args.data_dir, args.lengths)
    os.makedirs(args.out, exist_ok=True)
    write_table(rows, os.path.join(args.out, "bench_skip"))
    plot(rows, os.path.join(args.out, "bench_skip.png"))
    print(f"wrote {args.out}/bench_skip.json, .csv and .png")
    return rows


if __name__ == "__main__":
    main()

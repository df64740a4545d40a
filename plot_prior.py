"""
The learned positional prior of a checkpoint, the paper's interpretability view: for every layer (one panel) and
head (one line), the log-prior B_h(d) added to the attention logits, against the distance |d| = i - j from the
query to the key on a log axis.

    python plot_prior.py --ckpt out/demo/bam_ssmax-s1 [--out results/demo/prior.png] [--max_distance 4096]

The numbers come from attention_kernel.ggd_prior (the one home of the formula) with each layer's own parameters,
so the figure is exactly what the model adds. Heads with theta_beta < 0 ("anti-local": the prior is lowest at the
query and rises towards 0 far away, the heads that let BAM retrieve beyond its training context) are drawn thick
and warm-coloured; the others thin and cool. The dashed line marks the training length. With SSMax and
ssmax_prior=True the model multiplies content + prior by s_h * log(n) (spec §4); the figure shows B itself, and
s_h is listed in the legend and the JSON.

Writes the PNG and, beside it, a JSON with the same numbers (<out>.json): per layer and head theta_alpha,
theta_beta, mu, SSMax s, B at d = 0, and B at every plotted distance. Works for bam and alibi checkpoints (ALiBi
is the prior with theta_beta = 1 and fixed slopes); other encodings have no prior to show.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

from attention_kernel import ggd_prior
from model import load_model


def distances(max_distance, per_octave=8):
    """1 .. max_distance, log-spaced (integers, unique, both ends included)."""
    n = max(2, int(np.ceil(np.log2(max(max_distance, 2)) * per_octave)) + 1)
    return sorted({int(round(x)) for x in np.geomspace(1, max_distance, n)})


@torch.no_grad()
def prior_tables(model, dist):
    """[{layer, heads: [{head, theta_alpha, theta_beta, mu, ssmax_s, bias_at_0, bias}]}] for every layer that has a
    prior. bias[k] = B(d = -dist[k]): the key lies dist[k] positions before the query."""
    summary = {row["layer"]: row for row in model.prior_summary()}
    d = -torch.tensor([0] + list(dist), dtype=torch.float64)
    layers = []
    for i, block in enumerate(model.blocks):
        prior = block.attn.prior()
        if prior is None:
            continue
        table = ggd_prior(d, *prior).double()  # (H, 1 + len(dist))
        row = summary[i]
        heads = []
        for h in range(table.shape[0]):
            heads.append(dict(head=h, theta_alpha=row["theta_alpha"][h], theta_beta=row["theta_beta"][h],
                              mu=row["mu"][h], ssmax_s=row["ssmax_s"][h] if "ssmax_s" in row else None,
                              bias_at_0=table[h, 0].item(), bias=table[h, 1:].tolist()))
        layers.append(dict(layer=i, heads=heads))
    return layers


def plot(layers, dist, block_size, title, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(layers)
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4.4), squeeze=False, sharey=True)
    warm, cool = plt.get_cmap("autumn"), plt.get_cmap("winter")
    for ax, layer in zip(axes[0], layers):
        heads = layer["heads"]
        neg = [h for h in heads if h["theta_beta"] < 0]
        pos = [h for h in heads if h["theta_beta"] >= 0]
        for group, cmap, lw, ls in ((pos, cool, 1.2, "--"), (neg, warm, 2.6, "-")):
            for k, h in enumerate(sorted(group, key=lambda h: h["theta_beta"])):
                label = f"h{h['head']}: θβ={h['theta_beta']:+.2f}, θα={h['theta_alpha']:+.1f}"
                if h["ssmax_s"] is not None:
                    label += f", s={h['ssmax_s']:.2f}"
                ax.plot(dist, h["bias"], ls, lw=lw, color=cmap(0.85 * k / max(1, len(group) - 1)), label=label)
        ax.axvline(block_size, color="gray", ls=":", lw=1)
        ax.annotate(f"train length {block_size}", (block_size, 0.02), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize=7, color="gray", ha="right", va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("distance to the key |j - i| (tokens, log scale)")
        ax.set_title(f"layer {layer['layer']}: {len(neg)} of {len(heads)} heads with θβ < 0", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="lower left")
    axes[0][0].set_ylabel("log-prior B(d) added to the logits (symlog)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def build_parser():
    ap = argparse.ArgumentParser(description="Plot the learned GGD-BAM prior of every layer and head.")
    ap.add_argument("--ckpt", required=True, help="checkpoint file or run directory (newest ckpt_*.pt)")
    ap.add_argument("--out", default=None, help="PNG path (default: prior.png in the run directory); "
                                                 "the numbers go to the same path with .json")
    ap.add_argument("--max_distance", type=int, default=None, help="largest distance shown (default 64 x the "
                                                                    "training length)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    model, ckpt = load_model(args.ckpt)
    cfg = model.config
    if cfg.pos_encoding not in ("bam", "alibi"):
        sys.exit(f"plot_prior.py: {ckpt['path']} uses pos_encoding={cfg.pos_encoding!r}, which has no positional "
                 "prior to plot (bam and alibi do)")
    out = args.out or os.path.join(os.path.dirname(ckpt["path"]), "prior.png")
    max_distance = args.max_distance or 64 * cfg.block_size
    if max_distance < 2:
        sys.exit("--max_distance must be at least 2")
    dist = distances(max_distance)
    layers = prior_tables(model, dist)
    run = os.path.basename(os.path.dirname(os.path.abspath(ckpt["path"])))
    name = cfg.pos_encoding + ("+ssmax" if cfg.ssmax else "")
    n_neg = sum(h["theta_beta"] < 0 for layer in layers for h in layer["heads"])
    n_all = sum(len(layer["heads"]) for layer in layers)
    title = (f"{run} ({name}, step {ckpt.get('step', '?')}): learned prior B(d) = -exp(θα)(|d - μ| + 1e-5)^θβ; "
             f"{n_neg}/{n_all} heads with θβ < 0")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    plot(layers, dist, cfg.block_size, title, out)
    json_path = os.path.splitext(out)[0] + ".json"
    with open(json_path, "w") as f:
        json.dump(dict(ckpt=ckpt["path"], step=ckpt.get("step"), pos_encoding=cfg.pos_encoding, ssmax=cfg.ssmax,
                       ssmax_prior=cfg.ssmax_prior, block_size=cfg.block_size, distances=dist,
                       heads_theta_beta_negative=n_neg, heads=n_all, layers=layers), f, indent=1)
    for layer in layers:
        betas = " ".join(f"{h['theta_beta']:+.2f}" for h in layer["heads"])
        print(f"layer {layer['layer']}: theta_beta {betas}")
    print(f"{n_neg}/{n_all} heads with theta_beta < 0; wrote {out} and {json_path}")


if __name__ == "__main__":
    main()

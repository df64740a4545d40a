"""
The learned positional prior of a checkpoint: per layer (a panel) and head (a line), the log-prior
B_h(d) that the registered prior (priors.py) adds to the logits, against the distance |d| on a log
axis, out to 64 times the training length. bam and alibi only.

    python analysis/plot_prior.py --ckpt out/demo/bam_ssmax-s1 [--out results/demo/prior.png]

Heads the prior's highlight rule picks (GGD: theta_beta < 0, anti-local) are drawn thick and warm;
SSMax's s_h is in the legend. Writes the PNG and <out>.json with the same numbers.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from eval_common import EXPECTED_ERRORS, FULL_DISK_REMEDY, EvalError, pyplot, save_figure  # noqa: E402
from infra.runtime import atomic_file, errors_in_one_line  # noqa: E402
from model import load_model  # noqa: E402
from priors import ggd_mu  # noqa: E402

MAX_DISTANCE_MULTIPLE = 64  # the curves reach this multiple of the training length


def distances(max_distance, per_octave=8):
    """1 .. max_distance, log-spaced (integers, unique, both ends included)."""
    n = max(2, int(np.ceil(np.log2(max(max_distance, 2)) * per_octave)) + 1)

    return sorted({int(round(x)) for x in np.geomspace(1, max_distance, n)})


@torch.no_grad()
def prior_summary(model):
    """Per layer with a prior or SSMax: its name, parameters per head (ggd also mu), SSMax's s."""
    rows = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        family = attn.family
        row = {"layer": i}

        if family is not None:
            row["prior"] = family.name
            for name in family.params:
                row[name] = getattr(attn, name).float().tolist()
            if family.name == "ggd":
                row["mu"] = ggd_mu(attn.theta_mu.float()).tolist()

        if attn.ssmax_s is not None:
            row["ssmax_s"] = attn.ssmax_s.float().tolist()
        if len(row) > 1:
            rows.append(row)
    return rows


@torch.no_grad()
def prior_tables(model, dist):
    """[{layer, heads: [{head, <each prior parameter>, (mu,) ssmax_s, highlighted, bias_at_0,
    bias}]}] per layer with a prior; bias[k] = B(d = -dist[k])."""
    summary = {row["layer"]: row for row in prior_summary(model)}
    offsets = -torch.tensor([0] + list(dist), dtype=torch.float64)  # d = j - i <= 0

    layers = []
    for i, block in enumerate(model.blocks):
        bound = block.attn.bound_prior()
        if bound is None:
            continue

        # the registered formula itself, without the floor attention applies: (H, 1 + len(dist))
        table = bound.family.fn(offsets, *bound.params).double()
        highlighted = [False] * table.shape[0]
        if bound.family.highlight is not None:
            highlighted = bound.family.highlight(*bound.params).tolist()

        row = summary[i]
        per_head = [k for k in row if k not in ("layer", "prior")]
        heads = [
            dict(
                head=h,
                **{k: row[k][h] for k in per_head if k not in bound.family.shared},
                highlighted=bool(highlighted[h]),
                bias_at_0=table[h, 0].item(),
                bias=table[h, 1:].tolist(),
            )
            for h in range(table.shape[0])
        ]
        layers.append(dict(layer=i, heads=heads))
    return layers


def shape_of(h, prior):
    """The legend's order: the shape parameter if one number, else (T5's buckets) the last bias."""
    value = h.get(prior.shape_param)

    return value if isinstance(value, float) else h["bias"][-1]


def legend_label(h, prior):
    """'h3: θbeta=+0.52, θalpha=-1.3, s=1.02': the shape parameter first, no vector parameters."""
    names = sorted(prior.params, key=lambda n: n != prior.shape_param)
    parts = [
        f"{n.replace('theta_', 'θ')}={h[n]:+.2f}" for n in names if isinstance(h.get(n), float)
    ]
    if h.get("ssmax_s") is not None:
        parts.append(f"s={h['ssmax_s']:.2f}")

    return f"h{h['head']}: " + ", ".join(parts)


def plot(layers, dist, block_size, prior, title, path):
    """A panel per layer, a curve per head: highlighted heads thick and warm, the others dashed."""
    plt = pyplot()
    n_layers = len(layers)
    fig, axes = plt.subplots(1, n_layers, figsize=(4.6 * n_layers, 4.4), squeeze=False, sharey=True)

    for ax, layer in zip(axes[0], layers):
        heads = layer["heads"]
        hot = [h for h in heads if h["highlighted"]]
        rest = [h for h in heads if not h["highlighted"]]
        for group, cmap, lw, ls in ((rest, "winter", 1.2, "--"), (hot, "autumn", 2.6, "-")):
            for k, h in enumerate(sorted(group, key=lambda h: shape_of(h, prior))):
                color = plt.get_cmap(cmap)(0.85 * k / max(1, len(group) - 1))
                ax.plot(dist, h["bias"], ls, lw=lw, color=color, label=legend_label(h, prior))

        ax.axvline(block_size, color="gray", ls=":", lw=1)
        note = dict(rotation=90, fontsize=7, color="gray", ha="right", va="bottom")
        ax.annotate(
            f"train length {block_size}",
            (block_size, 0.02),
            xycoords=("data", "axes fraction"),
            **note,
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("distance to the key |j - i| (tokens, log scale)")
        title_of_panel = f"layer {layer['layer']}"
        if prior.highlight:
            title_of_panel += f": {len(hot)} of {len(heads)} heads with {prior.highlight_label}"
        ax.set_title(title_of_panel, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="lower left")

    axes[0][0].set_ylabel("log-prior B(d) added to the logits (symlog)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)


def build_parser():
    ap = argparse.ArgumentParser(
        description="Plot the positional prior of every layer and head of a checkpoint."
    )
    ap.add_argument(
        "--ckpt", required=True, help="checkpoint file or run directory (newest ckpt_*.pt)"
    )
    ap.add_argument(
        "--out",
        help="PNG path (default: prior.png in the run directory), its numbers beside in .json",
    )
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    model, ckpt = load_model(args.ckpt)
    cfg = model.config
    if cfg.pos_encoding not in ("bam", "alibi"):
        raise EvalError(
            f"{ckpt['path']} uses pos_encoding={cfg.pos_encoding!r}, which has no positional prior "
            "to plot (bam and alibi do)"
        )

    out = args.out or os.path.join(os.path.dirname(ckpt["path"]), "prior.png")
    dist = distances(MAX_DISTANCE_MULTIPLE * cfg.block_size)
    layers = prior_tables(model, dist)
    prior = model.blocks[0].attn.family
    n_hot = sum(h["highlighted"] for layer in layers for h in layer["heads"])
    n_all = sum(len(layer["heads"]) for layer in layers)
    hot = f"{n_hot}/{n_all} heads with {prior.highlight_label}" if prior.highlight else ""

    run = os.path.basename(os.path.dirname(os.path.abspath(ckpt["path"])))
    name = cfg.pos_encoding + ("+ssmax" if cfg.ssmax else "")
    title = f"{run} ({name}, step {ckpt.get('step', '?')}): {prior.name} prior {prior.formula}"
    if hot:
        title += f"\n{hot}"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    plot(layers, dist, cfg.block_size, prior, title, out)

    numbers = dict(
        ckpt=ckpt["path"],
        step=ckpt.get("step"),
        pos_encoding=cfg.pos_encoding,
        prior=prior.name,
        formula=prior.formula,
        ssmax=cfg.ssmax,
        scale_prior=cfg.scale_prior,
        block_size=cfg.block_size,
        distances=dist,
        highlight=prior.highlight_label,
        heads_highlighted=n_hot,
        heads=n_all,
        layers=layers,
    )
    json_path = os.path.splitext(out)[0] + ".json"
    with atomic_file(json_path, "w") as f:
        json.dump(numbers, f, indent=1)

    scalar = all(isinstance(h.get(prior.shape_param), float) for h in layers[0]["heads"])
    label = prior.shape_param if scalar else f"B(-{dist[-1]})"
    for layer in layers:
        values = " ".join(f"{shape_of(h, prior):+.2f}" for h in layer["heads"])
        print(f"layer {layer['layer']}: {label} {values}")
    print((hot + "; " if hot else "") + f"wrote {out} and {json_path}")


if __name__ == "__main__":
    errors_in_one_line("plot_prior.py", EXPECTED_ERRORS, FULL_DISK_REMEDY)
    main()

"""
Which heads read the passkey needle, and how far each head looks, on eval_passkey.py's own prompts.

    python analysis/inspect_attention.py --ckpt out/demo/bam_ssmax-s1 [--ckpt out/demo/alibi-s1 ...]
        --template demo --lengths 64 256 1024 4096 [--samples 20] [--out results/inspect]

At the query that predicts the first answer digit (--digit K: the K-th), per layer and head, means
over the prompts of the attention on the key's tokens and on the digit it copies, the mean distance
and the entropy, beside the head's prior. Writes attention_heads (.json/.csv/.png),
attention_summary.json and attention_needle_vs_length.png to --out.
"""

import argparse
import json
import os
import re
import sys
import time
from unittest import mock

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import eval_passkey as passkey  # noqa: E402
import model as model_code  # noqa: E402
from analysis.plot_prior import prior_summary  # noqa: E402
from attention import attention_probs  # noqa: E402
from eval_common import (  # noqa: E402
    EXPECTED_ERRORS,
    FULL_DISK_REMEDY,
    EvalError,
    Evaluation,
    add_common_args,
    plot_curves,
    pyplot,
    save_figure,
    start,
    write_table,
)
from eval_passkey import SEED  # noqa: E402
from infra import runtime  # noqa: E402

READS = 0.5  # a head "reads the needle" when most of its attention lies on the key's tokens


# ---- What is measured
def key_positions(enc, tokens, info):
    """Positions of the needle's tokens that carry key digits (merged ones too: gpt2's " 123")."""
    start = info["needle_start"]
    end = info["needle_end"]
    # byte offsets: the key's digits are ASCII
    token_bytes = [enc.token_bytes(t) for t in tokens[start:end]]
    text = b"".join(token_bytes)
    bounds = np.cumsum([0] + [len(b) for b in token_bytes]).tolist()
    spans = [m.span() for m in re.finditer(re.escape(str(info["key"]).encode()), text)]

    positions = []
    for t in range(end - start):
        # token t's bytes overlap a span lo..hi-1 of the key
        if any(bounds[t] < hi and lo < bounds[t + 1] for lo, hi in spans):
            positions.append(start + t)

    if not positions:
        needle = text.decode(errors="replace")
        raise ValueError(f"the key {info['key']} does not occur in the needle {needle!r}")

    return positions


def row_metrics(p, query_pos, key_pos):
    """(needle mass, mean distance, entropy in nats) of query_pos's weights p (..., keys)."""
    p = p.double()
    dist = query_pos - torch.arange(p.shape[-1], dtype=torch.float64, device=p.device)
    mass = p[..., list(key_pos)].sum(-1)

    return mass, (p * dist).sum(-1), -torch.special.xlogy(p, p).sum(-1)


@torch.no_grad()
def answer_row_probs(model, idx):
    """((n_layer, B, H, T) attention weights of the last query, its logits) from one forward: each
    layer's attention() call also computes that row alone (memory linear in the length)."""
    rows = []
    attention = model_code.attention

    def attention_and_answer_row(q, k, v, *, impl, row_scale=None, **kwargs):
        # SSMax: the answer row's own scale
        answer_scale = None if row_scale is None else row_scale[..., -1:]
        probs = attention_probs(
            q[:, :, -1:], k, q_offset=k.shape[2] - 1, row_scale=answer_scale, **kwargs
        )
        rows.append(probs[:, :, 0])

        return attention(q, k, v, impl=impl, row_scale=row_scale, **kwargs)

    with mock.patch.object(model_code, "attention", attention_and_answer_row):
        logits, _ = model(idx, logits_at=1)

    return torch.stack(rows), logits[:, -1]


def head_priors(model):
    """{layer: [per head: prior, parameters, shape_param, shape, highlight, ssmax_s, if any]}."""
    out = {}
    for row in prior_summary(model):
        prior = model.blocks[row["layer"]].attn.family
        marked = None
        if prior is not None and prior.highlight is not None:
            marked = prior.highlight(*(torch.tensor(row[n]) for n in prior.params)).tolist()

        heads = [{} for _ in range(model.config.n_head)]
        for h, head in enumerate(heads):
            if prior is not None:
                shape = row[prior.shape_param][h]
                head.update(prior=prior.name, shape_param=prior.shape_param, shape=shape)
                head.update({name: row[name][h] for name in prior.params})
            if marked is not None:
                head.update(highlight=bool(marked[h]), highlight_label=prior.highlight_label)
            if "ssmax_s" in row:
                head["ssmax_s"] = row["ssmax_s"][h]
        out[row["layer"]] = heads

    return out


# ---- Measuring every head of a checkpoint at one length
def inspect_prompt(ev, model, template, sample, digit):
    """One prompt (make_samples' (prompt, answer, info)): ((n_layer, H, 4) needle mass, distance,
    entropy, digit mass; [length, needle distance, uniform mass]; whether answer digit `digit` is
    the argmax)."""
    prompt, answer, info = sample
    n_given = info["n_given"] + digit - 1
    # the given answer tokens are read, then digit `digit` is predicted
    tokens = prompt + answer[:n_given]
    query = len(tokens) - 1

    keys = key_positions(ev.enc, prompt, info)
    one_token_per_digit = len(keys) == template["digits"]
    if digit > 1 and not one_token_per_digit:
        raise EvalError(
            f"--digit {digit} needs one token per key digit; this tokenizer merges digits"
        )

    idx = torch.tensor([tokens], dtype=torch.long, device=ev.device)
    with runtime.autocast(ev.device, ev.dtype):
        probs, logits = answer_row_probs(model, idx)
    correct = int(logits[0, : model.config.vocab_size].argmax()) == answer[n_given]

    metrics = torch.stack(row_metrics(probs[:, 0], query, keys), -1).cpu()  # (n_layer, H, 3)
    # the mass on the needle's digit that this answer digit copies
    digit_mass = torch.full(metrics.shape[:2] + (1,), float("nan"), dtype=torch.float64)
    if one_token_per_digit:
        digit_mass = probs[:, 0, :, keys[digit - 1]].double().cpu()[..., None]
    metrics = torch.cat([metrics, digit_mass], -1)

    prompt_stats = [len(tokens), query - float(np.mean(keys)), len(keys) / (query + 1)]

    return metrics, torch.tensor(prompt_stats, dtype=torch.float64), correct


def inspect_length(ev, run, template, length, samples, digit=1):
    """Rows (per layer x head, sample means) and digit `digit`'s accuracy, earlier digits given,
    on eval_passkey's prompts of SEED."""
    model = run["model"]
    metric_sums = 0
    stat_sums = 0
    n_correct = 0
    for sample in passkey.make_samples(ev.enc, template, length, samples, SEED):
        metrics, stats, correct = inspect_prompt(ev, model, template, sample, digit)
        metric_sums = metric_sums + metrics
        stat_sums = stat_sums + stats
        n_correct += correct

    metrics = metric_sums / samples
    length_tokens, needle_distance, uniform_mass = (stat_sums / samples).tolist()

    priors = head_priors(model)
    rows = []
    for layer in range(metrics.shape[0]):
        for head in range(metrics.shape[1]):
            needle_mass, mean_distance, entropy, digit_mass = metrics[layer, head].tolist()
            rows.append(
                dict(
                    label=run["label"],
                    pos_encoding=model.config.pos_encoding,
                    ssmax=model.config.ssmax,
                    train_length=run["block_size"],
                    target_length=length,
                    length=round(length_tokens, 1),
                    samples=samples,
                    digit=digit,
                    layer=layer,
                    head=head,
                    needle_mass=needle_mass,
                    digit_mass=digit_mass,
                    mean_distance=mean_distance,
                    needle_distance=needle_distance,
                    entropy=entropy,
                    uniform_mass=uniform_mass,
                    **(priors[layer][head] if layer in priors else {}),
                )
            )

    return rows, n_correct / samples


# ---- Summary
TOP = 3  # heads listed per checkpoint


def summarize(rows, accuracy, runs, lengths, length):
    """Per checkpoint: the TOP heads at `length`, those with mass >= READS, the best's curve."""
    keep = ("layer", "head", "needle_mass", "mean_distance", "entropy", "shape_param", "shape")

    out = []
    for run in runs:
        mine = [x for x in rows if x["label"] == run["label"]]
        ranked = [x for x in mine if x["target_length"] == length]
        ranked = sorted(ranked, key=lambda x: -x["needle_mass"])
        if not ranked:
            continue

        best = ranked[0]
        readers = [x for x in ranked if x["needle_mass"] >= READS]
        out.append(
            dict(
                label=run["label"],
                pos_encoding=best["pos_encoding"],
                ssmax=best["ssmax"],
                train_length=run["block_size"],
                chosen_at=length,
                top_heads=[{k: x[k] for k in keep if k in x} for x in ranked[:TOP]],
                readers=[{k: x[k] for k in keep if k in x} for x in readers],
                curve=best_head_curve(mine, best, lengths, accuracy, run["label"]),
            )
        )

    return out


def best_head_curve(mine, best, lengths, accuracy, label):
    """Per length with rows: head `best`'s needle mass and distance, any head's largest, etc."""
    curve = []
    for L in lengths:
        cell = [x for x in mine if x["target_length"] == L]
        if not cell:
            continue

        here = next(x for x in cell if (x["layer"], x["head"]) == (best["layer"], best["head"]))
        top_here = max(cell, key=lambda x: x["needle_mass"])
        curve.append(
            dict(
                target_length=L,
                needle_mass=here["needle_mass"],
                mean_distance=here["mean_distance"],
                max_needle_mass=top_here["needle_mass"],
                max_head=[top_here["layer"], top_here["head"]],
                uniform_mass=here["uniform_mass"],
                first_token_accuracy=accuracy[(label, L)],
            )
        )

    return curve


# ---- Figures
def head_label(row):
    """'θbeta=-0.42' for a head with a prior (its shape parameter), '' without one or where the
    shape is a vector (T5's buckets)."""
    if not isinstance(row.get("shape"), (int, float)):
        return ""

    return f"{row['shape_param'].replace('theta_', 'θ')}={row['shape']:+.2g}"


def plot_heads(rows, runs, length, path):
    """Per checkpoint, layers x heads coloured by needle mass at `length`."""
    plt = pyplot()
    panels = []
    for run in runs:
        cell = [x for x in rows if x["label"] == run["label"] and x["target_length"] == length]
        if cell:
            panels.append((run, cell))

    n_layer = max(x["layer"] for _, cell in panels for x in cell) + 1
    n_head = max(x["head"] for _, cell in panels for x in cell) + 1
    figsize = (1.6 + 0.85 * n_head, 0.9 + (0.55 * n_layer + 0.7) * len(panels))
    fig, axes = plt.subplots(len(panels), 1, figsize=figsize, squeeze=False)
    for ax, (run, cell) in zip(axes[:, 0], panels):
        image = draw_heads(plt, ax, cell, n_layer, n_head)
        first = cell[0]
        name = first["pos_encoding"] + ("+ssmax" if first["ssmax"] else "")
        multiple = length / run["block_size"]
        title = f"{run['label']} ({name}): {length} tokens = {multiple:g}x the training length"
        if any(x.get("highlight") for x in cell):
            title += f"; red frame: {first['highlight_label']}"
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02, label="needle mass")

    fig.suptitle(
        "Attention of the answer query on the needle's key tokens, per head\n"
        "(cell: the head's prior shape parameter, then its needle mass; mean over prompts)",
        fontsize=9,
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def draw_heads(plt, ax, cell, n_layer, n_head):
    """One checkpoint's layers x heads panel; returns the image (for its colour bar)."""
    needle_mass = np.full((n_layer, n_head), np.nan)
    for x in cell:
        needle_mass[x["layer"], x["head"]] = x["needle_mass"]
        text = "\n".join(filter(None, [head_label(x), f"{x['needle_mass']:.2f}"]))
        color = "black" if x["needle_mass"] > 0.6 else "white"
        ax.text(x["head"], x["layer"], text, ha="center", va="center", fontsize=6.5, color=color)
        if x.get("highlight"):
            corner = (x["head"] - 0.47, x["layer"] - 0.47)
            frame = plt.Rectangle(corner, 0.94, 0.94, fill=False, edgecolor="red", linewidth=2)
            ax.add_patch(frame)

    image = ax.imshow(needle_mass, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(n_head), [f"h{h}" for h in range(n_head)], fontsize=7)
    ax.set_yticks(range(n_layer), [f"layer {i}" for i in range(n_layer)], fontsize=7)
    return image


def plot_needle_vs_length(summary, path):
    """Each checkpoint's best head's needle mass by prompt length, and uniform attention's."""
    series = {}
    for s in summary:
        best = s["top_heads"][0]
        name = f"{s['label']} L{best['layer']}.h{best['head']}"
        label = " ".join(filter(None, [name, head_label(best)]))
        lengths = [c["target_length"] for c in s["curve"]]
        series[label] = (lengths, [c["needle_mass"] for c in s["curve"]])

    longest = max(summary, key=lambda s: len(s["curve"]))["curve"]
    lengths = [c["target_length"] for c in longest]
    series["uniform attention"] = (lengths, [c["uniform_mass"] for c in longest])

    plot_curves(
        series,
        [s["train_length"] for s in summary],
        path,
        xlabel="prompt length (tokens, log scale)",
        ylabel="attention mass on the needle's key tokens",
        title=f"Needle mass of each checkpoint's best head (chosen at {summary[0]['chosen_at']} "
        "tokens)",
        ylim=(-0.03, 1.03),
    )


# ---- Results
def write_outputs(args, rows, summary, runs, settings, t0):
    """attention_heads.{json,csv,png}, attention_needle_vs_length.png, attention_summary.json."""
    write_table(rows, os.path.join(args.out, "attention_heads"))

    figures = ["attention_heads.png", "attention_needle_vs_length.png"]
    plot_heads(rows, runs, settings["length"], os.path.join(args.out, figures[0]))
    plot_needle_vs_length(summary, os.path.join(args.out, figures[1]))

    written = dict(
        settings=settings,
        checkpoints=summary,
        wall_seconds=round(time.perf_counter() - t0, 2),
        figures=figures,
    )
    with runtime.atomic_file(os.path.join(args.out, "attention_summary.json"), "w") as f:
        json.dump(written, f, indent=1)


def describe_heads(heads):
    """'L1.h2 0.604 (θbeta=-0.07), ...' or 'none'."""
    described = []
    for head in heads:
        label = head_label(head)
        text = f"L{head['layer']}.h{head['head']} {head['needle_mass']:.3f}"
        described.append(text + (f" ({label})" if label else ""))
    return ", ".join(described) or "none"


def report(summary):
    """Per checkpoint: top heads and readers at the heatmap length, the best head's curve."""
    for s in summary:
        curve = " ".join(f"{c['target_length']}:{c['needle_mass']:.3f}" for c in s["curve"])
        print(f"{s['label']}: top heads at {s['chosen_at']}: {describe_heads(s['top_heads'])}")
        print(f"  heads with needle mass >= {READS}: {describe_heads(s['readers'])}")
        print(f"  best head's needle mass by length: {curve}")


# ---- Command line
def build_parser():
    ap = argparse.ArgumentParser(
        description="Per-head attention on the passkey needle: mass, distance, entropy."
    )
    add_common_args(ap, default_out="results/inspect")
    ap.add_argument("--template", choices=sorted(passkey.TEMPLATES), default="paper")
    ap.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        required=True,
        help="prompt lengths of the needle-vs-length curve; the heatmap and the best head are "
        "chosen at the largest",
    )
    ap.add_argument(
        "--samples",
        type=int,
        default=passkey.DEFAULT_SAMPLES,
        help="prompts per length (equidistant depths)",
    )
    ap.add_argument(
        "--digit",
        type=int,
        default=1,
        help="inspect the query that predicts this answer digit "
        "(1 = the first; digit_mass is the attention on the needle digit it copies)",
    )
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap


def inspect_all(ev, template, lengths, args):
    """(every checkpoint's and length's rows, {(label, length): accuracy}); OOM: EvalError."""
    total = len(ev.runs) * len(lengths) * args.samples
    bar = tqdm(
        total=total, desc="inspect", unit="prompt", file=sys.stderr, disable=args.no_progress
    )

    rows = []
    accuracy = {}
    for run in ev.runs:
        for L in lengths:
            bar.set_description(f"inspect {run['label']} L={L}")
            try:
                cell, accuracy[(run["label"], L)] = inspect_length(
                    ev, run, template, L, args.samples, args.digit
                )
            except RuntimeError as error:
                reason = runtime.out_of_memory(error, ev.device)
                if reason is None:
                    raise
                raise EvalError(f"{run['label']} at {L} tokens: {reason}; drop that length")
            rows += cell
            bar.update(args.samples)
    bar.close()
    return rows, accuracy


def main(argv=None):
    args = build_parser().parse_args(argv)
    template = passkey.TEMPLATES[args.template]
    if args.samples < 1:
        raise EvalError("--samples must be positive")
    if not 1 <= args.digit <= template["digits"]:
        raise EvalError(f"--digit must be between 1 and the template's {template['digits']} digits")

    t0 = time.perf_counter()
    runs, enc, device, dtype = start(args)
    lengths = sorted(set(args.lengths))
    shortest = passkey.min_prompt_length(enc, template)
    if lengths[0] < shortest:
        raise EvalError(
            f"length {lengths[0]} is shorter than the {args.template} prompt without filler "
            f"({shortest} tokens)"
        )
    runtime.own_folder(args.out)

    rows, accuracy = inspect_all(Evaluation(runs, enc, device, dtype), template, lengths, args)
    summary = summarize(rows, accuracy, runs, lengths, lengths[-1])
    settings = dict(
        template=args.template,
        template_hash=passkey.template_hash(template),
        seed=SEED,
        samples=args.samples,
        digit=args.digit,
        depths="equidistant",
        length=lengths[-1],
        lengths=lengths,
        dtype=dtype,
        device=str(device),
        tokenizer=runs[0]["tokenizer"],
    )
    write_outputs(args, rows, summary, runs, settings, t0)

    report(summary)
    print(
        "wrote attention_heads.{json,csv,png}, attention_needle_vs_length.png and "
        f"attention_summary.json to {args.out}/"
    )
    return rows, summary


if __name__ == "__main__":
    runtime.return_large_allocations()
    runtime.errors_in_one_line("inspect_attention.py", EXPECTED_ERRORS, FULL_DISK_REMEDY)
    main()

"""
Which heads read the passkey needle, and how far each head looks, on eval_passkey.py's own prompts.

    python inspect_attention.py --ckpt out/demo/bam_ssmax-s1 [--ckpt out/demo/alibi-s1 ...] --template demo
        --length 4096 [--lengths 64 256 1024 4096] [--samples 20] [--out results/inspect]

Per checkpoint, length, layer and head, at the query that predicts the first answer digit (--digit K: the K-th,
the earlier ones given), means over the prompts: needle_mass (attention on the key's tokens), digit_mass (on the
needle digit that the answer digit copies), mean_distance (sum_j p_j (i - j)) and entropy (nats), beside the head's
prior. Writes to --out: attention_heads.{json,csv,png}, attention_summary.json (per checkpoint its top heads and
those with needle mass >= 0.5 at --length, its best head at every length), attention_needle_vs_length.png.
"""
import argparse
import json
import os
import re
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import eval_common as ec
import eval_passkey as ep
from attention import attention_probs
from hardware import autocast
from priors import get_prior

READS = 0.5  # a head "reads the needle" when most of its attention lies on the key's tokens


# ---- What is measured ------------------------------------------------------------------------------------------
def key_positions(enc, tokens, info):
    """Positions of the needle's tokens that carry the key's digits (also merged ones, gpt2's " 123", "45.")."""
    start, end = info["needle_start"], info["needle_end"]
    pieces = [enc.token_bytes(t) for t in tokens[start:end]]  # byte offsets: the key's digits are ASCII
    text, bounds = b"".join(pieces), np.cumsum([0] + [len(b) for b in pieces]).tolist()
    spans = [m.span() for m in re.finditer(re.escape(str(info["key"]).encode()), text)]
    pos = [start + t for t in range(end - start) if any(bounds[t] < b and a < bounds[t + 1] for a, b in spans)]
    if not pos:
        raise ValueError(f"the key {info['key']} does not occur in the needle {text.decode(errors='replace')!r}")
    return pos


def row_metrics(p, query_pos, key_pos):
    """(needle mass, mean attended distance, entropy in nats) in float64 of p (..., n_keys), the attention weights
    over keys 0 .. n_keys-1 of the query at query_pos."""
    p = p.double()
    dist = query_pos - torch.arange(p.shape[-1], dtype=torch.float64, device=p.device)
    mass = p[..., list(key_pos)].sum(-1)
    return mass, (p * dist).sum(-1), -torch.special.xlogy(p, p).sum(-1)


@torch.no_grad()
def answer_row_probs(model, idx):
    """((n_layer, B, H, T) attention weights of the last query per layer, its logits) from one forward: a pre-hook
    per layer recomputes q and k and asks attention_probs for that row alone (memory linear in the length)."""
    rows = []

    def hook(attn, args):
        x, rope, doc_start, log_n = args[:4]
        q, k, _ = attn.qkv(x, rope)
        kwargs = attn.attention_kwargs(doc_start, log_n)
        if kwargs.get("row_scale") is not None:  # SSMax: the answer row's own scale
            kwargs["row_scale"] = kwargs["row_scale"][..., -1:]
        T = k.shape[2]
        rows.append(attention_probs(q[:, :, -1:], k, q_offset=T - 1, **kwargs)[:, :, 0])

    handles = [block.attn.register_forward_pre_hook(hook) for block in model.blocks]
    try:
        logits, _ = model(idx, logits_at=1)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(rows), logits[:, -1]


def head_priors(model):
    """{layer: [per head: the prior's name, parameters, shape_param and shape, highlight (GGD: theta_beta < 0),
    ssmax_s]}; layers without a prior give only ssmax_s, or nothing."""
    out = {}
    for row in model.prior_summary():
        heads = [{} for _ in range(model.config.n_head)]
        prior = get_prior(row["prior"]) if "prior" in row else None
        marked = None
        if prior is not None and prior.highlight is not None:
            marked = prior.highlight(*(torch.tensor(row[n]) for n in prior.params)).tolist()
        for h, d in enumerate(heads):
            if prior is not None:
                d.update(prior=prior.name, shape_param=prior.shape_param, shape=row[prior.shape_param][h])
                d.update({name: row[name][h] for name in prior.params})
            if marked is not None:
                d.update(highlight=bool(marked[h]), highlight_label=prior.highlight_label)
            if "ssmax_s" in row:
                d["ssmax_s"] = row["ssmax_s"][h]
        out[row["layer"]] = heads
    return out


# ---- Measuring every head of a checkpoint at one length --------------------------------------------------------
def inspect_length(run, enc, template, length, samples, seed, device, dtype, bar=None, digit=1):
    """Rows (one per layer x head, means over the samples) and the accuracy of answer digit `digit` at one length,
    at the query that predicts it (the earlier digits given, as eval_passkey.py scores them)."""
    model = run["model"]
    sums, n_correct = None, 0
    for prompt, answer, info in ep.make_samples(enc, template, length, samples, seed):
        n_given = info["n_given"] + digit - 1
        tokens = prompt + answer[:n_given]  # the given answer tokens are read, then digit `digit` is predicted
        i = len(tokens) - 1
        keys = key_positions(enc, prompt, info)
        if digit > 1 and len(keys) != template["digits"]:
            raise ValueError(f"--digit {digit} needs one token per key digit; this tokenizer merges digits")
        idx = torch.tensor([tokens], dtype=torch.long, device=device)
        with autocast(device, dtype):
            probs, logits = answer_row_probs(model, idx)
        n_correct += int(logits[0, :model.config.vocab_size].argmax()) == answer[n_given]
        m = torch.stack(row_metrics(probs[:, 0], i, keys), -1).cpu()  # (n_layer, H, 3)
        if len(keys) == template["digits"]:  # the mass on the needle's digit that this answer digit copies
            copy = probs[:, 0, :, keys[digit - 1]].double().cpu()[..., None]
        else:
            copy = torch.full(m.shape[:2] + (1,), float("nan"), dtype=torch.float64)
        m = torch.cat([m, copy], -1)
        extra = torch.tensor([len(tokens), i - float(np.mean(keys)), len(keys) / (i + 1)], dtype=torch.float64)
        sums = (m, extra) if sums is None else (sums[0] + m, sums[1] + extra)
        if bar is not None:
            bar.update(1)
    m, extra = sums[0] / samples, sums[1] / samples
    priors = head_priors(model)
    return [dict(label=run["label"], pos_encoding=model.config.pos_encoding, ssmax=model.config.ssmax,
                 train_length=run["block_size"], target_length=length, length=round(float(extra[0]), 1),
                 samples=samples, digit=digit, layer=layer, head=h, needle_mass=float(m[layer, h, 0]),
                 digit_mass=float(m[layer, h, 3]),
                 mean_distance=float(m[layer, h, 1]), needle_distance=float(extra[1]), entropy=float(m[layer, h, 2]),
                 uniform_mass=float(extra[2]), **(priors[layer][h] if layer in priors else {}))
            for layer in range(m.shape[0]) for h in range(m.shape[1])], n_correct / samples


def summarize(rows, accuracy, runs, lengths, length, top=3, reads=READS):
    """Per checkpoint: the top heads at `length`, those that read the needle (needle mass >= `reads`) and, at every
    length, the best head's and the largest needle mass, the uniform mass and the first-answer-token accuracy."""
    out = []
    for r in runs:
        mine = [x for x in rows if x["label"] == r["label"]]
        at = sorted((x for x in mine if x["target_length"] == length), key=lambda x: -x["needle_mass"])
        if not at:
            continue
        best = at[0]
        curve = []
        for L in lengths:
            cell = [x for x in mine if x["target_length"] == L]
            if not cell:
                continue
            b = next(x for x in cell if (x["layer"], x["head"]) == (best["layer"], best["head"]))
            m = max(cell, key=lambda x: x["needle_mass"])
            curve.append(dict(target_length=L, needle_mass=b["needle_mass"], mean_distance=b["mean_distance"],
                              max_needle_mass=m["needle_mass"], max_head=[m["layer"], m["head"]],
                              uniform_mass=b["uniform_mass"], first_token_accuracy=accuracy[(r["label"], L)]))
        keep = ("layer", "head", "needle_mass", "mean_distance", "entropy", "shape_param", "shape")
        out.append(dict(label=r["label"], pos_encoding=best["pos_encoding"], ssmax=best["ssmax"],
                        train_length=r["block_size"], chosen_at=length,
                        top_heads=[{k: x[k] for k in keep if k in x} for x in at[:top]],
                        readers=[{k: x[k] for k in keep if k in x} for x in at if x["needle_mass"] >= reads],
                        curve=curve))
    return out


# ---- Figures ---------------------------------------------------------------------------------------------------
def head_label(row):
    """'θbeta=-0.42' for a head with a prior (its shape parameter), '' without one."""
    return f"{row['shape_param'].replace('theta_', 'θ')}={row['shape']:+.2g}" if "shape_param" in row else ""


def plot_heads(rows, runs, length, path):
    """Per checkpoint, layers x heads coloured by needle mass at `length`, labelled with shape parameter and mass;
    highlighted heads framed red."""
    plt = ec._plt()
    panels = [(r, [x for x in rows if x["label"] == r["label"] and x["target_length"] == length]) for r in runs]
    panels = [(r, cell) for r, cell in panels if cell]
    n_layer = max(x["layer"] for _, cell in panels for x in cell) + 1
    n_head = max(x["head"] for _, cell in panels for x in cell) + 1
    fig, axes = plt.subplots(len(panels), 1, figsize=(1.6 + 0.85 * n_head, 0.9 + (0.55 * n_layer + 0.7) * len(panels)),
                             squeeze=False)
    for ax, (r, cell) in zip(axes[:, 0], panels):
        m = np.full((n_layer, n_head), np.nan)
        for x in cell:
            m[x["layer"], x["head"]] = x["needle_mass"]
            text = "\n".join(filter(None, [head_label(x), f"{x['needle_mass']:.2f}"]))
            ax.text(x["head"], x["layer"], text, ha="center", va="center", fontsize=6.5,
                    color="black" if x["needle_mass"] > 0.6 else "white")
            if x.get("highlight"):
                ax.add_patch(plt.Rectangle((x["head"] - 0.47, x["layer"] - 0.47), 0.94, 0.94, fill=False,
                                           edgecolor="red", linewidth=2))
        im = ax.imshow(m, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(n_head), [f"h{h}" for h in range(n_head)], fontsize=7)
        ax.set_yticks(range(n_layer), [f"layer {i}" for i in range(n_layer)], fontsize=7)
        x0 = cell[0]
        name = x0["pos_encoding"] + ("+ssmax" if x0["ssmax"] else "")
        framed = f"; red frame: {x0['highlight_label']}" if any(x.get("highlight") for x in cell) else ""
        ax.set_title(f"{r['label']} ({name}): {length} tokens = {length / r['block_size']:g}x the training length"
                     + framed, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02, label="needle mass")
    fig.suptitle("Attention of the answer query on the needle's key tokens, per head\n"
                 "(cell: the head's prior shape parameter, then its needle mass; mean over prompts)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_needle_vs_length(summary, path):
    """The needle mass of each checkpoint's best head against the prompt length, with uniform attention."""
    series = {}
    for s in summary:
        b = s["top_heads"][0]
        label = " ".join(filter(None, [f"{s['label']} L{b['layer']}.h{b['head']}", head_label(b)]))
        series[label] = ([c["target_length"] for c in s["curve"]], [c["needle_mass"] for c in s["curve"]])
    longest = max(summary, key=lambda s: len(s["curve"]))["curve"]
    series["uniform attention"] = ([c["target_length"] for c in longest], [c["uniform_mass"] for c in longest])
    ec.plot_curves(series, [s["train_length"] for s in summary], path, "prompt length (tokens, log scale)",
                   "attention mass on the needle's key tokens",
                   f"Needle mass of each checkpoint's best head (chosen at {summary[0]['chosen_at']} tokens)",
                   ylim=(-0.03, 1.03))


# ---- Command line ----------------------------------------------------------------------------------------------
def build_parser():
    ap = argparse.ArgumentParser(description="Per-head attention on the passkey needle: mass, distance, entropy.")
    ec.add_common_args(ap, default_out="results/inspect")
    ap.add_argument("--template", choices=sorted(ep.TEMPLATES), default="paper")
    ap.add_argument("--length", type=int, help="the heatmap's length, where the best head is chosen (default: max)")
    ap.add_argument("--lengths", type=int, nargs="+", help="prompt lengths of the needle-vs-length curve "
                                                           "(default: training length x 1, 2, 4, ... up to --length)")
    ap.add_argument("--samples", type=int, default=ep.DEFAULT_SAMPLES, help="prompts per length (equidistant depths)")
    ap.add_argument("--digit", type=int, default=1, help="inspect the query that predicts this answer digit "
                    "(1 = the first; digit_mass is the attention on the needle digit it copies)")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap


def choose_lengths(args, runs, enc, template):
    if args.length is None and not args.lengths:
        raise ValueError("give --length N (and optionally --lengths) to say which prompt lengths to inspect")
    lengths = set(args.lengths or ep.default_lengths([r["block_size"] for r in runs], args.length))
    length = args.length or max(lengths)
    lengths = sorted(lengths | {length})
    shortest = ep.min_prompt_length(enc, template)
    if lengths[0] < shortest:
        raise ValueError(f"length {lengths[0]} is shorter than the {args.template} prompt without filler "
                         f"({shortest} tokens)")
    return length, lengths


def run(args):
    if args.samples < 1:
        raise ValueError("--samples must be positive")
    if not 1 <= args.digit <= ep.TEMPLATES[args.template]["digits"]:
        raise ValueError(f"--digit must be between 1 and the template's {ep.TEMPLATES[args.template]['digits']} digits")
    t0 = time.perf_counter()
    device = ec.pick_device(args.device)
    dtype = ec.resolve_dtype(device, args.dtype)
    runs, enc = ec.load_runs(args.ckpt, device, args.attn_impl)
    template = ep.TEMPLATES[args.template]
    length, lengths = choose_lengths(args, runs, enc, template)
    for L in lengths:
        for r in runs:
            if why := ec.memory_shortfall(r["model"], L, device, args.memory_fraction):
                raise ValueError(f"{r['label']} at {L} tokens {why}; drop that length")
    rows, accuracy = [], {}
    bar = tqdm(total=len(runs) * len(lengths) * args.samples, desc="inspect", unit="prompt", file=sys.stderr,
               disable=args.no_progress, dynamic_ncols=True)
    for r in runs:
        for L in lengths:
            bar.set_description(f"inspect {r['label']} L={L}")
            cell, accuracy[(r["label"], L)] = inspect_length(r, enc, template, L, args.samples, args.seed,
                                                             device, dtype, bar, args.digit)
            rows += cell
    bar.close()
    summary = summarize(rows, accuracy, runs, lengths, length)

    ec.write_table(rows, os.path.join(args.out, "attention_heads"))
    figures = [os.path.join(args.out, "attention_heads.png"), os.path.join(args.out, "attention_needle_vs_length.png")]
    plot_heads(rows, runs, length, figures[0])
    plot_needle_vs_length(summary, figures[1])
    settings = dict(template=args.template, template_hash=ep.template_hash(template), seed=args.seed,
                    samples=args.samples, digit=args.digit, depths="equidistant", length=length, lengths=lengths,
                    dtype=dtype, device=str(device), tokenizer=runs[0]["tokenizer"])
    with open(os.path.join(args.out, "attention_summary.json"), "w") as f:
        json.dump(dict(settings=settings, checkpoints=summary, wall_seconds=round(time.perf_counter() - t0, 2),
                       figures=[os.path.basename(p) for p in figures]), f, indent=1)
    return rows, summary


def _heads(heads):
    return ", ".join(f"L{x['layer']}.h{x['head']} {x['needle_mass']:.3f}" +
                     (f" ({head_label(x)})" if head_label(x) else "") for x in heads) or "none"


def report(summary):
    """Per checkpoint: its top heads and readers at the heatmap length, its best head's needle mass by length."""
    for s in summary:
        curve = " ".join(f"{c['target_length']}:{c['needle_mass']:.3f}" for c in s["curve"])
        print(f"{s['label']}: top heads at {s['chosen_at']}: {_heads(s['top_heads'])}\n"
              f"  heads with needle mass >= {READS}: {_heads(s['readers'])}\n"
              f"  best head's needle mass by length: {curve}")


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        rows, summary = run(args)
    except (*ec.EXPECTED_ERRORS, ValueError, RuntimeError, OSError) as e:  # expected failures: one line
        sys.exit(f"inspect_attention.py: error: {e}")
    report(summary)
    print(f"wrote attention_heads.{{json,csv,png}}, attention_needle_vs_length.png and attention_summary.json "
          f"to {args.out}/")
    return rows, summary


if __name__ == "__main__":
    main()

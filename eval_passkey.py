"""
Passkey retrieval, the paper's headline experiment, with the authors' prompts and scoring (their evaluate.py): a
key hidden in filler text at equidistant depths; a sample is correct iff every scored answer token is the model's
argmax, teacher-forced on the answer (the same as greedy decoding reproducing the key).

    python eval_passkey.py --ckpt out/run1 [--ckpt out/run2 ...] [--lengths 4096 8192 | --max_length N |
        --preset paper|extreme] [--samples 20] [--template paper]

Writes to --out (default results/passkey): passkey_samples.jsonl (one record per sample; a rerun evaluates only
what is missing), passkey_summary.{json,csv} (checkpoint x length: accuracy, digit_accuracy, ...),
passkey_by_depth.{json,csv}, passkey_meta.json, passkey_accuracy.png, passkey_heatmap_<label>.png, and, when run
names carry a seed (bam_ssmax-s3), demo_table.{md,csv,json}: every run, then per variant the median and minimum.
"""
import argparse
import hashlib
import json
import os
import re
import statistics
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import eval_common as ec
from data import PASSKEY_TEMPLATES as TEMPLATES, PIECE_SEP
from hardware import autocast


PAPER_LENGTHS = [int(x) for x in np.linspace(0, 32768, 10)][1:]  # the authors' public evaluate.py
# lengths, samples, and what a preset changes in the template (digits, given_digits) and in the precision
PRESETS = {
    "paper": dict(lengths=PAPER_LENGTHS, samples=20),
    "extreme": dict(lengths=list(range(10_000, 100_001, 10_000)) + list(range(200_000, 500_001, 100_000)),
                    samples=10, template=dict(digits=6, given_digits=1), dtype="float32"),  # their 500K run
}
DEFAULT_SAMPLES = 20
DEPTH_BINS = 10  # of the by-depth table and heatmap
KEY_FIELDS = ("label", "ckpt", "ckpt_sha256", "target_length", "sample")


# ---- Prompts: [task] + filler x k + [needle with the key] + filler x (N - k) + [question] ------------
def template_hash(template):
    return hashlib.sha1(json.dumps(template, sort_keys=True).encode()).hexdigest()[:12]


def _pieces(enc, template):
    """Token lists of the key-independent pieces, each tokenized on its own as the authors do. SentencePiece starts
    every piece with a word boundary, tiktoken does not: with gpt2 and byte a later piece is sep + piece."""
    sep = template.get("sep", "" if enc.word_boundary else PIECE_SEP)
    task = ([enc.doc_start] if template.get("document") else []) + enc.encode_ordinary(template["task"])  # BOS: opt-in
    return dict(task=task, filler=enc.encode_ordinary(sep + template["filler"]),
                question=enc.encode_ordinary(sep + template["question"])), sep


def _needle(enc, template, sep, key):
    return enc.encode_ordinary(sep + template["needle"].format(pass_key=key))


def answer_tokens(enc, key, given_digits=0):
    """(tokens of " " + str(key), n_given): leading whitespace tokens and whole tokens of the first given_digits
    digits are given, not scored: the authors' scoring with Mistral ("▁" given, one token per digit), the same
    digits with byte; gpt2 merges the space into digits (" 123" + "45"), so all its answer tokens are scored."""
    answer = enc.encode_ordinary(" " + str(key))
    given = str(key)[:given_digits]
    n_given = 0
    while n_given < len(answer) - 1 and given.startswith(enc.decode(answer[:n_given + 1]).strip()):
        n_given += 1
    return answer, n_given


def min_prompt_length(enc, template):
    """Tokens of the prompt without any filler (with the widest key): shorter targets cannot be built."""
    pieces, sep = _pieces(enc, template)
    widest = _needle(enc, template, sep, 10 ** template["digits"] - 1)
    return len(pieces["task"]) + len(widest) + len(pieces["question"])


def filler_units(enc, template, target_length):
    """N: the filler units that fit beside task, needle (with the widest key 10^digits - 1) and question."""
    room = target_length - min_prompt_length(enc, template)
    return max(0, room // len(_pieces(enc, template)[0]["filler"]))


def build_prompt(enc, template, target_length, key, k):
    """(prompt tokens, answer tokens, info) with k filler units before the needle and N - k after it, never longer
    than target_length (a key longer than the widest drops units after the needle, then before). info: target_length,
    length, n_filler, k, depth (k / n_filler), key, needle_start, needle_end, n_given, answer_text."""
    pieces, sep = _pieces(enc, template)
    key = int(key)
    if len(str(key)) != template["digits"]:
        raise ValueError(f"key {key} does not have {template['digits']} digits")
    needle = _needle(enc, template, sep, key)
    n = filler_units(enc, template, target_length)
    fixed = len(pieces["task"]) + len(needle) + len(pieces["question"])
    if fixed > target_length:
        raise ValueError(f"target length {target_length} is shorter than the prompt without filler ({fixed} tokens)")
    F = len(pieces["filler"])
    after = n - k
    while fixed + (k + after) * F > target_length:
        if after:
            after -= 1
        else:
            k -= 1
    tokens = pieces["task"] + pieces["filler"] * k + needle + pieces["filler"] * after + pieces["question"]
    answer, n_given = answer_tokens(enc, key, template.get("given_digits", 0))
    info = dict(target_length=int(target_length), length=len(tokens), n_filler=k + after, k=k,
                depth=k / (k + after) if k + after else 0.0, key=key,
                needle_start=len(pieces["task"]) + k * F, needle_end=len(pieces["task"]) + k * F + len(needle),
                n_given=n_given, answer_text=" " + str(key))
    return tokens, answer, info


def make_samples(enc, template, target_length, samples, seed=1234):
    """[(prompt, answer, info)] of one length at the authors' equidistant depths, k = linspace(0, N, samples).long();
    the keys come from default_rng([seed, target_length]) alone, so they do not depend on the other lengths."""
    d = template["digits"]
    keys = np.random.default_rng([seed, target_length]).integers(10 ** (d - 1), 10 ** d, size=samples)
    ks = torch.linspace(0, filler_units(enc, template, target_length), samples).long().tolist()
    return [build_prompt(enc, template, target_length, int(keys[i]), ks[i]) for i in range(samples)]


# ---- Scoring ---------------------------------------------------------------------------------------------------
def score_batch(model, prompts, answers, n_given=0):
    """Teacher-forced exact match of prompts (one length) + answers (one length): [(correct, predicted tokens)].
    The model reads prompt + answer[:-1]; logits only at the positions that predict answer[n_given:]."""
    m = len(answers[0]) - n_given
    idx = torch.tensor([p + a[:-1] for p, a in zip(prompts, answers)], dtype=torch.long, device=ec.model_device(model))
    with torch.inference_mode():
        logits, _ = model(idx, logits_at=m)
    pred = logits[..., :model.config.vocab_size].argmax(-1).tolist()  # padded vocabulary rows are not tokens
    return [(pr == list(a[n_given:]), pr) for pr, a in zip(pred, answers)]


# ---- Evaluation ------------------------------------------------------------------------------------------------
def default_lengths(train_lengths, max_length=None):
    """The union over checkpoints of training length x 1, 2, 4, ... up to max_length (default 32 x the largest)."""
    max_length = max_length or 32 * max(train_lengths)
    return sorted({L for t in train_lengths for L in ec.geometric_lengths(t, max_length) if L <= max_length})


def _batch_size(model, n_tokens, group, device, batch_tokens, fraction):
    b = max(1, min(group, batch_tokens // n_tokens if batch_tokens else 1))
    while b > 1 and ec.memory_shortfall(model, n_tokens, device, fraction, batch=b):
        b //= 2
    return b


def plan(runs, enc, template, lengths, device, memory_fraction=0.9):
    """The (run, length) pairs to skip, and why: shorter than the prompt without filler, or too big for memory."""
    skipped = []
    shortest = min_prompt_length(enc, template)
    answer_len = len(answer_tokens(enc, 10 ** template["digits"] - 1)[0])  # the widest key
    for L in lengths:
        for r in runs:
            reason = (f"shorter than the prompt without filler ({shortest} tokens)" if L < shortest else
                      ec.memory_shortfall(r["model"], L + answer_len, device, memory_fraction))
            if reason:
                skipped.append(dict(label=r["label"], target_length=L, reason=reason))
    return skipped


def evaluate(runs, enc, lengths, *, template, samples=DEFAULT_SAMPLES, seed=1234, device="cpu", dtype="auto", log,
             batch_tokens=65536, memory_fraction=0.9, skipped=(), progress=True):
    """Score every missing (run, length, sample) into `log`, the same prompts for every run; returns how many."""
    skip = {(s["label"], s["target_length"]) for s in skipped}
    todo = {(r["label"], L): [i for i in range(samples) if (r["label"], r["ckpt_path"], r["ckpt_sha256"], L, i)
                              not in log.done] for L in lengths for r in runs if (r["label"], L) not in skip}
    todo = {k: v for k, v in todo.items() if v}
    bar = tqdm(total=sum(len(v) for v in todo.values()), desc="passkey", unit="sample", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    scored = 0
    for L in lengths:
        if not any((r["label"], L) in todo for r in runs):
            continue
        prompts = make_samples(enc, template, L, samples, seed)  # shared by every run
        for r in runs:
            missing = todo.get((r["label"], L))
            if not missing:
                continue
            bar.set_description(f"passkey {r['label']} L={L}")
            ec.reset_peak_memory(device)
            groups = {}  # equal token lengths can share a forward
            for i in missing:
                p, a, info = prompts[i]
                groups.setdefault((len(p), len(a), info["n_given"]), []).append(i)
            for (plen, alen, n_given), idxs in groups.items():
                b = _batch_size(r["model"], plen + alen - 1, len(idxs), device, batch_tokens, memory_fraction)
                for c in range(0, len(idxs), b):
                    chunk = idxs[c:c + b]
                    t0 = time.perf_counter()
                    with autocast(device, dtype):
                        results = score_batch(r["model"], [prompts[i][0] for i in chunk],
                                              [prompts[i][1] for i in chunk], n_given)
                    dt = (time.perf_counter() - t0) / len(chunk)
                    peak = ec.peak_memory_bytes(device) / 2**20
                    for i, (correct, pred) in zip(chunk, results):
                        _, answer, info = prompts[i]
                        log.add(dict(label=r["label"], **ec.checkpoint_fields(r), target_length=L, sample=i,
                                     length=info["length"], n_filler=info["n_filler"], k=info["k"],
                                     depth=info["depth"], key=info["key"], answer_tokens=answer[n_given:],
                                     predicted=pred, predicted_text=enc.decode(pred), correct=bool(correct),
                                     batch=len(chunk), seconds=round(dt, 4), peak_mem_mib=round(peak, 1)))
                    scored += len(chunk)
                    bar.update(len(chunk))
    bar.close()
    return scored


# ---- Summaries and figures -------------------------------------------------------------------------------------
def depth_bin(depth, n_bins=DEPTH_BINS):
    return min(int(depth * n_bins), n_bins - 1)


def bin_label(b, n_bins=DEPTH_BINS):
    return f"{100 * b / n_bins:.0f}-{100 * (b + 1) / n_bins:.0f}%"


def digits_right(rec, given_text):
    """[is digit k right] for one record (None: given, not scored). The answer produced is given_text + its
    teacher-forced predicted_text; digit k is right iff its k-th character after the space is the key's."""
    key, text = str(rec["key"]), (given_text + rec["predicted_text"])[1:]
    return [None if k < len(given_text) - 1 else k < len(text) and text[k] == d for k, d in enumerate(key)]


def given_text(enc, rec):
    """The text of the answer's given (unscored) tokens: " " + key less what the scored tokens decode to."""
    answer = " " + str(rec["key"])
    return answer[:len(answer) - len(enc.decode(rec["answer_tokens"]))]


def summarize(records, runs, lengths, enc, skipped=(), depth_bins=DEPTH_BINS):
    """(summary rows: checkpoint x length, by-depth rows: checkpoint x length x depth bin) from the records of
    these runs (label and checkpoint file) at these lengths. Skipped cells appear with accuracy None."""
    why = {(s["label"], s["target_length"]): s["reason"] for s in skipped}
    cells = {}
    for rec in records:
        cells.setdefault((rec["label"], rec["ckpt"], rec["target_length"]), {})[rec["sample"]] = rec
    summary, by_depth = [], []
    for r in runs:
        for L in lengths:
            recs = [v for _, v in sorted(cells.get((r["label"], r["ckpt_path"], L), {}).items())]
            row = dict(label=r["label"], ckpt=r["ckpt_path"], train_length=r["block_size"], target_length=L)
            summary.append(row)
            if not recs:
                row.update(n=0, correct=0, accuracy=None, digit_accuracy=None, mean_length=None, seconds=None,
                           seconds_per_sample=None, peak_mem_mib=None, status=f"skipped: {why[(r['label'], L)]}"
                           if (r["label"], L) in why else "not evaluated")
                continue
            n, c = len(recs), sum(x["correct"] for x in recs)
            secs = sum(x["seconds"] for x in recs)
            right = [digits_right(x, given_text(enc, x)) for x in recs]
            row.update(n=n, correct=c, accuracy=c / n,
                       digit_accuracy=[None if d[0] is None else sum(d) / n for d in zip(*right)],
                       mean_length=sum(x["length"] for x in recs) / n, seconds=round(secs, 3),
                       seconds_per_sample=round(secs / n, 4), peak_mem_mib=max(x["peak_mem_mib"] for x in recs),
                       status="ok")
            by_depth += depth_rows(r, L, recs, depth_bins)
    return summary, by_depth


def depth_rows(run, length, recs, depth_bins):
    bins = {}
    for x in recs:
        bins.setdefault(depth_bin(x["depth"], depth_bins), []).append(x["correct"])
    return [dict(label=run["label"], ckpt=run["ckpt_path"], train_length=run["block_size"], target_length=length,
                 depth_bin=bin_label(b, depth_bins), depth_lo=b / depth_bins, depth_hi=(b + 1) / depth_bins,
                 n=len(vals), correct=sum(vals), accuracy=sum(vals) / len(vals)) for b, vals in sorted(bins.items())]


def make_figures(summary, by_depth, runs, out, depth_bins=DEPTH_BINS):
    """passkey_accuracy.png (a curve per checkpoint) and a depth x length heatmap per checkpoint."""
    paths, series = [], {}
    for r in runs:
        rows = [s for s in summary if s["label"] == r["label"] and s["accuracy"] is not None]
        if rows:
            series[r["label"]] = ([s["target_length"] for s in rows], [s["accuracy"] for s in rows])
    if series:
        p = os.path.join(out, "passkey_accuracy.png")
        ec.plot_curves(series, [r["block_size"] for r in runs if r["label"] in series], p,
                       "context length (tokens, log scale)", "passkey accuracy",
                       "Passkey retrieval: accuracy vs context length", ylim=(-0.03, 1.03))
        paths.append(p)
    for r in runs:
        cols = sorted({d["target_length"] for d in by_depth if d["label"] == r["label"]})
        if not cols:
            continue
        m = np.full((depth_bins, len(cols)), np.nan)
        for d in by_depth:
            if d["label"] == r["label"]:
                m[round(d["depth_lo"] * depth_bins), cols.index(d["target_length"])] = d["accuracy"]
        p = os.path.join(out, f"passkey_heatmap_{re.sub(r'[^A-Za-z0-9._-]+', '_', r['label'])}.png")
        col = float(np.interp(np.log(r["block_size"]), np.log(cols), np.arange(len(cols))))  # the training length
        ec.plot_heatmap(m, [bin_label(b, depth_bins) for b in range(depth_bins)], cols, p,
                        f"passkey: {r['label']}\ntrain length {r['block_size']} (dashed)",
                        "context length (tokens)", "needle depth", train_col=col)
        paths.append(p)
    return paths


def markdown_summary(summary, runs, lengths):
    acc = {(s["label"], s["target_length"]): s["accuracy"] for s in summary}
    return ec.markdown_table(["checkpoint", "train len", *lengths], [
        [r["label"], r["block_size"], *("skip" if acc.get((r["label"], L)) is None else f"{acc[(r['label'], L)]:.2f}"
                                        for L in lengths)] for r in runs])


def seed_table(summary, out, digits):
    """The per-seed table of runs named <variant>-s<seed> (make demo SEEDS=N): accuracy at every multiple of the
    training length, one row per run, then per variant with several seeds the median and the minimum over them.
    Writes <out>/demo_table.{md,csv,json} and returns the markdown; None (nothing written) without seeded names."""
    cells, mults = {}, set()
    for s in summary:
        if s["accuracy"] is not None:
            ratio = s["target_length"] / s["train_length"]
            mult = int(ratio) if ratio == int(ratio) else round(ratio, 2)
            cells.setdefault(ec.seed_split(s["label"]), {})[mult] = s["accuracy"]
            mults.add(mult)
    if all(seed is None for _, seed in cells):
        return None
    mults, rows, body = sorted(mults), [], []

    def add(variant, statistic, seed, n_seeds, acc, first_cells, bold=""):
        rows.append(dict(variant=variant, statistic=statistic, seed=seed, n_seeds=n_seeds,
                         **{f"{m}x": acc.get(m) for m in mults}))
        body.append([*first_cells, *(f"{bold}{acc[m]:.2f}{bold}" if m in acc else "–" for m in mults)])

    for variant in dict.fromkeys(v for v, _ in cells):
        seeds = sorted((seed for v, seed in cells if v == variant), key=lambda x: (x is None, x))
        for seed in seeds:
            add(variant, "seed", seed, 1, cells[(variant, seed)], [variant, "–" if seed is None else seed])
        for stat, f in (("median", statistics.median), ("min", min)) if len(seeds) > 1 else ():
            per = {m: [cells[(variant, x)][m] for x in seeds if m in cells[(variant, x)]] for m in mults}
            add(variant, stat, None, len(seeds), {m: f(v) for m, v in per.items() if v},
                [f"**{variant}**", f"**{stat} of {len(seeds)}**"], bold="**")
    ec.write_table(rows, os.path.join(out, "demo_table"))
    lengths = ", ".join(str(t) for t in sorted({s["train_length"] for s in summary}))
    text = (ec.markdown_table(["run", "seed", *(f"{m}×" for m in mults)], body) + f"\n\nPasskey exact match "
            f"({digits} digits, teacher-forced) at multiples of the training length ({lengths} tokens).\n")
    with open(os.path.join(out, "demo_table.md"), "w") as f:
        f.write(text)
    return text


# ---- Command line ----------------------------------------------------------------------------------------------
def _int_list(values):
    parts = " ".join(values).replace(",", " ").split()
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ec.EvalError(f"--lengths takes positive integers (token counts), got {' '.join(values)!r}")
    return sorted({int(p) for p in parts})


def build_parser():
    ap = argparse.ArgumentParser(description="Passkey retrieval across context lengths.")
    ec.add_common_args(ap, default_out="results/passkey")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--lengths", nargs="+", help="target lengths in tokens (space or comma separated)")
    g.add_argument("--max_length", type=int, help="training length x 1, 2, 4, ... up to this (default 32 x)")
    g.add_argument("--preset", choices=sorted(PRESETS),
                   help="paper: int(linspace(0, 32768, 10))[1:], 20 samples; extreme: 10K..100K step "
                        "10K, 200K..500K step 100K, 10 samples, 6 digits with the first given, float32")
    ap.add_argument("--samples", type=int, help=f"samples per length (default {DEFAULT_SAMPLES}, or the preset's)")
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="paper")
    ap.add_argument("--batch_tokens", type=int, default=65536,
                    help="stack samples of one length into a forward while batch x length stays under this")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    samples = preset.get("samples", DEFAULT_SAMPLES) if args.samples is None else args.samples
    if samples < 1 or args.seed < 0:
        raise ec.EvalError(f"--samples must be at least 1 and --seed at least 0, got {samples} and {args.seed}")
    t_start = time.perf_counter()
    device = ec.pick_device(args.device)
    dtype = ec.resolve_dtype(device, preset.get("dtype", "auto") if args.dtype == "auto" else args.dtype)
    runs, enc = ec.load_runs(args.ckpt, device, args.attn_impl)
    template = dict(TEMPLATES[args.template], **preset.get("template", {}))
    lengths = _int_list(args.lengths) if args.lengths else (
        preset.get("lengths") or default_lengths([r["block_size"] for r in runs], args.max_length))
    # Prompts depend only on (seed, length, template, samples), so a rerun with the same settings resumes the
    # JSONL; one with other settings is refused, and a checkpoint whose weights changed is evaluated again.
    jsonl = os.path.join(args.out, "passkey_samples.jsonl")
    settings = dict(seed=args.seed, template=args.template, template_hash=template_hash(template), samples=samples,
                    depths="equidistant", tokenizer=runs[0]["tokenizer"], dtype=dtype)
    ec.check_settings(jsonl, settings)
    log = ec.ResultLog(jsonl, KEY_FIELDS, runs)
    skipped = plan(runs, enc, template, lengths, device, args.memory_fraction)
    for s in skipped:
        print(f"skipping length {s['target_length']} for {s['label']}: {s['reason']}", file=sys.stderr)
    scored = evaluate(runs, enc, lengths, template=template, samples=samples, seed=args.seed,
                      device=device, dtype=dtype, log=log, batch_tokens=args.batch_tokens,
                      memory_fraction=args.memory_fraction, skipped=skipped, progress=not args.no_progress)
    summary, by_depth = summarize(log.records, runs, lengths, enc, skipped)
    meta = write_outputs(args, summary, by_depth, runs, dict(settings=settings, lengths=lengths, skipped=skipped,
                                                             scored_this_call=scored), device, t_start)
    print(markdown_summary(summary, runs, lengths))
    table = seed_table(summary, args.out, template["digits"])
    if table:
        print("\n" + table)
    print(f"{scored} samples scored in {meta['wall_seconds']:.1f}s (peak RSS {meta['peak_rss_mib']:.0f} MiB); "
          f"results in {args.out}/")
    return dict(summary=summary, by_depth=by_depth, meta=meta, records=log.records, table=table)


def write_outputs(args, summary, by_depth, runs, meta, device, t_start):
    """The summary and by-depth tables, the figures and passkey_meta.json (settings, runs, time, peak memory)."""
    ec.write_table(summary, os.path.join(args.out, "passkey_summary"))
    ec.write_table(by_depth, os.path.join(args.out, "passkey_by_depth"))
    figures = make_figures(summary, by_depth, runs, args.out)
    cuda = torch.device(device).type == "cuda"
    meta.update(device=str(device), torch=torch.__version__,
                runs=[dict(label=r["label"], **ec.checkpoint_fields(r), train_length=r["block_size"],
                           pos_encoding=r["model"].config.pos_encoding, ssmax=r["model"].config.ssmax) for r in runs],
                wall_seconds=round(time.perf_counter() - t_start, 2),
                peak_rss_mib=round(ec.peak_memory_bytes("cpu") / 2**20, 1),
                peak_gpu_mib=round(ec.peak_memory_bytes(device) / 2**20, 1) if cuda else None,
                figures=[os.path.basename(p) for p in figures])
    with open(os.path.join(args.out, "passkey_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


if __name__ == "__main__":
    ec.run_script(main, "eval_passkey.py")

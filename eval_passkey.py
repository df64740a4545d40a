"""
Passkey retrieval, the paper's headline experiment, with the authors' prompts and scoring (their
evaluate.py): a key hidden in filler text at equidistant depths (passkey.py builds the prompts). A
sample is correct iff every scored answer token is the model's argmax, teacher-forced on the answer.

    python eval_passkey.py --ckpt out/run1 [--ckpt out/run2 ...]
        [--lengths 4096 8192 | --max_length N | --preset paper|extreme] [--samples 20]

Writes passkey_samples.jsonl (a rerun resumes it), passkey_summary and passkey_by_depth
(.json/.csv), passkey_meta.json and the figures to --out; with seeded run names also demo_table.
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

from data import atomic_file
from eval_common import (
    EvalError,
    ResultLog,
    add_common_args,
    check_settings,
    checkpoint_fields,
    claim_out,
    geometric_lengths,
    load_runs,
    markdown_table,
    memory_shortfall,
    model_device,
    multiple_of,
    peak_memory_bytes,
    pick_device,
    plot_curves,
    plot_heatmap,
    reset_peak_memory,
    resolve_dtype,
    run_script,
    write_table,
)
from eval_common import seed_table as write_seed_table
from runtime import autocast
from passkey import (
    TEMPLATES,
    answer_tokens,
    make_samples,
    min_prompt_length,
    template_hash,
    widest_key,
)

# the authors' public evaluate.py
PAPER_LENGTHS = [int(x) for x in np.linspace(0, 32768, 10)][1:]
# lengths, samples, and what a preset changes in the template (digits, given_digits) and in the
# precision
PRESETS = {
    "paper": dict(lengths=PAPER_LENGTHS, samples=20),
    # the authors' 500K run
    "extreme": dict(
        lengths=list(range(10_000, 100_001, 10_000)) + list(range(200_000, 500_001, 100_000)),
        samples=10,
        template=dict(digits=6, given_digits=1),
        dtype="float32",
    ),
}
DEFAULT_SAMPLES = 20
SEED = 1234  # the keys of every length come from default_rng([SEED, length])
BATCH_TOKENS = 65536  # samples of one length share a forward while batch x length stays under it
DEPTH_BINS = 10  # of the by-depth table and heatmap
KEY_FIELDS = ("label", "ckpt", "ckpt_sha256", "target_length", "sample")


# ---- Prompts and plan ----------------------------------------------------------------------------
def default_lengths(train_lengths, max_length=None):
    """The union over checkpoints of training length x 1, 2, 4, ... up to max_length (default 32 x
    the largest training length)."""
    max_length = max_length or 32 * max(train_lengths)

    lengths = set()
    for train_length in train_lengths:
        lengths.update(geometric_lengths(train_length, max_length))
    return sorted(L for L in lengths if L <= max_length)


def plan(runs, enc, template, lengths, device):
    """The (run, length) pairs to skip, and why: shorter than the prompt without filler, or too big
    for memory."""
    shortest = min_prompt_length(enc, template)
    widest_answer, _ = answer_tokens(enc, widest_key(template))

    skipped = []
    for L in lengths:
        for run in runs:
            if L < shortest:
                reason = f"shorter than the prompt without filler ({shortest} tokens)"
            else:
                reason = memory_shortfall(run["model"], L + len(widest_answer), device)
            if reason:
                skipped.append(dict(label=run["label"], target_length=L, reason=reason))
    return skipped


def missing_samples(runs, lengths, samples, log, skipped):
    """{(label, length): the sample indices `log` does not hold yet}, without skipped cells."""
    skip = {(s["label"], s["target_length"]) for s in skipped}

    todo = {}
    for L in lengths:
        for run in runs:
            if (run["label"], L) in skip:
                continue

            key = (run["label"], run["ckpt_path"], run["ckpt_sha256"], L)
            missing = [i for i in range(samples) if (*key, i) not in log.done]
            if missing:
                todo[(run["label"], L)] = missing
    return todo


# ---- Scoring -------------------------------------------------------------------------------------
def score_batch(model, prompts, answers, n_given=0):
    """Teacher-forced exact match of prompts (one length) + answers (one length):
    [(correct, predicted tokens)]. The model reads prompt + answer[:-1]; logits only at the
    positions that predict answer[n_given:]."""
    n_scored = len(answers[0]) - n_given
    rows = [prompt + answer[:-1] for prompt, answer in zip(prompts, answers)]
    idx = torch.tensor(rows, dtype=torch.long, device=model_device(model))
    with torch.inference_mode():
        logits, _ = model(idx, logits_at=n_scored)

    # padded vocabulary rows are not tokens
    predicted = logits[..., : model.config.vocab_size].argmax(-1).tolist()
    return [(pred == list(answer[n_given:]), pred) for pred, answer in zip(predicted, answers)]


def batch_size(model, n_tokens, group, device, batch_tokens):
    """Samples per forward: as many of the group as batch_tokens allows, halved until they fit."""
    batch = max(1, min(group, batch_tokens // n_tokens))
    while batch > 1 and memory_shortfall(model, n_tokens, device, batch=batch):
        batch //= 2
    return batch


def evaluate(runs, enc, lengths, template, samples, device, dtype, log, skipped=(), progress=True):
    """Score every missing (run, length, sample) into `log`, the same prompts for every run;
    returns how many."""
    todo = missing_samples(runs, lengths, samples, log, skipped)
    total = sum(len(v) for v in todo.values())
    bar = tqdm(total=total, desc="passkey", unit="sample", disable=not progress, file=sys.stderr)

    for L in lengths:
        if not any((run["label"], L) in todo for run in runs):
            continue

        # shared by every run
        prompts = make_samples(enc, template, L, samples, SEED)
        for run in runs:
            missing = todo.get((run["label"], L))
            if missing:
                bar.set_description(f"passkey {run['label']} L={L}")
                score_run(run, enc, L, prompts, missing, device, dtype, log, bar)
    bar.close()
    return total


def score_run(run, enc, length, prompts, missing, device, dtype, log, bar):
    """Score the samples `missing` of one run at one length, those of equal token lengths stacked
    into one forward."""
    reset_peak_memory(device)

    groups = {}
    for i in missing:
        prompt, answer, info = prompts[i]
        groups.setdefault((len(prompt), len(answer), info["n_given"]), []).append(i)

    for (prompt_len, answer_len, n_given), group in groups.items():
        n_tokens = prompt_len + answer_len - 1
        batch = batch_size(run["model"], n_tokens, len(group), device, BATCH_TOKENS)
        for first in range(0, len(group), batch):
            chunk = group[first : first + batch]
            score_chunk(run, enc, length, prompts, chunk, n_given, device, dtype, log)
            bar.update(len(chunk))


def score_chunk(run, enc, length, prompts, chunk, n_given, device, dtype, log):
    """Score the samples `chunk` of one length (equal token lengths) in one forward, into `log`."""
    t0 = time.perf_counter()
    with autocast(device, dtype):
        chunk_prompts = [prompts[i][0] for i in chunk]
        chunk_answers = [prompts[i][1] for i in chunk]
        results = score_batch(run["model"], chunk_prompts, chunk_answers, n_given)
    seconds_per_sample = (time.perf_counter() - t0) / len(chunk)
    peak_mib = peak_memory_bytes(device) / 2**20

    for i, (correct, predicted) in zip(chunk, results):
        _, answer, info = prompts[i]
        log.add(
            dict(
                label=run["label"],
                **checkpoint_fields(run),
                target_length=length,
                sample=i,
                length=info["length"],
                n_filler=info["n_filler"],
                k=info["k"],
                depth=info["depth"],
                key=info["key"],
                answer_tokens=answer[n_given:],
                predicted=predicted,
                predicted_text=enc.decode(predicted),
                correct=bool(correct),
                batch=len(chunk),
                seconds=round(seconds_per_sample, 4),
                peak_mem_mib=round(peak_mib, 1),
            )
        )


# ---- Summaries -----------------------------------------------------------------------------------
def depth_bin(depth, n_bins=DEPTH_BINS):
    return min(int(depth * n_bins), n_bins - 1)


def bin_label(depth_bin, n_bins=DEPTH_BINS):
    return f"{100 * depth_bin / n_bins:.0f}-{100 * (depth_bin + 1) / n_bins:.0f}%"


def digits_right(rec, given_text):
    """[is digit k right] for one record (None: given, not scored). The answer produced is
    given_text + its teacher-forced predicted_text; digit k is right iff its k-th character after
    the space is the key's."""
    key = str(rec["key"])
    text = (given_text + rec["predicted_text"])[1:]
    # less the space
    n_given = len(given_text) - 1
    return [
        None if k < n_given else k < len(text) and text[k] == digit for k, digit in enumerate(key)
    ]


def given_text(enc, rec):
    """The text of the answer's given (unscored) tokens: " " + key less what the scored tokens
    decode to."""
    answer = " " + str(rec["key"])
    return answer[: len(answer) - len(enc.decode(rec["answer_tokens"]))]


def summarize(records, runs, lengths, enc, skipped=(), depth_bins=DEPTH_BINS):
    """(summary rows: checkpoint x length, by-depth rows: checkpoint x length x depth bin) from
    the records of these runs (label and checkpoint file) at these lengths. Skipped cells appear
    with accuracy None."""
    why = {(s["label"], s["target_length"]): s["reason"] for s in skipped}
    cells = {}
    for rec in records:
        cell = cells.setdefault((rec["label"], rec["ckpt"], rec["target_length"]), {})
        cell[rec["sample"]] = rec

    summary = []
    by_depth = []
    for run in runs:
        for L in lengths:
            by_sample = cells.get((run["label"], run["ckpt_path"], L), {})
            recs = [rec for _, rec in sorted(by_sample.items())]
            row = dict(
                label=run["label"],
                ckpt=run["ckpt_path"],
                train_length=run["block_size"],
                target_length=L,
            )
            if recs:
                row.update(cell_scores(recs, enc))
                by_depth += depth_rows(run, L, recs, depth_bins)
            else:
                row.update(empty_cell(why.get((run["label"], L))))
            summary.append(row)
    return summary, by_depth


def cell_scores(recs, enc):
    """The summary fields of one checkpoint at one length from its records."""
    n = len(recs)
    n_correct = sum(rec["correct"] for rec in recs)
    seconds = sum(rec["seconds"] for rec in recs)
    right = [digits_right(rec, given_text(enc, rec)) for rec in recs]

    return dict(
        n=n,
        correct=n_correct,
        accuracy=n_correct / n,
        digit_accuracy=[None if d[0] is None else sum(d) / n for d in zip(*right)],
        mean_length=sum(rec["length"] for rec in recs) / n,
        seconds=round(seconds, 3),
        seconds_per_sample=round(seconds / n, 4),
        peak_mem_mib=max(rec["peak_mem_mib"] for rec in recs),
        status="ok",
    )


def empty_cell(reason):
    """The summary fields of a cell without records: skipped (reason) or not evaluated (None)."""
    return dict(
        n=0,
        correct=0,
        accuracy=None,
        digit_accuracy=None,
        mean_length=None,
        seconds=None,
        seconds_per_sample=None,
        peak_mem_mib=None,
        status="not evaluated" if reason is None else f"skipped: {reason}",
    )


def depth_rows(run, length, recs, depth_bins):
    bins = {}
    for rec in recs:
        bins.setdefault(depth_bin(rec["depth"], depth_bins), []).append(rec["correct"])

    return [
        dict(
            label=run["label"],
            ckpt=run["ckpt_path"],
            train_length=run["block_size"],
            target_length=length,
            depth_bin=bin_label(b, depth_bins),
            depth_lo=b / depth_bins,
            depth_hi=(b + 1) / depth_bins,
            n=len(correct),
            correct=sum(correct),
            accuracy=sum(correct) / len(correct),
        )
        for b, correct in sorted(bins.items())
    ]


def markdown_summary(summary, runs, lengths):
    accuracy = {(s["label"], s["target_length"]): s["accuracy"] for s in summary}

    rows = []
    for run in runs:
        cells = [accuracy.get((run["label"], L)) for L in lengths]
        shown = ["skip" if a is None else f"{a:.2f}" for a in cells]
        rows.append([run["label"], run["block_size"], *shown])
    return markdown_table(["checkpoint", "train len", *lengths], rows)


def seed_table(summary, out, digits):
    """The per-seed table (eval_common.seed_table) of passkey accuracy at every multiple of the
    training length. Writes <out>/demo_table.{md,csv,json,png} and returns the markdown; None
    (nothing written) without seeded names."""
    # run label -> {multiple of the training length: accuracy}
    cells = {}
    for s in summary:
        if s["accuracy"] is not None:
            multiple = multiple_of(s["target_length"], s["train_length"])
            cells.setdefault(s["label"], {})[multiple] = s["accuracy"]

    train_lengths = ", ".join(str(t) for t in sorted({s["train_length"] for s in summary}))
    caption = (
        f"Passkey exact match ({digits} digits, teacher-forced) at multiples of the training "
        f"length ({train_lengths} tokens)."
    )
    figure = dict(
        ylabel="passkey exact match",
        title="Passkey retrieval: median seed per variant, band from worst to best seed",
    )
    path = os.path.join(out, "demo_table")
    return write_seed_table(cells, path, caption, worst=("min", min), figure=figure)


# ---- Figures -------------------------------------------------------------------------------------
def make_figures(summary, by_depth, runs, out, depth_bins=DEPTH_BINS):
    """passkey_accuracy.png (a curve per checkpoint) and a depth x length heatmap per
    checkpoint."""
    series = {}
    for run in runs:
        rows = [s for s in summary if s["label"] == run["label"] and s["accuracy"] is not None]
        if rows:
            lengths = [s["target_length"] for s in rows]
            series[run["label"]] = (lengths, [s["accuracy"] for s in rows])

    paths = []
    if series:
        path = os.path.join(out, "passkey_accuracy.png")
        plot_curves(
            series,
            [run["block_size"] for run in runs if run["label"] in series],
            path,
            "context length (tokens, log scale)",
            "passkey accuracy",
            "Passkey retrieval: accuracy vs context length",
            ylim=(-0.03, 1.03),
        )
        paths.append(path)

    for run in runs:
        path = plot_depth_heatmap(run, by_depth, out, depth_bins)
        if path:
            paths.append(path)
    return paths


def plot_depth_heatmap(run, by_depth, out, depth_bins):
    """passkey_heatmap_<label>.png: accuracy by needle depth x length of one checkpoint (its path),
    or None without records."""
    mine = [d for d in by_depth if d["label"] == run["label"]]
    cols = sorted({d["target_length"] for d in mine})
    if not cols:
        return None

    accuracy = np.full((depth_bins, len(cols)), np.nan)
    for d in mine:
        row = round(d["depth_lo"] * depth_bins)
        accuracy[row, cols.index(d["target_length"])] = d["accuracy"]

    safe_label = re.sub(r"[^A-Za-z0-9._-]+", "_", run["label"])
    path = os.path.join(out, f"passkey_heatmap_{safe_label}.png")
    # where the training length falls between the columns (log scale)
    train_col = float(np.interp(np.log(run["block_size"]), np.log(cols), np.arange(len(cols))))
    plot_heatmap(
        accuracy,
        [bin_label(b, depth_bins) for b in range(depth_bins)],
        cols,
        path,
        f"passkey: {run['label']}\ntrain length {run['block_size']} (dashed)",
        "context length (tokens)",
        "needle depth",
        train_col=train_col,
    )
    return path


# ---- Command line --------------------------------------------------------------------------------
def build_parser():
    ap = argparse.ArgumentParser(description="Passkey retrieval across context lengths.")
    add_common_args(ap, default_out="results/passkey")
    lengths = ap.add_mutually_exclusive_group()
    lengths.add_argument(
        "--lengths", nargs="+", help="target lengths in tokens (space or comma separated)"
    )
    lengths.add_argument(
        "--max_length",
        type=int,
        help="training length x 1, 2, 4, ... up to this (default 32 x the largest training length)",
    )
    lengths.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="paper: int(linspace(0, 32768, 10))[1:], 20 samples; extreme: 10K..100K step "
        "10K, 200K..500K step 100K, 10 samples, 6 digits with the first given, float32",
    )
    ap.add_argument(
        "--samples",
        type=int,
        help=f"samples per length (default {DEFAULT_SAMPLES}, or the preset's)",
    )
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="paper")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap


def int_list(values):
    parts = " ".join(values).replace(",", " ").split()
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise EvalError(
            f"--lengths takes positive integers (token counts), got {' '.join(values)!r}"
        )
    return sorted({int(p) for p in parts})


def choose_lengths(args, preset, runs):
    """--lengths, else the preset's, else training length x 1, 2, 4, ... up to --max_length."""
    if args.lengths:
        return int_list(args.lengths)

    train_lengths = [run["block_size"] for run in runs]
    return preset.get("lengths") or default_lengths(train_lengths, args.max_length)


def main(argv=None):
    args = build_parser().parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    samples = preset.get("samples", DEFAULT_SAMPLES) if args.samples is None else args.samples
    if samples < 1:
        raise EvalError(f"--samples must be at least 1, got {samples}")

    t_start = time.perf_counter()
    device = pick_device(args.device)
    dtype = resolve_dtype(device, preset.get("dtype", "auto"))
    runs, enc = load_runs(args.ckpt, device, args.attn_impl, dtype)
    template = dict(TEMPLATES[args.template], **preset.get("template", {}))
    lengths = choose_lengths(args, preset, runs)

    with claim_out(args.out):
        # Prompts depend only on (seed, length, template, samples), so a rerun with the same
        # settings resumes the JSONL; one with other settings is refused, and a checkpoint whose
        # weights changed is evaluated again.
        jsonl = os.path.join(args.out, "passkey_samples.jsonl")
        settings = dict(
            seed=SEED,
            template=args.template,
            template_hash=template_hash(template),
            samples=samples,
            depths="equidistant",
            tokenizer=runs[0]["tokenizer"],
            dtype=dtype,
        )
        check_settings(jsonl, settings)
        log = ResultLog(jsonl, KEY_FIELDS, runs)

        skipped = plan(runs, enc, template, lengths, device)
        for s in skipped:
            print(
                f"skipping length {s['target_length']} for {s['label']}: {s['reason']}",
                file=sys.stderr,
            )

        progress = not args.no_progress
        scored = evaluate(
            runs, enc, lengths, template, samples, device, dtype, log, skipped, progress
        )

        summary, by_depth = summarize(log.records, runs, lengths, enc, skipped)
        meta = dict(settings=settings, lengths=lengths, skipped=skipped, scored_this_call=scored)
        meta = write_outputs(args.out, summary, by_depth, runs, meta, device, t_start)
        table = report(summary, runs, lengths, template, scored, meta, args.out)
        return dict(summary=summary, by_depth=by_depth, meta=meta, records=log.records, table=table)


def write_outputs(out, summary, by_depth, runs, meta, device, t_start):
    """The summary and by-depth tables, the figures and passkey_meta.json (settings, runs, time,
    peak memory)."""
    write_table(summary, os.path.join(out, "passkey_summary"))
    write_table(by_depth, os.path.join(out, "passkey_by_depth"))
    figures = make_figures(summary, by_depth, runs, out)

    run_rows = [
        dict(
            label=run["label"],
            **checkpoint_fields(run),
            train_length=run["block_size"],
            pos_encoding=run["model"].config.pos_encoding,
            ssmax=run["model"].config.ssmax,
        )
        for run in runs
    ]
    cuda = torch.device(device).type == "cuda"
    meta.update(
        device=str(device),
        torch=torch.__version__,
        runs=run_rows,
        wall_seconds=round(time.perf_counter() - t_start, 2),
        peak_rss_mib=round(peak_memory_bytes("cpu") / 2**20, 1),
        peak_gpu_mib=round(peak_memory_bytes(device) / 2**20, 1) if cuda else None,
        figures=[os.path.basename(p) for p in figures],
    )

    with atomic_file(os.path.join(out, "passkey_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def report(summary, runs, lengths, template, scored, meta, out):
    """Print the accuracy table (and the per-seed table, returned) and where the results are."""
    print(markdown_summary(summary, runs, lengths))

    table = seed_table(summary, out, template["digits"])
    if table:
        print("\n" + table)

    print(
        f"{scored} samples scored in {meta['wall_seconds']:.1f}s "
        f"(peak RSS {meta['peak_rss_mib']:.0f} MiB); results in {out}/"
    )
    return table


if __name__ == "__main__":
    run_script(main, "eval_passkey.py")

"""
Passkey retrieval, the paper's headline experiment, with the authors' prompts and scoring (their
evaluate.py): a key hidden in filler text at equidistant depths (passkey.py builds the prompts); a
sample is correct iff every scored answer token is the model's argmax, teacher-forced on the answer
(the same as greedy decoding reproducing the key).

    python eval_passkey.py --ckpt out/run1 [--ckpt out/run2 ...]
        [--lengths 4096 8192 | --max_length N | --preset paper|extreme] [--samples 20]
        [--template paper]

Writes to --out (default results/passkey): passkey_samples.jsonl (one record per sample; a rerun
evaluates only what is missing), passkey_summary.{json,csv} (checkpoint x length: accuracy,
digit_accuracy, ...), passkey_by_depth.{json,csv}, passkey_meta.json, passkey_accuracy.png,
passkey_heatmap_<label>.png, and, when run names carry a seed (bam_ssmax-s3),
demo_table.{md,csv,json,png}: every run, then per variant the median and minimum.
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
import passkey
from hardware import autocast

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
DEPTH_BINS = 10  # of the by-depth table and heatmap
KEY_FIELDS = ("label", "ckpt", "ckpt_sha256", "target_length", "sample")


# ---- Scoring -------------------------------------------------------------------------------------
def score_batch(model, prompts, answers, n_given=0):
    """Teacher-forced exact match of prompts (one length) + answers (one length):
    [(correct, predicted tokens)]. The model reads prompt + answer[:-1]; logits only at the
    positions that predict answer[n_given:]."""
    n_scored = len(answers[0]) - n_given
    rows = [prompt + answer[:-1] for prompt, answer in zip(prompts, answers)]
    idx = torch.tensor(rows, dtype=torch.long, device=ec.model_device(model))
    with torch.inference_mode():
        logits, _ = model(idx, logits_at=n_scored)

    # padded vocabulary rows are not tokens
    predicted = logits[..., : model.config.vocab_size].argmax(-1).tolist()
    return [(pred == list(answer[n_given:]), pred) for pred, answer in zip(predicted, answers)]


# ---- Evaluation ----------------------------------------------------------------------------------
def default_lengths(train_lengths, max_length=None):
    """The union over checkpoints of training length x 1, 2, 4, ... up to max_length (default 32 x
    the largest training length)."""
    max_length = max_length or 32 * max(train_lengths)
    lengths = set()
    for train_length in train_lengths:
        lengths.update(ec.geometric_lengths(train_length, max_length))
    return sorted(L for L in lengths if L <= max_length)


def _batch_size(model, n_tokens, group, device, batch_tokens, fraction):
    """Samples per forward: as many of the group as batch_tokens allows, halved until they fit."""
    batch = max(1, min(group, batch_tokens // n_tokens if batch_tokens else 1))
    while batch > 1 and ec.memory_shortfall(model, n_tokens, device, fraction, batch=batch):
        batch //= 2
    return batch


def plan(runs, enc, template, lengths, device, memory_fraction=0.9):
    """The (run, length) pairs to skip, and why: shorter than the prompt without filler, or too big
    for memory."""
    skipped = []
    shortest = passkey.min_prompt_length(enc, template)
    widest_answer, _ = passkey.answer_tokens(enc, passkey.widest_key(template))
    for L in lengths:
        for run in runs:
            if L < shortest:
                reason = f"shorter than the prompt without filler ({shortest} tokens)"
            else:
                n_tokens = L + len(widest_answer)
                reason = ec.memory_shortfall(run["model"], n_tokens, device, memory_fraction)
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


def evaluate(
    runs,
    enc,
    lengths,
    *,
    template,
    samples=DEFAULT_SAMPLES,
    seed=1234,
    device="cpu",
    dtype="auto",
    log,
    batch_tokens=65536,
    memory_fraction=0.9,
    skipped=(),
    progress=True,
):
    """Score every missing (run, length, sample) into `log`, the same prompts for every run;
    returns how many."""
    todo = missing_samples(runs, lengths, samples, log, skipped)
    bar = tqdm(
        total=sum(len(v) for v in todo.values()),
        desc="passkey",
        unit="sample",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    scored = 0
    for L in lengths:
        if not any((run["label"], L) in todo for run in runs):
            continue

        prompts = passkey.make_samples(enc, template, L, samples, seed)  # shared by every run
        for run in runs:
            missing = todo.get((run["label"], L))
            if not missing:
                continue
            bar.set_description(f"passkey {run['label']} L={L}")
            ec.reset_peak_memory(device)
            # equal token lengths can share a forward
            groups = {}
            for i in missing:
                prompt, answer, info = prompts[i]
                groups.setdefault((len(prompt), len(answer), info["n_given"]), []).append(i)
            for (prompt_len, answer_len, n_given), group in groups.items():
                n_tokens = prompt_len + answer_len - 1
                batch = _batch_size(
                    run["model"], n_tokens, len(group), device, batch_tokens, memory_fraction
                )
                for first in range(0, len(group), batch):
                    chunk = group[first : first + batch]
                    score_chunk(run, enc, L, prompts, chunk, n_given, device, dtype, log)
                    scored += len(chunk)
                    bar.update(len(chunk))
    bar.close()
    return scored


def score_chunk(run, enc, length, prompts, chunk, n_given, device, dtype, log):
    """Score the samples `chunk` of one length (equal token lengths) in one forward, into `log`."""
    t0 = time.perf_counter()
    with autocast(device, dtype):
        results = score_batch(
            run["model"], [prompts[i][0] for i in chunk], [prompts[i][1] for i in chunk], n_given
        )
    seconds_per_sample = (time.perf_counter() - t0) / len(chunk)
    peak_mib = ec.peak_memory_bytes(device) / 2**20

    for i, (correct, predicted) in zip(chunk, results):
        _, answer, info = prompts[i]
        log.add(
            dict(
                label=run["label"],
                **ec.checkpoint_fields(run),
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


# ---- Summaries and figures -----------------------------------------------------------------------
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
    n_given = len(given_text) - 1  # less the space
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
            summary.append(row)
            if recs:
                row.update(cell_scores(recs, enc))
                by_depth += depth_rows(run, L, recs, depth_bins)
            else:
                reason = why.get((run["label"], L))
                row.update(
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


def make_figures(summary, by_depth, runs, out, depth_bins=DEPTH_BINS):
    """passkey_accuracy.png (a curve per checkpoint) and a depth x length heatmap per
    checkpoint."""
    paths = []
    series = {}
    for run in runs:
        rows = [s for s in summary if s["label"] == run["label"] and s["accuracy"] is not None]
        if rows:
            series[run["label"]] = (
                [s["target_length"] for s in rows],
                [s["accuracy"] for s in rows],
            )
    if series:
        path = os.path.join(out, "passkey_accuracy.png")
        ec.plot_curves(
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
        mine = [d for d in by_depth if d["label"] == run["label"]]
        cols = sorted({d["target_length"] for d in mine})
        if not cols:
            continue
        accuracy = np.full((depth_bins, len(cols)), np.nan)
        for d in mine:
            accuracy[round(d["depth_lo"] * depth_bins), cols.index(d["target_length"])] = d[
                "accuracy"
            ]
        safe_label = re.sub(r"[^A-Za-z0-9._-]+", "_", run["label"])
        path = os.path.join(out, f"passkey_heatmap_{safe_label}.png")
        # where the training length falls between the columns (log scale)
        train_col = float(np.interp(np.log(run["block_size"]), np.log(cols), np.arange(len(cols))))
        ec.plot_heatmap(
            accuracy,
            [bin_label(b, depth_bins) for b in range(depth_bins)],
            cols,
            path,
            f"passkey: {run['label']}\ntrain length {run['block_size']} (dashed)",
            "context length (tokens)",
            "needle depth",
            train_col=train_col,
        )
        paths.append(path)
    return paths


def markdown_summary(summary, runs, lengths):
    accuracy = {(s["label"], s["target_length"]): s["accuracy"] for s in summary}
    rows = []
    for run in runs:
        cells = [accuracy.get((run["label"], L)) for L in lengths]
        rows.append(
            [run["label"], run["block_size"], *("skip" if a is None else f"{a:.2f}" for a in cells)]
        )
    return ec.markdown_table(["checkpoint", "train len", *lengths], rows)


def seed_table(summary, out, digits):
    """The per-seed table (eval_common.seed_table) of passkey accuracy at every multiple of the
    training length. Writes <out>/demo_table.{md,csv,json,png} and returns the markdown; None
    (nothing written) without seeded names."""
    cells = {}  # run label -> {multiple of the training length: accuracy}
    for s in summary:
        if s["accuracy"] is not None:
            multiple = ec.multiple_of(s["target_length"], s["train_length"])
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
    return ec.seed_table(cells, path, caption, worst=("min", min), figure=figure)


# ---- Command line --------------------------------------------------------------------------------
def _int_list(values):
    parts = " ".join(values).replace(",", " ").split()
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ec.EvalError(
            f"--lengths takes positive integers (token counts), got {' '.join(values)!r}"
        )
    return sorted({int(p) for p in parts})


def build_parser():
    ap = argparse.ArgumentParser(description="Passkey retrieval across context lengths.")
    ec.add_common_args(ap, default_out="results/passkey")
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
    ap.add_argument("--template", choices=sorted(passkey.TEMPLATES), default="paper")
    ap.add_argument(
        "--batch_tokens",
        type=int,
        default=65536,
        help="stack samples of one length into a forward while batch x length stays under this",
    )
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap


def choose_lengths(args, preset, runs):
    """--lengths, else the preset's, else training length x 1, 2, 4, ... up to --max_length."""
    if args.lengths:
        return _int_list(args.lengths)
    train_lengths = [run["block_size"] for run in runs]
    return preset.get("lengths") or default_lengths(train_lengths, args.max_length)


def main(argv=None):
    args = build_parser().parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    samples = preset.get("samples", DEFAULT_SAMPLES) if args.samples is None else args.samples
    if samples < 1 or args.seed < 0:
        raise ec.EvalError(
            f"--samples must be at least 1 and --seed at least 0, got {samples} and {args.seed}"
        )

    t_start = time.perf_counter()
    device = ec.pick_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else preset.get("dtype", "auto")
    dtype = ec.resolve_dtype(device, dtype)
    runs, enc = ec.load_runs(args.ckpt, device, args.attn_impl, dtype)
    template = dict(passkey.TEMPLATES[args.template], **preset.get("template", {}))
    lengths = choose_lengths(args, preset, runs)

    # Prompts depend only on (seed, length, template, samples), so a rerun with the same settings
    # resumes the JSONL; one with other settings is refused, and a checkpoint whose weights
    # changed is evaluated again.
    jsonl = os.path.join(args.out, "passkey_samples.jsonl")
    settings = dict(
        seed=args.seed,
        template=args.template,
        template_hash=passkey.template_hash(template),
        samples=samples,
        depths="equidistant",
        tokenizer=runs[0]["tokenizer"],
        dtype=dtype,
    )
    ec.check_settings(jsonl, settings)
    log = ec.ResultLog(jsonl, KEY_FIELDS, runs)
    skipped = plan(runs, enc, template, lengths, device, args.memory_fraction)
    for s in skipped:
        message = f"skipping length {s['target_length']} for {s['label']}: {s['reason']}"
        print(message, file=sys.stderr)

    scored = evaluate(
        runs,
        enc,
        lengths,
        template=template,
        samples=samples,
        seed=args.seed,
        device=device,
        dtype=dtype,
        log=log,
        batch_tokens=args.batch_tokens,
        memory_fraction=args.memory_fraction,
        skipped=skipped,
        progress=not args.no_progress,
    )

    summary, by_depth = summarize(log.records, runs, lengths, enc, skipped)
    meta = dict(settings=settings, lengths=lengths, skipped=skipped, scored_this_call=scored)
    meta = write_outputs(args, summary, by_depth, runs, meta, device, t_start)
    table = report(summary, runs, lengths, template, scored, meta, args.out)
    return dict(summary=summary, by_depth=by_depth, meta=meta, records=log.records, table=table)


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


def write_outputs(args, summary, by_depth, runs, meta, device, t_start):
    """The summary and by-depth tables, the figures and passkey_meta.json (settings, runs, time,
    peak memory)."""
    ec.write_table(summary, os.path.join(args.out, "passkey_summary"))
    ec.write_table(by_depth, os.path.join(args.out, "passkey_by_depth"))
    figures = make_figures(summary, by_depth, runs, args.out)

    cuda = torch.device(device).type == "cuda"
    run_rows = [
        dict(
            label=run["label"],
            **ec.checkpoint_fields(run),
            train_length=run["block_size"],
            pos_encoding=run["model"].config.pos_encoding,
            ssmax=run["model"].config.ssmax,
        )
        for run in runs
    ]
    meta.update(
        device=str(device),
        torch=torch.__version__,
        runs=run_rows,
        wall_seconds=round(time.perf_counter() - t_start, 2),
        peak_rss_mib=round(ec.peak_memory_bytes("cpu") / 2**20, 1),
        peak_gpu_mib=round(ec.peak_memory_bytes(device) / 2**20, 1) if cuda else None,
        figures=[os.path.basename(p) for p in figures],
    )
    with open(os.path.join(args.out, "passkey_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


if __name__ == "__main__":
    ec.run_script(main, "eval_passkey.py")

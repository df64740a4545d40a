"""
Passkey retrieval, the paper's headline experiment, with the authors' prompts and scoring (their
evaluate.py): a key hidden in filler at equidistant depths. A sample is correct iff every scored
answer token is the model's argmax, teacher-forced.

    python eval_passkey.py --ckpt out/run1 [--ckpt out/run2 ...]
        [--lengths 4096 8192 | --max_length N | --preset paper|extreme] [--samples 20]

Writes passkey_samples.jsonl (a rerun resumes it), passkey_summary and passkey_by_depth
(.json/.csv), passkey_meta.json and figures to --out; with seeded run names also demo_table. The
prompt (prepare_demo.py trains on it too), each piece tokenized alone as the authors do:

    [task] + filler x k + [needle with the key] + filler x (N - k) + [question]   then " " + key
"""

import argparse
import hashlib
import json
import os
import re
import resource
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from eval_common import (
    EXPECTED_ERRORS,
    FULL_DISK_REMEDY,
    EvalError,
    Evaluation,
    add_common_args,
    check_resume_settings,
    checkpoint_fields,
    counting_work,
    curves,
    default_lengths,
    markdown_table,
    model_device,
    parse_lengths,
    plot_curves,
    pyplot,
    save_figure,
    seed_table,
    skip_note,
    start,
    work_fraction,
    work_share,
    write_table,
)
from infra import runtime

# ---- prompts
# task, filler, needle, question, digits; optional: sep (before each later piece), document (open
# with the document-start token), given_digits (leading key digits given, not scored)
TEMPLATES = {
    # the authors' evaluate.py, verbatim
    "paper": {
        "task": "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize them. I will quiz you about the important information there.",
        "filler": "The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
        "back again.",
        "needle": "The pass key is {pass_key}. Remember it. {pass_key} is the pass key.",
        "question": "What is the pass key? The pass key is",
        "digits": 5,
    },
    # the CPU demo (byte tokenizer): "@" opens the task, the filler is a closed walk of
    # prepare_demo.CHAIN (training uses fresh walks), "#" marks the key, "?" asks for it
    "demo": {
        "task": "@",
        "filler": "bgnfmheldi",
        "needle": "#{pass_key}",
        "question": "?",
        "digits": 5,
        "sep": "",
        "document": True,
    },
}
# lengths, samples, and any change to the template and precision
PRESETS = {
    # the authors' public evaluate.py
    "paper": dict(lengths=[int(x) for x in np.linspace(0, 32768, 10)][1:], samples=20),
    # the authors' 500K run
    "extreme": dict(
        lengths=list(range(10_000, 100_001, 10_000)) + list(range(200_000, 500_001, 100_000)),
        samples=10,
        template=dict(digits=6, given_digits=1),
        dtype="float32",
    ),
}
DEFAULT_SAMPLES = 20
SEED = 1234  # each length's keys come from default_rng([SEED, length])


def template_hash(template):
    """Identifies a template's strings in a results file's settings."""
    return hashlib.sha1(json.dumps(template, sort_keys=True).encode()).hexdigest()[:12]


def separator(enc, template):
    """Before each later piece: none where every encoding opens a word (SentencePiece), else " "."""
    return template.get("sep", "" if enc.word_boundary else " ")


def pieces(enc, template):
    """Token lists of the key-independent pieces: task, filler and question."""
    sep = separator(enc, template)
    opening = [enc.doc_start] if template.get("document") else []

    return dict(
        task=opening + enc.encode_ordinary(template["task"]),
        filler=enc.encode_ordinary(sep + template["filler"]),
        question=enc.encode_ordinary(sep + template["question"]),
    )


def needle_tokens(enc, template, key):
    return enc.encode_ordinary(separator(enc, template) + template["needle"].format(pass_key=key))


def widest_key(template):
    return 10 ** template["digits"] - 1


def random_keys(rng, template, n):
    """n keys, uniform over those with exactly the template's digits."""
    digits = template["digits"]
    return rng.integers(10 ** (digits - 1), 10**digits, size=n)


def answer_tokens(enc, key, given_digits=0):
    """(tokens of " " + str(key), n_given): the whole leading tokens of the space and the first
    given_digits digits are given, not scored; gpt2 merges the space into digits: all scored."""
    answer = enc.encode_ordinary(" " + str(key))
    given = str(key)[:given_digits]

    n_given = 0
    while n_given < len(answer) - 1 and given.startswith(enc.decode(answer[: n_given + 1]).strip()):
        n_given += 1
    return answer, n_given


def join(parts, before, needle, after):
    return parts["task"] + before + needle + after + parts["question"]


def min_prompt_length(enc, template):
    """Prompt tokens without filler, with the widest key: the shortest target."""
    widest = needle_tokens(enc, template, widest_key(template))
    return len(join(pieces(enc, template), [], widest, []))


def filler_units(enc, template, target_length):
    """N: filler units that fit beside task, needle (widest key) and question."""
    room = target_length - min_prompt_length(enc, template)
    return max(0, room // len(pieces(enc, template)["filler"]))


def build_prompt(enc, template, target_length, key, k):
    """(prompt, answer, info): k filler units, the needle, N - k units."""
    parts = pieces(enc, template)
    key = int(key)
    if len(str(key)) != template["digits"]:
        raise ValueError(f"key {key} does not have {template['digits']} digits")

    needle = needle_tokens(enc, template, key)
    fixed = len(join(parts, [], needle, []))
    if fixed > target_length:
        raise ValueError(f"target length {target_length} is shorter than the prompt ({fixed})")

    # a key longer than the widest: drop filler units after the needle, then before, down to the
    # `room` units that fit beside this needle
    unit = len(parts["filler"])
    room = (target_length - fixed) // unit
    after = max(0, min(filler_units(enc, template, target_length) - k, room - k))
    k = min(k, room - after)

    tokens = join(parts, parts["filler"] * k, needle, parts["filler"] * after)
    answer, n_given = answer_tokens(enc, key, template.get("given_digits", 0))

    needle_start = len(parts["task"]) + k * unit
    info = dict(
        length=len(tokens),
        n_filler=k + after,
        k=k,
        depth=k / (k + after) if k + after else 0.0,
        key=key,
        needle_start=needle_start,
        needle_end=needle_start + len(needle),
        n_given=n_given,
    )
    return tokens, answer, info


def make_samples(enc, template, target_length, samples, seed=SEED):
    """[(prompt, answer, info)] at the authors' depths, keys of (seed, length)."""
    keys = random_keys(np.random.default_rng([seed, target_length]), template, samples)
    n_filler = filler_units(enc, template, target_length)
    before = torch.linspace(0, n_filler, samples).long().tolist()

    return [build_prompt(enc, template, target_length, key, k) for key, k in zip(keys, before)]


# ---- score
BATCH_TOKENS = 65536  # one length's samples share a forward while batch x length stays under it
KEY_FIELDS = ("label", "ckpt", "ckpt_sha256", "target_length", "sample")


def score_batch(model, prompts, answers, n_given=0):
    """Teacher-forced exact match of prompts + answers (each of one length): [(correct, predicted
    tokens)], from logits only where answer[n_given:] is predicted."""
    n_scored = len(answers[0]) - n_given
    rows = [prompt + answer[:-1] for prompt, answer in zip(prompts, answers)]
    idx = torch.tensor(rows, dtype=torch.long, device=model_device(model))

    with torch.inference_mode():
        logits, _ = model(idx, logits_at=n_scored)

    # padded vocabulary rows are not tokens
    predicted = logits[..., : model.config.vocab_size].argmax(-1).tolist()
    return [(pred == list(answer[n_given:]), pred) for pred, answer in zip(predicted, answers)]


def record_key(run, length, i):
    """KEY_FIELDS of sample i at one length: the question and the checkpoint answering it."""
    return (run["label"], run["ckpt_path"], run["ckpt_sha256"], length, i)


def score(ev, template, lengths, samples, progress=True):
    """Score what ev.log misses: (how many, [the lengths skipped per run and why]): shorter than
    the prompt, or out of memory."""
    shortest = min_prompt_length(ev.enc, template)
    fitting = [length for length in lengths if length >= shortest]
    todo = {}
    for length in fitting:
        for run in ev.runs:
            missing = [
                i for i in range(samples) if record_key(run, length, i) not in ev.log.records
            ]
            todo[(run["label"], length)] = missing

    total = sum(len(v) for v in todo.values())
    bar = tqdm(total=total, desc="passkey", unit="sample", disable=not progress, file=sys.stderr)

    too_short = f"shorter than the prompt without filler ({shortest} tokens)"
    skipped = []
    for length in lengths:
        prompts = None
        for run in ev.runs:
            reason = None if length in fitting else too_short
            missing = todo.get((run["label"], length))
            if missing:
                bar.set_description(f"passkey {run['label']} L={length}")
                prompts = prompts or make_samples(ev.enc, template, length, samples, SEED)
                reason = score_run(ev, run, length, prompts, missing, bar)
            if reason:
                skipped.append(dict(label=run["label"], target_length=length, reason=reason))
                skip_note(run["label"], length, reason)
    bar.close()

    return total, skipped


def score_run(ev, run, length, prompts, missing, bar):
    """Score one run's `missing` samples at one length, batching equal token lengths, halving a
    batch out of memory down to one: None, or why the length is skipped."""
    runtime.reset_peak_memory(ev.device)

    groups = {}
    for i in missing:
        prompt, answer, info = prompts[i]
        groups.setdefault((len(prompt), len(answer), info["n_given"]), []).append(i)

    for (prompt_len, answer_len, _), group in groups.items():
        batch = max(1, min(len(group), BATCH_TOKENS // (prompt_len + answer_len - 1)))
        while group:
            chunk = group[:batch]
            reason = runtime.fits(ev.device, score_chunk, ev, run, length, prompts, chunk)
            if not reason:
                group = group[batch:]
                bar.update(len(chunk))
            elif batch > 1:
                batch //= 2
            else:
                return reason
    return None


def score_chunk(ev, run, length, prompts, chunk):
    """Score the `chunk` samples (equal token lengths) in one forward, into ev.log."""
    n_given = prompts[chunk[0]][2]["n_given"]
    t0 = time.perf_counter()
    with runtime.autocast(ev.device, ev.dtype), counting_work() as work:
        chunk_prompts, chunk_answers, _ = zip(*(prompts[i] for i in chunk))
        results = score_batch(run["model"], chunk_prompts, chunk_answers, n_given)

    seconds = (time.perf_counter() - t0) / len(chunk)
    peak_mib = runtime.peak_memory_bytes(ev.device) / 2**20

    for i, (correct, predicted) in zip(chunk, results):
        _, answer, info = prompts[i]
        record = dict(label=run["label"], **checkpoint_fields(run), target_length=length, sample=i)
        record.update({k: info[k] for k in ("length", "n_filler", "k", "depth", "key")})
        record.update(
            answer_tokens=answer[n_given:],
            predicted=predicted,
            predicted_text=ev.enc.decode(predicted),
            correct=bool(correct),
            batch=len(chunk),
            seconds=round(seconds, 4),
            peak_mem_mib=round(peak_mib, 1),
            attention_work=work_fraction(work),
        )
        ev.log.add(record)


# ---- summarise
DEPTH_BINS = 10  # of the by-depth table and heatmaps


def bin_label(b, n_bins=DEPTH_BINS):
    return f"{100 * b / n_bins:.0f}-{100 * (b + 1) / n_bins:.0f}%"


def digits_right(rec, enc):
    """[is digit k of the key right] (None: given, not scored): the answer's given text, then its
    teacher-forced predicted_text, read per character after the space."""
    key = str(rec["key"])
    given = (" " + key)[: len(key) + 1 - len(enc.decode(rec["answer_tokens"]))]
    text = (given + rec["predicted_text"])[1:]

    return [None if k < len(given) - 1 else text[k : k + 1] == d for k, d in enumerate(key)]


def summarise(ev, lengths, template, meta, out, started):
    """Write and print the tables, figures and passkey_meta.json."""
    summary, by_depth = summary_rows(ev, lengths, meta["settings"]["samples"], meta["skipped"])
    write_table(summary, os.path.join(out, "passkey_summary"))
    write_table(by_depth, os.path.join(out, "passkey_by_depth"))

    figures = [plot_depth_heatmap(run, by_depth, out) for run in ev.runs]
    series = curves(summary, "target_length", "accuracy")
    if series:
        figures.append(os.path.join(out, "passkey_accuracy.png"))
        train_lengths = [run["block_size"] for run in ev.runs if run["label"] in series]
        axes = dict(xlabel="context length (tokens, log scale)", ylabel="passkey accuracy")
        title = "Passkey retrieval: accuracy vs context length"
        plot_curves(series, train_lengths, figures[-1], title=title, ylim=(-0.03, 1.03), **axes)

    meta["runs"] = []
    for run in ev.runs:
        config = run["model"].config
        row = dict(label=run["label"], **checkpoint_fields(run), train_length=run["block_size"])
        meta["runs"].append(dict(row, pos_encoding=config.pos_encoding, ssmax=config.ssmax))

    cuda = torch.device(ev.device).type == "cuda"
    meta.update(
        device=str(ev.device),
        torch=torch.__version__,
        wall_seconds=round(time.perf_counter() - started, 2),
        peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10, 1),
        peak_gpu_mib=round(runtime.peak_memory_bytes(ev.device) / 2**20, 1) if cuda else None,
        figures=[os.path.basename(p) for p in figures if p],
    )
    with runtime.atomic_file(os.path.join(out, "passkey_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)

    rows = []
    work = []
    for run in ev.runs:
        mine = [s for s in summary if s["label"] == run["label"]]
        shown = [f"{s['accuracy']:.2f}" if s["accuracy"] is not None else "skip" for s in mine]
        rows.append([run["label"], run["block_size"], *shown])
        shares = [f"{s['attention_work']:.1%}" if s["attention_work"] else "-" for s in mine]
        work.append([run["label"], run["block_size"], *shares])
    print(markdown_table(["checkpoint", "train len", *lengths], rows))
    print("attention work (the share of visible scores read):")
    print(markdown_table(["checkpoint", "train len", *lengths], work))
    table = demo_table(summary, out, template["digits"])
    if table:
        print("\n" + table)

    print(
        f"{meta['scored_this_call']} samples scored in {meta['wall_seconds']:.1f}s "
        f"(peak RSS {meta['peak_rss_mib']:.0f} MiB); results in {out}/"
    )
    records = list(ev.log.records.values())
    return dict(summary=summary, by_depth=by_depth, meta=meta, records=records, table=table)


def summary_rows(ev, lengths, samples, skipped):
    """(summary rows: checkpoint x length, by-depth rows: also x depth bin)."""
    why = {(s["label"], s["target_length"]): s["reason"] for s in skipped}

    summary = []
    by_depth = []
    for run in ev.runs:
        for L in lengths:
            keys = [record_key(run, L, i) for i in range(samples)]
            recs = [ev.log.records[key] for key in keys if key in ev.log.records]
            row = dict(label=run["label"], ckpt=run["ckpt_path"], train_length=run["block_size"])
            row["target_length"] = L
            summary.append(dict(row, **cell_scores(recs, ev.enc, why.get((run["label"], L)))))
            by_depth += depth_rows(row, recs)
    return summary, by_depth


def cell_scores(recs, enc, reason=None):
    """Summary fields of one checkpoint at one length."""
    n = len(recs)
    if not n:
        fields = ("accuracy", "digit_accuracy", "mean_length", "seconds", "seconds_per_sample")
        fields += ("attention_work", "peak_mem_mib")
        status = "not evaluated" if reason is None else f"skipped: {reason}"
        return dict(n=0, correct=0, **dict.fromkeys(fields), status=status)

    n_correct = sum(rec["correct"] for rec in recs)
    seconds = sum(rec["seconds"] for rec in recs)
    right = zip(*(digits_right(rec, enc) for rec in recs))

    return dict(
        n=n,
        correct=n_correct,
        accuracy=n_correct / n,
        digit_accuracy=[None if d[0] is None else sum(d) / n for d in right],
        mean_length=sum(rec["length"] for rec in recs) / n,
        seconds=round(seconds, 3),
        seconds_per_sample=round(seconds / n, 4),
        attention_work=work_share(recs),
        peak_mem_mib=max(rec["peak_mem_mib"] for rec in recs),
        status="ok",
    )


def depth_rows(row, recs, n_bins=DEPTH_BINS):
    """Accuracy by needle depth of one summary row's records."""
    bins = {}
    for rec in recs:
        b = min(int(rec["depth"] * n_bins), n_bins - 1)
        bins.setdefault(b, []).append(rec["correct"])

    return [
        dict(row, depth_bin=bin_label(b, n_bins), depth_lo=b / n_bins, depth_hi=(b + 1) / n_bins)
        | dict(n=len(correct), correct=sum(correct), accuracy=sum(correct) / len(correct))
        for b, correct in sorted(bins.items())
    ]


def demo_table(summary, out, digits):
    """<out>/demo_table: accuracy per seed at each multiple of the training length."""
    cells = {}
    for s in summary:
        if s["accuracy"] is not None:
            # 4 for 256 / 64, else 2 decimals
            ratio = s["target_length"] / s["train_length"]
            multiple = int(ratio) if ratio == int(ratio) else round(ratio, 2)
            cells.setdefault(s["label"], {})[multiple] = s["accuracy"]

    train_lengths = ", ".join(str(t) for t in sorted({s["train_length"] for s in summary}))
    caption = (
        f"Passkey exact match ({digits} digits, teacher-forced) at multiples of the training "
        f"length ({train_lengths} tokens)."
    )
    title = "Passkey retrieval: median seed per variant, band from worst to best seed"
    figure = dict(ylabel="passkey exact match", title=title)
    path = os.path.join(out, "demo_table")
    return seed_table(cells, path, caption, ("min", min), figure)


def plot_depth_heatmap(run, by_depth, out, n_bins=DEPTH_BINS):
    """passkey_heatmap_<label>.png: accuracy by depth x length, or None."""
    mine = [d for d in by_depth if d["label"] == run["label"]]
    cols = sorted({d["target_length"] for d in mine})
    if not cols:
        return None

    accuracy = np.full((n_bins, len(cols)), np.nan)
    for d in mine:
        accuracy[round(d["depth_lo"] * n_bins), cols.index(d["target_length"])] = d["accuracy"]

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(cols), 1.2 + 0.35 * n_bins))
    im = ax.imshow(accuracy, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(cols)), map(str, cols), rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(n_bins), [bin_label(b, n_bins) for b in range(n_bins)], fontsize=8)

    # the training length's place among the columns (log scale)
    train_col = np.interp(np.log(run["block_size"]), np.log(cols), np.arange(len(cols)))
    ax.axvline(train_col, color="black", linestyle="--", linewidth=1.5)
    ax.set(xlabel="context length (tokens)", ylabel="needle depth")
    ax.set_title(f"passkey: {run['label']}\ntrain length {run['block_size']} (dashed)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()

    safe_label = re.sub(r"[^A-Za-z0-9._-]+", "_", run["label"])
    path = os.path.join(out, f"passkey_heatmap_{safe_label}.png")
    save_figure(fig, path, dpi=120)
    return path


# ---- main
def build_parser():
    ap = argparse.ArgumentParser(description="Passkey retrieval across context lengths.")
    add_common_args(ap, default_out="results/passkey")

    lengths = ap.add_mutually_exclusive_group()
    lengths.add_argument("--lengths", nargs="+", help="target lengths in tokens")
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

    ap.add_argument("--samples", type=int, help=f"per length (default {DEFAULT_SAMPLES})")
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="paper")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    samples = args.samples or preset.get("samples", DEFAULT_SAMPLES)
    if args.samples is not None and args.samples < 1:
        raise EvalError(f"--samples must be at least 1, got {args.samples}")

    started = time.perf_counter()
    runs, enc, device, dtype = start(args, preset.get("dtype", "auto"))
    template = dict(TEMPLATES[args.template], **preset.get("template", {}))
    train_lengths = [r["block_size"] for r in runs]
    lengths = preset.get("lengths") or default_lengths(train_lengths, args.max_length)
    lengths = parse_lengths(args.lengths) if args.lengths else lengths
    runtime.own_folder(args.out)

    # prompts depend only on (seed, length, template, samples): a rerun with these settings
    # resumes the JSONL, one with others is refused
    settings = dict(
        seed=SEED,
        template=args.template,
        template_hash=template_hash(template),
        samples=samples,
        depths="equidistant",
        tokenizer=runs[0]["tokenizer"],
        dtype=dtype,
    )
    log_path = os.path.join(args.out, "passkey_samples.jsonl")
    check_resume_settings(log_path, settings)
    ev = Evaluation(runs, enc, device, dtype, runtime.ResultLog(log_path, KEY_FIELDS))

    scored, skipped = score(ev, template, lengths, samples, not args.no_progress)
    meta = dict(settings=settings, lengths=lengths, skipped=skipped, scored_this_call=scored)
    return summarise(ev, lengths, template, meta, args.out, started)


if __name__ == "__main__":
    runtime.return_large_allocations()
    runtime.errors_in_one_line("eval_passkey.py", EXPECTED_ERRORS, FULL_DISK_REMEDY)
    main()

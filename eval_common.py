"""
What eval_passkey.py, eval_ruler.py, eval_ppl.py and analysis/ share: options, checkpoints loaded
with the kernel's self-check, the Evaluation their scoring functions share, the attention work,
the out-of-memory skip note, resumable results, summary and per-seed tables, figures.
"""

import contextlib
import csv
import json
import os
import re
import statistics
import sys
from typing import NamedTuple
from unittest import mock

import torch

import attention as attention_code
from attention import IMPLS, impl_error, plan
from data import DataError, get_tokenizer
from infra import runtime
from infra.kernel_check import KernelMismatch, check_kernel
from infra.runtime import FolderBusy
from model import CheckpointError, load_model


class EvalError(ValueError):
    """An evaluation cannot run as asked; the message says what to do."""


# what an entry point prints as one line `<script>: error: ...` (others are bugs); a full disk
# leaves nothing partial, so a rerun resumes
EXPECTED_ERRORS = (EvalError, CheckpointError, DataError, FileNotFoundError, FolderBusy)
FULL_DISK_REMEDY = "free some and run it again: it resumes where it stopped"


# ---- options
def add_common_args(parser, default_out):
    """--ckpt, --out, and the two options one-line errors name as remedies."""
    add = parser.add_argument
    add("--ckpt", action="append", required=True, help="checkpoint or run directory; repeatable")
    add("--out", default=default_out, help="output directory")
    add("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    add("--attn_impl", default="auto", choices=list(IMPLS), help="attention.py's impl")
    add("--no_skip", action="store_true", help="read every key (no attention.first_keys)")


def parse_lengths(values):
    """--lengths: positive token counts, space/comma separated; sorted, deduplicated."""
    parts = " ".join(values).replace(",", " ").split()
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        shown = " ".join(values)
        raise EvalError(f"--lengths takes positive integers (token counts), got {shown!r}")

    return sorted({int(p) for p in parts})


def default_lengths(train_lengths, max_length=None):
    """Training length x 1, 2, 4, ... up to max_length (default 32 x the largest)."""
    max_length = max_length or 32 * max(train_lengths)
    lengths = {t * 2**k for t in train_lengths for k in range(max_length.bit_length())}
    return sorted(L for L in lengths if L <= max_length)


def pick_device(name="auto"):
    try:
        return str(runtime.resolve_device(name))
    except ValueError as e:
        raise EvalError(f"--device {name} {e}; use --device cpu") from None


def resolve_dtype(device, dtype="auto"):
    """auto: bfloat16 on a GPU with native support, else float16; float32 on the CPU."""
    if dtype != "auto":
        return dtype

    if torch.device(device).type != "cuda":
        return "float32"
    return "bfloat16" if runtime.native_bf16(device) else "float16"


def model_device(model):
    return next((p.device for p in model.parameters()), torch.device("cpu"))


# ---- checkpoints
def load_run(path, device, attn_impl, dtype, skip=True):
    """A checkpoint as a run named by its directory, its kernel checked; skip: attention's."""
    model, ckpt = load_model(path, device, attn_impl, skip)
    why = impl_error(attn_impl, model.config.family, device, grad=False)
    if why:
        raise EvalError(f"{path}: --attn_impl {attn_impl}: {why}")

    path = os.path.normpath(path)
    label = os.path.basename(os.path.dirname(path) if os.path.isfile(path) else path)
    try:
        line = check_kernel(model.blocks[0].attn, getattr(torch, dtype), training=False)
    except KernelMismatch as e:
        raise EvalError(f"{label}: {e}; evaluate with --attn_impl torch") from None
    if line:
        print(f"{label}: {line}", flush=True)

    return dict(
        label=label,
        model=model,
        ckpt_path=os.path.abspath(ckpt["path"]),
        ckpt_step=ckpt.get("step"),
        ckpt_sha256=runtime.checkpoint_digest(ckpt),
        block_size=model.config.block_size,
        tokenizer=model.config.tokenizer,
        data_dir=ckpt.get("config", {}).get("data_dir"),
    )


def load_runs(paths, device, attn_impl="auto", dtype="float32", skip=True):
    """(runs, tokenizer): the checkpoints must share a tokenizer (identical prompts)."""
    runs = [load_run(path, device, attn_impl, dtype, skip) for path in paths]

    names = {r["tokenizer"] for r in runs}
    if len(names) > 1:
        per_run = ", ".join(f"{r['label']}: {r['tokenizer']}" for r in runs)
        raise EvalError(f"the checkpoints use different tokenizers ({per_run}); compare separately")

    # same-named run directories: suffixed with their index
    labels = [r["label"] for r in runs]
    for i, r in enumerate(runs):
        if labels.count(r["label"]) > 1:
            r["label"] = f"{r['label']}#{i}"
    return runs, get_tokenizer(names.pop())


def start(args, dtype="auto"):
    """(runs, tokenizer, device, dtype) of --device, --ckpt, --attn_impl; writes nothing."""
    device = pick_device(args.device)
    dtype = resolve_dtype(device, dtype)
    runs, enc = load_runs(args.ckpt, device, args.attn_impl, dtype, not args.no_skip)
    return runs, enc, device, dtype


class Evaluation(NamedTuple):
    """What a command's scoring functions share, built once in main: the checkpoints (load_run's
    runs), their tokenizer, the device and dtype they run in, and the per-sample results."""

    runs: list
    enc: object
    device: str
    dtype: str
    log: runtime.ResultLog = None


@contextlib.contextmanager
def counting_work():
    """Yields [kept, visible], summed over the attention() calls while active: the scores each call
    reads from its rows' first keys on (those it plans: counting plans nothing twice), and the
    scores those rows see. kept / visible is the "attention work"."""
    counts = [0, 0]

    def counted(q, k, v, args, impl):
        chosen, first_key = plan(q, k, v, args, impl)
        B, H, Tq, _ = q.shape
        rows = torch.arange(Tq, device=q.device) + args.q_offset
        earliest = torch.zeros(B, H, Tq, dtype=torch.long, device=q.device)
        if args.doc_start is not None:
            earliest = earliest + args.doc_start[:, None, rows]
        kept = earliest if first_key is None else first_key
        counts[0] += int((rows + 1 - kept).sum())
        counts[1] += int((rows + 1 - earliest).sum())
        return chosen, first_key

    with mock.patch.object(attention_code, "plan", counted):
        yield counts


def work_fraction(work):
    """counting_work()'s counts as a share (None where no attention ran)."""
    return round(work[0] / work[1], 5) if work[1] else None


def work_share(records):
    """The mean work_fraction of the records that hold one, or None."""
    shares = [r["attention_work"] for r in records if r.get("attention_work") is not None]
    return round(sum(shares) / len(shares), 5) if shares else None


def training_data_dir(runs, data_dir=None):
    """data_dir, else the training data directory that all checkpoints record."""
    if data_dir:
        return data_dir

    recorded = sorted({r["data_dir"] for r in runs if r.get("data_dir")})
    if len(recorded) != 1:
        what = f"different data {recorded}" if recorded else "no training data directory"
        raise EvalError(f"the checkpoints record {what}; pass --data_dir")
    if not os.path.isdir(recorded[0]):
        raise EvalError(
            f"the checkpoints were trained on {recorded[0]!r}, which does not exist from here "
            f"({os.getcwd()}); pass --data_dir"
        )
    return recorded[0]


def checkpoint_fields(run):
    """Ties a result record to its checkpoint, not only to its path."""
    return dict(ckpt=run["ckpt_path"], ckpt_step=run["ckpt_step"], ckpt_sha256=run["ckpt_sha256"])


def skip_note(label, length, reason):
    print(f"skipping length {length} for {label}: {reason}", file=sys.stderr)


# ---- results
def check_resume_settings(jsonl_path, settings):
    """Refuse to resume a JSONL made with other settings (kept in <jsonl>.settings.json)."""
    side = jsonl_path + ".settings.json"
    # tuples -> lists: an exact comparison
    settings = json.loads(json.dumps(settings))

    if not os.path.exists(jsonl_path) or os.path.getsize(jsonl_path) == 0:
        with runtime.atomic_file(side, "w") as f:
            json.dump(settings, f, indent=1)
        return

    stored = {}
    if os.path.exists(side):
        with open(side) as f:
            stored = json.load(f)
    diff = [k for k in sorted(set(stored) | set(settings)) if stored.get(k) != settings.get(k)]
    if diff:
        was = ", ".join(f"{k} {stored.get(k)!r} (now {settings.get(k)!r})" for k in diff)
        raise EvalError(
            f"{jsonl_path} was made with other settings ({was}), so resuming would mix results; "
            "use another --out, or delete the file to start over"
        )


def write_table(rows, path_prefix):
    """Flat dicts as <prefix>.json and .csv (a list in a CSV cell as JSON)."""
    os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
    with runtime.atomic_file(path_prefix + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    if not rows:
        return

    fieldnames = list(dict.fromkeys(k for r in rows for k in r))
    with runtime.atomic_file(path_prefix + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})


def markdown_table(header, rows):
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


# ---- the per-seed tables
def seed_split(name):
    """(variant, seed) of <variant>-s<seed>[ rest] (bam_ssmax-s3), else (name, None)."""
    match = re.match(r"^(?P<variant>.+)-s(?P<seed>\d+)(?P<rest>.*)$", name)
    if not match:
        return name, None

    return match["variant"] + match["rest"], int(match["seed"])


def seed_table(cells, path_prefix, caption, worst, figure):
    """Per-seed table of runs named <variant>-s<seed>: a row per run, then each variant's median
    and worst (("min", min) or ("max", max)) over seeds, to 2 decimals. cells: {label: {multiple of
    the training length: value}}. Writes <path_prefix>.{md,csv,json,png} (figure: plot_curves'
    axes); returns the markdown, or None (nothing written) if no label has a seed."""
    by_run = {seed_split(label): values for label, values in cells.items()}
    if all(seed is None for _, seed in by_run):
        return None

    mults = sorted({m for values in by_run.values() for m in values})
    rows = []
    body = []
    series = {}
    bands = {}
    for variant in dict.fromkeys(v for v, _ in by_run):
        seeds = sorted((s for v, s in by_run if v == variant), key=lambda s: (s is None, s))
        runs = [by_run[(variant, s)] for s in seeds]
        # over seeds that have the cell (a length may be skipped for lack of memory)
        per_mult = {m: [r[m] for r in runs if m in r] for m in mults if any(m in r for r in runs)}

        lines = [("seed", s, 1, r) for s, r in zip(seeds, runs)]
        if len(seeds) > 1:
            for name, statistic in (("median", statistics.median), worst):
                values = {m: statistic(v) for m, v in per_mult.items()}
                lines.append((name, None, len(seeds), values))

        for statistic, seed, n_seeds, values in lines:
            row = dict(variant=variant, statistic=statistic, seed=seed, n_seeds=n_seeds)
            rows.append(row | {f"{m}x": values.get(m) for m in mults})

            bold = "" if statistic == "seed" else "**"
            first = [variant, "–" if seed is None else seed]
            if bold:
                first = [f"**{variant}**", f"**{statistic} of {n_seeds}**"]
            shown = [f"{bold}{values[m]:.2f}{bold}" if m in values else "–" for m in mults]
            body.append(first + shown)

        label = f"{variant} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"
        series[label] = (list(per_mult), [statistics.median(v) for v in per_mult.values()])
        if len(seeds) > 1:
            bands[label] = [[f(v) for v in per_mult.values()] for f in (min, max)]

    write_table(rows, path_prefix)
    xlabel = "multiple of the training length (log scale)"
    plot_curves(series, (), path_prefix + ".png", bands, xlabel=xlabel, **figure)

    text = markdown_table(["run", "seed", *(f"{m}×" for m in mults)], body) + f"\n\n{caption}\n"
    with runtime.atomic_file(path_prefix + ".md", "w") as f:
        f.write(text)
    return text


# ---- figures
def pyplot():
    """matplotlib's pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, **savefig_args):
    """fig.savefig via runtime.atomic_file (format from path's extension), then close."""
    try:
        with runtime.atomic_file(path) as f:
            fig.savefig(f, format=os.path.splitext(path)[1][1:] or None, **savefig_args)
    finally:
        pyplot().close(fig)


def curves(rows, x, y):
    """{label: (xs, ys)}: a curve per label through the rows with a y value."""
    series = {}
    for r in rows:
        if r[y] is not None:
            xs, ys = series.setdefault(r["label"], ([], []))
            xs.append(r[x])
            ys.append(r[y])
    return series


LINE_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v")]


def curve_styles(names):
    """{name: matplotlib style}: a colour per variant, a line style and marker per seed."""
    keys = {name: seed_split(name) for name in names}
    variants = list(dict.fromkeys(v for v, _ in keys.values()))
    seeds = sorted({s for _, s in keys.values() if s is not None})
    cmap = pyplot().get_cmap("tab10" if len(variants) <= 10 else "tab20")

    styles = {}
    for name, (variant, seed) in keys.items():
        line, marker = ("-", "o")
        if seed is not None:
            line, marker = LINE_STYLES[seeds.index(seed) % len(LINE_STYLES)]
        color = cmap(variants.index(variant) % cmap.N)
        styles[name] = dict(color=color, linestyle=line, marker=marker)
    return styles


def plot_curves(series, train_lengths, path, bands=None, **axes):
    """series = {name: (xs, ys)} on a log x axis; bands = {name: (lows, highs)}; axes: Axes.set's
    (xlabel, ylabel, title, yscale, ylim)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    styles = curve_styles(series)

    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name, markersize=4, **styles[name])
        if name in (bands or {}):
            color = styles[name]["color"]
            ax.fill_between(xs, *bands[name], color=color, alpha=0.12, linewidth=0)

    note = dict(rotation=90, va="top", ha="right", fontsize=8, color="gray")
    for t in sorted(set(train_lengths)):
        ax.axvline(t, color="gray", linestyle="--", linewidth=1)
        ax.annotate(f"train length {t}", (t, 1), xycoords=("data", "axes fraction"), **note)

    ax.set(**axes)
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.tight_layout()
    save_figure(fig, path, dpi=120, bbox_inches="tight")

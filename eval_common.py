"""
What every evaluation (eval_passkey.py, eval_ruler.py, eval_ppl.py, inspect_attention.py) shares:
command-line options, the output folder held for one evaluation at a time, device and precision,
loading checkpoints with their tokenizer, a memory check before long contexts, resumable per-sample
JSONL, summary JSON/CSV, and the figures.
"""

import contextlib
import csv
import ctypes
import fcntl
import hashlib
import json
import math
import os
import re
import shlex
import socket
import statistics
import sys
import time

import torch

from attention import IMPLS, KernelMismatch, impl_error
from model import CheckpointError, load_model
from data import (
    DataError,
    atomic_file,
    disk_full,
    get_tokenizer,
    no_space_left,
    remove_stale_temporaries,
)
from runtime import native_bf16, resolve_device


class EvalError(ValueError):
    """An evaluation cannot run as asked; the message says what to do."""


# What an evaluation turns into one line `<script>: error: ...` and exit 1 (anything else is a bug).
EXPECTED_ERRORS = (EvalError, CheckpointError, DataError, FileNotFoundError)


def mmap_large_allocations():
    """From now on, in this process, give every allocation of >= 1 MiB its own mmap, returned to the
    OS when freed (glibc only; elsewhere nothing). Long CPU evaluations need it: without it,
    multi-MiB tensors fragment the heap and stay resident (an l6 forward at 32K tokens: > 7 GiB RSS
    instead of ~2 GiB)."""
    # not glibc (macOS, musl): nothing to set
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return

    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 1 << 20)


def run_script(main, script):
    """An evaluation's entry point: large allocations mmapped (mmap_large_allocations), and an
    expected failure or a full disk ends in one line and exit status 1, no traceback."""
    mmap_large_allocations()
    try:
        main()
    except EXPECTED_ERRORS as e:
        sys.exit(f"{script}: error: {e}")
    except OSError as e:
        if not disk_full(e):
            raise
        sys.exit(f"{script}: error: {full_disk_line(e)}")


def full_disk_line(error):
    """What an evaluation says when its disk fills: nothing written is partial (atomic_file; a cut
    JSONL line is dropped), so a rerun resumes."""
    return (
        f"{no_space_left(error.filename)}; free some and run it again: it resumes where it stopped"
    )


# ---- the output folder ---------------------------------------------------------------------------
# Held (flock) by the evaluation writing the folder; it holds "pid N on HOST: command line". The
# file stays: removing a lock file races with the next evaluation taking it.
LOCK_NAME = ".eval.lock"


@contextlib.contextmanager
def claim_out(out):
    """Hold the output folder for one evaluation. A second evaluation into it refuses (EvalError,
    naming the holder): two writers would each rewrite the summary from their own checkpoints'
    rows, and one's would be lost. Temporary files of dead writers are removed first."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, LOCK_NAME), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EvalError(
                f"{out} is in use by another evaluation ({lock_holder(lock)}); wait for it to "
                "end, or give this one another --out"
            ) from None

        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}: {shlex.join(sys.argv)}")
        lock.flush()
        for name in remove_stale_temporaries(out):
            print(f"removed {name}, left in {out} by a writer that has ended", file=sys.stderr)

        try:
            yield
        finally:
            # the next holder writes its own line; until then, none
            lock.truncate(0)


def lock_holder(lock):
    """The holder's line in a held lock file; it writes it just after taking the lock."""
    for _ in range(20):
        lock.seek(0)
        holder = lock.read().strip()
        if holder:
            return holder
        time.sleep(0.05)
    return "a process that has not written its pid yet"


# ---- options -------------------------------------------------------------------------------------
# An evaluation skips a length whose estimated peak exceeds this fraction of the free memory
# (memory_shortfall): the 512x passkey run relies on it.
MEMORY_FRACTION = 0.9


def add_common_args(parser, default_out):
    """The options every long-context evaluation takes: checkpoints, output folder, and the two
    that a one-line error names as its remedy (--device cpu, --attn_impl torch)."""
    parser.add_argument(
        "--ckpt",
        action="append",
        required=True,
        help="checkpoint file or run directory (newest ckpt_*.pt); repeat to compare several",
    )
    parser.add_argument(
        "--out", default=default_out, help="output directory for JSONL, JSON, CSV and PNG files"
    )
    parser.add_argument(
        "--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ..."
    )
    parser.add_argument(
        "--attn_impl", default="auto", choices=list(IMPLS), help="attention.py's impl"
    )
    return parser


def pick_device(name="auto"):
    """The device of --device (hardware.resolve_device), as a string."""
    try:
        device = resolve_device(name)
    except ValueError as e:
        raise EvalError(f"--device {name} {e}; use --device cpu") from None

    return str(device)


def resolve_dtype(device, dtype="auto"):
    """The autocast precision on this device: auto = bfloat16 on a GPU that has it natively,
    float16 on an older one, float32 on CPU (hardware.autocast takes it)."""
    if dtype != "auto":
        return dtype

    if torch.device(device).type != "cuda":
        return "float32"
    return "bfloat16" if native_bf16(device) else "float16"


def model_device(model):
    """The device of the model's parameters (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


# ---- checkpoints -------------------------------------------------------------------------------
def run_label(path):
    """A short name for a checkpoint in tables and legends: the run directory's name."""
    path = os.path.normpath(path)
    if os.path.isfile(path):
        return os.path.basename(os.path.dirname(path))
    return os.path.basename(path)


def checkpoint_digest(ckpt):
    """sha256 (16 hex digits) of a checkpoint's model settings and weights, what decides an
    evaluation's numbers (not the file: a copy with other metadata has the same digest)."""
    digest = hashlib.sha256(json.dumps(ckpt["model_args"], sort_keys=True).encode())
    for name in sorted(ckpt["model"]):
        tensor = ckpt["model"][name]
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def load_run(path, device, attn_impl="auto"):
    """One checkpoint as a run: a dict of label, model, ckpt_path (absolute), ckpt_step,
    ckpt_sha256, block_size, tokenizer, data_dir (or None)."""
    model, ckpt = load_model(path, device, attn_impl=attn_impl)
    impl = model.attn_impl
    why = impl_error(impl, model.config.family, device, grad=False)
    if why:
        raise EvalError(f"{path}: --attn_impl {impl}: {why}")

    return dict(
        label=run_label(path),
        model=model,
        ckpt_path=os.path.abspath(ckpt["path"]),
        ckpt_step=ckpt.get("step"),
        ckpt_sha256=checkpoint_digest(ckpt),
        block_size=model.config.block_size,
        tokenizer=model.config.tokenizer,
        data_dir=ckpt.get("config", {}).get("data_dir"),
    )


def check_kernel(model, label, dtype):
    """Where the model's attention resolves to the Triton kernel, compare it with the reference on a
    problem shaped like this evaluation (model.Attention.check_kernel) and print the line, before
    anything is evaluated; an EvalError where they disagree."""
    try:
        line = model.check_kernel(getattr(torch, dtype), training=False)
    except KernelMismatch as e:
        raise EvalError(f"{label}: {e}; evaluate with --attn_impl torch (the reference)") from None
    if line:
        print(f"{label}: {line}", flush=True)


def load_runs(paths, device, attn_impl="auto", dtype="float32"):
    """(runs, tokenizer): every checkpoint as a run (load_run), all with one tokenizer so that they
    see identical prompts, each with its kernel checked for evaluations in dtype (check_kernel)."""
    runs = [load_run(path, device, attn_impl) for path in paths]
    for run in runs:
        check_kernel(run["model"], run["label"], dtype)

    names = {r["tokenizer"] for r in runs}
    if len(names) > 1:
        per_run = ", ".join(f"{r['label']}: {r['tokenizer']}" for r in runs)
        raise EvalError(
            f"the checkpoints were trained with different tokenizers ({per_run}); "
            "compare them separately"
        )

    labels = [r["label"] for r in runs]
    # two run directories with the same name: told apart by index
    for i, r in enumerate(runs):
        if labels.count(r["label"]) > 1:
            r["label"] = f"{r['label']}#{i}"
    return runs, get_tokenizer(names.pop())


def training_data_dir(runs, data_dir=None):
    """data_dir if given, else the training data directory that the checkpoints record (they must
    agree)."""
    if data_dir:
        return data_dir

    recorded = sorted({r["data_dir"] for r in runs if r.get("data_dir")})
    if not recorded:
        raise EvalError("the checkpoints record no training data directory; pass --data_dir")
    if len(recorded) > 1:
        raise EvalError(
            f"the checkpoints were trained on different data ({', '.join(recorded)}); "
            "pass --data_dir"
        )
    if not os.path.isdir(recorded[0]):
        raise EvalError(
            f"the checkpoints were trained on {recorded[0]!r}, which does not exist from here "
            f"({os.getcwd()}); pass --data_dir"
        )
    return recorded[0]


def checkpoint_fields(run):
    """The fields that tie a result record to the checkpoint that produced it (not only to its
    path)."""
    return dict(ckpt=run["ckpt_path"], ckpt_step=run["ckpt_step"], ckpt_sha256=run["ckpt_sha256"])


# ---- memory ------------------------------------------------------------------------------------
def free_memory_bytes(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]

    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def memory_shortfall(model, length, device, batch=1, kv_cache=False, extra_bytes=0):
    """Why a no-grad forward over `length` tokens would not fit in MEMORY_FRACTION of the free
    memory, or None. Its estimated peak: one block's fp32 activations, the reference's score chunk
    (<= 256 MiB by construction), the weights, every layer's K/V with a KV cache, extra_bytes."""
    cfg = model.config
    # fp32 per token: residual + norm out, q/k/v/y, SwiGLU (w1, w3, product) at 2D
    per_token = 4 * cfg.n_embd * (2 + 4 + 3 * 2)
    activations = per_token * length * batch
    score_chunk = 256 * 2**20
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = 2 * cfg.n_layer * cfg.n_embd * 4 * length * batch if kv_cache else 0
    peak = int(activations + score_chunk + weights + cache) + extra_bytes

    free = free_memory_bytes(device)
    if peak > MEMORY_FRACTION * free:
        return (
            f"needs ~{fmt_bytes(peak)}, more than {MEMORY_FRACTION:.0%} of the {fmt_bytes(free)} "
            f"free on {device}"
        )


def reset_peak_memory(device):
    """CUDA only: the CPU's peak RSS cannot be reset."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def peak_memory_bytes(device):
    """CUDA: the allocator's peak since reset_peak_memory. CPU: the process's peak resident set size
    so far."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(torch.device(device))

    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- results -----------------------------------------------------------------------------------
def read_whole_lines(path):
    """The lines of a JSONL file up to the first damaged one (cut by an interruption, or not JSON),
    and how many lines the file holds."""
    if not os.path.exists(path):
        return [], 0

    with open(path) as f:
        lines = f.readlines()
    whole = []
    for line in lines:
        if not line.endswith("\n"):
            break
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError:
                break
        whole.append(line)
    return whole, len(lines)


class ResultLog:
    """Append-only per-sample JSONL; reopening it resumes (`done`: the keys already written; see
    drop_stale)."""

    def __init__(self, path, key_fields, runs=()):
        self.path = path
        self.key_fields = key_fields
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

        # a damaged line and everything after it are redone; the tail is dropped first, else new
        # records would be appended behind it and lost
        lines, n_lines = read_whole_lines(path)
        if len(lines) < n_lines:
            self._rewrite(lines)
        self.records = [json.loads(line) for line in lines if line.strip()]
        self.done = {self.key(r) for r in self.records}

        if runs:
            self.drop_stale(runs)

    def _rewrite(self, lines):
        with atomic_file(self.path, "w") as f:
            f.writelines(lines)

    def drop_stale(self, runs):
        """Remove (with a note) the records of a path that now holds another checkpoint: it is
        evaluated again."""
        digest_now = {r["ckpt_path"]: r["ckpt_sha256"] for r in runs}

        # the records of a path not evaluated now are kept
        def is_current(record):
            recorded = record.get("ckpt_sha256")
            return digest_now.get(record.get("ckpt"), recorded) == recorded

        stale = [r for r in self.records if not is_current(r)]
        if not stale:
            return

        self.records = [r for r in self.records if is_current(r)]
        self._rewrite([json.dumps(r) + "\n" for r in self.records])
        self.done = {self.key(r) for r in self.records}
        for path in dict.fromkeys(r["ckpt"] for r in stale):
            n_old = sum(r["ckpt"] == path for r in stale)
            print(
                f"note: {path} changed since {self.path} was written (sha256 now "
                f"{digest_now[path]}): its {n_old} old results are dropped and it is evaluated "
                "again",
                file=sys.stderr,
            )

    def key(self, record):
        return tuple(record[k] for k in self.key_fields)

    def add(self, record):
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            # A rerun would drop a cut line (read_whole_lines); cut it now, so that the file only
            # ever holds whole records.
            with contextlib.suppress(OSError):
                os.truncate(self.path, size)
            e.filename = e.filename or self.path
            raise

        self.records.append(record)
        self.done.add(self.key(record))


def write_table(rows, path_prefix):
    """Write a list of flat dicts as <prefix>.json and <prefix>.csv (a list in a CSV cell is written
    as JSON)."""
    os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
    with atomic_file(path_prefix + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    if not rows:
        return

    fieldnames = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_file(path_prefix + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})


def check_settings(jsonl_path, settings):
    """Refuse to resume a JSONL made with other settings (kept in <jsonl>.settings.json), else
    (re)write them."""
    side = jsonl_path + ".settings.json"
    # tuples -> lists, so that the comparison is exact
    settings = json.loads(json.dumps(settings))

    if os.path.exists(jsonl_path) and os.path.getsize(jsonl_path) > 0:
        stored = {}
        if os.path.exists(side):
            with open(side) as f:
                stored = json.load(f)
        diff = [
            f"{k}: {stored.get(k, '<absent>')!r} (stored) vs {settings.get(k, '<absent>')!r} (now)"
            for k in sorted(set(stored) | set(settings))
            if stored.get(k) != settings.get(k)
        ]
        if diff:
            raise EvalError(
                f"{jsonl_path} was made with other settings ({'; '.join(diff)}), so resuming would "
                "mix results; use another --out, or delete the file to start over"
            )
        return

    os.makedirs(os.path.dirname(os.path.abspath(side)), exist_ok=True)
    with atomic_file(side, "w") as f:
        json.dump(settings, f, indent=1)


def markdown_table(header, rows):
    """A GitHub-markdown table from a header list and rows of cells (anything str() can print)."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- figures -----------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, **savefig_args):
    """fig.savefig through atomic_file (the format from path's extension), then close it."""
    try:
        with atomic_file(path) as f:
            fig.savefig(f, format=os.path.splitext(path)[1][1:] or None, **savefig_args)
    finally:
        _plt().close(fig)


# a line style and marker per seed
LINE_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v")]
# <variant>-s<seed>[ ...]
SEEDED_NAME = re.compile(r"^(?P<variant>.+)-s(?P<seed>\d+)(?P<rest>.*)$")


def seed_split(name):
    """(variant, seed) of a run name <variant>-s<seed>[ rest] (the demo's runs: bam_ssmax-s3);
    (name, None) for other names."""
    match = SEEDED_NAME.match(name)
    if not match:
        return name, None
    return match["variant"] + match["rest"], int(match["seed"])


def multiple_of(length, train_length):
    """length / train_length as an int when whole (4 for 256 / 64), else rounded to 2 decimals."""
    ratio = length / train_length
    return int(ratio) if ratio == int(ratio) else round(ratio, 2)


def seed_table(cells, path_prefix, caption, worst, digits=2, figure=None):
    """The per-seed table of runs named <variant>-s<seed> (make demo SEEDS=N): one row per run, then
    per variant with several seeds the median and the worst over them.

    cells: {run label: {multiple of the training length: value}}; worst: ("min", min) where higher
    is better (accuracy), ("max", max) where lower is (perplexity). Writes
    <path_prefix>.{md,csv,json} (and, given figure = plot_seed_table's labels, <path_prefix>.png)
    and returns the markdown; None (nothing written) when no label carries a seed."""
    by_run = {seed_split(label): values for label, values in cells.items()}
    if all(seed is None for _, seed in by_run):
        return None

    mults = sorted({m for values in by_run.values() for m in values})
    rows = []
    body = []

    def add(variant, statistic, seed, n_seeds, values, first_cells, bold=""):
        columns = {f"{m}x": values.get(m) for m in mults}
        rows.append(
            dict(variant=variant, statistic=statistic, seed=seed, n_seeds=n_seeds, **columns)
        )
        shown = [f"{bold}{values[m]:.{digits}f}{bold}" if m in values else "–" for m in mults]
        body.append([*first_cells, *shown])

    for variant in dict.fromkeys(v for v, _ in by_run):
        seeds = sorted((seed for v, seed in by_run if v == variant), key=lambda x: (x is None, x))
        for seed in seeds:
            seed_cell = "–" if seed is None else seed
            add(variant, "seed", seed, 1, by_run[(variant, seed)], [variant, seed_cell])

        statistics_ = (("median", statistics.median), worst) if len(seeds) > 1 else ()
        for name, statistic in statistics_:
            # over the seeds that have the cell (a length can be skipped for lack of memory)
            per_mult = {
                m: [by_run[(variant, s)][m] for s in seeds if m in by_run[(variant, s)]]
                for m in mults
            }
            values = {m: statistic(v) for m, v in per_mult.items() if v}
            first_cells = [f"**{variant}**", f"**{name} of {len(seeds)}**"]
            add(variant, name, None, len(seeds), values, first_cells, bold="**")

    write_table(rows, path_prefix)
    if figure is not None:
        plot_seed_table(by_run, path_prefix + ".png", **figure)

    text = markdown_table(["run", "seed", *(f"{m}×" for m in mults)], body) + f"\n\n{caption}\n"
    with atomic_file(path_prefix + ".md", "w") as f:
        f.write(text)
    return text


def plot_seed_table(by_run, path, ylabel, title, logy=False):
    """seed_table's figure: per variant the median over its seeds (a line; the one seed's values
    where it has one) and the band between its two extreme seeds, against the multiple of the
    training length. by_run: {(variant, seed): {multiple: value}}."""
    plt = _plt()
    variants = list(dict.fromkeys(v for v, _ in by_run))
    cmap = plt.get_cmap("tab10" if len(variants) <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(8.5, 4.8))

    for i, variant in enumerate(variants):
        runs = [values for (v, _), values in by_run.items() if v == variant]
        mults = sorted({m for values in runs for m in values})
        per_mult = [[values[m] for values in runs if m in values] for m in mults]
        style = dict(color=cmap(i % cmap.N), linestyle=LINE_STYLES[i // 10 % len(LINE_STYLES)][0])
        label = f"{variant} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
        medians = [statistics.median(v) for v in per_mult]
        ax.plot(mults, medians, label=label, marker="o", markersize=3, **style)
        if len(runs) > 1:
            low = [min(v) for v in per_mult]
            high = [max(v) for v in per_mult]
            ax.fill_between(mults, low, high, color=style["color"], alpha=0.12, linewidth=0)

    ax.set(yscale="log" if logy else "linear", ylabel=ylabel, title=title)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("multiple of the training length (log scale)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.tight_layout()
    save_figure(fig, path, dpi=110, bbox_inches="tight")


def curve_styles(names):
    """{name: matplotlib style}: one colour per variant, one line style and marker per seed
    (seed_split)."""
    keys = {name: seed_split(name) for name in names}
    variants = list(dict.fromkeys(v for v, _ in keys.values()))
    seeds = sorted({s for _, s in keys.values() if s is not None})
    cmap = _plt().get_cmap("tab10" if len(variants) <= 10 else "tab20")

    styles = {}
    for name, (variant, seed) in keys.items():
        line, marker = ("-", "o")
        if seed is not None:
            line, marker = LINE_STYLES[seeds.index(seed) % len(LINE_STYLES)]
        color = cmap(variants.index(variant) % cmap.N)
        styles[name] = dict(color=color, linestyle=line, marker=marker)
    return styles


def plot_curves(series, train_lengths, path, xlabel, ylabel, title, logy=False, ylim=None):
    """One line per name of series = {name: (xs, ys)}, x on a log axis, each training length
    marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    styles = curve_styles(series)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name, markersize=4, **styles[name])

    for t in sorted(set(train_lengths)):
        ax.axvline(t, color="gray", linestyle="--", linewidth=1)
        ax.annotate(
            f"train length {t}",
            (t, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="gray",
        )

    ax.set(yscale="log" if logy else "linear", ylim=ylim, xlabel=xlabel, ylabel=ylabel, title=title)
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.tight_layout()
    save_figure(fig, path, dpi=120, bbox_inches="tight")


def plot_heatmap(matrix, row_labels, col_labels, path, title, xlabel, ylabel, train_col=None):
    """A red-yellow-green 0..1 heatmap (rows: e.g. depths, cols: e.g. lengths); train_col marks a
    column."""
    plt = _plt()
    figsize = (1.2 + 0.6 * len(col_labels), 1.2 + 0.35 * len(row_labels))
    fig, ax = plt.subplots(figsize=figsize)
    im = ax.imshow(matrix, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="upper")

    col_names = [str(c) for c in col_labels]
    ax.set_xticks(range(len(col_labels)), col_names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(row_labels)), [str(r) for r in row_labels], fontsize=8)
    if train_col is not None:
        ax.axvline(train_col, color="black", linestyle="--", linewidth=1.5)

    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def fmt_bytes(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def geometric_lengths(train_length, max_length):
    """train_length x 1, 2, 4, ... up to max_length (the default length grid of the evaluations)."""
    n = int(math.floor(math.log2(max(max_length, train_length) / train_length)))
    return [train_length * 2**k for k in range(n + 1)]

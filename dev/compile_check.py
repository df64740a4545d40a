"""
The attention kernel compiled for real NVIDIA GPUs, with no GPU: every specialisation that
training, the evaluations and the self-check launch, made by the kernel's own host code on CPU
tensors and compiled by Triton (with the ptxas its wheel ships) for sm_80, sm_86, sm_89, sm_90 and
sm_120. For each: compiled or the compiler's error, registers, spill stores and loads,
shared memory against the target's per-block limit, and whether every 16-bit dot runs on tensor
cores (mma or wgmma in the TTGIR). It fails on a compile error, on shared memory over the limit
and on a 16-bit dot without tensor cores; spills are reported, not failed.

    python dev/compile_check.py                        # the full matrix (make test-all)
    python dev/compile_check.py --quick                # make test's subset: l12's kernels
    python dev/compile_check.py --targets 86 --jobs 1  # one target

A stand-in for Triton's driver (TargetDriver) names the target: the host code asks it for the GPU
as it asks a real one, and each launch is compiled where it would have run. Writes
compile_check.json and .csv and the summary compile_check.md to --out.
"""

import argparse
import concurrent.futures
import contextlib
import io
import itertools
import multiprocessing
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

import attention_kernel as ak  # noqa: E402
from attention import AttentionArgs, ssmax_log_n  # noqa: E402
from eval_common import markdown_table, write_table  # noqa: E402
from infra import runtime  # noqa: E402
from priors import PRIORS, BoundPrior  # noqa: E402

# The shared memory one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin), per target:
# A100 163 KiB; RTX 30xx, A10, A40, RTX A6000 (sm_86), RTX 40xx, L4, L40S (sm_89) and RTX 50xx
# (sm_120) 99 KiB; H100, H200 (sm_90) 227 KiB.
TARGETS = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 120: 101_376}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class TargetDriver:
    """Triton's driver for a GPU that is not here: its target and shared memory, as device `arch`
    (a kernel cache per target). A launch under it runs nothing (launches())."""

    def __init__(self, arch):
        self.arch = arch
        self.utils = self

    def get_current_device(self):
        return self.arch

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_device_properties(self, device):
        return {"max_shared_mem": TARGETS[self.arch], "multiprocessor_count": 132}


KERNELS = ("fwd", "preprocess", "dkdv", "dq")
# the launch options a compilation takes (Triton's jit hook gives them)
OPTIONS = ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion", "launch_cooperative_grid")


@contextlib.contextmanager
def stand_in(arch):
    """Triton's driver stands in for sm_<arch> (TargetDriver) within the block."""
    previous = dict(vars(driver))
    driver.set_active(TargetDriver(arch))
    try:
        yield
    finally:
        vars(driver).update(previous)


@contextlib.contextmanager
def launches(arch):
    """Triton's driver stands in for sm_<arch>, and each launch is recorded instead of run, into
    the list this yields: (Triton's cache key, (kernel name, signature, constants, attributes,
    options)), what triton.compile takes."""
    recorded = []

    def record(*, key, fn, compile, **_):
        options = {name: compile[name] for name in OPTIONS}
        spec = (compile["signature"], compile["constants"], compile["configs"][0], options)
        recorded.append((str(key), (fn.name, *spec)))
        return True  # nothing to launch

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        with stand_in(arch):
            yield recorded
    finally:
        knobs.runtime.jit_cache_hook = previous


def compile_for(arch, launch):
    """One recorded launch compiled for sm_<arch>: a dict of what the compiler reports."""
    name, signature, constants, attrs, options = launch
    log = io.StringIO()
    started = time.time()
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed
    knobs.compilation.always_compile = True  # a cached kernel prints nothing
    try:
        with contextlib.redirect_stdout(log):
            source = ASTSource(getattr(ak, name), signature, constants, attrs)
            kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as error:  # the compiler's own exceptions vary between versions
        # Triton's message ends with the error, after the source lines it points at
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return dict(
            error=(lines[-1] if lines else repr(error))[:200], seconds=time.time() - started
        )

    # ptxas -v's report (Triton 3.4 keeps it to itself: unknown there)
    usage = re.search(
        rf"properties for {name}\n.*? (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used "
        r"(\d+) registers",
        log.getvalue(),
        re.S,
    )
    stores, loads, registers = map(int, usage.groups()) if usage else (None, None, None)
    return dict(
        error="",
        registers=registers,
        spill_stores=stores,
        spill_loads=loads,
        shared=kernel.metadata.shared,
        dots=_dots(kernel.asm["ttgir"]),
        seconds=time.time() - started,
    )


def _dots(ttgir):
    """How the 16-bit dots run, from the TTGIR: "wgmma" (sm_90's warpgroup MMA), "mma" (mma.sync),
    "fma" for one on no tensor core; "-" where no dot has 16-bit operands (fp32's ieee dots run on
    FMA units by design)."""
    kinds = set()
    for line in ttgir.splitlines():
        op = re.search(r"= (tt\.dot|ttng\.warp_group_dot) ", line)
        if not op or not re.search(r"x(bf16|f16)\b", line):
            continue
        if op.group(1) == "ttng.warp_group_dot":
            kinds.add("wgmma")
        else:
            kinds.add("mma" if "#mma" in line.split(" -> ")[-1] else "fma")
    return " + ".join(sorted(kinds)) or "-"


# ---- what the runs launch
# Prior settings: (label, prior name or None, trained params, SSMax, SSMax scaling the prior).
# Every registered prior with its trainable params, GGD with theta_mu too (train_mu), each
# without SSMax, with it, and (trained ones, as model.py) with it scaling the prior.
def prior_settings():
    settings = []
    for name in (None, *PRIORS):
        family = PRIORS.get(name)
        trained_sets = [family.trainable if family else ()]
        if name == "ggd":
            trained_sets.append((*family.trainable, "theta_mu"))
        for trained in trained_sets:
            label = name or "nope"
            if name == "ggd" and "theta_mu" in trained:
                label += " (mu trained)"
            settings.append((label, name, trained, False, False))
            settings.append((label + " + SSMax", name, trained, True, False))
            if trained:
                settings.append((label + " + SSMax scaling", name, trained, True, True))
    return settings


# make test's subset: the l12 model's kernels in bf16, training with documents
QUICK_SETTINGS = ("ggd + SSMax scaling", "ggd + SSMax", "alibi", "nope", "t5_bucket + SSMax")


def _call(setting, dtype, head_dim, shape, documents, train):
    """attention_triton on zeros shaped (B, H, Tq, Tk) with a prior setting, forward and, where
    train, backward (q, k, v and the trained params): the launches of one attention() call. Tq <
    Tk is a decoding step: k and v are a KV cache's views."""
    _, name, trained, ssmax, scale_prior = setting
    B, H, Tq, Tk = shape
    q = torch.zeros(B, Tq, H, head_dim, dtype=dtype).transpose(1, 2)
    k = torch.zeros(B, Tk, H, head_dim, dtype=dtype).transpose(1, 2)
    v = torch.zeros_like(k)
    if Tq < Tk:
        cache = torch.zeros(B, Tk + 16, H, head_dim, dtype=dtype).transpose(1, 2)
        k = v = cache[:, :, :Tk]
    for t in (q, k, v):
        t.requires_grad_(train)

    prior = None
    if name is not None:
        family = PRIORS[name]
        named = zip(family.params, family.initial("default", H))
        params = [t.float().requires_grad_(train and n in trained) for n, t in named]
        prior = BoundPrior(family, tuple(params))
    doc_start = None
    if documents:
        doc_start = torch.zeros(B, Tk, dtype=torch.long)
        doc_start[:, Tk // 3 :] = Tk // 3
    row_scale = None
    if ssmax:
        s = torch.ones(H, requires_grad=train)
        row_scale = s[None, :, None] * ssmax_log_n(torch.arange(Tk - Tq, Tk), doc_start)[:, None]

    args = AttentionArgs(doc_start, prior, row_scale, scale_prior).resolve(q, k, v)
    with torch.set_grad_enabled(train):
        out = ak.attention_triton(q, k, v, args)
        if train:
            out.float().sum().backward()


# The full matrix: the training kernels of every prior setting in each dtype, at a head_dim of
# every BLOCK_D class (_block_d): the CPU demos' 8, the 1B model's 32, l12's 48, 64 and 128; every
# other run (the self-check's problems, an evaluation, a decoding step) for l12 in bf16 and the
# CPU demo's model in fp32.
TRAINING = {"bf16": (8, 32, 48, 64, 128), "fp16": (48, 64, 128), "fp32": (8, 32, 64, 128)}
EVERY_RUN = (("bf16", 48), ("fp32", 8))
# Triton specialises an int on its being 1 or a multiple of 16 only: short runs stand in for long
TRAIN = ("train", (1, 16, 256, 256), True, True)  # l12's 16 heads, documents


def other_runs(dtype, head_dim):
    """(run, shape, documents, train) of every call but training's: the self-check's problems
    (training's and an evaluation's: check_length's tokens, two heads), an evaluation's forward and
    a decoding step. Under a target (check_length asks it for its tiles)."""
    check = ak.check_length(head_dim, dtype, torch.device("cpu"))
    return [
        ("self-check", (2, 2, check, check), True, True),
        ("self-check, evaluation", (2, 2, check, check), False, False),
        ("evaluation", (1, 16, 512, 512), False, False),
        ("decoding", (1, 16, 1, 200), False, False),
    ]


def calls(quick):
    """(dtype, head_dim, run, shape, documents, train, prior setting) of every call checked; quick:
    l12's training in bf16 (head_dim 48, and 64 for GGD + SSMax scaling the prior). The self-check
    adds its steep prior's problem. Under a target."""
    settings = prior_settings()
    if quick:
        l12 = [s for s in settings if s[0] in QUICK_SETTINGS]
        paper = next(s for s in l12 if s[0] == "ggd + SSMax scaling")
        return [("bf16", 48, *TRAIN, s) for s in l12] + [("bf16", 64, *TRAIN, paper)]

    found = []
    for dtype_name, head_dims in TRAINING.items():
        for head_dim in head_dims:
            found += [(dtype_name, head_dim, *TRAIN, s) for s in settings]
    steep = ("self-check's steep ggd", "ggd", (), False, False)
    for dtype_name, head_dim in EVERY_RUN:
        for run, shape, documents, train in other_runs(DTYPES[dtype_name], head_dim):
            extra = [steep] if run == "self-check" else []
            found += [
                (dtype_name, head_dim, run, shape, documents, train, s) for s in settings + extra
            ]
    return found


def collect(arch, quick):
    """Every launch of calls(quick) on sm_<arch>, once: {Triton's key: row}, a row the first call's
    settings, the launch (launches()) and every prior setting that launched it."""
    found = {}
    with launches(arch) as recorded:
        for dtype_name, head_dim, run, shape, documents, train, setting in calls(quick):
            first = len(recorded)
            _call(setting, DTYPES[dtype_name], head_dim, shape, documents, train)
            for key, launch in recorded[first:]:
                where = dict(dtype=dtype_name, head_dim=head_dim, run=run, launch=launch)
                found.setdefault(key, dict(where, priors=[]))["priors"].append(setting[0])
    return found


# ---- compile and report
def _tiles(launch):
    """The launch's tiles as "BLOCK_M x BLOCK_N, warps w, stages s" (the preprocess: BLOCK_M)."""
    name, signature, constants, attrs, options = launch
    kernel = getattr(ak, name)
    values = {kernel.arg_names[path[0]]: v for path, v in constants.items() if len(path) == 1}
    blocks = " x ".join(str(values[b]) for b in ("BLOCK_M", "BLOCK_N") if b in values)
    return f"{blocks}, {options['num_warps']} warps, {options['num_stages']} stages"


def check(arch, found, jobs):
    """Each found launch compiled for sm_<arch> (jobs processes): the report rows, in order."""
    rows = []
    context = multiprocessing.get_context("fork")  # the workers need nothing but the launch
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(compile_for, arch, f["launch"]) for f in found.values()]
        for done, (found_row, future) in enumerate(zip(found.values(), futures), 1):
            launch = found_row["launch"]
            row = dict(
                target=f"sm_{arch}",
                kernel=launch[0].removeprefix("_attn_").removeprefix("bwd_"),
                dtype=found_row["dtype"],
                head_dim=found_row["head_dim"],
                run=found_row["run"],
                priors=", ".join(dict.fromkeys(found_row["priors"])),
                tiles=_tiles(launch),
                **future.result(),
            )
            row["shared_limit"] = TARGETS[arch]
            row["failure"] = failure(row)
            rows.append(row)
            print(f"[{done}/{len(futures)}] {_line(row)}", flush=True)
    return rows


def failure(row):
    """What fails a row: a compile error, shared memory over the limit, a 16-bit dot without
    tensor cores; "" where none."""
    if row["error"]:
        return "does not compile: " + row["error"]
    if row["shared"] > row["shared_limit"]:
        return f"shared memory {row['shared']:,} B over the limit {row['shared_limit']:,} B"
    if "fma" in row["dots"]:
        return "a 16-bit dot without tensor cores"
    return ""


def _line(row):
    where = f"{row['target']} {row['kernel']:<10} {row['dtype']} d{row['head_dim']:<4}"
    settings = f"{row['tiles']:<28} {row['run']}: {row['priors']}"
    if row["error"]:
        return f"{where} ERROR {row['error']}  [{settings}]"
    spills = f"spills {row['spill_stores']}/{row['spill_loads']} B"
    failure = f"FAIL {row['failure']} " if row["failure"] else ""
    return (
        f"{where} {row['registers']} regs, {spills:<16} shared {row['shared']:>7,} B, "
        f"{row['dots']:<5} {failure}[{settings}]"
    )


SUMMARY = ["target", "kernel", "specialisations", "failures", "registers (max)", "spilling"]
SUMMARY += ["shared memory (max / limit, B)", "16-bit dots"]
SPILLS = ["dtype", "kernel", "head_dim", "targets", "specialisations", "registers"]
SPILLS += ["spills, most (stores / loads, B)"]


def _spill_table(spills):
    """The specialisations that spill, a row per dtype, kernel and head_dim (the CSV has each)."""
    table = []
    key = lambda r: (r["dtype"], KERNELS.index(r["kernel"]), r["head_dim"])  # noqa: E731
    for _, group in itertools.groupby(sorted(spills, key=key), key):
        group = list(group)
        first = group[0]
        targets = ", ".join(dict.fromkeys(r["target"] for r in group))
        registers = sorted({r["registers"] for r in group})
        most = max(group, key=lambda r: r["spill_stores"] + r["spill_loads"])
        row = [first["dtype"], first["kernel"], first["head_dim"], targets, len(group)]
        row += [", ".join(map(str, registers)), f"{most['spill_stores']} / {most['spill_loads']}"]
        table.append(row)
    return table


def summary(rows, seconds):
    """The report in markdown: a row per target and kernel, then the specialisations that spill
    (bytes stored / loaded per thread). "?" where ptxas's report was not to be had."""
    table = []
    ordered = sorted(rows, key=lambda r: (int(r["target"][3:]), KERNELS.index(r["kernel"])))
    for (target, kernel), group in itertools.groupby(ordered, lambda r: (r["target"], r["kernel"])):
        group = list(group)
        built = [r for r in group if not r["error"]]
        registers = [r["registers"] for r in built if r["registers"] is not None]
        spilling = sum(bool(r["spill_stores"] or r["spill_loads"]) for r in built)
        shared = max((r["shared"] for r in built), default=0)
        dots = ", ".join(sorted({r["dots"] for r in built} - {"-"})) or "-"
        failures = sum(bool(r["failure"]) for r in group)
        limit = f"{shared:,} / {group[0]['shared_limit']:,}"
        table.append([target, kernel, len(group), failures, max(registers, default="?")])
        table[-1] += [spilling if registers else "?", limit, dots]

    spills = [r for r in rows if not r["error"] and (r["spill_stores"] or r["spill_loads"])]
    lines = [f"{len(rows)} specialisations, Triton {triton.__version__}, {seconds:.0f} s", ""]
    known = any(r.get("registers") is not None for r in rows)
    count = len(spills) if known else "unknown (this Triton keeps ptxas's report to itself)"
    lines += [markdown_table(SUMMARY, table), "", f"Specialisations that spill: {count}", ""]
    lines += [markdown_table(SPILLS, _spill_table(spills))] if spills else []
    return "\n".join(lines) + "\n"


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--targets", type=int, nargs="+", default=list(TARGETS), choices=list(TARGETS)
    )
    parser.add_argument("--quick", action="store_true", help="make test's subset")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compilers at a time")
    parser.add_argument("--out", default="dev/results/compile")
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()

    started = time.time()
    rows = []
    for arch in args.targets:
        found = collect(arch, args.quick)
        print(f"sm_{arch}: {len(found)} specialisations", flush=True)
        rows += check(arch, found, args.jobs)
    report = summary(rows, time.time() - started)
    print(report)
    write_table(rows, os.path.join(args.out, "compile_check"))
    with runtime.atomic_file(os.path.join(args.out, "compile_check.md"), "w") as f:
        f.write(report)
    failures = [r for r in rows if r["failure"]]
    if failures:
        sys.exit(
            f"compile_check.py: error: {len(failures)} specialisations fail: "
            + failures[0]["failure"]
        )


if __name__ == "__main__":
    main()

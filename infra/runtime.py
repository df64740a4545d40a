"""
What a run needs from the machine, and a reader can skip: the device and its precision, one writer
per output folder, files that appear whole or not at all (checkpoints and shards among them), a
full disk in one line, stop signals, the run's log files, the allocator and memory. Only the entry
points call it (train.py, the eval and prepare scripts, analysis/, dev/); none of it changes a
number they compute.
"""

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

from model import CheckpointError, checkpoint_state

# ---- device and precision


def resolve_device(name="auto"):
    """The torch.device of a device setting: auto is CUDA if torch finds a GPU, else the CPU. A
    ValueError whose message follows the name: "cuda:3 needs a CUDA GPU, ..."."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"is not a device torch knows ({e})") from None

    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("needs a CUDA GPU, and torch finds none")
    return device


def training_device(name, dtype, compile, ddp):
    """The device a training asks for, checked against its precision (a ValueError says what does
    not fit). A GPU launch that finds no GPU stops rather than train for days on a CPU."""
    try:
        device = resolve_device(name)
    except ValueError as e:
        raise ValueError(f"device={name!r} {e}; use --device=cpu") from None

    gpu_recipe = dtype == "bfloat16" and compile
    if name == "auto" and device.type == "cpu" and (ddp or gpu_recipe):
        why = "under torchrun" if ddp else "with the GPU recipe's dtype=bfloat16 and compile=True"
        raise ValueError(
            f"device=auto found no CUDA GPU {why}; to train on the CPU on purpose pass "
            "--device=cpu (e.g. python train.py <config> --device=cpu --compile=False "
            "--dtype=float32)"
        )
    if device.type == "cpu" and dtype == "float16":
        raise ValueError(
            "dtype='float16' needs CUDA (it relies on a GradScaler); on the CPU use bfloat16 or "
            "float32"
        )
    return device


def start_processes(device, dtype, ddp, log):
    """(device, dtype) of this process, with torchrun's process group started: a GPU per process,
    TF32 matmuls, and float16 where a GPU has no native bfloat16."""
    if ddp and device.type == "cuda":
        device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if device.type == "cuda" and dtype == "bfloat16" and not native_bf16(device):
        log(f"note: {torch.cuda.get_device_name(device)} has no native bfloat16; float16 it is")
        dtype = "float16"
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device, dtype


def native_bf16(device):
    """Whether a CUDA device computes in bfloat16 natively (compute capability 8.0 and newer).
    torch.cuda.is_bf16_supported() also counts a T4's emulation: slow, and other rounding."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def autocast(device, dtype):
    """The autocast context of a precision name; float32 runs without autocast."""
    if dtype == "float32":
        return nullcontext()

    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, dtype))


# bf16 dense tensor-core peak FLOP/s per GPU, for MFU; the longer names first, so that "H100 PCIe"
# is not read as "H100"
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989.5e12),
    ("H200", 989.5e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("RTX 4090", 165.2e12),
]


def peak_flops(device_name):
    """The bf16 peak of a GPU by its name, or None for one not in the table."""
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


# ---- one writer per folder
# A script that writes a folder (a run's out_dir, an evaluation's --out, a data directory) owns it:
# it holds an flock on <folder>/.lock for as long as it lives. The kernel drops the lock when the
# process ends, SIGKILL included, so a folder is never left locked. Since no one else writes there,
# every temporary file the owner finds at the start is a dead writer's, and goes.
LOCK_NAME = ".lock"
TEMPORARY_SUFFIX = ".tmp"
_owned = {}


class FolderBusy(RuntimeError):
    """Another process owns the folder."""


def own_folder(folder):
    """Make this process the one writer of folder (created if need be) until it exits, and remove
    the temporary files left there. A FolderBusy names the owner, where one is alive."""
    key = os.path.realpath(folder)
    if key in _owned:
        return

    os.makedirs(folder, exist_ok=True)
    lock = open(os.path.join(folder, LOCK_NAME), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a process that is starting"
        lock.close()
        raise FolderBusy(
            f"{folder} is in use by another process ({holder}); wait for it to end, or give this "
            "one another folder"
        ) from None

    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}: {shlex.join(sys.argv)}\n")
    lock.flush()
    _owned[key] = lock

    for name in sorted(os.listdir(folder)):
        if name.endswith(TEMPORARY_SUFFIX):
            os.remove(os.path.join(folder, name))
            print(f"note: removed {name} from {folder}, left by a writer that ended", flush=True)


@contextlib.contextmanager
def atomic_file(path, mode="wb", **open_args):
    """A file whose content appears under path only if the block ends without an exception: written
    to path + ".tmp", fsynced, then renamed over path. On an exception the temporary goes."""
    path = os.fspath(path)
    tmp = path + TEMPORARY_SUFFIX
    f = open(tmp, mode, **open_args)
    try:
        yield f

        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException as e:
        # closing flushes what is buffered, which fails again on a full disk
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(OSError):
            os.remove(tmp)

        # a failed write() names no file; the error line names it
        if isinstance(e, OSError) and e.filename is None:
            e.filename = path
        raise


def disk_full(error):
    """Whether an exception is a write that failed for a full disk or quota."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space_left(path, what=None):
    """The line for a disk that filled while path was written: where, and what is free."""
    folder = os.path.dirname(os.path.abspath(path or "."))
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    held = f" for {what}" if what else ""
    return f"no space left{held} in {folder} ({free:,} bytes free)"


def errors_in_one_line(script, expected, full_disk_remedy):
    """From here on, an uncaught exception of an expected kind prints `<script>: error: <message>`
    instead of a traceback, a full disk no_space_left's line and the remedy, and a torch.compile
    failure the way out. Python exits 1 after any uncaught exception. Only rank 0 speaks."""

    def hook(kind, error, traceback):
        if disk_full(error):
            message = f"{no_space_left(error.filename)}; {full_disk_remedy}"
        elif kind.__module__.startswith(("torch._dynamo", "torch._inductor")):
            message = f"torch.compile failed ({kind.__name__}: {error}); rerun with --compile=False"
        elif issubclass(kind, expected):
            message = str(error)
        else:
            return sys.__excepthook__(kind, error, traceback)

        if os.environ.get("RANK", "0") == "0":
            print(f"{script}: error: {message}", file=sys.stderr)

    sys.excepthook = hook


# ---- per-sample results that resume
class ResultLog:
    """Append-only per-sample JSONL that only ever holds whole records; reopening it resumes
    (`records`: {key: record} of those written, key the record's key_fields). The evaluations'
    key_fields hold the checkpoint's digest: a path that now holds other weights is evaluated
    again, and the earlier weights' records stay beside the new ones."""

    def __init__(self, path, key_fields):
        self.path = path
        self.key_fields = key_fields
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

        lines = []
        if os.path.exists(path):
            with open(path) as f:
                lines = [line for line in f if line.strip()]
        # the whole records: those before a line that a kill or a full disk cut
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
        if records and not lines[len(records) - 1].endswith("\n"):
            records.pop()

        # a damaged tail goes first, else new records would be appended behind it and lost
        if len(records) < len(lines):
            with atomic_file(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        self.records = {self.key(r): r for r in records}

    def key(self, record):
        return tuple(record[k] for k in self.key_fields)

    def add(self, record):
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            # cut a partial line now, so that the file only ever holds whole records
            with contextlib.suppress(OSError):
                os.truncate(self.path, size)
            e.filename = e.filename or self.path
            raise

        self.records[self.key(record)] = record


# ---- stop signals
# A run stopped by a signal exits, after its checkpoint, with sysexits' EX_TEMPFAIL ("try again":
# --resume=True) for its stop signals, and with the shell's 128 + 2 for Ctrl-C.
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


def signal_names(names):
    """The signals of a comma-separated setting such as "SIGTERM,SIGUSR1"."""
    return [name.strip() for name in names.split(",") if name.strip()]


def catch_stop_signals(names):
    """Make the signals named, and SIGINT, only record their arrival: received["signal"]."""
    received = {"signal": 0}

    def record(signum, frame):
        received["signal"] = signum

    for name in signal_names(names) + ["SIGINT"]:
        signal.signal(signal.Signals[name], record)
    return received


def agreed_stop(received, device):
    """The signal that stops the run after this step, or 0: in one process the one it received,
    read without waiting; across processes the largest any rank received, so that every rank stops
    at the same step (a collective that waits for the device)."""
    if not dist.is_initialized():
        return received["signal"]

    flag = torch.tensor(received["signal"], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag)


# ---- a run's environment
def git(*args):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def environment(argv, world_size):
    """What reproduces a run: versions, GPUs, the git commit and the command line."""
    triton = None
    if importlib.util.find_spec("triton"):
        import triton

    cuda = torch.cuda.is_available()
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton and triton.__version__,
        cuda=torch.version.cuda,
        gpu=torch.cuda.get_device_name() if cuda else None,
        gpu_count=torch.cuda.device_count(),
        world_size=world_size,
        git_commit=git("rev-parse", "HEAD"),
        git_dirty=bool(git("status", "--porcelain", "-uno")),
        command=shlex.join([sys.executable, *argv]),
    )


def run_log(settings, world_size, start_step, master):
    """Start a training run's files in its out_dir (rank 0): config.json, env.json, and
    metrics.jsonl cut back to start_step. Returns write(record): a line of metrics.jsonl, and with
    wandb_log its numbers to Weights & Biases."""
    if not master:
        return lambda record: None

    out_dir = settings["out_dir"]
    path = os.path.join(out_dir, "metrics.jsonl")
    # a resumed run keeps its records up to its checkpoint; a line cut by a crash has no newline
    kept = []
    if settings["resume"] and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.endswith("\n")]
        kept = [line for line in kept if json.loads(line)["step"] <= start_step]
    with open(path, "w") as f:
        f.writelines(kept)

    env = dict(environment(sys.argv, world_size), start_step=start_step)
    for name, content in (("config.json", settings), ("env.json", env)):
        with atomic_file(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)

    wandb = None
    if settings["wandb_log"]:
        import wandb

        name = settings["wandb_run_name"] or os.path.basename(os.path.normpath(out_dir))
        wandb.init(project=settings["wandb_project"], config=settings, name=name)

    def write(record):
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if wandb:
            flat = {**record, **record.get("prior", {})}
            numbers = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and k != "step"}
            wandb.log(numbers, step=record["step"])

    return write


# ---- Checkpoints, written whole (the format is model.py's)
def save_checkpoint(path, model, **extra):
    """Write the model (a plain GPT) and `extra` to path, whole or not at all. A CheckpointError
    says why a write failed; a full disk says what is free."""
    state = checkpoint_state(model, **extra)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_file(path) as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as e:
        # torch's zip writer reports a failed write as a RuntimeError caused by the OSError
        cause = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise

        why = f"could not write the checkpoint {path}: {cause.strerror or cause}"
        if disk_full(cause):
            why = no_space_left(path, "the checkpoint")
        raise CheckpointError(why) from e


def checkpoint_digest(ckpt):
    """sha256 of a checkpoint's model settings and weights (not of its file)."""
    digest = hashlib.sha256(json.dumps(ckpt["model_args"], sort_keys=True).encode())

    for name in sorted(ckpt["model"]):
        tensor = ckpt["model"][name]
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy())

    return digest.hexdigest()[:16]


# ---- memory
def return_large_allocations():
    """glibc: give every allocation of 16 MiB or more its own mmap, handed back when freed.
    Long CPU evaluations need it: large tensors otherwise fragment the heap and stay resident (an
    l6 forward at 32K tokens: over 7 GiB instead of about 2). Smaller blocks stay on the heap:
    skipping allocates and frees blocks of a few MiB thousands of times a forward, and fresh pages
    for each took a third of its time (text BAM at 32K tokens: 2.7 s, 3.8-4.5 s with 1 MiB).
    Elsewhere it does nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return

    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 16 << 20)


def out_of_memory(error, device):
    """'out of memory (<first line>)' for an allocation that failed (CUDA's, or the CPU
    allocator's), else None."""
    cpu_failed = isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    if not (isinstance(error, torch.OutOfMemoryError) or cpu_failed):
        return None

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"out of memory ({first_line})"


def fits(device, fn, *args):
    """Run fn(*args): None, or why it is skipped when it runs out of memory (others are raised)."""
    try:
        fn(*args)
    except RuntimeError as error:
        reason = out_of_memory(error, device)
        if reason is None:
            raise
        return reason
    return None


def reset_peak_memory(device):
    """Start peak_memory_bytes afresh: CUDA's allocator peak; a Linux CPU's peak resident set
    (writing 5 to /proc/self/clear_refs resets VmHWM). Elsewhere a CPU's peak is the process's."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(torch.device(device))
        return

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_bytes(device):
    """CUDA: the allocator's peak since reset_peak_memory. CPU: the peak resident set since then
    (Linux), or the process's."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(torch.device(device))

    try:
        with open("/proc/self/status") as f:
            peak_kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
        return int(peak_kib) * 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

"""
Train a bam-gpt model: the paper's recipe in one loop, on one CPU, one GPU or many.

    python train.py config/bam_120m.py                                    # one device
    torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py  # one node, 8 GPUs
    ... --resume=True                                                     # continue a run

Every setting is a variable below; a config file and --key=value arguments override them
(configurator.py). out_dir/ holds config.json (the resolved settings), env.json (versions, GPUs,
git commit, command line), metrics.jsonl (a record per logged step) and ckpt_{step:07d}.pt, the
model after that many optimizer updates.
"""

import importlib.util
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from attention import KernelMismatch, impl_error
from model import (
    CheckpointError,
    checkpoint_name,
    checkpoints,
    load_checkpoint,
    load_state,
    save_checkpoint,
)
from configurator import ConfigError, configure
from data import (
    VAL_TOKENS,
    DataError,
    TokenLoader,
    atomic_file,
    disk_full,
    no_space_left,
    remove_stale_temporaries,
)
from runtime import autocast, native_bf16, peak_flops, resolve_device
from model import GPT, MODEL_SIZES, GPTConfig

# ---- Settings: the defaults are the paper's l12 BAM+SSMax recipe (config/bam_120m.py names it)
# I/O
out_dir = "out"  # run directory (see the module docstring)
data_dir = "data/fineweb_mistral"  # token shards of prepare_fineweb.py / prepare_demo.py
resume = False  # continue from the newest checkpoint in out_dir: model, optimizer, step, RNG
eval_interval = 250  # validation loss every this many steps (also at step 0 and at the end)
eval_iters = 159  # val batches per evaluation (at most what the split holds): 99.4% of FineWeb's
log_interval = 10  # a progress line and a metrics.jsonl record every this many steps
ckpt_interval = 1000  # a checkpoint every this many steps (and at the end)
keep_last = 2  # checkpoints kept in out_dir; older ones are deleted (0 = keep all)
stop_signals = "SIGTERM,SIGUSR1"  # preemption: finish the step, save, exit 75 (Ctrl-C too: 130)
wandb_log = False  # also send the metrics records to Weights & Biases (pip install wandb)
wandb_project = "bam-gpt"
wandb_run_name = ""  # "" = the name of out_dir

# data: 589,824 tokens per step = 1152 sequences x 512 (batch_size x accumulation x processes)
batch_size = 48  # sequences per micro-batch per process (48 x 512 fits an 80 GB GPU)
gradient_accumulation_steps = 1  # micro-batches per step over ALL processes (each: this / world)
tokens_per_step = 589824  # > 0 overrides the above: accumulation = this / (batch x block x world)
allow_data_repeat = False  # let the run read its training data more than once (else it refuses)

# model (model.GPTConfig; vocab_size and tokenizer come from the data)
model_size = ""  # "" or l6 | l8 | l12 | l15 | l18 | l24 (model.MODEL_SIZES): sets the next three
n_layer = 12
n_head = 16
n_embd = 768
block_size = 512  # the training context
pos_encoding = "bam"  # nope | sinusoidal | rope | alibi | bam
ssmax = True  # Scalable-Softmax: each query row's logits times s_h * log(n_i)
scale_prior = True  # bam + ssmax: s log n scales the prior too (the paper's placement)
prior = "ggd"  # bam's learned prior (priors.py): ggd | cauchy | kerple_log | t5_bucket | ...
bam_init = "zero"  # the prior's init; ggd: zero (starts as NoPE) | alibi | linear | "A,B"
train_mu = False  # ggd: train theta_mu too (the paper keeps mu = 0)
rope_theta = 500000.0
norm_eps = 1e-5

# optimizer: RAdam, decoupled weight decay on >= 2-D weights; one schedule scales each group's lr
learning_rate = 1e-3  # peak learning rate
min_lr = 1e-4  # the cosine ends here at max_iters
max_iters = 20000  # optimizer steps in the run (~11.8B tokens, about one epoch of FineWeb-10B)
warmup_iters = 0  # linear warmup steps (the paper relies on RAdam's rectification instead)
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the global gradient norm at this value (0 = no clipping)
prior_lr = 0.0  # learning rate of the BAM prior parameters (0 = learning_rate)
ssmax_lr = 0.0  # learning rate of the SSMax s parameters (0 = learning_rate)

# system
device = "auto"  # auto (cuda if there is one, else cpu) | cpu | cuda | cuda:1; torchrun: a GPU each
dtype = "bfloat16"  # bfloat16 | float16 (CUDA, with a GradScaler) | float32: the autocast precision
compile = True  # torch.compile the model for training (evaluation uses the plain module)
attn_impl = "auto"  # auto | torch | sdpa | triton: what computes attention (attention.py)
seed = 42  # process r seeds torch with seed + r
config_keys = [
    k
    for k, v in globals().items()
    if k.islower() and not k.startswith("_") and isinstance(v, (bool, int, float, str))
]
# --------------------------------------------------------------------------------------------------


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, a checkpoint that does not fit, a torch.compile
    failure, ...)."""


def get_lr(step, cfg):
    """Learning rate of update `step` (0-based): linear warmup, then cosine from learning_rate to
    min_lr."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters

    ratio = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0)))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


def model_config(cfg):
    """The model's settings as a GPTConfig, which checks them (head_dim, rope, prior, bam_init).
    vocab_size and tokenizer keep their defaults until open_data reads them from the data."""
    names = [f.name for f in fields(GPTConfig) if f.name not in ("vocab_size", "tokenizer")]
    return GPTConfig(**{name: getattr(cfg, name) for name in names})


# ---- Guards: every setting is checked before any data or model is touched -----------------------
def setting_errors(cfg, world_size):
    """What is wrong with the settings, one message per problem ([] if nothing)."""
    errors = []
    if cfg.model_size not in ("", *MODEL_SIZES):
        sizes = list(MODEL_SIZES)
        errors.append(f"model_size must be '' or one of {sizes}, got {cfg.model_size!r}")
    if cfg.dtype not in ("bfloat16", "float16", "float32"):
        errors.append(f"dtype must be bfloat16, float16 or float32, got {cfg.dtype!r}")

    at_least_one = (
        "batch_size block_size gradient_accumulation_steps max_iters eval_interval eval_iters "
        "log_interval ckpt_interval n_layer n_head n_embd"
    )
    for key in at_least_one.split():
        if getattr(cfg, key) < 1:
            errors.append(f"{key} must be at least 1, got {getattr(cfg, key)}")
    non_negative = (
        "tokens_per_step warmup_iters keep_last grad_clip weight_decay prior_lr ssmax_lr min_lr"
    )
    for key in non_negative.split():
        if getattr(cfg, key) < 0:
            errors.append(f"{key} must be >= 0, got {getattr(cfg, key)}")

    if not cfg.learning_rate > 0:
        errors.append(f"learning_rate must be > 0, got {cfg.learning_rate}")
    if cfg.min_lr > cfg.learning_rate:
        errors.append(f"min_lr={cfg.min_lr} is above learning_rate={cfg.learning_rate}")
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        errors.append(f"beta1 and beta2 must lie in [0, 1), got {cfg.beta1}, {cfg.beta2}")
    if cfg.wandb_log and not importlib.util.find_spec("wandb"):
        errors.append("wandb_log=True needs the wandb package")

    for name in signal_names(cfg.stop_signals):
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            errors.append(f"stop_signals: {name!r} is not a signal a process can catch")

    per_micro = cfg.batch_size * cfg.block_size * world_size
    if cfg.tokens_per_step > 0 and per_micro > 0 and cfg.tokens_per_step % per_micro:
        errors.append(
            f"tokens_per_step={cfg.tokens_per_step} is not a multiple of batch_size x block_size x "
            f"world_size = {per_micro}; choose a batch_size that divides it, or set "
            "tokens_per_step=0 and use gradient_accumulation_steps"
        )
    if cfg.tokens_per_step == 0 and cfg.gradient_accumulation_steps % world_size:
        errors.append(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible by "
            f"the world size {world_size} (it counts micro-batches over all processes)"
        )
    return errors


def resolve_config(settings, world_size):
    """(settings, model config): the settings (a dict) as a namespace with the derived ones filled
    in (model_size's n_layer, n_embd, n_head and tokens_per_step's accumulation), and the model's
    GPTConfig. A ConfigError names every problem found."""
    cfg = SimpleNamespace(**settings)
    if cfg.model_size in MODEL_SIZES:
        cfg.n_layer, cfg.n_embd, cfg.n_head = MODEL_SIZES[cfg.model_size]

    errors = setting_errors(cfg, world_size)
    if errors:
        raise ConfigError("invalid settings: " + "; ".join(errors))

    if cfg.tokens_per_step > 0:
        cfg.gradient_accumulation_steps = cfg.tokens_per_step // (cfg.batch_size * cfg.block_size)

    try:
        config = model_config(cfg)
    except ValueError as e:
        raise ConfigError(f"invalid settings: {e}") from None
    return cfg, config


def check_device(cfg, family, ddp):
    """The device the settings ask for (auto resolved), checked with the precision and the attention
    impl (for the model's prior) against the hardware (a ConfigError says what does not fit)."""
    try:  # first, so that a driver too old for this torch is named as the reason
        device = resolve_device(cfg.device)
    except ValueError as e:
        message = f"device={cfg.device!r} {e}; use --device=cpu"
        raise ConfigError(f"invalid settings: {message}") from None
    cuda = torch.cuda.is_available()
    gpu_recipe = cfg.dtype == "bfloat16" and cfg.compile
    if cfg.device == "auto" and not cuda and (ddp or gpu_recipe):
        # a GPU launch that finds no GPU is a mistake: stop rather than train a large model for days
        # on the CPU
        why = "under torchrun" if ddp else "with the GPU recipe's dtype=bfloat16 and compile=True"
        raise ConfigError(
            f"invalid settings: device=auto found no CUDA GPU {why}; to train on the CPU on "
            "purpose pass --device=cpu (e.g. python train.py <config> --device=cpu "
            "--compile=False --dtype=float32)"
        )

    if device.type == "cpu" and cfg.dtype == "float16":
        raise ConfigError(
            "invalid settings: dtype='float16' needs CUDA (it relies on a GradScaler); on the CPU "
            "use bfloat16 or float32"
        )

    error = impl_error(cfg.attn_impl, family, device, grad=True)
    if error:
        raise ConfigError(f"invalid settings: attn_impl={cfg.attn_impl!r}: {error}")
    return device


def open_data(cfg, config, rank, world_size, tokens_per_update, log):
    """(train loader, val loader, val batches per evaluation); sets the model config's tokenizer and
    vocab_size, and cfg's world_size."""
    try:
        train_loader = TokenLoader(
            cfg.data_dir, "train", cfg.block_size, cfg.batch_size, rank, world_size
        )
        val_loader = TokenLoader(
            cfg.data_dir, "val", cfg.block_size, cfg.batch_size, tokenizer=train_loader.tokenizer
        )
    except ValueError as e:  # data that cannot be used (too short, mixed tokenizers, broken shard)
        raise ConfigError(str(e)) from e

    eval_iters = min(cfg.eval_iters, max(1, len(val_loader) // cfg.batch_size))
    if eval_iters < cfg.eval_iters:
        log(
            f"note: the val split holds {eval_iters} batches; "
            f"eval_iters {cfg.eval_iters} -> {eval_iters}"
        )

    config.tokenizer = train_loader.tokenizer
    config.vocab_size = train_loader.vocab_size
    cfg.world_size = world_size
    check_data_budget(cfg, config.tokenizer, len(train_loader), tokens_per_update)
    return train_loader, val_loader, eval_iters


def check_data_budget(cfg, tokenizer, train_windows, tokens_per_update):
    """Refuse a run that would wrap around its training data (the loader repeats it), unless
    allow_data_repeat."""
    needed = cfg.max_iters * tokens_per_update
    have = train_windows * cfg.block_size
    if needed <= have or cfg.allow_data_repeat:
        return

    # what prepare_fineweb.py should fetch: + validation, + what the shards' ends lose
    total = math.ceil((VAL_TOKENS + 1.001 * needed) / 1e8) * 1e8
    raise ConfigError(
        f"the run reads {needed:,} training tokens ({cfg.max_iters} steps x {tokens_per_update:,}) "
        f"but {cfg.data_dir} holds {have:,} in whole {cfg.block_size}-token windows: "
        f"{needed - have:,} missing, so data would repeat. Get them with "
        f"`python prepare_fineweb.py --name sample-100BT --tokenizer {tokenizer} "
        f"--max_tokens {int(total)} "
        f"--out_dir {cfg.data_dir}` (resumes and extends), lower max_iters, or pass "
        "--allow_data_repeat=True"
    )


# ---- Setup ---------------------------------------------------------------------------------------
def setup_device(cfg, device, ddp, local_rank, log):
    """This process's device (torchrun: a GPU per process), recorded in cfg.device, with the process
    group started; a GPU without bfloat16 trains in float16."""
    if ddp and device.type == "cuda":
        device = torch.device(f"cuda:{local_rank}")
    cfg.device = str(device)

    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if cfg.dtype == "bfloat16" and not native_bf16(device):
            name = torch.cuda.get_device_name(device)
            log(f"note: {name} has no native bfloat16; training in float16 with a GradScaler")
            cfg.dtype = "float16"
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device


def check_run_dir(out_dir, resuming, master, log):
    """The checkpoints of out_dir, after checking that they agree with resume=True/False. Rank 0
    first removes the temporary files of writers that no longer run (a crash mid-write)."""
    if master:
        removed = remove_stale_temporaries(out_dir)
        if removed:
            log(f"removed the unfinished files of a writer that no longer runs: {removed}")

    existing = checkpoints(out_dir)
    if resuming and not existing:
        raise TrainingError(
            f"resume was asked for, but {out_dir!r} holds no ckpt_<step>.pt to resume from"
        )
    if not resuming and existing:
        newest = os.path.basename(existing[-1][1])
        raise TrainingError(
            f"{out_dir!r} already holds checkpoints (newest {newest}); pass --resume=True to "
            "continue that run, or choose another --out_dir"
        )
    return existing


@dataclass
class Run:
    """One training run: what the steps of the loop share, and where the run stands."""

    cfg: SimpleNamespace  # the resolved settings
    model: torch.nn.Module  # what trains: raw_model, compiled and/or wrapped in DDP
    raw_model: GPT  # the plain module: evaluation, checkpoints, the prior's log
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # float16's loss scaling; disabled otherwise
    autocast: object  # the precision context of every forward
    accum: int  # micro-batches per process per step
    tokens_per_update: int  # tokens per optimizer step over all processes
    log: Callable  # print on rank 0, nothing on the others
    master: bool  # rank 0: writes the run's files and checkpoints
    flops_per_step: Optional[float] = None  # for MFU, on a GPU with a known peak
    peak_flops: Optional[float] = None  # the bf16 peak of all processes' GPUs together
    step: int = 0  # optimizer updates done
    val_loss: Optional[float] = None  # of the latest evaluation
    last_checkpoint: Optional[str] = None  # the newest checkpoint written (or resumed from)
    stopped_by: Optional[str] = None  # the signal that stopped the run before max_iters


def restore(run, path, rank, world_size):
    """Load a checkpoint's model, optimizer, scaler and RNG into the run (the settings stay the
    current ones) and continue from its step."""
    ckpt = load_checkpoint(path, map_location="cpu")
    try:
        load_state(run.raw_model, ckpt)
    except ValueError as e:  # another model
        raise TrainingError(f"cannot resume: {e}") from None

    # the optimizer's state comes from the checkpoint, its hyperparameters from the current settings
    hyper = ("lr", "base_lr", "weight_decay", "betas")
    fresh = [{k: g[k] for k in hyper} for g in run.optimizer.param_groups]
    run.optimizer.load_state_dict(ckpt["optimizer"])
    for group, settings in zip(run.optimizer.param_groups, fresh):
        group.update(settings)
    if "scaler" in ckpt and run.scaler.is_enabled():
        run.scaler.load_state_dict(ckpt["scaler"])

    # another number of processes wrote other streams: they cannot continue
    rng = ckpt.get("rng", [])
    rng_restored = len(rng) == world_size
    if rng_restored:
        torch.set_rng_state(rng[rank]["cpu"])
        if run.cfg.device.startswith("cuda") and rng[rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rng[rank]["cuda"])

    now = vars(run.cfg)
    changed = [
        f"{k}={now[k]!r} (was {v!r})"
        for k, v in ckpt.get("config", {}).items()
        if k in now and k != "resume" and v != now[k]
    ]
    run.log(
        f"resuming {ckpt['path']} at step {ckpt['step']}; RNG {'' if rng_restored else 'not '}"
        f"restored; settings changed: {', '.join(changed) or 'none'}"
    )
    run.step = ckpt["step"]
    run.last_checkpoint = ckpt["path"]
    run.val_loss = ckpt.get("val_loss")


def describe(run):
    """Three lines for the log: the model, its parameters, the batch."""
    cfg = run.cfg
    config = run.raw_model.config
    encoding = config.pos_encoding + ("+ssmax" if config.ssmax else "")
    prior = f" ({config.prior} prior)" if config.pos_encoding == "bam" else ""
    run.log(
        f"model: {encoding}{prior}, {config.n_layer} layers, {config.n_head} heads, "
        f"n_embd {config.n_embd}, vocab {config.vocab_size} ({config.tokenizer})"
    )

    group_sizes = {k: sum(p.numel() for p in ps) for k, ps in run.raw_model.param_groups().items()}
    total = run.raw_model.num_params()
    non_embedding = run.raw_model.num_params(non_embedding=True)
    run.log(
        f"parameters: {total:,} total, {non_embedding:,} non-embedding, "
        f"{group_sizes['prior']} trainable prior, {group_sizes['ssmax']} SSMax s"
    )

    run.log(
        f"batch: {cfg.batch_size} x {cfg.block_size} tokens x {run.accum} accumulation x "
        f"{cfg.world_size} processes = {run.tokens_per_update:,} tokens per step; "
        f"{cfg.max_iters} steps; device {cfg.device}, {cfg.dtype}, compile={cfg.compile}"
    )


def git(*args):
    repo = os.path.dirname(os.path.abspath(__file__))
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def environment(argv, world_size):
    """What env.json records to reproduce a run: package versions, the GPUs, the git commit, the
    command line."""
    triton = importlib.import_module("triton") if importlib.util.find_spec("triton") else None
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


def write_json(path, obj):
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=2)


def write_run_files(run, argv):
    """config.json (the settings and the model's), env.json (of this launch) and metrics.jsonl, cut
    back to the step the run starts from. Returns the path of metrics.jsonl."""
    cfg = run.cfg
    os.makedirs(cfg.out_dir, exist_ok=True)
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")

    # a resumed run keeps the records up to its checkpoint; a line cut short by a crash has no
    # newline
    kept = []
    if cfg.resume and os.path.exists(metrics_path):
        with open(metrics_path) as f:
            lines = [line for line in f if line.endswith("\n")]
        kept = [line for line in lines if json.loads(line)["step"] <= run.step]

    config = dict(
        vars(cfg),
        model_args=asdict(run.raw_model.config),
        tokens_per_step_actual=run.tokens_per_update,
    )
    write_json(os.path.join(cfg.out_dir, "config.json"), config)

    env = dict(environment(argv, cfg.world_size), start_step=run.step)
    write_json(os.path.join(cfg.out_dir, "env.json"), env)

    with open(metrics_path, "w") as f:
        f.writelines(kept)
    return metrics_path


def metrics_writer(cfg, path):
    """write(record): a line of metrics.jsonl, its numbers to Weights & Biases (wandb_log). No path:
    nothing."""
    wandb = importlib.import_module("wandb") if path and cfg.wandb_log else None
    if wandb:
        name = cfg.wandb_run_name or os.path.basename(os.path.normpath(cfg.out_dir))
        wandb.init(project=cfg.wandb_project, config=vars(cfg), name=name)

    def write(record):
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if wandb:
            flat = {**record, **record.get("prior", {})}
            numbers = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and k != "step"}
            wandb.log(numbers, step=record["step"])

    return write


# ---- Stopping on a signal ----------------------------------------------------------------------
# A run stopped by a signal exits with one of these codes after its checkpoint is written: sysexits'
# EX_TEMPFAIL ("try again": --resume=True) for stop_signals, the shell's 128 + 2 for Ctrl-C.
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


def signal_names(stop_signals):
    return [name.strip() for name in stop_signals.split(",") if name.strip()]


def catch_stop_signals(stop_signals):
    """Make stop_signals and SIGINT (Ctrl-C) only record their arrival, so that the loop stops after
    the current step. Returns (the record, a function that puts the previous handlers back)."""
    received = {"signal": 0}

    def record(signum, frame):
        received["signal"] = signum

    caught = [signal.Signals[name] for name in signal_names(stop_signals)] + [signal.SIGINT]
    previous = {sig: signal.signal(sig, record) for sig in caught}

    def restore():
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return received, restore


def agreed_stop(run, received):
    """The signal that stops the run after this step, or 0: the largest number any rank received, so
    that every rank stops at the same step (one all_reduce a step under DDP)."""
    if not dist.is_initialized():
        return received["signal"]

    device = next(run.raw_model.parameters()).device
    flag = torch.tensor(received["signal"], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag)


# ---- The loop ------------------------------------------------------------------------------------
def micro_step(run, x, y, doc_start, last):
    """Forward and backward of one micro-batch; returns its loss (already divided by accum)."""
    # DDP all-reduces the gradients once per step, at the last micro-batch
    no_sync = isinstance(run.model, DDP) and not last
    with run.model.no_sync() if no_sync else nullcontext():
        try:
            with run.autocast:
                loss = run.model(x, y, doc_start=doc_start)[1] / run.accum
            run.scaler.scale(loss).backward()
        except Exception as e:
            compiler = type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))
            if run.cfg.compile and compiler:
                raise TrainingError(
                    f"torch.compile failed at step {run.step + 1} ({type(e).__name__}: {e}); "
                    "rerun with --compile=False"
                ) from e
            raise
    return loss.detach().float()


def last_good_checkpoint(run):
    """What an error that stops the run names as the place to go back to."""
    return run.last_checkpoint or "none (no checkpoint was written yet)"


def train_step(run, loader, lr):
    """(mean train loss, grad norm) of update run.step + 1 at lr (scaled per group by base_lr),
    run.accum micro-batches; nothing is applied if the loss or the gradients are not finite."""
    for group in run.optimizer.param_groups:
        group["lr"] = group["base_lr"] * lr / run.cfg.learning_rate

    device = next(run.raw_model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    for micro in range(run.accum):
        batch = loader.get_batch(run.step, micro, run.accum)
        x, y, doc_start = (t.to(device, non_blocking=True) for t in batch)
        loss_sum += micro_step(run, x, y, doc_start, last=micro == run.accum - 1)
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
        loss_sum /= dist.get_world_size()

    run.scaler.unscale_(run.optimizer)
    max_norm = run.cfg.grad_clip or float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), max_norm).item()
    train_loss = loss_sum.item()
    # float16's scaler skips steps with inf gradients by itself; anything else non-finite stops
    bad_norm = not run.scaler.is_enabled() and not math.isfinite(grad_norm)
    if not math.isfinite(train_loss) or bad_norm:
        what = f"gradient norm {grad_norm}"
        if not math.isfinite(train_loss):
            what = f"loss {train_loss}"
        raise TrainingError(
            f"non-finite {what} at step {run.step + 1}; training stopped before applying it. The "
            f"last good checkpoint is {last_good_checkpoint(run)}; try a lower learning_rate, a "
            "smaller grad_clip or dtype=float32"
        )

    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return train_loss, grad_norm


@torch.no_grad()
def evaluate(run, loader, eval_iters):
    """Mean validation loss over eval_iters batches (document-masked); the batches are split over
    processes."""
    model = run.raw_model
    device = next(model.parameters()).device
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1

    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)  # sum of batch losses, batches
    for k in range(rank, eval_iters, world_size):
        x, y, doc_start = (t.to(device) for t in loader.get_batch(k))
        with run.autocast:
            loss = model(x, y, doc_start=doc_start)[1]
        total += torch.stack([loss.double(), torch.ones_like(loss, dtype=torch.float64)])
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def eval_and_log(run, loader, eval_iters, record):
    """Evaluate into run.val_loss, and add to `record` and print the val loss and (bam) the prior's
    shape parameter per layer as [min, median, max] and the heads its highlight rule picks (ggd:
    theta_beta < 0)."""
    run.val_loss = evaluate(run, loader, eval_iters)
    record["val_loss"] = run.val_loss
    message = f"step {run.step}: val loss {run.val_loss:.4f}"

    if run.raw_model.config.pos_encoding == "bam":
        family = run.raw_model.config.family
        priors = [block.attn.bound_prior() for block in run.raw_model.blocks]
        shape_index = family.params.index(family.shape_param)
        shape = [prior.params[shape_index].detach().float().cpu() for prior in priors]
        quantiles = [[x.min().item(), x.quantile(0.5).item(), x.max().item()] for x in shape]
        rounded = [[round(q, 4) for q in row] for row in quantiles]
        record["prior"] = {family.shape_param: rounded}
        medians = [round(x.quantile(0.5).item(), 4) for x in shape]
        message += f" | {family.shape_param} median per layer {medians}"

        if family.highlight is not None:
            picked = int(sum(family.highlight(*prior.params).sum() for prior in priors))
            record["prior"]["heads_highlighted"] = picked
            heads = sum(x.numel() for x in shape)
            message += f" | heads with {family.highlight_label}: {picked}/{heads}"
    run.log(message)


def progress_record(run, train_loss, lr, grad_norm, seconds_per_step):
    """The metrics record of a logged step, printed as its progress line."""
    cfg = run.cfg
    tokens_per_s = run.tokens_per_update / seconds_per_step
    record = dict(
        step=run.step,
        train_loss=train_loss,
        lr=lr,
        grad_norm=grad_norm,
        tokens_per_s=tokens_per_s,
        ms_per_step=1000 * seconds_per_step,
    )
    line = (
        f"step {run.step}/{cfg.max_iters} | loss {train_loss:.4f} | lr {lr:.2e} | "
        f"grad norm {grad_norm:.3f} | {tokens_per_s:,.0f} tok/s | "
        f"{1000 * seconds_per_step:.1f} ms/step"
    )
    if run.peak_flops:
        record["mfu"] = run.flops_per_step / seconds_per_step / run.peak_flops
        line += f" | mfu {100 * record['mfu']:.1f}%"
    eta = format_eta(seconds_per_step * (cfg.max_iters - run.step))
    run.log(f"{line} | eta {eta}")
    return record


def save(run):
    """Write ckpt_<step>.pt (rank 0, with every process's RNG state); keep the newest keep_last."""
    cfg = run.cfg
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    own_rng = {"cpu": torch.get_rng_state(), "cuda": cuda_rng}
    rng = [own_rng]
    if dist.is_initialized():
        rng = [None] * dist.get_world_size()
        dist.all_gather_object(rng, own_rng)

    path = os.path.join(cfg.out_dir, checkpoint_name(run.step))
    error = None
    if run.master:
        extra = {"scaler": run.scaler.state_dict()} if run.scaler.is_enabled() else {}
        try:
            save_checkpoint(
                path,
                run.raw_model,
                optimizer=run.optimizer.state_dict(),
                step=run.step,
                config=vars(cfg),
                rng=rng,
                val_loss=run.val_loss,
                tokens=run.step * run.tokens_per_update,
                world_size=cfg.world_size,
                **extra,
            )
        except CheckpointError as e:
            error = f"{e}; the last good checkpoint is {last_good_checkpoint(run)}"

    # every rank learns whether the checkpoint is in place, so that none trains on alone
    if dist.is_initialized():
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise TrainingError(error)

    # older checkpoints go only once the new one is safely in place
    if run.master and cfg.keep_last > 0:
        for _, old in checkpoints(cfg.out_dir)[: -cfg.keep_last]:
            os.remove(old)
    run.last_checkpoint = path


def format_eta(seconds):
    minutes = int(seconds // 60)
    if minutes >= 60:
        return f"{minutes // 60}h{minutes % 60:02d}m"
    return f"{minutes}m{int(seconds % 60):02d}s"


def train_loop(run, train_loader, val_loader, eval_iters, write, received):
    """Train from run.step to max_iters: log, evaluate and save at their intervals. A signal in
    `received` stops it after the current step, with a checkpoint (run.stopped_by names it).
    Returns the last train loss."""
    cfg = run.cfg
    if run.step == 0:
        record = {"step": 0}
        eval_and_log(run, val_loader, eval_iters, record)
        write(record)

    train_loss = None
    interval_seconds = 0.0  # the steps since the last progress line, for its speed
    interval_steps = 0
    while run.step < cfg.max_iters:
        started = time.time()
        lr = get_lr(run.step, cfg)
        train_loss, grad_norm = train_step(run, train_loader, lr)
        run.step += 1
        interval_seconds += time.time() - started
        interval_steps += 1

        do_eval = run.step % cfg.eval_interval == 0 or run.step == cfg.max_iters
        if do_eval or run.step % cfg.log_interval == 0:
            seconds_per_step = interval_seconds / interval_steps
            record = progress_record(run, train_loss, lr, grad_norm, seconds_per_step)
            interval_seconds = 0.0
            interval_steps = 0
            if do_eval:
                eval_and_log(run, val_loader, eval_iters, record)
            write(record)

        stop = agreed_stop(run, received)
        if stop or run.step % cfg.ckpt_interval == 0 or run.step == cfg.max_iters:
            save(run)
        if stop and run.step < cfg.max_iters:
            run.stopped_by = signal.Signals(stop).name
            break
    return train_loss


def build_run(cfg, config, device, accum, tokens_per_update, log, master):
    """The model of config on its device, its optimizer and loss scaler, in a Run at step 0."""
    raw_model = GPT(config, attn_impl=cfg.attn_impl).to(device)
    betas = (cfg.beta1, cfg.beta2)
    optimizer = raw_model.configure_optimizers(
        cfg.weight_decay, cfg.learning_rate, betas, prior_lr=cfg.prior_lr, ssmax_lr=cfg.ssmax_lr
    )
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "float16")
    return Run(
        cfg=cfg,
        model=raw_model,
        raw_model=raw_model,
        optimizer=optimizer,
        scaler=scaler,
        autocast=autocast(device, cfg.dtype),
        accum=accum,
        tokens_per_update=tokens_per_update,
        log=log,
        master=master,
    )


def check_kernel(run):
    """Compare the Triton kernel with the reference on a problem shaped like this run's attention
    (its dtype, prior, SSMax, documents, every gradient) before anything is trained or written; a
    TrainingError where they disagree. Every rank checks its own GPU."""
    try:
        line = run.raw_model.check_kernel(getattr(torch, run.cfg.dtype), training=True)
    except KernelMismatch as e:
        raise TrainingError(f"{e}; train with --attn_impl=torch (the reference)") from None
    if line:
        run.log(line)


def measure_mfu(run, device, world_size):
    """Set what MFU needs: the FLOPs of a step and the GPUs' bf16 peak (none on a CPU or an unknown
    GPU)."""
    if device.type != "cuda":
        return
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name)
    if peak is None:
        run.log(f"note: no bf16 peak known for {name!r}; MFU is not reported")
        return
    run.flops_per_step = run.raw_model.flops_per_token(run.cfg.block_size) * run.tokens_per_update
    run.peak_flops = peak * world_size


def log_end(run, seconds):
    """The run's last line: done, or stopped by a signal and how to continue."""
    if run.stopped_by:
        run.log(
            f"stopped by {run.stopped_by} after step {run.step}; checkpoint {run.last_checkpoint}; "
            "continue with --resume=True"
        )
        return

    run.log(
        f"done: step {run.step} of {run.cfg.max_iters} in {format_eta(seconds)}; "
        f"val loss {run.val_loss}; checkpoint {run.last_checkpoint}"
    )


def train(settings, argv=()):
    """Run training with the settings dict (every key of config_keys). Returns a summary dict."""
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if ddp else 1
    master = rank == 0
    log = print if master else (lambda *args, **kwargs: None)

    cfg, config = resolve_config(settings, world_size)
    device = check_device(cfg, config.family, ddp)
    device = setup_device(cfg, device, ddp, local_rank, log)

    # micro-batches per process per step, and the tokens of a step over all processes
    accum = cfg.gradient_accumulation_steps // world_size
    tokens_per_update = cfg.batch_size * cfg.block_size * accum * world_size
    torch.manual_seed(cfg.seed + rank)
    existing = check_run_dir(cfg.out_dir, cfg.resume, master, log)
    loaders = open_data(cfg, config, rank, world_size, tokens_per_update, log)
    train_loader, val_loader, eval_iters = loaders

    run = build_run(cfg, config, device, accum, tokens_per_update, log, master)
    describe(run)
    check_kernel(run)
    if cfg.resume:
        restore(run, existing[-1][1], rank, world_size)

    if cfg.compile:
        run.model = torch.compile(run.raw_model)
    if ddp:
        run.model = DDP(run.model, device_ids=[device.index] if device.type == "cuda" else None)

    metrics_path = write_run_files(run, argv) if master else None
    write = metrics_writer(cfg, metrics_path)
    measure_mfu(run, device, world_size)

    started = time.time()
    received, restore_handlers = catch_stop_signals(cfg.stop_signals)
    try:
        train_loss = train_loop(run, train_loader, val_loader, eval_iters, write, received)
    finally:
        restore_handlers()

    log_end(run, time.time() - started)
    if ddp:  # leave together: a rank tearing down gloo while another still exits can hang it
        dist.barrier()
        dist.destroy_process_group()
    return dict(
        step=run.step,
        train_loss=train_loss,
        val_loss=run.val_loss,
        checkpoint=run.last_checkpoint,
        out_dir=cfg.out_dir,
        stopped_by=run.stopped_by,
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    settings = configure({k: globals()[k] for k in config_keys}, argv)
    return train(settings, argv=[os.path.abspath(__file__), *argv])


if __name__ == "__main__":
    try:
        summary = main()
    except (ConfigError, TrainingError, DataError, CheckpointError, FileNotFoundError) as e:
        # settings errors: rank 0 says it, once
        if os.environ.get("RANK", "0") == "0" or not isinstance(e, ConfigError):
            print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        # a full disk while writing the run's logs: the checkpoints written so far are intact
        if not disk_full(e):
            raise
        message = f"{no_space_left(e.filename)}; free some and resume with --resume=True"
        print(f"train.py: error: {message}", file=sys.stderr)
        sys.exit(1)
    if summary["stopped_by"] == "SIGINT":
        sys.exit(EXIT_INTERRUPTED)
    if summary["stopped_by"]:
        sys.exit(EXIT_PREEMPTED)

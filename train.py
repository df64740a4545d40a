"""
Train a bam-gpt model: the paper's recipe in one loop, on one CPU, one GPU or many.

    python train.py config/bam_120m.py  # one device
    torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py  # one node, 8 GPUs
    ... --resume=True  # continue a run

Settings: the variables below, overridden by a config file and --key=value (configurator.py).
out_dir/ holds config.json, env.json, metrics.jsonl (a record per logged step), ckpt_<step>.pt.
"""

import importlib.util
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from attention import impl_error
from configurator import ConfigError, configure
from data import DataError, TokenLoader
from infra import runtime
from infra.kernel_check import KernelMismatch, check_kernel
from model import (
    GPT,
    CheckpointError,
    GPTConfig,
    checkpoint_name,
    checkpoints,
    load_checkpoint,
    load_state,
)

# ---- Settings: defaults are the paper's l12 BAM+SSMax recipe (config/bam_120m.py)
# I/O
out_dir = "out"  # run directory (see the docstring)
data_dir = "data/fineweb_mistral"  # shards from prepare_fineweb.py / prepare_demo.py
resume = False  # resume from out_dir's newest checkpoint: model, optimizer, step, RNG
eval_interval = 250  # steps between val losses (also at step 0 and the end)
eval_iters = 159  # val batches per eval (capped by the split): 99.4% of FineWeb's
log_interval = 10  # steps between progress lines / metrics.jsonl records
ckpt_interval = 1000  # steps between checkpoints (also at the end)
keep_last = 2  # newest checkpoints kept in out_dir, older deleted (0 = all)
stop_signals = "SIGTERM,SIGUSR1"  # save at the step (torchrun: a log step), exit 75 (Ctrl-C: 130)
wandb_log = False  # also log metrics to Weights & Biases (pip install wandb)
wandb_project = "bam-gpt"
wandb_run_name = ""  # "" = out_dir's name

# data: 589,824 tokens/step = 1152 sequences x 512 = batch_size x accumulation x block_size
batch_size = 48  # sequences per micro-batch per process (48 x 512 fits an 80 GB GPU)
gradient_accumulation_steps = 24  # micro-batches per step over ALL processes (each: this / world)
allow_data_repeat = False  # may read the training data more than once (else refused)

# model (model.GPTConfig; vocab_size and tokenizer come from the data)
n_layer = 12
n_head = 16
n_embd = 768
block_size = 512  # training context
pos_encoding = "bam"  # nope | sinusoidal | rope | alibi | bam
ssmax = True  # Scalable-Softmax: each query row's logits times s_h * log(n_i)
scale_prior = True  # bam + ssmax: s log n scales the prior too (the paper's placement)
prior = "ggd"  # bam's learned prior (priors.py): ggd | cauchy | kerple_log | t5_bucket | ...
bam_init = "zero"  # the prior's init; ggd: zero (starts as NoPE) | alibi | linear | "A,B"
train_mu = False  # ggd: train theta_mu too (the paper keeps mu = 0)
rope_theta = 500000.0
norm_eps = 1e-5

# optimizer: RAdam, decoupled weight decay on >= 2-D weights; one schedule scales each group's lr
learning_rate = 1e-3  # peak
min_lr = 1e-4  # the cosine's end, at max_iters
max_iters = 20000  # optimizer steps (~11.8B tokens, about one epoch of FineWeb-10B)
warmup_iters = 0  # linear warmup steps (the paper relies on RAdam's rectification)
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # global gradient norm clip (0 = none)
prior_lr = 0.0  # lr of the BAM prior parameters (0 = learning_rate)
ssmax_lr = 0.0  # lr of the SSMax s parameters (0 = learning_rate)

# system
device = "auto"  # auto (cuda if any, else cpu) | cpu | cuda | cuda:1; torchrun: a GPU each
dtype = "bfloat16"  # bfloat16 | float16 (CUDA, GradScaler) | float32: autocast precision
compile = True  # torch.compile the model for training (evaluation runs it plain)
attn_impl = "auto"  # auto | torch | sdpa | triton: what computes attention (attention.py)
skip = False  # skip keys the prior proves negligible (exact); off until a GPU measures the gain
seed = 42  # process r seeds torch with seed + r
config_keys = [
    k
    for k, v in globals().items()
    if k.islower() and not k.startswith("_") and isinstance(v, (bool, int, float, str))
]
# ---- the functions train.py reuses or tests, then the run


class TrainingError(RuntimeError):
    """The run cannot go on: non-finite loss, ill-fitting checkpoint, compile error."""


def check_settings(cfg, world_size, ddp):
    """Check every setting before data or model are touched. Returns (device, GPTConfig); a
    ConfigError says why."""
    errors = []
    if cfg.dtype not in ("bfloat16", "float16", "float32"):
        errors.append(f"dtype must be bfloat16, float16 or float32, got {cfg.dtype!r}")

    at_least_one = (
        "batch_size block_size gradient_accumulation_steps max_iters eval_interval eval_iters "
        "log_interval ckpt_interval n_layer n_head n_embd"
    )
    for key in at_least_one.split():
        if getattr(cfg, key) < 1:
            errors.append(f"{key} must be at least 1, got {getattr(cfg, key)}")
    for key in "warmup_iters keep_last grad_clip weight_decay prior_lr ssmax_lr min_lr".split():
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
    for name in runtime.signal_names(cfg.stop_signals):
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            errors.append(f"stop_signals: {name!r} is not a signal a process can catch")

    if cfg.gradient_accumulation_steps % world_size:
        errors.append(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} is not divisible by "
            f"the world size {world_size} (it counts micro-batches over all processes)"
        )
    if errors:
        raise ConfigError("invalid settings: " + "; ".join(errors))

    # the model's checks (incl. unused settings), then the device's
    names = [f.name for f in fields(GPTConfig) if f.name not in ("vocab_size", "tokenizer")]
    try:
        config = GPTConfig(**{name: getattr(cfg, name) for name in names})
        device = runtime.training_device(cfg.device, cfg.dtype, cfg.compile, ddp)
    except ValueError as e:
        raise ConfigError(f"invalid settings: {e}") from None

    error = impl_error(cfg.attn_impl, config.family, device, grad=True)
    if error:
        raise ConfigError(f"invalid settings: attn_impl={cfg.attn_impl!r}: {error}")
    return device, config


def get_lr(step, cfg):
    """Learning rate of update `step` (0-based): linear warmup, then cosine to min_lr."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / cfg.warmup_iters

    ratio = (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0)))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)


def to_device(batch, device):
    """A batch's tensors on the device; on CUDA from pinned memory, without waiting for the copy."""
    if device.type != "cuda":
        return [t.to(device) for t in batch]
    return [t.pin_memory().to(device, non_blocking=True) for t in batch]


def read_steps(history, step, last_good, check_norm):
    """The loop's one wait on the device: the (loss, gradient norm) of the steps up to `step` since
    the last read (`history`, emptied), the losses averaged over ranks. Returns the last step's; a
    TrainingError names the first non-finite one (a gradient norm only if check_norm)."""
    losses, norms = map(torch.stack, zip(*history))
    if dist.is_initialized():
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    rows = torch.stack([losses, norms], 1).tolist()
    history.clear()

    for at, (loss, norm) in enumerate(rows, step - len(rows) + 1):
        if not math.isfinite(loss) or (check_norm and not math.isfinite(norm)):
            what = f"gradient norm {norm}" if math.isfinite(loss) else f"loss {loss}"
            raise TrainingError(
                f"non-finite {what} at step {at}; training stopped at step {step}, unsaved. The "
                f"last good checkpoint is {last_good or 'none yet'}; try a lower learning_rate, "
                "a smaller grad_clip or dtype=float32"
            )
    return rows[-1]


@torch.no_grad()
def evaluate(model, loader, eval_iters, autocast, step):
    """Mean val loss over eval_iters batches (document-masked, split over ranks) and, for bam, the
    learned prior's shape (GPT.prior_record): (record fields, log line)."""
    device = next(model.parameters()).device
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1

    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)  # sum of batch losses
    for k in range(rank, eval_iters, world_size):
        x, y, doc_start = to_device(loader.get_batch(k), device)
        with autocast:
            loss = model(x, y, doc_start=doc_start)[1]
        total += loss.double()
    if dist.is_initialized():
        dist.all_reduce(total)
    model.train()

    val_loss = total.item() / eval_iters
    record = {"val_loss": val_loss}
    message = f"step {step}: val loss {val_loss:.4f}"
    prior = model.prior_record()
    family = model.config.family
    if prior:
        record["prior"] = prior
        medians = [row[1] for row in prior[family.shape_param]]
        message += f" | {family.shape_param} median per layer {medians}"
    if "heads_highlighted" in prior:
        heads = model.config.n_layer * model.config.n_head
        message += f" | heads with {family.highlight_label}: {prior['heads_highlighted']}/{heads}"
    return record, message


def restore(path, model, optimizer, scaler, cfg, log):
    """Load a checkpoint's model, optimizer, scaler and this rank's RNG; current settings stay, the
    log names changed ones. Returns the checkpoint."""
    ckpt = load_checkpoint(path)
    try:
        load_state(model, ckpt)
    except ValueError as e:
        raise TrainingError(f"cannot resume: {e}") from None

    # optimizer state from the checkpoint, hyperparameters from current settings
    hyper = ("lr", "base_lr", "weight_decay", "betas")
    current = [{k: group[k] for k in hyper} for group in optimizer.param_groups]
    optimizer.load_state_dict(ckpt["optimizer"])
    for group, settings in zip(optimizer.param_groups, current):
        group.update(settings)
    if "scaler" in ckpt and scaler.is_enabled():
        scaler.load_state_dict(ckpt["scaler"])

    # RNG streams drawn by another process count cannot continue
    rng = ckpt.get("rng", [])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_restored = len(rng) == (dist.get_world_size() if dist.is_initialized() else 1)
    if rng_restored:
        torch.set_rng_state(rng[rank]["cpu"])
    if rng_restored and rng[rank]["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(rng[rank]["cuda"])

    then = ckpt.get("config", {})
    changed = [
        f"{k}={v!r} (was {then[k]!r})"
        for k, v in vars(cfg).items()
        if k in then and k != "resume" and then[k] != v
    ]
    log(
        f"resuming {ckpt['path']} at step {ckpt['step']}; RNG {'' if rng_restored else 'not '}"
        f"restored; settings changed: {', '.join(changed) or 'none'}"
    )
    return ckpt


def save(cfg, model, optimizer, scaler, step, val_loss, last_good):
    """Write ckpt_<step>.pt on rank 0 with every rank's RNG state; keep the newest keep_last. Every
    rank learns if it was written, so none trains on alone. Returns its path."""
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    own_rng = {"cpu": torch.get_rng_state(), "cuda": cuda_rng}
    rng = [own_rng]
    if dist.is_initialized():
        rng = [None] * dist.get_world_size()
        dist.all_gather_object(rng, own_rng)

    path = os.path.join(cfg.out_dir, checkpoint_name(step))
    writer = not dist.is_initialized() or dist.get_rank() == 0
    error = None
    if writer:
        state = dict(optimizer=optimizer.state_dict(), step=step, config=vars(cfg), rng=rng)
        state.update(val_loss=val_loss, world_size=len(rng))
        if scaler.is_enabled():
            state["scaler"] = scaler.state_dict()
        try:
            runtime.save_checkpoint(path, model, **state)
        except CheckpointError as e:
            error = f"{e}; the last good checkpoint is {last_good or 'none yet'}"
    if dist.is_initialized():
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise TrainingError(error)

    # delete older checkpoints only once the new one is safe
    if writer and cfg.keep_last > 0:
        for _, old in checkpoints(cfg.out_dir)[: -cfg.keep_last]:
            os.remove(old)
    return path


if __name__ == "__main__":
    expected = (ConfigError, TrainingError, DataError, CheckpointError, FileNotFoundError)
    remedy = "free some and resume with --resume=True"
    runtime.errors_in_one_line("train.py", (*expected, runtime.FolderBusy), remedy)
    cfg = SimpleNamespace(**configure({k: globals()[k] for k in config_keys}))

    # ---- processes, device and precision
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if ddp else 1
    master = rank == 0
    log = print if master else (lambda *args, **kwargs: None)
    device, config = check_settings(cfg, world_size, ddp)
    device, cfg.dtype = runtime.start_processes(device, cfg.dtype, ddp, log)
    cfg.device = str(device)
    autocast = runtime.autocast(device, cfg.dtype)
    # micro-batches per process per step
    accum = cfg.gradient_accumulation_steps // world_size
    tokens_per_update = cfg.batch_size * cfg.block_size * accum * world_size
    torch.manual_seed(cfg.seed + rank)

    # ---- the run directory holds checkpoints iff resuming
    existing = checkpoints(cfg.out_dir)
    if cfg.resume and not existing:
        raise TrainingError(f"resume was asked for, but {cfg.out_dir!r} holds no checkpoint")
    if not cfg.resume and existing:
        newest = checkpoint_name(existing[-1][0])
        raise TrainingError(
            f"{cfg.out_dir!r} already holds checkpoints (newest {newest}); pass --resume=True to "
            "continue that run, or choose another --out_dir"
        )

    # ---- data: windows in stream order, batches a function of (step, micro-step, rank)
    train_loader = TokenLoader(
        cfg.data_dir, "train", cfg.block_size, cfg.batch_size, rank, world_size
    )
    val_loader = TokenLoader(
        cfg.data_dir, "val", cfg.block_size, cfg.batch_size, tokenizer=train_loader.tokenizer
    )
    eval_iters = min(cfg.eval_iters, max(1, len(val_loader) // cfg.batch_size))
    if eval_iters < cfg.eval_iters:
        log(f"note: the val split holds {eval_iters} batches; eval_iters {cfg.eval_iters} -> that")
    config.tokenizer = train_loader.tokenizer
    config.vocab_size = train_loader.vocab_size

    # the loader wraps around; reading data twice is refused
    if not cfg.allow_data_repeat:
        train_loader.check_enough(cfg.max_iters, tokens_per_update)

    # ---- model, optimizer, kernel self-check, resumed state
    model = GPT(config, attn_impl=cfg.attn_impl, skip=cfg.skip).to(device)
    betas = (cfg.beta1, cfg.beta2)
    optimizer = model.configure_optimizers(
        cfg.weight_decay, cfg.learning_rate, betas, prior_lr=cfg.prior_lr, ssmax_lr=cfg.ssmax_lr
    )
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "float16")
    groups = {name: sum(p.numel() for p in ps) for name, ps in model.param_groups().items()}
    log(
        f"model: {config}; {model.num_params():,} parameters, {model.num_params(True):,} "
        f"non-embedding, {groups['prior']} trainable prior, {groups['ssmax']} SSMax s"
    )
    log(
        f"batch: {cfg.batch_size} x {cfg.block_size} tokens x {accum} accumulation x "
        f"{world_size} processes = {tokens_per_update:,} tokens per step; {cfg.max_iters} steps; "
        f"device {cfg.device}, {cfg.dtype}, compile={cfg.compile}"
    )

    # a kernel untested on this GPU must first match the reference
    try:
        line = check_kernel(model.blocks[0].attn, getattr(torch, cfg.dtype), training=True)
    except KernelMismatch as e:
        raise TrainingError(f"{e}; train with --attn_impl=torch (the reference)") from None
    if line:
        log(line)

    step = 0
    val_loss = None
    last_checkpoint = None
    if cfg.resume:
        ckpt = restore(existing[-1][1], model, optimizer, scaler, cfg, log)
        step = ckpt["step"]
        val_loss = ckpt.get("val_loss")
        last_checkpoint = ckpt["path"]

    # ---- compile, DDP, the run's files
    train_model = torch.compile(model) if cfg.compile else model
    if ddp:
        device_ids = [device.index] if device.type == "cuda" else None
        train_model = DDP(train_model, device_ids=device_ids)

    # from here this process owns the run directory (nothing written before)
    if master:
        runtime.own_folder(cfg.out_dir)
    settings = dict(vars(cfg), model_args=asdict(config), tokens_per_update=tokens_per_update)
    write = runtime.run_log(settings, world_size, step, master)

    # MFU: a step's FLOPs over the GPUs' bf16 peak (for GPUs the table knows)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = runtime.peak_flops(gpu_name)
    flops_per_step = model.flops_per_token(cfg.block_size) * tokens_per_update

    # ---- the loop: step, log line, evaluation, checkpoint, preemption stop
    if step == 0:
        fields_at_0, message = evaluate(model, val_loader, eval_iters, autocast, step)
        val_loss = fields_at_0["val_loss"]
        log(message)
        write({"step": 0, **fields_at_0})

    received = runtime.catch_stop_signals(cfg.stop_signals)
    history = []  # each step's (loss, gradient norm) since the last read, on the device
    started = time.time()
    since = started  # the end of the last read: a step's time is measured from read to read
    batch = to_device(train_loader.get_batch(step, 0, accum), device)
    while step < cfg.max_iters:
        lr = get_lr(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr / cfg.learning_rate

        # per micro-batch: forward, fetch the next, backward; DDP averages gradients at the last
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y, doc_start = batch
            no_sync = ddp and micro < accum - 1
            with train_model.no_sync() if no_sync else nullcontext():
                with autocast:
                    loss = train_model(x, y, doc_start=doc_start)[1] / accum
                next_step, next_micro = divmod(step * accum + micro + 1, accum)
                batch = to_device(train_loader.get_batch(next_step, next_micro, accum), device)
                scaler.scale(loss).backward()
            loss_sum += loss.detach().float()

        # the update, checked at the next read (float16's scaler skips inf gradients itself)
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        history.append((loss_sum, grad_norm))
        step += 1

        # a stop signal: read each step in one process, agreed by the ranks at log steps (it waits)
        do_eval = step % cfg.eval_interval == 0 or step == cfg.max_iters
        do_log = do_eval or step % cfg.log_interval == 0
        stop = runtime.agreed_stop(received, device) if do_log or not ddp else 0
        do_save = stop or step % cfg.ckpt_interval == 0 or step == cfg.max_iters
        if not (do_log or do_save):
            continue

        # read the device for a log line, and before an evaluation or a checkpoint
        steps_read = len(history)
        train_loss, grad_norm = read_steps(history, step, last_checkpoint, not scaler.is_enabled())
        seconds_per_step = (time.time() - since) / steps_read
        if do_log:
            record = dict(step=step, train_loss=train_loss, lr=lr, grad_norm=grad_norm)
            record["tokens_per_s"] = tokens_per_update / seconds_per_step
            record["ms_per_step"] = 1000 * seconds_per_step
            line = (
                f"step {step}/{cfg.max_iters} | loss {train_loss:.4f} | lr {lr:.2e} | grad norm "
                f"{grad_norm:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"{record['ms_per_step']:.1f} ms/step"
            )
            if peak:
                record["mfu"] = flops_per_step / seconds_per_step / (peak * world_size)
                line += f" | mfu {100 * record['mfu']:.1f}%"
            eta = timedelta(seconds=round(seconds_per_step * (cfg.max_iters - step)))
            log(f"{line} | eta {eta}")
            if do_eval:
                more, message = evaluate(model, val_loader, eval_iters, autocast, step)
                val_loss = more["val_loss"]
                record.update(more)
                log(message)
            write(record)

        # checkpoint at the interval, the end, and on a stop signal
        if do_save:
            last_checkpoint = save(cfg, model, optimizer, scaler, step, val_loss, last_checkpoint)
        if stop and step < cfg.max_iters:
            break
        since = time.time()

    if ddp:  # leave together: one rank tearing down gloo while another exits can hang it
        dist.barrier()
        dist.destroy_process_group()
    if step < cfg.max_iters:
        log(
            f"stopped by {signal.Signals(stop).name} after step {step}; checkpoint "
            f"{last_checkpoint}; continue with --resume=True"
        )
        sys.exit(runtime.EXIT_INTERRUPTED if stop == signal.SIGINT else runtime.EXIT_PREEMPTED)
    took = timedelta(seconds=round(time.time() - started))
    log(
        f"done: step {step} of {cfg.max_iters} in {took}; val loss {val_loss}; checkpoint "
        f"{last_checkpoint}"
    )

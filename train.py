"""
Train a bam-gpt model: the paper's recipe in one loop, on one CPU, one GPU or many.

    python train.py config/bam_120m.py                                       # one device (GPU, or CPU)
    torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py     # one node, 8 GPUs
    torchrun --nnodes=2 --node_rank=0 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \
             --nproc_per_node=8 train.py config/bam_120m.py                  # several nodes (node_rank 0, 1, ...)
    ... --resume=True                                                        # continue a run where it stopped

Settings are the module-level variables below; their defaults are the paper's recipe, and a config file and
--key=value arguments override them (configurator.py). The run directory out_dir/ holds:
    config.json     the resolved settings (plus world_size, vocab_size, tokenizer, model_args)
    env.json        versions, GPUs, host, git commit and command line of every launch
    metrics.jsonl   one JSON object per logged step: step, train_loss, lr, grad_norm, tokens_per_s, ms_per_step,
                    mfu (CUDA), and at evaluations val_loss and the learned prior (bam)
    ckpt_{step:07d}.pt  model.save_checkpoint(): model_args, model, optimizer, step, config, rng, val_loss, ...
"step N" always means "after N optimizer updates": ckpt_0000100.pt holds the model after update 100, the
metrics record of step 100 holds the training loss of update 100 (measured before it) and the val loss after it.
"""
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from attention_kernel import impl_error
from configurator import ConfigError, configure
from data import VAL_TOKENS, DataError, TokenLoader
from model import (GPT, MODEL_SIZES, POS_ENCODINGS, RUNTIME_KEYS, CheckpointError, GPTConfig, autocast,
                   checkpoint_model_args, checkpoint_name, checkpoints, config_diff, load_checkpoint, load_state,
                   peak_flops, save_checkpoint)
from priors import PRIORS

# ----------------------------------------------------------------------------------------------------------
# Settings. The defaults are the paper's l12 BAM+SSMax recipe: config/bam_120m.py only names the run.
# ----------------------------------------------------------------------------------------------------------
# I/O
out_dir = "out"                  # run directory (see the module docstring)
data_dir = "data/fineweb_mistral"  # token shards written by prepare_fineweb.py / prepare_demo.py
resume = False                   # continue from the newest checkpoint in out_dir: model, optimizer, step, RNG
eval_interval = 250              # validation loss every this many steps (also at step 0 and at the end)
eval_iters = 159                 # validation batches per evaluation (capped at what the val split holds); 159 x 48
                                 # windows of 512 cover 99.4% of the 3,932,160-token FineWeb val split
log_interval = 10                # a progress line and a metrics.jsonl record every this many steps
ckpt_interval = 1000             # a checkpoint every this many steps (and at the end)
keep_last = 2                    # checkpoints kept in out_dir; older ones are deleted (0 = keep all)
wandb_log = False                # also send the metrics records to Weights & Biases (pip install wandb)
wandb_project = "bam-gpt"
wandb_run_name = ""              # "" = the name of out_dir
# data: 589,824 tokens per step = 1152 sequences x 512 (batch_size x gradient accumulation x processes)
batch_size = 48                  # sequences per micro-batch per process (48 x 512 fits an 80 GB GPU)
gradient_accumulation_steps = 1  # micro-batches per step over ALL processes (each process does this / world size)
tokens_per_step = 589824         # > 0 overrides the above: accumulation = this / (batch_size * block_size * world size)
allow_data_repeat = False        # let the run read its training data more than once (else it refuses to start)
# model: model_size, then every field of model.GPTConfig with its default there (n_layer, n_head, n_embd,
# block_size = the training context, pos_encoding, ssmax, prior, attn_impl, ...), except vocab_size and tokenizer:
# the data sets those
model_size = ""                  # "" or l6 | l8 | l12 | l15 | l18 | l24 (model.MODEL_SIZES): sets n_layer, n_head, n_embd
MODEL_KEYS = tuple(f.name for f in fields(GPTConfig) if f.name not in ("vocab_size", "tokenizer"))
globals().update({f.name: f.default for f in fields(GPTConfig) if f.name in MODEL_KEYS})
# optimizer: RAdam with decoupled weight decay on >= 2-D weights; one schedule scales every group's own lr
learning_rate = 1e-3             # peak learning rate
min_lr = 1e-4                    # the cosine ends here at max_iters
max_iters = 20000                # optimizer steps in the run (~11.8B tokens, about one epoch of FineWeb-10B)
warmup_iters = 0                 # linear warmup steps (the paper relies on RAdam's rectification instead)
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0                  # clip the global gradient norm at this value (0 = no clipping)
prior_lr = 0.0                   # learning rate of the BAM prior parameters (0 = learning_rate)
ssmax_lr = 0.0                   # learning rate of the SSMax s parameters (0 = learning_rate)
# system
device = "auto"                  # auto (cuda if available, else cpu) | cpu | cuda | cuda:1 ...; torchrun: cuda:LOCAL_RANK
dtype = "bfloat16"               # bfloat16 | float16 (CUDA, with a GradScaler) | float32: the autocast precision
compile = True                   # torch.compile the model for training (evaluation uses the plain module)
seed = 42                        # process r seeds torch with seed + r
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (bool, int, float, str))]
# ----------------------------------------------------------------------------------------------------------


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, a checkpoint that does not fit, torch.compile failure, ...)."""


def get_lr(step, c):
    """Learning rate of update `step` (0-based): linear warmup, then cosine from learning_rate to min_lr."""
    if step < c["warmup_iters"]:
        return c["learning_rate"] * (step + 1) / c["warmup_iters"]
    ratio = (step - c["warmup_iters"]) / max(1, c["max_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (c["learning_rate"] - c["min_lr"])


def model_args(c, vocab_size, tokenizer):
    """The GPTConfig of settings c; vocab_size and tokenizer come from the data."""
    return dict({k: c[k] for k in MODEL_KEYS}, vocab_size=vocab_size, tokenizer=tokenizer)


def resolve_config(c, world_size):
    """Check the settings and fill in derived ones, before any data or model is touched. Raises ConfigError."""
    c = dict(c)
    errors = []
    if c["model_size"]:
        if c["model_size"] not in MODEL_SIZES:
            errors.append(f"model_size must be '' or one of {list(MODEL_SIZES)}, got {c['model_size']!r}")
        else:
            c["n_layer"], c["n_embd"], c["n_head"] = MODEL_SIZES[c["model_size"]]
    if c["pos_encoding"] not in POS_ENCODINGS:
        errors.append(f"pos_encoding must be one of {list(POS_ENCODINGS)}, got {c['pos_encoding']!r}")
    if c["dtype"] not in ("bfloat16", "float16", "float32"):
        errors.append(f"dtype must be bfloat16, float16 or float32, got {c['dtype']!r}")
    for k in ("batch_size", "block_size", "gradient_accumulation_steps", "max_iters", "eval_interval", "eval_iters",
              "log_interval", "ckpt_interval", "n_layer", "n_head", "n_embd"):
        if c[k] < 1:
            errors.append(f"{k} must be at least 1, got {c[k]}")
    for k in ("tokens_per_step", "warmup_iters", "keep_last", "grad_clip", "weight_decay", "prior_lr", "ssmax_lr",
              "min_lr"):
        if c[k] < 0:
            errors.append(f"{k} must be >= 0, got {c[k]}")
    if not c["learning_rate"] > 0:
        errors.append(f"learning_rate must be > 0, got {c['learning_rate']}")
    if c["min_lr"] > c["learning_rate"]:
        errors.append(f"min_lr={c['min_lr']} is above learning_rate={c['learning_rate']}")
    if not (0 <= c["beta1"] < 1 and 0 <= c["beta2"] < 1):
        errors.append(f"beta1 and beta2 must lie in [0, 1), got {c['beta1']}, {c['beta2']}")
    errors += resolve_accumulation(c, world_size)
    if c["device"] != "auto":
        try:
            dev = torch.device(c["device"])
            if dev.type == "cuda" and not torch.cuda.is_available():
                errors.append(f"device={c['device']!r} but this machine has no CUDA GPU; use --device=cpu")
        except RuntimeError as e:
            errors.append(f"device={c['device']!r} is not a device torch knows ({e})")
    if c["wandb_log"] and importlib.util.find_spec("wandb") is None:
        errors.append("wandb_log=True needs the wandb package (pip install wandb)")
    errors += attn_impl_errors(c)
    if not errors:
        try:  # the model's own checks (head_dim, rope, prior, bam_init); the vocabulary comes later from the data
            GPTConfig(**model_args(c, vocab_size=1, tokenizer=""))
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("invalid settings:\n  " + "\n  ".join(errors))
    return c


def open_data(c, rank, world_size, tokens_per_update, log):
    """The train and val loaders, and the validation batches per evaluation. Sets c's tokenizer, vocab_size and
    world_size from the data, and refuses a run that would repeat it (check_data_budget)."""
    try:
        train_loader = TokenLoader(c["data_dir"], "train", c["block_size"], c["batch_size"], rank, world_size)
        val_loader = TokenLoader(c["data_dir"], "val", c["block_size"], c["batch_size"], tokenizer=train_loader.tokenizer)
    except ValueError as e:  # data that cannot be used (too short, mixed tokenizers, a broken shard): say why
        raise ConfigError(str(e)) from e
    eval_iters = min(c["eval_iters"], max(1, len(val_loader) // c["batch_size"]))
    if eval_iters < c["eval_iters"]:
        log(f"note: the val split holds {len(val_loader)} windows = {eval_iters} batches; eval_iters "
            f"{c['eval_iters']} -> {eval_iters}")
    c.update(tokenizer=train_loader.tokenizer, vocab_size=train_loader.vocab_size, world_size=world_size)
    check_data_budget(c, len(train_loader), tokens_per_update)
    return train_loader, val_loader, eval_iters


def check_data_budget(c, train_windows, tokens_per_update):
    """Refuse a run that would wrap around its training data (the loader repeats it), unless allow_data_repeat."""
    T = c["block_size"]
    needed, have = c["max_iters"] * tokens_per_update, train_windows * T
    if needed <= have or c["allow_data_repeat"]:
        return
    total = math.ceil((VAL_TOKENS + 1.001 * needed) / 1e8) * 1e8  # + validation, + what shard ends lose
    raise ConfigError(f"the run reads {needed:,} training tokens ({c['max_iters']} steps x {tokens_per_update:,}) but "
                      f"{c['data_dir']} holds {have:,} in whole {T}-token windows: {needed - have:,} missing, so "
                      f"data would repeat. Get them with `python prepare_fineweb.py --name sample-100BT --tokenizer "
                      f"{c['tokenizer']} --max_tokens {int(total)} --out_dir {c['data_dir']}` (resumes and extends), "
                      "lower max_iters, or pass --allow_data_repeat=True")


def attn_impl_errors(c):
    """attn_impl that cannot train this model on this device (attention_kernel.impl_error decides)."""
    prior = PRIORS.get(c["prior"]) if c["pos_encoding"] == "bam" else PRIORS["alibi"] if c["pos_encoding"] == "alibi" else None
    device = ("cuda" if torch.cuda.is_available() else "cpu") if c["device"] == "auto" else c["device"]
    try:
        error = impl_error(c["attn_impl"], prior, device, grad=True)
    except RuntimeError:  # a device torch does not know: reported with the device
        return []
    return [f"attn_impl: {error}"] if error else []


def resolve_accumulation(c, world_size):
    """Set c["gradient_accumulation_steps"] from tokens_per_step (when > 0). Returns the errors found."""
    if c["tokens_per_step"] > 0 and c["batch_size"] > 0 and c["block_size"] > 0:
        per_micro = c["batch_size"] * c["block_size"] * world_size
        if c["tokens_per_step"] % per_micro:
            return [f"tokens_per_step={c['tokens_per_step']} is not a multiple of batch_size x block_size x "
                    f"world_size = {c['batch_size']} x {c['block_size']} x {world_size} = {per_micro}; "
                    "choose a batch_size that divides it, or set tokens_per_step=0 and use "
                    "gradient_accumulation_steps"]
        c["gradient_accumulation_steps"] = c["tokens_per_step"] // per_micro * world_size
    elif c["gradient_accumulation_steps"] % world_size:
        return [f"gradient_accumulation_steps={c['gradient_accumulation_steps']} is not divisible by the "
                f"world size {world_size} (it counts micro-batches over all processes)"]
    return []


# ----------------------------------------------------------------------------------------------------------
# Setup helpers
# ----------------------------------------------------------------------------------------------------------
def setup_device(c, ddp, local_rank):
    """Resolve c["device"] (torchrun: one GPU per process), select it and start the process group."""
    if c["device"] == "auto":
        c["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if ddp and c["device"].startswith("cuda"):
        c["device"] = f"cuda:{local_rank}"
    device = torch.device(c["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device


def check_precision(c, device, log):
    """Fall back where the hardware cannot do what c asks: bfloat16 without support, compile without a C++
    compiler on CPU. Updates c["dtype"] and c["compile"]."""
    dtype = c["dtype"]
    if device.type == "cuda" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        log("warning: this GPU has no bfloat16; using float16 with a GradScaler")
        dtype = "float16"
    if device.type == "cpu" and dtype == "float16":
        raise ConfigError("dtype='float16' needs CUDA (it relies on a GradScaler); on CPU use bfloat16 or float32")
    if device.type == "cpu" and dtype == "bfloat16":
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.ones(2, 2) @ torch.ones(2, 2)
        except Exception as e:
            log(f"warning: bfloat16 autocast is not supported on this CPU ({e}); training in float32")
            dtype = "float32"
    c["dtype"] = dtype
    if c["compile"] and device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++"))
                                                       or shutil.which("c++") or shutil.which("clang++")):
        log("warning: compile=True but no C++ compiler was found for torch.compile on CPU; running uncompiled")
        c["compile"] = False


def check_run_dir(out_dir, resuming):
    """The checkpoints of out_dir, after checking that they agree with resume=True/False."""
    existing = checkpoints(out_dir)
    if resuming and not existing:
        raise TrainingError(f"resume was asked for, but {out_dir!r} holds no ckpt_<step>.pt to resume from")
    if not resuming and existing:
        raise TrainingError(f"{out_dir!r} already holds checkpoints (newest {os.path.basename(existing[-1][1])}); "
                            "pass --resume=True to continue that run, or choose another --out_dir")
    return existing


def restore(path, raw_model, optimizer, scaler, c, rank, world_size, log):
    """Load model, optimizer, scaler and this process's RNG from a checkpoint; hyperparameters stay those of c.
    Returns (step, checkpoint path, val_loss)."""
    ckpt = load_checkpoint(path, map_location="cpu")
    args, old = model_args(c, c["vocab_size"], c["tokenizer"]), checkpoint_model_args(ckpt)
    diff = config_diff(*({k: a[k] for k in args if k not in RUNTIME_KEYS} for a in (old, args)))
    if diff:
        raise TrainingError(f"cannot resume {ckpt['path']!r}: its model differs from these settings "
                            "(checkpoint vs now):\n  " + "\n  ".join(diff))
    load_state(raw_model, ckpt)
    fresh = [{k: g[k] for k in ("lr", "base_lr", "weight_decay", "betas")} for g in optimizer.param_groups]
    optimizer.load_state_dict(ckpt["optimizer"])
    for g, f in zip(optimizer.param_groups, fresh):  # hyperparameters come from the current settings
        g.update(f)
    if "scaler" in ckpt and scaler.is_enabled():
        scaler.load_state_dict(ckpt["scaler"])
    rng = ckpt.get("rng", [])
    if len(rng) == world_size:
        torch.set_rng_state(rng[rank]["cpu"])
        if c["device"].startswith("cuda") and rng[rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rng[rank]["cuda"])
    else:
        log(f"note: the checkpoint was written by {len(rng)} processes, this run has {world_size}: "
            "RNG streams are not restored")
    step, val_loss = ckpt["step"], ckpt.get("val_loss")
    changed = [f"{k}: {ckpt['config'].get(k)!r} -> {c[k]!r}" for k in config_keys
               if k != "resume" and ckpt.get("config", {}).get(k, c[k]) != c[k]]
    log(f"resuming {ckpt['path']}: step {step} of {c['max_iters']} (val loss "
        f"{val_loss if val_loss is None else round(val_loss, 4)}); model, optimizer and RNG restored, the data "
        f"continues at batch {step} of the stream")
    if changed:
        log("settings changed since that checkpoint:\n  " + "\n  ".join(changed))
    return step, ckpt["path"], val_loss


def describe(raw_model, c, accum, tokens_per_update):
    """Three lines for the log: the model, its parameters, the batch."""
    groups = raw_model.param_groups()
    prior = f" ({c['prior']} prior)" if c["pos_encoding"] == "bam" else ""
    return (f"model: {c['pos_encoding']}{'+ssmax' if c['ssmax'] else ''}{prior}, {c['n_layer']} layers, "
            f"{c['n_head']} heads, n_embd {c['n_embd']}, vocab {c['vocab_size']} ({c['tokenizer']})\n"
            f"parameters: {raw_model.num_params():,} total, {raw_model.num_params(non_embedding=True):,} "
            f"non-embedding, {sum(p.numel() for p in groups['prior'])} trainable prior, "
            f"{sum(p.numel() for p in groups['ssmax'])} SSMax s\n"
            f"batch: {c['batch_size']} x {c['block_size']} tokens x {accum} accumulation x {c['world_size']} "
            f"processes = {tokens_per_update:,} tokens per step; {c['max_iters']} steps = "
            f"{tokens_per_update * c['max_iters']:,} tokens; device {c['device']}, {c['dtype']}, "
            f"compile={c['compile']}")


def refuse_cpu_for_gpu_recipe(c, ddp):
    """device=auto that finds no GPU in a GPU launch is a mistake, not a wish: stop instead of training a large
    model for days on the CPU. A GPU launch is torchrun, or the GPU recipe's precision (dtype=bfloat16 with
    compile=True, as config/bam_120m.py and the defaults). An explicit --device=cpu trains on the CPU on purpose."""
    if c["device"] != "auto" or torch.cuda.is_available():
        return
    if ddp or (c["dtype"] == "bfloat16" and c["compile"]):
        why = "under torchrun" if ddp else "with the GPU recipe's dtype=bfloat16 and compile=True"
        raise ConfigError(f"device=auto found no CUDA GPU {why}; to train on the CPU on purpose pass --device=cpu "
                          "(e.g. python train.py <config> --device=cpu --compile=False --dtype=float32)")


def environment(argv, world_size):
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                                  text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "hostname": socket.gethostname(),
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0, "world_size": world_size,
            "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain", "-uno")),
            "command": shlex.join([sys.executable, *argv])}


def write_run_files(c, tokens_per_update, argv, start_step):
    """config.json, env.json (this launch, and the earlier launches of a resumed run) and metrics.jsonl cut back
    to start_step: records of steps after it were lost with the crash. Returns the metrics path."""
    os.makedirs(c["out_dir"], exist_ok=True)
    with open(os.path.join(c["out_dir"], "config.json"), "w") as f:
        json.dump(dict(c, model_args=model_args(c, c["vocab_size"], c["tokenizer"]),
                       tokens_per_step_actual=tokens_per_update), f, indent=2)
    env_path = os.path.join(c["out_dir"], "env.json")
    earlier = []
    if c["resume"] and os.path.exists(env_path):
        with open(env_path) as f:
            prev = json.load(f)
        earlier = prev.pop("earlier_launches", []) + [prev]
    with open(env_path, "w") as f:
        json.dump(dict(environment(argv, c["world_size"]), start_step=start_step, earlier_launches=earlier), f,
                  indent=2)
    metrics_path = os.path.join(c["out_dir"], "metrics.jsonl")
    kept = []
    if c["resume"] and os.path.exists(metrics_path):
        with open(metrics_path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= start_step:
                        kept.append(line)
                except (ValueError, KeyError):  # a line cut short by the crash
                    pass
    with open(metrics_path, "w") as f:
        f.writelines(kept)
    return metrics_path


def start_wandb(c):
    import wandb
    wandb.init(project=c["wandb_project"], config=c,
               name=c["wandb_run_name"] or os.path.basename(os.path.normpath(c["out_dir"])))
    return wandb


# ----------------------------------------------------------------------------------------------------------
# Loop helpers
# ----------------------------------------------------------------------------------------------------------
def train_step(model, raw_model, optimizer, scaler, loader, ctx, step, accum, lr, c, last_ckpt):
    """Optimizer update step + 1 at learning rate lr (each group scaled by its own base_lr), over `accum`
    micro-batches per process. Returns (mean train loss, grad norm)."""
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * lr / c["learning_rate"]
    device = next(raw_model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum):
        x, y, doc_start = (t.to(device, non_blocking=True) for t in loader.get_batch(step, micro, accum))
        sync = model.no_sync() if isinstance(model, DDP) and micro < accum - 1 else nullcontext()
        with sync:  # DDP all-reduces the gradients once per step, at the last micro-batch
            try:
                with ctx:
                    _, loss = model(x, y, doc_start=doc_start)
                    loss = loss / accum
                scaler.scale(loss).backward()
            except Exception as e:
                if c["compile"] and type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
                    raise TrainingError(f"torch.compile failed at step {step + 1} ({type(e).__name__}: {e}); "
                                        "rerun with --compile=False") from e
                raise
        loss_sum += loss.detach().float()
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
        loss_sum /= dist.get_world_size()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(),
                                               c["grad_clip"] if c["grad_clip"] > 0 else float("inf")).item()
    train_loss = loss_sum.item()
    if not math.isfinite(train_loss) or (not scaler.is_enabled() and not math.isfinite(grad_norm)):
        what = f"loss {train_loss}" if not math.isfinite(train_loss) else f"gradient norm {grad_norm}"
        raise TrainingError(f"non-finite {what} at step {step + 1}; training stopped before applying it. The last "
                            f"good checkpoint is {last_ckpt or 'none (no checkpoint was written yet)'}; "
                            "try a lower learning_rate, a smaller grad_clip or dtype=float32")
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return train_loss, grad_norm


@torch.no_grad()
def evaluate(raw_model, loader, eval_iters, ctx):
    """Mean validation loss over eval_iters batches (document-masked); the batches are split over processes."""
    device = next(raw_model.parameters()).device
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    raw_model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)  # sum of batch losses, batches
    for k in range(rank, eval_iters, world_size):
        x, y, doc_start = (t.to(device) for t in loader.get_batch(k))
        with ctx:
            _, loss = raw_model(x, y, doc_start=doc_start)
        total += torch.stack([loss.double(), torch.ones((), device=device, dtype=torch.float64)])
    if dist.is_initialized():
        dist.all_reduce(total)
    raw_model.train()
    return (total[0] / total[1]).item()


def prior_record(raw_model):
    """The learned prior's shape parameter per layer as [min, median, max], and how many heads its highlight rule
    picks (ggd: theta_beta < 0). bam only."""
    prior_def = raw_model.blocks[0].attn.prior_def
    if raw_model.config.pos_encoding != "bam" or not prior_def.shape_param:
        return {}
    bound = [b.attn.prior() for b in raw_model.blocks]
    shapes = [p.params[prior_def.params.index(prior_def.shape_param)].detach().float().cpu() for p in bound]
    record = {prior_def.shape_param: [[round(x.min().item(), 4), round(x.quantile(0.5).item(), 4),
                                       round(x.max().item(), 4)] for x in shapes]}
    if prior_def.highlight is not None:
        record["heads_highlighted"] = int(sum(prior_def.highlight(*p.params).sum().item() for p in bound))
    return record


def eval_and_log(step, record, raw_model, loader, eval_iters, ctx, log):
    """Add the validation loss (and the learned prior) to `record`, print them, return the loss."""
    record["val_loss"] = val_loss = evaluate(raw_model, loader, eval_iters, ctx)
    prior = prior_record(raw_model)
    msg = f"step {step}: val loss {val_loss:.4f}"
    if prior:
        record["prior"] = prior
        cfg, prior_def = raw_model.config, raw_model.blocks[0].attn.prior_def
        msg += f" | {prior_def.shape_param} median per layer {[x[1] for x in prior[prior_def.shape_param]]}"
        if "heads_highlighted" in prior:
            msg += (f" | heads with {prior_def.highlight_label}: "
                    f"{prior['heads_highlighted']}/{cfg.n_layer * cfg.n_head}")
    log(msg)
    return val_loss


def progress_record(step, train_loss, lr, grad_norm, seconds_per_step, tokens_per_update, flops_per_step, peak, c,
                    log):
    """The metrics record of a logged step, printed as one progress line."""
    dt = seconds_per_step
    record = {"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm,
              "tokens_per_s": tokens_per_update / dt, "ms_per_step": 1000 * dt}
    mfu = flops_per_step / dt / (peak * c["world_size"]) if peak else None
    if mfu is not None:
        record["mfu"] = mfu
    log(f"step {step}/{c['max_iters']} | loss {train_loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
        f"{tokens_per_update / dt:,.0f} tok/s | {1000 * dt:.1f} ms/step"
        + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")
        + f" | eta {format_eta(dt * (c['max_iters'] - step))}")
    return record


def write_metrics(path, record, wandb):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if wandb is not None:
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if "heads_highlighted" in record.get("prior", {}):
            scalars["heads_highlighted"] = record["prior"]["heads_highlighted"]
        wandb.log(scalars, step=record["step"])


def rng_states():
    """This process's torch RNG states (CPU, and CUDA if used), gathered from every process when distributed."""
    own = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}
    if not dist.is_initialized():
        return [own]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, own)
    return every


def save(step, raw_model, optimizer, scaler, c, val_loss, tokens_per_update, master):
    """Write ckpt_<step>.pt (rank 0; every process takes part in gathering the RNG states) and delete all but the
    newest keep_last. Returns its path."""
    rng = rng_states()
    path = os.path.join(c["out_dir"], checkpoint_name(step))
    if master:
        extra = {"scaler": scaler.state_dict()} if scaler.is_enabled() else {}
        save_checkpoint(path, raw_model, optimizer=optimizer.state_dict(), step=step, config=c, rng=rng,
                        val_loss=val_loss, tokens=step * tokens_per_update, world_size=c["world_size"], **extra)
        if c["keep_last"] > 0:
            for _, old in checkpoints(c["out_dir"])[:-c["keep_last"]]:
                os.remove(old)
    return path


def format_eta(seconds):
    m = int(seconds // 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{int(seconds % 60):02d}s"


# ----------------------------------------------------------------------------------------------------------
def train(c, argv=()):
    """Run training with the settings dict c (every key of config_keys). Returns a summary dict."""
    # ---- processes, device, precision, run directory ----
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if ddp else 1
    c = resolve_config(c, world_size)
    refuse_cpu_for_gpu_recipe(c, ddp)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    device = setup_device(c, ddp, local_rank)
    accum = c["gradient_accumulation_steps"] // world_size  # micro-batches per process per step
    tokens_per_update = c["batch_size"] * c["block_size"] * accum * world_size
    torch.manual_seed(c["seed"] + rank)
    check_precision(c, device, log)
    ctx = autocast(device, c["dtype"])
    scaler = torch.amp.GradScaler(device.type, enabled=c["dtype"] == "float16")
    existing = check_run_dir(c["out_dir"], c["resume"])

    train_loader, val_loader, eval_iters = open_data(c, rank, world_size, tokens_per_update, log)

    # ---- model and optimizer ----
    raw_model = GPT(GPTConfig(**model_args(c, c["vocab_size"], c["tokenizer"]))).to(device)  # evals, ckpts use it
    optimizer = raw_model.configure_optimizers(c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]),
                                               prior_lr=c["prior_lr"], ssmax_lr=c["ssmax_lr"])
    log(describe(raw_model, c, accum, tokens_per_update))
    step, last_ckpt, val_loss = 0, None, None
    if c["resume"]:
        step, last_ckpt, val_loss = restore(existing[-1][1], raw_model, optimizer, scaler, c, rank, world_size, log)
    model = torch.compile(raw_model) if c["compile"] else raw_model
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    metrics_path = write_run_files(c, tokens_per_update, argv, step) if master else None
    wandb = start_wandb(c) if master and c["wandb_log"] else None
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if device.type == "cuda" and peak is None:  # MFU needs the GPU's peak
        log(f"note: no bf16 peak known for {torch.cuda.get_device_name(device)!r}; MFU is not reported")
    flops_per_step = raw_model.flops_per_token(c["block_size"]) * tokens_per_update

    # ---- the loop ----
    if step == 0:
        record = {"step": 0}
        val_loss = eval_and_log(0, record, raw_model, val_loader, eval_iters, ctx, log)
        if master:
            write_metrics(metrics_path, record, wandb)
    train_loss, interval_time, interval_steps, train_start = None, 0.0, 0, time.time()
    while step < c["max_iters"]:
        t0 = time.time()
        lr = get_lr(step, c)
        train_loss, grad_norm = train_step(model, raw_model, optimizer, scaler, train_loader, ctx, step, accum, lr,
                                           c, last_ckpt)
        step += 1
        interval_time += time.time() - t0
        interval_steps += 1
        do_eval = step % c["eval_interval"] == 0 or step == c["max_iters"]
        if do_eval or step % c["log_interval"] == 0:
            record = progress_record(step, train_loss, lr, grad_norm, interval_time / interval_steps,
                                     tokens_per_update, flops_per_step, peak, c, log)
            interval_time, interval_steps = 0.0, 0
            if do_eval:
                val_loss = eval_and_log(step, record, raw_model, val_loader, eval_iters, ctx, log)
            if master:
                write_metrics(metrics_path, record, wandb)
        if step % c["ckpt_interval"] == 0 or step == c["max_iters"]:
            last_ckpt = save(step, raw_model, optimizer, scaler, c, val_loss, tokens_per_update, master)
    log(f"done: step {step} of {c['max_iters']} in {format_eta(time.time() - train_start)}; val loss {val_loss}; "
        f"checkpoint {last_ckpt}")
    if ddp:  # leave together: a rank tearing down gloo while another still exits can hang it
        dist.barrier()
        dist.destroy_process_group()
    return {"step": step, "train_loss": train_loss, "val_loss": val_loss, "checkpoint": last_ckpt,
            "out_dir": c["out_dir"]}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    c = configure({k: globals()[k] for k in config_keys}, argv)
    return train(c, argv=[os.path.abspath(__file__), *argv])


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, TrainingError, DataError, CheckpointError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0" or not isinstance(e, ConfigError):  # settings errors: rank 0 says it
            print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(1)

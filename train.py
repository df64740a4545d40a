"""
Train a bam-gpt model: the paper's recipe in one loop, on one CPU, one GPU or many.

    python train.py config/bam_120m.py                                       # one device (GPU, or CPU)
    torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py     # one node, 8 GPUs (--nnodes=...)
    ... --resume=True                                                        # continue a run where it stopped

Settings are the variables below (the paper's recipe), overridden by a config file and --key=value arguments
(configurator.py). out_dir/ holds config.json (the resolved settings), env.json (versions, GPUs, git commit and
command line of every launch), metrics.jsonl (a record per logged step: train_loss, lr, grad_norm, tokens_per_s,
ms_per_step, mfu on CUDA; val_loss and the learned prior at evaluations) and ckpt_{step:07d}.pt. "Step N" is
"after N optimizer updates": ckpt_0000100.pt and the record of step 100 hold the model after update 100.
"""
import importlib.util
import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from attention import impl_error
from configurator import ConfigError, configure
from data import VAL_TOKENS, DataError, TokenLoader
from model import (GPT, MODEL_SIZES, CheckpointError, GPTConfig, autocast, checkpoint_name,
                   checkpoints, load_checkpoint, load_state, peak_flops, save_checkpoint)
from priors import PRIORS

# ---- Settings: the defaults are the paper's l12 BAM+SSMax recipe (config/bam_120m.py only names the run) --
# I/O
out_dir = "out"                  # run directory (see the module docstring)
data_dir = "data/fineweb_mistral"  # token shards written by prepare_fineweb.py / prepare_demo.py
resume = False                   # continue from the newest checkpoint in out_dir: model, optimizer, step, RNG
eval_interval = 250              # validation loss every this many steps (also at step 0 and at the end)
eval_iters = 159                 # val batches per evaluation (at most what the split holds): 99.4% of FineWeb's val
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
# model (model.GPTConfig; vocab_size and tokenizer come from the data)
model_size = ""                  # "" or l6 | l8 | l12 | l15 | l18 | l24 (model.MODEL_SIZES): sets n_layer, n_head, n_embd
n_layer = 12
n_head = 16
n_embd = 768
block_size = 512                 # the training context
pos_encoding = "bam"             # nope | sinusoidal | rope | alibi | bam
ssmax = True                     # Scalable-Softmax: each query row's logits times s_h * log(n_i)
ssmax_init = 1.0                 # s starts here (the authors' seq_scale)
ssmax_prior = True               # bam + ssmax: (q.k/sqrt(d) + B) * s log n, the prior scaled too (the authors' default)
prior = "ggd"                    # bam's learned prior, a name registered in priors.py (ggd | cauchy | yours)
bam_init = "zero"                # its init (priors.py); ggd: zero (starts as NoPE) | alibi | linear | "A,B"
train_mu = False                 # ggd: train theta_mu too (the paper keeps mu = 0)
attn_impl = "auto"               # auto | torch | sdpa | triton (attention_kernel.py)
rope_theta = 500000.0
norm_eps = 1e-5
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
config_keys = [k for k, v in globals().items() if k.islower() and not k.startswith("_")
               and isinstance(v, (bool, int, float, str))]
MODEL_KEYS = tuple(f.name for f in fields(GPTConfig) if f.name not in ("vocab_size", "tokenizer"))
# ----------------------------------------------------------------------------------------------------------


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, a checkpoint that does not fit, a torch.compile failure, ...)."""


def get_lr(step, c):
    """Learning rate of update `step` (0-based): linear warmup, then cosine from learning_rate to min_lr."""
    if step < c["warmup_iters"]:
        return c["learning_rate"] * (step + 1) / c["warmup_iters"]
    ratio = (step - c["warmup_iters"]) / max(1, c["max_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (c["learning_rate"] - c["min_lr"])


def model_args(c, vocab_size, tokenizer):
    """The GPTConfig of settings c; vocab_size and tokenizer come from the data."""
    return dict({k: c[k] for k in MODEL_KEYS}, vocab_size=vocab_size, tokenizer=tokenizer)


# ---- Guards: every setting is checked before any data or model is touched --------------------------------
def resolve_config(c, world_size):
    """The settings with the derived ones filled in; a ConfigError names every problem found."""
    c = dict(c)
    if c["model_size"] in MODEL_SIZES:
        c["n_layer"], c["n_embd"], c["n_head"] = MODEL_SIZES[c["model_size"]]
    per_micro = c["batch_size"] * c["block_size"] * world_size
    checks = [
        (c["model_size"] not in ("", *MODEL_SIZES), f"model_size must be '' or one of {list(MODEL_SIZES)}, got "
                                                    f"{c['model_size']!r}"),
        (c["dtype"] not in ("bfloat16", "float16", "float32"), f"dtype must be bfloat16, float16 or float32, got "
                                                               f"{c['dtype']!r}"),
        *((c[k] < 1, f"{k} must be at least 1, got {c[k]}") for k in (
            "batch_size", "block_size", "gradient_accumulation_steps", "max_iters", "eval_interval", "eval_iters",
            "log_interval", "ckpt_interval", "n_layer", "n_head", "n_embd")),
        *((c[k] < 0, f"{k} must be >= 0, got {c[k]}") for k in (
            "tokens_per_step", "warmup_iters", "keep_last", "grad_clip", "weight_decay", "prior_lr", "ssmax_lr",
            "min_lr")),
        (not c["learning_rate"] > 0, f"learning_rate must be > 0, got {c['learning_rate']}"),
        (c["min_lr"] > c["learning_rate"], f"min_lr={c['min_lr']} is above learning_rate={c['learning_rate']}"),
        (not (0 <= c["beta1"] < 1 and 0 <= c["beta2"] < 1), f"beta1 and beta2 must lie in [0, 1), got "
                                                             f"{c['beta1']}, {c['beta2']}"),
        (c["wandb_log"] and not importlib.util.find_spec("wandb"), "wandb_log=True needs the wandb package"),
        (c["tokens_per_step"] > 0 and per_micro > 0 and c["tokens_per_step"] % per_micro,
         f"tokens_per_step={c['tokens_per_step']} is not a multiple of batch_size x block_size x world_size = "
         f"{per_micro}; choose a batch_size that divides it, or set tokens_per_step=0 and use "
         "gradient_accumulation_steps"),
        (c["tokens_per_step"] == 0 and c["gradient_accumulation_steps"] % world_size,
         f"gradient_accumulation_steps={c['gradient_accumulation_steps']} is not divisible by the world size "
         f"{world_size} (it counts micro-batches over all processes)")]
    errors = [msg for bad, msg in checks if bad]
    if not errors and c["tokens_per_step"] > 0:
        c["gradient_accumulation_steps"] = c["tokens_per_step"] // (c["batch_size"] * c["block_size"])
    if not errors:
        try:  # the model's own checks (head_dim, rope, prior, bam_init); the vocabulary comes later from the data
            GPTConfig(**model_args(c, vocab_size=1, tokenizer=""))
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("invalid settings: " + "; ".join(errors))
    return c


def check_device(c, ddp):
    """The device, precision and attention impl the settings ask for, against the hardware (raises ConfigError)."""
    def fail(msg):
        raise ConfigError("invalid settings: " + msg)
    cuda = torch.cuda.is_available()
    if c["device"] == "auto" and not cuda and (ddp or (c["dtype"] == "bfloat16" and c["compile"])):
        # a GPU launch that finds no GPU is a mistake: stop rather than train a large model for days on the CPU
        why = "under torchrun" if ddp else "with the GPU recipe's dtype=bfloat16 and compile=True"
        fail(f"device=auto found no CUDA GPU {why}; to train on the CPU on purpose pass --device=cpu (e.g. "
             "python train.py <config> --device=cpu --compile=False --dtype=float32)")
    try:
        device = torch.device(c["device"] if c["device"] != "auto" else "cuda" if cuda else "cpu")
    except RuntimeError as e:
        fail(f"device={c['device']!r} is not a device torch knows ({e})")
    if device.type == "cuda" and not cuda:
        fail(f"device={c['device']!r} but no CUDA GPU is available; use --device=cpu")
    if device.type == "cpu" and c["dtype"] == "float16":
        fail("dtype='float16' needs CUDA (it relies on a GradScaler); on the CPU use bfloat16 or float32")
    prior = c["prior"] if c["pos_encoding"] == "bam" else "alibi" if c["pos_encoding"] == "alibi" else None
    if error := impl_error(c["attn_impl"], PRIORS.get(prior), device, grad=True):
        fail(f"attn_impl={c['attn_impl']!r}: {error}")


def open_data(c, rank, world_size, tokens_per_update, log):
    """(train loader, val loader, val batches per evaluation); c's tokenizer, vocab_size, world_size are set."""
    try:
        train_loader = TokenLoader(c["data_dir"], "train", c["block_size"], c["batch_size"], rank, world_size)
        val_loader = TokenLoader(c["data_dir"], "val", c["block_size"], c["batch_size"], tokenizer=train_loader.tokenizer)
    except ValueError as e:  # data that cannot be used (too short, mixed tokenizers, a broken shard): say why
        raise ConfigError(str(e)) from e
    eval_iters = min(c["eval_iters"], max(1, len(val_loader) // c["batch_size"]))
    if eval_iters < c["eval_iters"]:
        log(f"note: the val split holds {eval_iters} batches; eval_iters {c['eval_iters']} -> {eval_iters}")
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


# ---- Setup -----------------------------------------------------------------------------------------------
def setup_device(c, ddp, local_rank, log):
    """Resolve c["device"] (torchrun: a GPU per process), start the process group; no bfloat16 GPU: float16."""
    c["device"] = c["device"] if c["device"] != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if ddp and c["device"].startswith("cuda"):
        c["device"] = f"cuda:{local_rank}"
    device = torch.device(c["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if c["dtype"] == "bfloat16" and not torch.cuda.is_bf16_supported():
            log("warning: this GPU has no bfloat16; using float16 with a GradScaler")
            c["dtype"] = "float16"
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device


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
    """(step, path, val_loss) of a checkpoint whose model, optimizer, scaler and RNG are loaded (settings: c's)."""
    ckpt = load_checkpoint(path, map_location="cpu")
    try:
        load_state(raw_model, ckpt)
    except ValueError as e:  # another model
        raise TrainingError(f"cannot resume: {e}") from None
    fresh = [{k: g[k] for k in ("lr", "base_lr", "weight_decay", "betas")} for g in optimizer.param_groups]
    optimizer.load_state_dict(ckpt["optimizer"])
    for g, f in zip(optimizer.param_groups, fresh):  # hyperparameters come from the current settings
        g.update(f)
    if "scaler" in ckpt and scaler.is_enabled():
        scaler.load_state_dict(ckpt["scaler"])
    rng = ckpt.get("rng", [])
    if len(rng) == world_size:  # else the streams cannot continue: another number of processes wrote them
        torch.set_rng_state(rng[rank]["cpu"])
        if c["device"].startswith("cuda") and rng[rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rng[rank]["cuda"])
    changed = [f"{k}={c[k]!r} (was {v!r})" for k, v in ckpt.get("config", {}).items()
               if k in c and k != "resume" and v != c[k]]
    log(f"resuming {ckpt['path']} at step {ckpt['step']}; RNG {'' if len(rng) == world_size else 'not '}restored; "
        f"settings changed: {', '.join(changed) or 'none'}")
    return ckpt["step"], ckpt["path"], ckpt.get("val_loss")


def describe(raw_model, c, accum, tokens_per_update):
    """Three lines for the log: the model, its parameters, the batch."""
    n = {k: sum(p.numel() for p in ps) for k, ps in raw_model.param_groups().items()}
    prior = f" ({c['prior']} prior)" if c["pos_encoding"] == "bam" else ""
    return (f"model: {c['pos_encoding']}{'+ssmax' if c['ssmax'] else ''}{prior}, {c['n_layer']} layers, "
            f"{c['n_head']} heads, n_embd {c['n_embd']}, vocab {c['vocab_size']} ({c['tokenizer']})\nparameters: "
            f"{raw_model.num_params():,} total, {raw_model.num_params(non_embedding=True):,} non-embedding, "
            f"{n['prior']} trainable prior, {n['ssmax']} SSMax s\nbatch: {c['batch_size']} x {c['block_size']} "
            f"tokens x {accum} accumulation x {c['world_size']} processes = {tokens_per_update:,} tokens per step; "
            f"{c['max_iters']} steps; device {c['device']}, {c['dtype']}, compile={c['compile']}")


def git(*args):
    try:
        return subprocess.run(["git", *args], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(argv, world_size):
    triton, cuda = importlib.util.find_spec("triton") and importlib.import_module("triton"), torch.cuda.is_available()
    return dict(time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), hostname=socket.gethostname(),
                python=platform.python_version(), torch=torch.__version__, triton=triton and triton.__version__,
                cuda=torch.version.cuda, gpu=torch.cuda.get_device_name() if cuda else None,
                gpu_count=torch.cuda.device_count(), world_size=world_size, git_commit=git("rev-parse", "HEAD"),
                git_dirty=bool(git("status", "--porcelain", "-uno")), command=shlex.join([sys.executable, *argv]))


def write_run_files(c, tokens_per_update, argv, start_step):
    """config.json, env.json (with a resumed run's earlier launches) and metrics.jsonl cut back to start_step."""
    os.makedirs(c["out_dir"], exist_ok=True)
    env_path, metrics_path = (os.path.join(c["out_dir"], f) for f in ("env.json", "metrics.jsonl"))
    earlier, kept = [], []
    if c["resume"] and os.path.exists(env_path):
        with open(env_path) as f:
            prev = json.load(f)
        earlier = prev.pop("earlier_launches", []) + [prev]
    if c["resume"] and os.path.exists(metrics_path):
        with open(metrics_path) as f:  # a last line cut short by the crash has no newline
            kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= start_step]
    for name, obj in (("config.json", dict(c, model_args=model_args(c, c["vocab_size"], c["tokenizer"]),
                                           tokens_per_step_actual=tokens_per_update)),
                      ("env.json", dict(environment(argv, c["world_size"]), start_step=start_step,
                                        earlier_launches=earlier))):
        with open(os.path.join(c["out_dir"], name), "w") as f:
            json.dump(obj, f, indent=2)
    with open(metrics_path, "w") as f:
        f.writelines(kept)
    return metrics_path


def metrics_writer(c, path):
    """write(record): a line of metrics.jsonl, its numbers to Weights & Biases (wandb_log). No path: nothing."""
    wandb = importlib.import_module("wandb") if path and c["wandb_log"] else None
    if wandb:
        wandb.init(project=c["wandb_project"], config=c,
                   name=c["wandb_run_name"] or os.path.basename(os.path.normpath(c["out_dir"])))

    def write(record):
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if wandb:
            numbers = {k: v for k, v in {**record, **record.get("prior", {})}.items() if isinstance(v, (int, float))}
            wandb.log({k: v for k, v in numbers.items() if k != "step"}, step=record["step"])
    return write


# ---- The loop --------------------------------------------------------------------------------------------
def train_step(model, raw_model, optimizer, scaler, loader, ctx, step, accum, lr, c, last_ckpt):
    """(mean train loss, grad norm) of update step + 1 at lr (scaled per group by base_lr), `accum` micro-batches."""
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * lr / c["learning_rate"]
    device = next(raw_model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum):
        x, y, doc_start = (t.to(device, non_blocking=True) for t in loader.get_batch(step, micro, accum))
        # DDP all-reduces the gradients once per step, at the last micro-batch
        with model.no_sync() if isinstance(model, DDP) and micro < accum - 1 else nullcontext():
            try:
                with ctx:
                    loss = model(x, y, doc_start=doc_start)[1] / accum
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
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), c["grad_clip"] or float("inf")).item()
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
            loss = raw_model(x, y, doc_start=doc_start)[1]
        total += torch.stack([loss.double(), torch.ones_like(loss, dtype=torch.float64)])
    if dist.is_initialized():
        dist.all_reduce(total)
    raw_model.train()
    return (total[0] / total[1]).item()


def eval_and_log(step, record, raw_model, loader, eval_iters, ctx, log):
    """Add to `record` and print the val loss and (bam) the prior's shape parameter per layer as [min, median,
    max] and the heads its highlight rule picks (ggd: theta_beta < 0). Returns the loss."""
    record["val_loss"] = val_loss = evaluate(raw_model, loader, eval_iters, ctx)
    msg = f"step {step}: val loss {val_loss:.4f}"
    prior_def = raw_model.blocks[0].attn.prior_def
    if raw_model.config.pos_encoding == "bam":
        bound = [b.attn.prior() for b in raw_model.blocks]
        shape = [p.params[prior_def.params.index(prior_def.shape_param)].detach().float().cpu() for p in bound]
        record["prior"] = {prior_def.shape_param: [[round(x.min().item(), 4), round(x.quantile(0.5).item(), 4),
                                                    round(x.max().item(), 4)] for x in shape]}
        msg += f" | {prior_def.shape_param} median per layer {[round(x.quantile(0.5).item(), 4) for x in shape]}"
        if prior_def.highlight is not None:
            n = record["prior"]["heads_highlighted"] = int(sum(prior_def.highlight(*p.params).sum() for p in bound))
            msg += f" | heads with {prior_def.highlight_label}: {n}/{sum(x.numel() for x in shape)}"
    log(msg)
    return val_loss


def progress_record(step, train_loss, lr, grad_norm, dt, tokens_per_update, flops, c, log):
    """The metrics record of a logged step (dt: seconds per step), printed; flops: (FLOPs per step, peak) or None."""
    record = dict(step=step, train_loss=train_loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_update / dt,
                  ms_per_step=1000 * dt)
    if flops:
        record["mfu"] = flops[0] / dt / flops[1]
    log(f"step {step}/{c['max_iters']} | loss {train_loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
        f"{tokens_per_update / dt:,.0f} tok/s | {1000 * dt:.1f} ms/step"
        + (f" | mfu {100 * record['mfu']:.1f}%" if flops else "")
        + f" | eta {format_eta(dt * (c['max_iters'] - step))}")
    return record


def save(step, raw_model, optimizer, scaler, c, val_loss, tokens_per_update, master):
    """Write ckpt_<step>.pt (rank 0, every process's RNG state), keep the newest keep_last; returns its path."""
    own = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}
    rng = [own]
    if dist.is_initialized():
        dist.all_gather_object(rng := [None] * dist.get_world_size(), own)
    path = os.path.join(c["out_dir"], checkpoint_name(step))
    if master:
        extra = {"scaler": scaler.state_dict()} if scaler.is_enabled() else {}
        save_checkpoint(path, raw_model, optimizer=optimizer.state_dict(), step=step, config=c, rng=rng,
                        val_loss=val_loss, tokens=step * tokens_per_update, world_size=c["world_size"], **extra)
        for _, old in checkpoints(c["out_dir"])[:-c["keep_last"]] if c["keep_last"] > 0 else ():
            os.remove(old)
    return path


def format_eta(seconds):
    m = int(seconds // 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{int(seconds % 60):02d}s"


def train(c, argv=()):
    """Run training with the settings dict c (every key of config_keys). Returns a summary dict."""
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if ddp else 1
    c = resolve_config(c, world_size)
    check_device(c, ddp)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    device = setup_device(c, ddp, local_rank, log)
    accum = c["gradient_accumulation_steps"] // world_size  # micro-batches per process per step
    tokens_per_update = c["batch_size"] * c["block_size"] * accum * world_size
    torch.manual_seed(c["seed"] + rank)
    ctx = autocast(device, c["dtype"])
    scaler = torch.amp.GradScaler(device.type, enabled=c["dtype"] == "float16")
    existing = check_run_dir(c["out_dir"], c["resume"])
    train_loader, val_loader, eval_iters = open_data(c, rank, world_size, tokens_per_update, log)

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
    write = metrics_writer(c, write_run_files(c, tokens_per_update, argv, step) if master else None)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if device.type == "cuda" and peak is None:
        log(f"note: no bf16 peak known for {torch.cuda.get_device_name(device)!r}; MFU is not reported")
    flops = (raw_model.flops_per_token(c["block_size"]) * tokens_per_update, peak * world_size) if peak else None

    if step == 0:
        val_loss = eval_and_log(0, record := {"step": 0}, raw_model, val_loader, eval_iters, ctx, log)
        write(record)
    train_loss, interval_time, interval_steps, train_start = None, 0.0, 0, time.time()
    while step < c["max_iters"]:
        t0, lr = time.time(), get_lr(step, c)
        train_loss, grad_norm = train_step(model, raw_model, optimizer, scaler, train_loader, ctx, step, accum, lr,
                                           c, last_ckpt)
        step, interval_time, interval_steps = step + 1, interval_time + time.time() - t0, interval_steps + 1
        do_eval = step % c["eval_interval"] == 0 or step == c["max_iters"]
        if do_eval or step % c["log_interval"] == 0:
            record = progress_record(step, train_loss, lr, grad_norm, interval_time / interval_steps,
                                     tokens_per_update, flops, c, log)
            interval_time, interval_steps = 0.0, 0
            if do_eval:
                val_loss = eval_and_log(step, record, raw_model, val_loader, eval_iters, ctx, log)
            write(record)
        if step % c["ckpt_interval"] == 0 or step == c["max_iters"]:
            last_ckpt = save(step, raw_model, optimizer, scaler, c, val_loss, tokens_per_update, master)
    log(f"done: step {step} of {c['max_iters']} in {format_eta(time.time() - train_start)}; val loss {val_loss}; "
        f"checkpoint {last_ckpt}")
    if ddp:  # leave together: a rank tearing down gloo while another still exits can hang it
        dist.barrier()
        dist.destroy_process_group()
    return dict(step=step, train_loss=train_loss, val_loss=val_loss, checkpoint=last_ckpt, out_dir=c["out_dir"])


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

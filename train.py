"""
Train a bam-gpt model: the paper's recipe (spec §0, §6) in one loop, on one CPU, one GPU or many.

    python train.py config/bam_120m.py                                       # one device (GPU, or CPU)
    torchrun --standalone --nproc_per_node=8 train.py config/bam_120m.py     # one node, 8 GPUs
    torchrun --nnodes=2 --node_rank=0 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \
             --nproc_per_node=8 train.py config/bam_120m.py                  # several nodes (node_rank 0, 1, ...)
    ... --resume=True                                                        # continue a run where it stopped

Settings are the module-level variables below; a config file and --key=value arguments override them
(configurator.py). The run directory out_dir/ holds:
    config.json     the resolved settings (plus world_size, vocab_size, tokenizer, model_args)
    env.json        versions, GPUs, host, git commit and command line of every launch, and (CUDA) the result of
                    the attention self-check run before the first step (attention_check.py)
    metrics.jsonl   one JSON object per logged step: step, train_loss, lr, grad_norm, tokens_per_s, ms_per_step,
                    mfu (CUDA), and at evaluations val_loss and the learned prior (bam)
    ckpt_{step:07d}.pt  model.save_checkpoint(): model_args, model, optimizer, step, config, rng, val_loss, ...
"step N" always means "after N optimizer updates": ckpt_0000100.pt holds the model after update 100, the
metrics record of step 100 holds the training loss of update 100 (measured before it) and the val loss after it.
"""
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

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from attention_check import SelfCheckError, self_check_model
from configurator import ConfigError, configure
from data import TokenLoader
from priors import PRIORS
from model import (CKPT_RE, GPT, MODEL_SIZES, POS_ENCODINGS, RUNTIME_KEYS, GPTConfig, checkpoint_model_args,
                   config_diff, load_checkpoint, load_state, save_checkpoint)

# ----------------------------------------------------------------------------------------------------------
# Settings (defaults = the paper's l12 BAM+SSMax recipe; config/bam_120m.py spells it out)
# ----------------------------------------------------------------------------------------------------------
# I/O
out_dir = "out"                  # run directory (see the module docstring)
data_dir = "data/fineweb10B"     # token shards written by prepare_fineweb.py / prepare_demo.py
init_from = "scratch"            # "scratch" | "resume" (same as resume=True)
resume = False                   # continue from the newest checkpoint in out_dir: model, optimizer, step, RNG
eval_interval = 250              # validation loss every this many steps (also at step 0 and at the end)
eval_iters = 100                 # validation batches per evaluation (capped at what the val split holds)
log_interval = 10                # a progress line and a metrics.jsonl record every this many steps
ckpt_interval = 1000             # a checkpoint every this many steps (and at the end)
keep_last = 2                    # checkpoints kept in out_dir; older ones are deleted (0 = keep all)
# data
batch_size = 48                  # sequences per micro-batch per process
block_size = 512                 # training context length
gradient_accumulation_steps = 1  # micro-batches per step over ALL processes (each process does this / world size)
tokens_per_step = 589824         # > 0 overrides the above: accumulation = this / (batch_size * block_size * world size)
# model
model_size = ""                  # "" or l6 | l8 | l12 | l15 | l18 | l24 (spec §1): overrides n_layer, n_head, n_embd
n_layer = 12
n_head = 16
n_embd = 768
pos_encoding = "bam"             # nope | sinusoidal | rope | alibi | bam
ssmax = True                     # Scalable-Softmax on every layer
ssmax_init = 1.0                 # initial SSMax s
ssmax_prior = True               # BAM+SSMax scales the prior too: (q.k/sqrt(d) + B) * s log n
prior = "ggd"                    # the learned prior family of bam: a name registered in priors.py (ggd, cauchy, ...)
bam_init = "zero"                # the prior's init spec; ggd: zero | alibi | linear | "ALPHA,BETA" (priors.ggd_init)
train_mu = False                 # ggd: train theta_mu too (frozen at 0 in the paper)
attn_impl = "auto"               # auto | torch | flex | triton: how attention is computed (attention_kernel.py)
# optimizer: RAdam with decoupled weight decay on >= 2-D weights; one schedule scales every group's own lr
learning_rate = 1e-3             # peak learning rate
min_lr = 1e-4                    # the cosine ends here at max_iters
max_iters = 20000                # optimizer steps in the run
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

# bf16 dense tensor-core peak per GPU, matched against torch.cuda.get_device_name() in this order
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100", 989.5e12),
                   ("H200", 989.5e12), ("GH200", 989.5e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12),
                   ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A6000", 154.8e12), ("A10G", 70e12),
                   ("A10", 125e12), ("RTX 4090", 165.2e12), ("RTX 3090", 71e12)]


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, a checkpoint that does not fit, torch.compile failure, ...)."""


def peak_flops(device_name):
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)


def get_lr(step, c):
    """Learning rate of update `step` (0-based): linear warmup, then cosine from learning_rate to min_lr."""
    if step < c["warmup_iters"]:
        return c["learning_rate"] * (step + 1) / c["warmup_iters"]
    ratio = (step - c["warmup_iters"]) / max(1, c["max_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (c["learning_rate"] - c["min_lr"])


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
    if c["init_from"] not in ("scratch", "resume"):
        errors.append(f"init_from must be 'scratch' or 'resume', got {c['init_from']!r}")
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
    if c["tokens_per_step"] > 0 and c["batch_size"] > 0 and c["block_size"] > 0:
        per_micro = c["batch_size"] * c["block_size"] * world_size
        if c["tokens_per_step"] % per_micro:
            errors.append(f"tokens_per_step={c['tokens_per_step']} is not a multiple of batch_size x block_size x "
                          f"world_size = {c['batch_size']} x {c['block_size']} x {world_size} = {per_micro}; "
                          "choose a batch_size that divides it, or set tokens_per_step=0 and use "
                          "gradient_accumulation_steps")
        else:
            c["gradient_accumulation_steps"] = c["tokens_per_step"] // per_micro * world_size
    elif c["gradient_accumulation_steps"] % world_size:
        errors.append(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} is not divisible by the "
                      f"world size {world_size} (it counts micro-batches over all processes)")
    if c["device"] != "auto":
        try:
            dev = torch.device(c["device"])
            if dev.type == "cuda" and not torch.cuda.is_available():
                errors.append(f"device={c['device']!r} but this machine has no CUDA GPU; use --device=cpu")
        except RuntimeError as e:
            errors.append(f"device={c['device']!r} is not a device torch knows ({e})")
    errors += attn_impl_errors(c)
    if not errors:
        try:  # the model's own checks (head_dim, rope, prior, bam_init); the vocabulary comes later from the data
            GPTConfig(**model_args_from(c, vocab_size=1, tokenizer=""))
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("invalid settings:\n  " + "\n  ".join(errors))
    return c


def attn_impl_errors(c):
    """attn_impl settings that could not train this model: said before any data or model is touched."""
    if c["attn_impl"] == "flex" and (c["device"] == "cpu" or (c["device"] == "auto" and not torch.cuda.is_available())):
        return ["attn_impl='flex' cannot train on the CPU (FlexAttention has no CPU backward in this torch); "
                "use attn_impl=torch or auto"]
    prior = c["prior"] if c["pos_encoding"] == "bam" else "alibi" if c["pos_encoding"] == "alibi" else None
    if c["attn_impl"] == "triton" and prior in PRIORS and "triton" not in PRIORS[prior].native:
        return [f"attn_impl='triton' cannot compute the prior {prior!r} (the kernel hard-codes "
                f"{', '.join(p for p in PRIORS if 'triton' in PRIORS[p].native)}); use attn_impl=flex or auto"]
    return []


def model_args_from(c, vocab_size, tokenizer):
    keys = ("n_layer", "n_head", "n_embd", "block_size", "pos_encoding", "ssmax", "ssmax_init", "ssmax_prior",
            "prior", "bam_init", "train_mu", "attn_impl")
    return dict({k: c[k] for k in keys}, vocab_size=vocab_size, tokenizer=tokenizer)


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


def checkpoints(run_dir):
    """[(step, path)] of the checkpoints in a run directory, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    return sorted((int(m.group(1)), os.path.join(run_dir, f)) for f in os.listdir(run_dir) if (m := CKPT_RE.match(f)))


def rng_states(ddp):
    """This process's torch RNG states (CPU, and CUDA if used), gathered from every process when distributed."""
    own = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None}
    if not ddp:
        return [own]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, own)
    return every


def format_eta(seconds):
    m = int(seconds // 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{int(seconds % 60):02d}s"


# ----------------------------------------------------------------------------------------------------------
def train(c, argv=()):
    """Run training with the settings dict c (every key of config_keys). Returns a summary dict."""
    # ---- processes and settings ----
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if ddp else 1
    c = resolve_config(c, world_size)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    if c["device"] == "auto":
        c["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if ddp and c["device"].startswith("cuda"):
        c["device"] = f"cuda:{local_rank}"
    device = torch.device(c["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        return _train(c, argv, ddp, rank, world_size, master, log, device)
    finally:
        if ddp:
            dist.destroy_process_group()


def _train(c, argv, ddp, rank, world_size, master, log, device):
    accum = c["gradient_accumulation_steps"] // world_size  # micro-batches per process per step
    tokens_per_update = c["batch_size"] * c["block_size"] * accum * world_size
    torch.manual_seed(c["seed"] + rank)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # ---- precision ----
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
    autocast = (nullcontext() if dtype == "float32"
                else torch.autocast(device_type=device.type, dtype=getattr(torch, dtype)))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
    if c["compile"] and device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++"))
                                                       or shutil.which("c++") or shutil.which("clang++")):
        log("warning: compile=True but no C++ compiler was found for torch.compile on CPU; running uncompiled")
        c["compile"] = False

    # ---- run directory ----
    resuming = c["resume"] or c["init_from"] == "resume"
    existing = checkpoints(c["out_dir"])
    if resuming and not existing:
        raise TrainingError(f"resume was asked for, but {c['out_dir']!r} holds no ckpt_<step>.pt to resume from")
    if not resuming and existing:
        raise TrainingError(f"{c['out_dir']!r} already holds checkpoints (newest {os.path.basename(existing[-1][1])}); "
                            "pass --resume=True to continue that run, or choose another --out_dir")

    # ---- data ----
    train_loader = TokenLoader(c["data_dir"], "train", c["block_size"], c["batch_size"], rank, world_size)
    val_loader = TokenLoader(c["data_dir"], "val", c["block_size"], c["batch_size"], tokenizer=train_loader.tokenizer)
    eval_iters = min(c["eval_iters"], max(1, len(val_loader) // c["batch_size"]))
    if eval_iters < c["eval_iters"]:
        log(f"note: the val split holds {len(val_loader)} windows = {eval_iters} batches; eval_iters "
            f"{c['eval_iters']} -> {eval_iters}")
    c.update(tokenizer=train_loader.tokenizer, vocab_size=train_loader.vocab_size, world_size=world_size)

    # ---- model and optimizer ----
    model_args = model_args_from(c, train_loader.vocab_size, train_loader.tokenizer)
    raw_model = GPT(GPTConfig(**model_args)).to(device)  # the plain module: evaluation and checkpoints use it
    optimizer = raw_model.configure_optimizers(c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]),
                                               prior_lr=c["prior_lr"], ssmax_lr=c["ssmax_lr"])
    groups = raw_model.param_groups()
    n_prior, n_ssmax = sum(p.numel() for p in groups["prior"]), sum(p.numel() for p in groups["ssmax"])
    log(f"model: {c['pos_encoding']}{'+ssmax' if c['ssmax'] else ''}"
        f"{' (' + c['prior'] + ' prior)' if c['pos_encoding'] == 'bam' else ''}, {c['n_layer']} layers, {c['n_head']} heads, "
        f"n_embd {c['n_embd']}, vocab {c['vocab_size']} ({c['tokenizer']})")
    log(f"parameters: {raw_model.num_params():,} total, {raw_model.num_params(non_embedding=True):,} non-embedding, "
        f"{n_prior} trainable prior, {n_ssmax} SSMax s")
    log(f"batch: {c['batch_size']} x {c['block_size']} tokens x {accum} accumulation x {world_size} processes "
        f"= {tokens_per_update:,} tokens per step; {c['max_iters']} steps = {tokens_per_update * c['max_iters']:,} "
        f"tokens; device {device}, {dtype}, compile={c['compile']}")

    start_step, last_ckpt, val_loss = 0, None, None
    if resuming:
        ckpt = load_checkpoint(existing[-1][1], map_location="cpu")
        old_args = checkpoint_model_args(ckpt)
        diff = config_diff(*({k: a[k] for k in model_args if k not in RUNTIME_KEYS} for a in (old_args, model_args)))
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
        start_step, last_ckpt, val_loss = ckpt["step"], ckpt["path"], ckpt.get("val_loss")
        rng = ckpt.get("rng", [])
        if len(rng) == world_size:
            torch.set_rng_state(rng[rank]["cpu"])
            if device.type == "cuda" and rng[rank]["cuda"] is not None:
                torch.cuda.set_rng_state(rng[rank]["cuda"])
        else:
            log(f"note: the checkpoint was written by {len(rng)} processes, this run has {world_size}: "
                "RNG streams are not restored")
        changed = [f"{k}: {ckpt['config'].get(k)!r} -> {c[k]!r}" for k in config_keys
                   if k not in ("resume", "init_from") and ckpt.get("config", {}).get(k, c[k]) != c[k]]
        log(f"resuming {ckpt['path']}: step {start_step} of {c['max_iters']} (val loss "
            f"{val_loss if val_loss is None else round(val_loss, 4)}); model, optimizer and RNG restored, the data "
            f"continues at batch {start_step} of the stream")
        if changed:
            log("settings changed since that checkpoint:\n  " + "\n  ".join(changed))

    attn_check = None  # on CUDA: the attention impl vs the reference, before the first step (attention_check.py)
    if device.type == "cuda":
        attn_check = self_check_model(raw_model, training=True, dtype=getattr(torch, dtype))
        log(f"attention self-check: {attn_check['impl']} matches the reference (max error {attn_check['max_err']:.1e}, "
            f"{attn_check['seconds']:.1f} s)")
    model = raw_model
    if c["compile"]:
        model = torch.compile(raw_model)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # ---- run directory files (rank 0) ----
    metrics_path = os.path.join(c["out_dir"], "metrics.jsonl")
    if master:
        os.makedirs(c["out_dir"], exist_ok=True)
        with open(os.path.join(c["out_dir"], "config.json"), "w") as f:
            json.dump(dict(c, model_args=model_args, tokens_per_step_actual=tokens_per_update), f, indent=2)
        env_path = os.path.join(c["out_dir"], "env.json")
        earlier = []  # a resumed run keeps the environments of its earlier launches
        if resuming and os.path.exists(env_path):
            with open(env_path) as f:
                prev = json.load(f)
            earlier = prev.pop("earlier_launches", []) + [prev]
        with open(env_path, "w") as f:
            json.dump(dict(environment(argv, world_size), start_step=start_step, attention_check=attn_check,
                           earlier_launches=earlier), f, indent=2)
        # metrics.jsonl is the trajectory up to the resumed step: records of steps after it were lost with the crash
        kept = []
        if resuming and os.path.exists(metrics_path):
            with open(metrics_path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= start_step:
                            kept.append(line)
                    except (ValueError, KeyError):  # a line cut short by the crash
                        pass
        with open(metrics_path, "w") as f:
            f.writelines(kept)

    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if device.type == "cuda" and peak is None:
        log(f"note: no bf16 peak known for {torch.cuda.get_device_name(device)!r}; MFU is not reported")
    flops_per_step = raw_model.flops_per_token(c["block_size"]) * tokens_per_update

    def write_metrics(record):
        if master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    @torch.no_grad()
    def evaluate():
        """Mean validation loss over eval_iters batches (document-masked); the batches are split over processes."""
        raw_model.eval()
        total = torch.zeros(2, device=device, dtype=torch.float64)  # sum of batch losses, batches
        for k in range(rank, eval_iters, world_size):
            x, y, doc_start = (t.to(device) for t in val_loader.get_batch(k))
            with autocast:
                _, loss = raw_model(x, y, doc_start=doc_start)
            total += torch.stack([loss.double(), torch.ones((), device=device, dtype=torch.float64)])
        if ddp:
            dist.all_reduce(total)
        raw_model.train()
        return (total[0] / total[1]).item()

    prior_def = raw_model.blocks[0].attn.prior_def

    def prior_record():
        """The learned prior's shape parameter per layer as [min, median, max], and how many heads its highlight
        rule picks (ggd: theta_beta < 0). bam only."""
        if c["pos_encoding"] != "bam" or not prior_def.shape_param:
            return {}
        bound = [b.attn.prior() for b in raw_model.blocks]
        shapes = [p.params[prior_def.params.index(prior_def.shape_param)].detach().float().cpu() for p in bound]
        record = {prior_def.shape_param: [[round(x.min().item(), 4), round(x.quantile(0.5).item(), 4),
                                           round(x.max().item(), 4)] for x in shapes]}
        if prior_def.highlight is not None:
            record["heads_highlighted"] = int(sum(prior_def.highlight(*p.params).sum().item() for p in bound))
        return record

    def run_eval(step, record):
        nonlocal val_loss
        val_loss = evaluate()
        record["val_loss"] = val_loss
        prior = prior_record()
        if prior:
            record["prior"] = prior
        msg = f"step {step}: val loss {val_loss:.4f}"
        if prior:
            msg += f" | {prior_def.shape_param} median per layer {[x[1] for x in prior[prior_def.shape_param]]}"
            if "heads_highlighted" in prior:
                msg += (f" | heads with {prior_def.highlight_label}: "
                        f"{prior['heads_highlighted']}/{c['n_layer'] * c['n_head']}")
        log(msg)

    def save(step):
        nonlocal last_ckpt
        rng = rng_states(ddp)  # every process takes part
        if master:
            path = os.path.join(c["out_dir"], f"ckpt_{step:07d}.pt")
            extra = {"scaler": scaler.state_dict()} if scaler.is_enabled() else {}
            save_checkpoint(path, raw_model, optimizer=optimizer.state_dict(), step=step, config=c, rng=rng,
                            val_loss=val_loss, tokens=step * tokens_per_update, world_size=world_size, **extra)
            last_ckpt = path
            if c["keep_last"] > 0:
                for _, old in checkpoints(c["out_dir"])[:-c["keep_last"]]:
                    os.remove(old)

    # ---- the loop ----
    if start_step == 0:
        record = {"step": 0}
        run_eval(0, record)
        write_metrics(record)
    step, train_loss, interval_time, interval_steps, train_start = start_step, None, 0.0, 0, time.time()
    while step < c["max_iters"]:
        t0 = time.time()
        lr = get_lr(step, c)
        for g in optimizer.param_groups:
            g["lr"] = g["base_lr"] * lr / c["learning_rate"]
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y, doc_start = (t.to(device, non_blocking=True) for t in train_loader.get_batch(step, micro, accum))
            sync = nullcontext() if not ddp or micro == accum - 1 else model.no_sync()  # all-reduce once per step
            with sync:
                try:
                    with autocast:
                        _, loss = model(x, y, doc_start=doc_start)
                        loss = loss / accum
                    scaler.scale(loss).backward()
                except Exception as e:
                    if c["compile"] and type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
                        raise TrainingError(f"torch.compile failed at step {step + 1} ({type(e).__name__}: {e}); "
                                            "rerun with --compile=False") from e
                    raise
            loss_sum += loss.detach().float()
        if ddp:
            dist.all_reduce(loss_sum)
            loss_sum /= world_size
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
        step += 1
        interval_time += time.time() - t0
        interval_steps += 1

        do_log = step % c["log_interval"] == 0 or step == c["max_iters"]
        do_eval = step % c["eval_interval"] == 0 or step == c["max_iters"]
        if do_log or do_eval:
            dt = interval_time / max(interval_steps, 1)
            record = {"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": tokens_per_update / dt, "ms_per_step": 1000 * dt}
            mfu = flops_per_step / dt / (peak * world_size) if peak else None
            if mfu is not None:
                record["mfu"] = mfu
            log(f"step {step}/{c['max_iters']} | loss {train_loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                f"{tokens_per_update / dt:,.0f} tok/s | {1000 * dt:.1f} ms/step"
                + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")
                + f" | eta {format_eta(dt * (c['max_iters'] - step))}")
            interval_time, interval_steps = 0.0, 0
            if do_eval:
                run_eval(step, record)
            write_metrics(record)
        if step % c["ckpt_interval"] == 0 or step == c["max_iters"]:
            save(step)
    log(f"done: step {step} of {c['max_iters']} in {format_eta(time.time() - train_start)}; val loss {val_loss}; "
        f"checkpoint {last_ckpt}")
    return {"step": step, "train_loss": train_loss, "val_loss": val_loss,
            "checkpoint": last_ckpt, "out_dir": c["out_dir"]}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    c = configure({k: globals()[k] for k in config_keys}, argv)
    return train(c, argv=[os.path.abspath(__file__), *argv])


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, TrainingError, FileNotFoundError, SelfCheckError) as e:  # expected: a message, no traceback
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(1)

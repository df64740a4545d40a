"""
Checkpoints, the one place that writes and reads them. A checkpoint is a dict of "model_args" (the
GPTConfig as a dict), "model" (a clean state_dict) and whatever the trainer adds (optimizer, step,
RNG, ...), written atomically and loaded with weights_only=True, so that reading one never runs
code.
"""

import os
import re
from dataclasses import asdict, fields

import torch

from data import atomic_file, disk_full, no_space_left
from model import GPT, GPTConfig
from priors import PRIORS

CKPT_RE = re.compile(r"ckpt_(\d+)\.pt$")

# Model settings that older checkpoints carry and that say nothing about the saved model: attn_impl
# (which impl computed attention, a runtime choice) and ssmax_init (SSMax's s, trained, is in the
# weights). They are dropped on load.
RETIRED_KEYS = ("attn_impl", "ssmax_init")


class CheckpointError(RuntimeError):
    """A file that is not a readable bam-gpt checkpoint, one that does not fit the model asked for,
    or a checkpoint that could not be written."""


def unwrap(model):
    """The plain GPT inside a DDP and/or torch.compile wrapper (DDP(compile(model)), as train.py
    builds it)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def save_checkpoint(path, model, **extra):
    """Write a checkpoint with atomic_file: a crash or a full disk mid-write never leaves a
    truncated checkpoint under the real name, nor a temporary file. CheckpointError says why a
    write failed."""
    raw_model = unwrap(model)  # saved keys carry no "_orig_mod." / "module." prefixes
    state = {"model_args": asdict(raw_model.config), "model": raw_model.state_dict(), **extra}

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_file(path) as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as e:
        failure = os_error_in(e)
        if failure is None:
            raise
        raise CheckpointError(write_error(path, failure)) from e


def os_error_in(error):
    """The OSError behind an exception, if any: torch's zip writer reports a failed write (a full
    disk) as a RuntimeError whose context is the OSError."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def write_error(path, error):
    """What an OSError from writing path means, in words: a full disk says so, with what is free."""
    if disk_full(error):
        return no_space_left(path, "the checkpoint")
    return f"could not write the checkpoint {path}: {error.strerror or error}"


def checkpoint_name(step):
    return f"ckpt_{step:07d}.pt"


def checkpoints(run_dir):
    """[(step, path)] of the checkpoints in a run directory, oldest first ([] if there is no such
    directory)."""
    if not os.path.isdir(run_dir):
        return []

    found = []
    for name in os.listdir(run_dir):
        match = CKPT_RE.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


def load_checkpoint(path, map_location="cpu"):
    """The checkpoint dict of a .pt file or a run directory's newest ckpt_<step>.pt, loaded with
    weights_only=True. The dict's "path" says which file it was."""
    if os.path.isdir(path):
        found = checkpoints(path)
        if not found:
            raise FileNotFoundError(
                f"run directory {path!r} holds no ckpt_<step>.pt; has train.py saved one yet?"
            )
        path = found[-1][1]
    elif not os.path.isfile(path):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}: pass a .pt file or a run directory written by train.py"
        )

    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"could not read checkpoint {path!r} ({type(e).__name__}: {e}); "
            "is it a bam-gpt checkpoint and fully written?"
        ) from e

    if not isinstance(ckpt, dict) or "model_args" not in ckpt or "model" not in ckpt:
        raise CheckpointError(
            f"{path!r} is not a bam-gpt checkpoint (expected keys 'model_args' and 'model')"
        )
    return dict(ckpt, path=path)


def checkpoint_model_args(ckpt):
    """A checkpoint's GPTConfig as a dict, settings it predates at their defaults and RETIRED_KEYS
    dropped; CheckpointError for settings this code does not know and for an unregistered prior."""
    where = ckpt.get("path", "")
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    saved = {k: v for k, v in ckpt["model_args"].items() if k not in RETIRED_KEYS}

    unknown = set(saved) - set(defaults)
    if unknown:
        raise CheckpointError(
            f"checkpoint {where!r} has model settings this code does not know: {sorted(unknown)}"
        )

    args = {**defaults, **saved}
    if args["pos_encoding"] == "bam" and args["prior"] not in PRIORS:
        raise CheckpointError(
            f"checkpoint {where!r} uses the prior {args['prior']!r}, which is not registered "
            f"(registered: {', '.join(PRIORS)}); register it in priors.py to load it"
        )
    return args


def load_state(model, ckpt):
    """Load ckpt["model"] into model, or raise an error that says how the checkpoint's model
    differs."""
    where = ckpt.get("path", "")
    raw_model = unwrap(model)
    theirs = checkpoint_model_args(ckpt)
    ours = asdict(raw_model.config)
    diff = [f"{k}: {theirs[k]!r} vs {ours[k]!r}" for k in ours if theirs[k] != ours[k]]
    if diff:
        raise ValueError(
            f"checkpoint {where!r} is from another model (checkpoint vs this model):\n  "
            + "\n  ".join(diff)
        )

    try:
        raw_model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # missing or unexpected keys, other shapes
        message = " ".join(str(e).split())
        raise CheckpointError(f"checkpoint {where!r} does not fit this model: {message}") from None


def load_model(path, device="cpu", attn_impl="auto"):
    """(GPT in eval mode, checkpoint dict) from a checkpoint file or run directory, attention
    computed by attn_impl."""
    ckpt = load_checkpoint(path)
    config = GPTConfig(**checkpoint_model_args(ckpt))
    model = GPT(config, attn_impl=attn_impl or "auto")
    load_state(model, ckpt)
    return model.to(device).eval(), ckpt

"""
The hardware a script runs on: the device a `device` setting names (auto: the GPU if torch finds
one), the autocast context of a precision name, and the GPU's bf16 peak for MFU. One home for
train.py, dev/bench.py and the evaluations, so that "auto" means the same everywhere.
"""

from contextlib import nullcontext

import torch


def resolve_device(name="auto"):
    """The torch.device of a device setting: auto is CUDA if torch finds a GPU, else the CPU. A
    ValueError for a name torch does not know, or for a GPU that is not there; its message follows
    the name ("cuda:3 needs a CUDA GPU, ...")."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"is not a device torch knows ({e})") from None

    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("needs a CUDA GPU, and torch finds none")
    return device


def autocast(device, dtype):
    """The autocast context of a precision name (bfloat16 | float16 | float32); float32 runs without
    autocast."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, dtype))


# bf16 dense tensor-core peak per GPU, matched against torch.cuda.get_device_name() in this order:
# the longer names first, so that "H100 PCIe" is not read as "H100"
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989.5e12),
    ("H200", 989.5e12),
    ("GH200", 989.5e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A6000", 154.8e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165.2e12),
    ("RTX 3090", 71e12),
]


def peak_flops(device_name):
    """The bf16 peak FLOP/s of a GPU by its name, or None for one not in the table."""
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in device_name), None)

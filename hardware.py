"""
The hardware a script runs on: the device a `device` setting names (auto: the GPU if torch finds
one), the autocast context of a precision name, and the GPU's bf16 peak for MFU. One home for
train.py, dev/bench.py and the evaluations, so that "auto" means the same everywhere.
"""

import re
from contextlib import nullcontext

import torch

# The oldest Linux driver that each CUDA major version runs on (NVIDIA's CUDA toolkit release
# notes): a torch built for CUDA 13 finds no GPU under a 570 driver, and says only that.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}


def driver_version(path="/proc/driver/nvidia/version"):
    """The loaded NVIDIA driver's version as a tuple of ints, or None without one (or off Linux)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    found = re.search(r"NVRM version:.*?\s(\d+)\.(\d+)(?:\.(\d+))?\s", text)
    return tuple(int(x) for x in found.groups() if x is not None) if found else None


def gpu_problem():
    """Why torch finds no GPU on a machine with an NVIDIA driver: a CPU build of torch, or a driver
    older than its CUDA needs (a sentence that says which driver); None where neither applies."""
    have = driver_version()
    if have is None or torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build; install a CUDA build of torch"

    major = int(torch.version.cuda.split(".")[0])
    need = MIN_DRIVER.get(major)
    if need is None or have >= need:
        return None
    return (
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, which needs NVIDIA "
        f"driver {'.'.join(map(str, need))} or newer, and the loaded driver is "
        f"{'.'.join(map(str, have))}: update the driver, or install a torch built for an older "
        "CUDA (pytorch.org/get-started/locally)"
    )


def resolve_device(name="auto"):
    """The torch.device of a device setting: auto is CUDA if torch finds a GPU, else the CPU. A
    ValueError for a name torch does not know, for a GPU that is not there, or (auto too) for an
    NVIDIA driver that torch cannot use (gpu_problem); its message follows the name ("cuda:3 needs
    a CUDA GPU, ...")."""
    problem = gpu_problem() if name != "cpu" else None
    if problem:
        raise ValueError(f"finds no usable GPU: {problem}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"is not a device torch knows ({e})") from None

    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("needs a CUDA GPU, and torch finds none")
    return device


def native_bf16(device):
    """Whether a CUDA device computes in bfloat16 natively (compute capability 8.0, Ampere, and
    newer). torch.cuda.is_bf16_supported() also counts emulation, which a T4 (7.5) has: slow, and
    its bfloat16 matmuls take other paths than a run on an A100 or H100."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


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

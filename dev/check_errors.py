"""
The errors behind infra/kernel_check.py's CHECK_TOLERANCE: the self-check's problem for every
registered prior, SSMax off, on, and scaling the prior, a few seeds, in each dtype. Prints one line
per problem and the largest error of each kind per dtype. Through Triton's interpreter on a CPU
(about 10 minutes per head_dim), compiled on a GPU.

    TRITON_INTERPRET=1 python dev/check_errors.py --head_dim 64
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import attention_kernel as ak  # noqa: E402
from infra import kernel_check as kc  # noqa: E402
from priors import PRIORS  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (SSMax, scaling the prior)
PLACEMENTS = ((False, False), (True, False), (True, True))


def errors_of(family, head_dim, dtype, ssmax, scale_prior, seed, device):
    """check_kernel's errors {name: error} on its problem drawn from `seed`, with gradients."""
    problem = kc._check_problem(
        family, family.trainable, head_dim, dtype, ssmax, scale_prior, True, device, seed=seed
    )
    return kc.kernel_errors(problem, device, True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    device = "cpu" if ak.interpreting() else "cuda"

    for dtype in DTYPES:
        worst = {}
        for family in PRIORS.values():
            for ssmax, scale_prior in PLACEMENTS:
                # a BAM model's SSMax scales a prior iff it has trained parameters
                if scale_prior and not family.trainable:
                    continue
                for seed in range(args.seeds):
                    errors = errors_of(
                        family, args.head_dim, dtype, ssmax, scale_prior, seed, device
                    )
                    text = " ".join(f"{name} {error:.1e}" for name, error in errors.items())
                    print(f"{dtype} {family.name} ssmax={ssmax} scale_prior={scale_prior} {text}")
                    for name, error in errors.items():
                        kind = kc.check_kind(name)
                        worst[kind] = max(worst.get(kind, 0.0), error)
        print(f"largest, {dtype}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


if __name__ == "__main__":
    main()

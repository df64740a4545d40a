"""
The Triton kernel's self-check. A compiled kernel can compute wrong numbers without an error on a
GPU that no test ran on, so every run that resolves to impl "triton" (train.py and each
evaluation) first compares it with the reference on one small problem shaped like the run, once
per configuration and process: a mismatch stops the run before it writes anything.
"""

import time

import torch

from attention import attention, pick_impl, ssmax_log_n
from attention_kernel import check_length
from priors import BoundPrior, get_prior

# The reference runs in fp32 on the same rounded inputs; the errors are relative (kernel_errors). A
# correct kernel differs by the roundings the reference does not make: with 16-bit inputs, P before
# P V and dS before dS K and dS^T Q are rounded to 8 bits (bfloat16) or 11 (float16), and the output
# once more. The prior's and SSMax's gradients are sums in fp32 (with dQ's own Delta: OWN_DELTA).
# Measured by dev/check_errors.py on every registered prior, SSMax off, on and scaling the prior,
# three seeds, head_dim 32 and 64, the largest errors were:
#   float32: output 2.7e-6, q k v 4.3e-6, parameters 5.0e-5
#   float16: output 4.2e-4, q k v 1.2e-3, parameters 7.9e-5
#   bfloat16: output 6.9e-3, q k v 2.0e-2, parameters 6.0e-5
# The tolerances leave 4x to 37x over those; a misread table moves scores by a distance's worth of
# prior, and the gradients of its parameters by far more than 1e-3 (tests/test_kernel.py's
# test_self_check_catches_a_misread_table). (output, q k v, parameters) per dtype:
CHECK_TOLERANCE = {
    torch.float32: (1e-4, 1e-4, 1e-3),
    torch.float16: (4e-3, 1e-2, 1e-3),
    torch.bfloat16: (3e-2, 1e-1, 1e-3),
}
_checked = set()
GGD = get_prior("ggd")


class KernelMismatch(RuntimeError):
    """The Triton kernel disagrees with the reference on check_kernel's problem."""


def check_kernel(layer, dtype, training):
    """Compare the kernel with the reference on a problem shaped like `layer`'s attention (a
    model.Attention: its impl, prior and trained parameters, SSMax and its placement, head_dim), in
    dtype, with documents and every gradient when training. Returns the line to print, or None where
    the layer's impl is not the kernel or its configuration was checked before in this process;
    raises KernelMismatch (the same line) where an error is over CHECK_TOLERANCE."""
    family = layer.family
    device = layer.wq.weight.device
    impl = pick_impl(layer.attn_impl, family, device, training, dtype, layer.head_dim)
    if impl != "triton":
        return None

    trained = ()
    if family is not None and training:
        trained = tuple(n for n in family.params if getattr(layer, n).requires_grad)
    problem = (family, trained, layer.head_dim, dtype, layer.ssmax_s is not None, layer.scale_prior)
    if (problem, str(device), training) in _checked:
        return None
    _checked.add((problem, str(device), training))

    started = time.time()
    inputs = _check_problem(*problem, documents=training, device=device)
    errors = kernel_errors(inputs, device, training)
    # and a steep prior's, whose rows skip most tiles (attention.first_keys)
    steep = _check_problem(GGD, (), *problem[2:4], False, False, training, device, steep=True)
    errors |= {f"skipping {n}": e for n, e in kernel_errors(steep, device, training).items()}
    line, ok = _check_line(errors, inputs, *problem)
    if not ok:
        raise KernelMismatch(f"the Triton kernel disagrees with the reference: {line}")
    return f"{line}: ok in {time.time() - started:.1f} s"


def check_kind(name):
    """The kind of one of the self-check's results, each with its tolerance: the output, the inputs'
    gradients (q, k, v) or the parameters' (the prior's, SSMax's s)."""
    name = name.removeprefix("skipping ")
    if name == "output":
        return "output"
    return "inputs" if name in ("q", "k", "v") else "parameters"


def _check_problem(
    family, trained, head_dim, dtype, ssmax, scale_prior, documents, device, seed=0, steep=False
):
    """The self-check's problem, on the CPU from its own generator (the run's RNG is untouched),
    as long as device's tiles ask (check_length): a dict of q, k, v (B, H, T, D) in dtype in the
    model's (B, T, H, D) layout, dout, doc_start (three documents per row) or None, the prior (its
    default init moved at random: a constant prior hides misreads) with its trained names, and
    SSMax's s, one sign per head."""
    gen = torch.Generator().manual_seed(seed)
    B, H, T, D = 2, 2, check_length(head_dim, dtype, torch.device(device)), head_dim
    q, k, v = (torch.randn(B, T, H, D, generator=gen).to(dtype).transpose(1, 2) for _ in range(3))
    # the output's gradient in its dtype, as autograd hands it to the kernel's backward
    dout = torch.randn(B, H, T, D, generator=gen).to(dtype)

    doc_start = None
    if documents:
        doc_start = torch.zeros(B, T, dtype=torch.long)
        for b in range(B):
            for start in sorted((torch.randperm(T - 1, generator=gen)[:2] + 1).tolist()):
                doc_start[b, start:] = start

    params = ()
    if family is not None:
        # some inits draw from the global RNG
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            params = tuple(t.float() for t in family.initial("default", H))
        if family.trainable:
            params = tuple(t + 0.5 * torch.randn(t.shape, generator=gen) for t in params)
    if steep:  # GGD heads falling by e |d|^1.5 and 1.6 |d|: their rows read a few tiles
        params = (torch.tensor([1.0, 0.5]), torch.tensor([1.5, 1.0]), torch.zeros(2))

    # SSMax's s of both signs, whose row scales s log n are -0.0 where n = 1
    s = torch.tensor([1.0, -0.6]) if ssmax else None
    return dict(
        q=q, k=k, v=v, dout=dout, doc_start=doc_start, family=family, params=params,
        trained=trained, s=s, scale_prior=scale_prior,
    )  # fmt: skip


def _check_outputs(impl, problem, device, training):
    """impl's output and, when training, its gradients {name: tensor} on the problem; the
    reference takes fp32 copies of the same rounded q, k, v."""
    family = problem["family"]
    leaves = {name: problem[name] for name in ("q", "k", "v")}
    if impl == "torch":
        leaves = {name: t.float() for name, t in leaves.items()}
    if family is not None:
        named = zip(family.params, problem["params"])
        leaves |= {n: t for n, t in named if n in problem["trained"]}
    if problem["s"] is not None:
        leaves["s"] = problem["s"]
    leaves = {n: t.to(device, copy=True).requires_grad_(training) for n, t in leaves.items()}

    prior = None
    if family is not None:
        values = [leaves.get(n, t.to(device)) for n, t in zip(family.params, problem["params"])]
        prior = BoundPrior(family, tuple(values))
    doc_start = problem["doc_start"]
    if doc_start is not None:
        doc_start = doc_start.to(device)
    row_scale = None
    if problem["s"] is not None:
        positions = torch.arange(leaves["q"].shape[2], device=device)
        log_n = ssmax_log_n(positions, doc_start)
        row_scale = leaves["s"][None, :, None] * log_n[:, None, :]

    with torch.set_grad_enabled(training):
        out = attention(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            doc_start=doc_start,
            prior=prior,
            row_scale=row_scale,
            scale_prior=problem["scale_prior"],
            impl=impl,
        )
        results = {"output": out.detach().float().cpu()}
        if training:
            (out.float() * problem["dout"].to(device)).sum().backward()
            results |= {n: t.grad.float().cpu() for n, t in leaves.items()}
    return results


def kernel_errors(problem, device, training):
    """The kernel's errors on a _check_problem, output and (training) gradients: {name: max
    |kernel - reference| / scale}, the scale max |reference| (floored at 1e-3, so that a gradient of
    0 is compared absolutely), for the prior's parameters taken over all of them together: each
    sums dS times a table of like size, while one may be near 0 by chance."""
    kernel = _check_outputs("triton", problem, device, training)
    reference = _check_outputs("torch", problem, device, training)
    family = problem["family"]
    params = [n for n in reference if family is not None and n in family.params]
    scale = {n: reference[n].double().abs().max() for n in reference}
    for name in params:
        scale[name] = max(scale[p] for p in params)

    errors = {}
    for name in reference:
        difference = (kernel[name].double() - reference[name].double()).abs().max()
        errors[name] = (difference / scale[name].clamp_min(1e-3)).item()
    return errors


def _check_line(errors, problem, family, trained, head_dim, dtype, ssmax, scale_prior):
    """The self-check's line, the largest error of each kind against its tolerance, and whether
    every error is within its tolerance (NaN is not)."""
    tolerances = dict(zip(("output", "inputs", "parameters"), CHECK_TOLERANCE[dtype]))
    worst = {}
    for name, error in errors.items():
        kind = check_kind(name)
        if kind not in worst or not error <= errors[worst[kind]]:
            worst[kind] = name

    what = family.name if family is not None else "no prior"
    if ssmax:
        what += " + SSMax" + (" scaling the prior" if scale_prior else "")
    if problem["doc_start"] is not None:
        what += ", documents"
    parts = []
    for kind, name in worst.items():
        which = "" if kind == "output" else f" ({name})"
        parts.append(f"{kind} {errors[name]:.1e}{which} (tolerance {tolerances[kind]:.0e})")

    dtype_name = str(dtype).removeprefix("torch.")
    length = problem["q"].shape[2]
    line = (
        f"attention kernel check ({dtype_name}, head_dim {head_dim}, {what}, {length} tokens): "
        + ", ".join(parts)
    )
    ok = all(error <= tolerances[check_kind(name)] for name, error in errors.items())
    return line, ok

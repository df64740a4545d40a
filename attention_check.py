"""
A startup self-check of the attention implementation a run is about to use, against the PyTorch reference.

    result = self_check_model(model, training=True, dtype=torch.bfloat16)   # train.py, before the first step
    result = self_check(impl, n_head=16, head_dim=48, prior=..., ssmax=True, scale_prior=True,
                        documents=True, training=True, device="cuda", dtype=torch.bfloat16)

A fused kernel is compiled for the GPU it meets, by a compiler version nobody tested it with: a wrong result
there is silent (the loss still goes down, a little worse). So before training (and before every evaluation)
the impl runs once on small random inputs shaped like the model -- its heads, head_dim, dtype, prior (with its
trained parameters moved by a fixed random step, so that a prior at its initial value, e.g. GGD's constant
"zero", still exercises the distance-dependent path), SSMax placement and document masking -- and is compared
with the reference (attention_torch, in fp32 on the CPU, from the same rounded inputs): the values and, for
training, the gradient of every input that the run trains (q, k, v, the prior's parameters, SSMax's
row_scale). Beyond the dtype's tolerance it raises SelfCheckError, whose message names the impl, the largest
error and the alternatives; scripts turn it into one line and stop. Nothing ever falls back silently.
"""
import math
import time

import torch

from attention_kernel import attention, auto_impl
from priors import bind

# max |impl - reference| / max |reference| per compared tensor: (values, gradients). The reference sees the same
# rounded inputs, so these bound the error of the kernel's own arithmetic: half-precision P and dS in its matmuls
# (bf16: 8 mantissa bits, fp16 and tf32: 11) and fp32 accumulation in another order.
TOLERANCES = {"float32": (1e-4, 1e-3), "tf32": (5e-3, 1e-2), "float16": (5e-3, 1e-2), "bfloat16": (3e-2, 6e-2)}
ALTERNATIVES = ("flex", "torch")


class SelfCheckError(RuntimeError):
    """The attention implementation disagrees with the reference (or failed to run); .result holds the details."""

    def __init__(self, result):
        self.result = result
        others = " or ".join(f"--attn_impl={a}" for a in ALTERNATIVES if a != result["impl"])
        if "error" in result:
            what = f"failed to run ({result['error']})"
        else:
            what = (f"differs from the PyTorch reference by {result['max_err']:.2g} in {result['worst']} "
                    f"(max |err| / max |ref|; the {result['precision']} tolerance is {result['tolerance']:.0e})")
        super().__init__(f"attention self-check: impl={result['impl']} ({result['precision']}, "
                         f"{'training' if result['training'] else 'evaluation'}) {what}; rerun with {others}")


def _rel_err(a, b):
    """max |a - b| relative to max |b|; the floor 1e-3 makes it absolute for tensors that are ~0 in the reference
    (a prior gradient of rows with one visible key). Non-finite values count as an infinite error."""
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-3)).item()


def _inputs(n_head, head_dim, prior, ssmax, documents, training, batch, seq_len, gen):
    """CPU fp32 leaves: q, k, v in the model's layout ((B, T, H, D) viewed as (B, H, T, D)), the prior (its
    trainable parameters moved by N(0, 0.5^2)), the SSMax row_scale s_h log n_i, and doc_start."""
    B, T = batch, seq_len
    q, k, v = (torch.randn(B, T, n_head, head_dim, generator=gen).transpose(1, 2) for _ in range(3))
    doc_start = None
    if documents:  # a few documents per row, boundaries at random positions (mid-tile, like packed batches)
        doc_start = torch.zeros(B, T, dtype=torch.long)
        for b in range(B):
            for cut in sorted(torch.randperm(T - 1, generator=gen)[:3].add(1).tolist()):
                doc_start[b, cut:] = cut
    if prior is not None:
        prior = bind(prior)
        params = tuple(p.detach().float().cpu() + (0.5 * torch.randn(p.shape, generator=gen) if p.requires_grad
                                                   else 0.0) for p in prior.params)
        trained = [p.requires_grad and training for p in prior.params]
        prior = prior._replace(params=tuple(p.requires_grad_(t) for p, t in zip(params, trained)))
    row_scale = None
    if ssmax:  # as the model: n_i = keys visible to query i in its document
        pos = torch.arange(T)
        n = pos[None, :] - doc_start + 1 if doc_start is not None else (pos + 1)[None, :]
        s = 0.5 + torch.rand(n_head, generator=gen)
        row_scale = (s[None, :, None] * n.float().log()[:, None, :]).requires_grad_(training)
    return q, k, v, prior, row_scale, doc_start


def _run(impl, q, k, v, prior, row_scale, doc_start, scale_prior, dout, device, dtype, q_len):
    """attention() on the last q_len queries; returns {name: fp32 CPU tensor}: "out" and, with dout, the
    gradient of q, k, v and of every other input that requires one."""
    train = dout is not None

    def leaf(t, dt=None, grad=True):
        return t.detach().to(device=device, dtype=dt or t.dtype).requires_grad_(train and grad)
    q_, k_, v_ = leaf(q[:, :, -q_len:], dtype), leaf(k, dtype), leaf(v, dtype)
    leaves = dict(q=q_, k=k_, v=v_)
    if prior is not None:
        prior = prior._replace(params=tuple(leaf(p, grad=p.requires_grad) for p in prior.params))
        leaves.update(zip(prior.prior.params, prior.params))
    rs = None if row_scale is None else leaf(row_scale[..., -q_len:], grad=row_scale.requires_grad)
    leaves = {n: t for n, t in dict(leaves, row_scale=rs).items() if t is not None and t.requires_grad}
    with torch.set_grad_enabled(train):
        out = attention(q_, k_, v_, doc_start=None if doc_start is None else doc_start.to(device), prior=prior,
                        row_scale=rs, scale_prior=scale_prior, impl=impl)
        result = {"out": out.detach().float().cpu()}
        if train:
            grads = torch.autograd.grad((out.float() * dout.to(device)).sum(), list(leaves.values()))
            result.update((n, g.float().cpu()) for n, g in zip(leaves, grads))
    return result


def self_check(impl, *, n_head, head_dim, prior=None, ssmax=False, scale_prior=False, documents=False,
               training=False, device="cuda", dtype=torch.bfloat16, batch=2, seq_len=320, seed=0, strict=True):
    """Compare attention(impl=impl) with the reference on inputs shaped like the model (see the module docstring).

    prior: None, a BoundPrior or a GGD triple; the parameters that require grad are the trained ones (moved by
    a fixed random step, and their gradients compared when training). training: values and gradients of one
    document-masked batch; otherwise values of a prefill and of a short continuation (the KV-cache step).
    Returns {impl, precision, training, max_err, worst, errors, tolerance, seconds, ok}; raises SelfCheckError
    if it is not ok and strict."""
    t0 = time.perf_counter()
    device = torch.device(device)
    precision = str(dtype).removeprefix("torch.")
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"  # the reference on the GPU, and impls that follow the flag, multiply in tf32
    tol_values, tol_grads = TOLERANCES[precision]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, prior, row_scale, doc_start = _inputs(n_head, head_dim, prior, ssmax, documents, training, batch,
                                                   seq_len, gen)
    if impl == "auto":  # the impl that attention() picks for these inputs
        impl = auto_impl(q.to(device), prior)
    cases = [("", seq_len, torch.randn(q.shape, generator=gen) if training else None)]
    if not training:
        cases.append(("decode ", 7, None))
    errors, tols = {}, {}
    result = dict(impl=impl, precision=precision, training=training, shape=[batch, n_head, seq_len, head_dim])
    with torch.autocast(device.type, enabled=False):
        for label, q_len, dout in cases:
            args = (q, k, v, prior, row_scale, doc_start, scale_prior, dout)
            try:
                got = _run(impl, *args, device, dtype, q_len)
            except Exception as e:  # a kernel that does not compile or launch here: the same refusal, one line
                result.update(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}", ok=False,
                              seconds=round(time.perf_counter() - t0, 3))
                if strict:
                    raise SelfCheckError(result) from e
                return result
            # the reference: fp32 on the CPU from the same rounded q, k, v
            ref = _run("torch", *(t.to(dtype).float() for t in args[:3]), *args[3:], "cpu", torch.float32, q_len)
            for name in ref:
                errors[label + name] = _rel_err(got[name], ref[name])
                tols[label + name] = tol_values if name == "out" else tol_grads
    worst = max(errors, key=lambda n: errors[n] / tols[n])
    result.update(max_err=errors[worst], worst=worst, tolerance=tols[worst], errors=errors,
                  ok=all(errors[n] <= tols[n] for n in errors), seconds=round(time.perf_counter() - t0, 3))
    if strict and not result["ok"]:
        raise SelfCheckError(result)
    return result


def self_check_model(model, *, training, dtype, device=None, **kw):
    """self_check for a GPT (model.py): its attention impl, heads, head_dim, the first layer's prior and SSMax
    placement; documents when training (packed batches are document-masked)."""
    cfg = model.config
    attn = model.blocks[0].attn
    device = device or next(model.parameters()).device
    return self_check(cfg.attn_impl, n_head=cfg.n_head, head_dim=cfg.n_embd // cfg.n_head, prior=attn.prior(),
                      ssmax=hasattr(attn, "ssmax_s"), scale_prior=cfg.pos_encoding == "bam" and cfg.ssmax_prior,
                      documents=training, training=training, device=device, dtype=dtype, **kw)


def main(argv=None):
    """Check every impl at a model size's shape, training and evaluation (gpu_check.sh). Exit status 1 if any
    is refused; the results go to --out as JSON."""
    import argparse
    import json
    import sys

    from model import GPT, GPTConfig

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model_size", default="l12", help="a size preset of model.py (BAM + SSMax, the default prior)")
    p.add_argument("--impls", default="triton,flex,torch", help="comma-separated attention implementations")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq_len", type=int, default=320, help="positions of the random inputs")
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    args = p.parse_args(argv)
    results = []
    for impl in args.impls.split(","):
        model = GPT(GPTConfig.from_size(args.model_size, vocab_size=64, attn_impl=impl)).to(args.device)
        for training in (True, False):
            r = self_check_model(model, training=training, dtype=getattr(torch, args.dtype), seq_len=args.seq_len,
                                 strict=False)
            results.append(r)
            status = "ok" if r["ok"] else "REFUSED: " + str(SelfCheckError(r))
            err = r.get("max_err", float("nan"))
            print(f"{impl:>6} {'training' if training else 'evaluation':<10} {r['precision']:<8} max err "
                  f"{err:.1e} ({r.get('worst', '-')}) in {r['seconds']:.2f} s  {status}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()

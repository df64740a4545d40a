"""torch.compile sees the whole model: attention is a registered custom op (Triton), never a graph
break, and the prior's tables are built in the traced graph. On the CPU the Triton kernel runs under
the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and the compiled model uses the
aot_eager backend (AOTAutograd traces forward and backward, then runs the captured graphs eagerly),
so compiled and eager results must be bitwise equal."""

import pytest
import torch
import torch._dynamo

import attention_kernel as ak
import model as model_mod
from priors import BoundPrior, get_prior

pytest.importorskip("triton")
if not torch.cuda.is_available() and not ak.interpreting():
    pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() and not ak.interpreting() else "cpu"


def tiny_gpt(attn_impl):
    """BAM + SSMax with a non-trivial prior (anti-local and local heads, mu != 0), every prior
    parameter trained."""
    cfg = model_mod.GPTConfig(
        vocab_size=64,
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=32,
        pos_encoding="bam",
        ssmax=True,
        train_mu=True,
    )
    torch.manual_seed(0)
    net = model_mod.GPT(cfg, attn_impl=attn_impl).to(DEVICE)
    with torch.no_grad():
        for blk in net.blocks:
            blk.attn.theta_alpha.copy_(torch.tensor([0.3, -0.5]))
            blk.attn.theta_beta.copy_(torch.tensor([-1.2, 0.8]))
            blk.attn.theta_mu.copy_(torch.tensor([0.0, 0.4]))
    gen = torch.Generator().manual_seed(1)
    idx, tgt = (torch.randint(0, 64, (2, 32), generator=gen).to(DEVICE) for _ in range(2))
    ds = torch.zeros(2, 32, dtype=torch.long)
    ds[0, 11:], ds[1, 5:], ds[1, 20:] = 11, 5, 20  # document boundaries inside the 16-row tiles
    return net, (idx, tgt), dict(doc_start=ds.to(DEVICE))


def loss_and_grads(fn, net, args, kwargs):
    net.zero_grad(set_to_none=True)
    _, loss = fn(*args, **kwargs)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None
    }


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", (16, 16))


def test_kernel_compiled_model_has_no_graph_break_and_equals_eager(small_tiles):
    net, args, kwargs = tiny_gpt("triton")
    torch._dynamo.reset()
    loss_eager, g_eager = loss_and_grads(net, net, args, kwargs)
    # fullgraph: the model is one graph, and a graph break raises with its reason
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    loss_comp, g_comp = loss_and_grads(compiled, net, args, kwargs)
    torch._dynamo.reset()
    assert torch.equal(loss_comp, loss_eager)
    assert (
        set(g_comp) == set(g_eager)
        and any(".theta_" in n for n in g_eager)
        and any("ssmax" in n for n in g_eager)
    )
    for n in g_eager:
        assert torch.equal(g_comp[n], g_eager[n]), n


def test_kernel_custom_ops_pass_opcheck(small_tiles):
    """torch.library.opcheck: schema, fake-tensor implementation (shapes, strides, dtypes), autograd
    registration and AOT dispatch of the forward and backward ops, on inputs with every option
    (documents, a prior's table and derivative tables, SSMax), laid out as attention_triton hands
    them over (contiguous; the queries' doc_start as int32)."""
    gen = torch.Generator().manual_seed(0)
    B, H, T, D = 1, 2, 20, 16
    q, k, v = (torch.randn(B, H, T, D, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    ds = torch.zeros(B, T, dtype=torch.int32, device=DEVICE)
    ds[:, 7:] = 7
    params = tuple(
        torch.tensor(x, device=DEVICE, requires_grad=True) for x in ([1.0, -0.5], [0.0, 1.2])
    )
    table, dtable, theta, table_start = ak._prior_tables(
        BoundPrior(get_prior("cauchy"), params),
        H,
        T,
        T,
        0,
        DEVICE,
    )
    assert dtable.shape == (H, 2, table.shape[1]) and theta.requires_grad
    row_scale = (torch.rand(B, H, T, generator=gen) + 0.5).to(DEVICE).requires_grad_()
    # every row's first key: its document's start
    first_key = ds.long()[:, None].expand(B, H, T).contiguous()
    fwd_args = (
        q,
        k,
        v,
        ds,
        table,
        dtable,
        theta,
        row_scale,
        first_key,
        True,
        0,
        0.25,
        table_start,
    )
    torch.library.opcheck(torch.ops.bam.triton_attention_fwd.default, fwd_args)
    detached = [t.detach() if torch.is_tensor(t) else t for t in fwd_args]
    o, lse = torch.ops.bam.triton_attention_fwd(*detached)
    q, k, v, ds, table, dtable, theta, row_scale, first_key, *flags = detached
    torch.library.opcheck(
        torch.ops.bam.triton_attention_bwd.default,
        (
            torch.randn_like(o),
            q,
            k,
            v,
            o,
            lse,
            ds,
            table,
            dtable,
            row_scale,
            first_key,
            *flags,
            True,
        ),
    )

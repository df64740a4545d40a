"""Skipping (attention.first_keys): the bound holds in float64 for every prior, nothing skipped is
read, skipped equals unskipped, the kernel visits the tiles the windows predict, decoding with a KV
cache, and the evaluations' --no_skip."""

import os
import sys

import pytest
import torch
from test_ppl import argv, setup  # noqa: F401 (setup is a fixture)
from test_readme import register_readme_prior

import attention_kernel as ak
import attention_sdpa
import eval_ppl
from attention import AttentionArgs, attention, dense_attention, first_keys
from eval_common import counting_work
from infra.kernel_check import _check_problem
from infra.runtime import save_checkpoint
from model import GPT, GPTConfig, KVCache
from priors import PRIORS, BoundPrior, get_prior

EPS = 2.0**-24
STEEP = ([1.0, 0.5], [1.5, 1.0], [0.0, 0.0])  # GGD heads that fall by e |d|^1.5 and 1.6 |d|


def ggd(alpha, beta, mu):
    return tuple(torch.tensor(x) for x in (alpha, beta, mu))


def qkv(B, H, Tq, Tk, D, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(B, H, Tq, D, generator=gen)
    k = scale * torch.randn(B, H, Tk, D, generator=gen)
    return q, k, torch.randn(B, H, Tk, D, generator=gen)


def dense_probs(q, k, args):
    """softmax_j(s_ij) in float64, written out from attention()'s formula; 0 on hidden keys."""
    i = torch.arange(q.shape[2])[:, None] + args.q_offset
    j = torch.arange(k.shape[2])[None, :]
    scores = args.softmax_scale * q.double() @ k.double().transpose(-1, -2)
    log_prior = args.prior.table((j - i).flatten()).double().view(-1, *(j - i).shape)
    r = 1.0 if args.row_scale is None else args.row_scale.double()[..., None]
    scores = (scores + log_prior) * r if args.scale_prior else scores * r + log_prior
    visible = j <= i
    if args.doc_start is not None:
        visible = visible & (j >= args.doc_start[:, i])[:, None]
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)


def prior_values(name, H, gen):
    """A registered prior's default init moved at random (a constant prior hides misreads)."""
    family = get_prior(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        values = family.initial("default", H)
    if family.trainable:
        values = tuple(t + 0.5 * torch.randn(t.shape, generator=gen) for t in values)
    return BoundPrior(family, values)


SSMAX = {  # (s per head or None, scale_prior)
    "none": (None, False),
    "s>0": ([1.0, 0.4, 2.0], False),
    "s>0 scaling the prior": ([1.0, 0.4, 2.0], True),
    "s<0 scaling the prior": ([-0.6, 1.0, -0.2], True),
    "s<0": ([-0.6, 1.0, -0.2], False),
    "s=0": ([0.0, 0.0, 0.0], True),
}


def bound_case(prior, ssmax, seed=0):
    """Resolved args with documents, q_offset and SSMax; q, k scaled to stress the content term."""
    B, H, Tq, Tk = 2, 3, 96, 160
    q, k, _ = qkv(B, H, Tq, Tk, 8, seed, scale=2.0)
    doc_start = torch.zeros(B, Tk, dtype=torch.long)
    doc_start[1, 70:] = 70
    s, scale_prior = SSMAX[ssmax]
    row_scale = None
    if s is not None:
        pos = torch.arange(Tk - Tq, Tk)
        n = (pos[None] - doc_start[:, pos] + 1).float()
        row_scale = torch.tensor(s)[None, :, None] * n.log()[:, None, :]
    args = AttentionArgs(doc_start, prior, row_scale, scale_prior).resolve(q, k, k)
    return q, k, args


@pytest.mark.parametrize("ssmax", list(SSMAX))
@pytest.mark.parametrize("name", [*PRIORS, "knots"])
def test_bound_holds_for_every_prior(name, ssmax, monkeypatch):
    """Every row's and every column's skipped mass is at most 2^-24 (ε mode), every skipped weight
    is below 2^-150 in zero mode, and every window lies in its row's document."""
    if name == "knots":
        register_readme_prior(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    prior = prior_values(name, 3, gen)
    if name == "ggd":  # one steep head, so that the case is not vacuous
        prior = BoundPrior(prior.family, ggd([1.0, 0.0, -0.5], [1.5, 0.5, -1.0], [0.0, 2.0, 0.0]))
    q, k, args = bound_case(prior, ssmax)
    probs = dense_probs(q, k, args)
    rows = torch.arange(q.shape[2]) + args.q_offset
    j = torch.arange(k.shape[2])
    for mode, check in ((True, "mass"), ("zero", "each")):
        first = first_keys(q, k, args._replace(skip=mode))
        assert (first <= rows).all() and (first >= args.doc_start[:, None, rows]).all()
        skipped = probs * (j < first[..., None])
        if check == "mass":
            assert skipped.sum(-1).max() <= EPS and skipped.sum(-2).max() <= EPS
        else:
            assert skipped.max() < 2.0**-150
    if name == "ggd" and ssmax in ("none", "s>0"):
        kept = rows - first[:, 0] + 1
        assert kept.max() < 30 < rows.min()  # the steep head reads a few keys of its 160


def test_flat_heads_and_flipped_rows_keep_every_key():
    """theta_beta <= 0 (mass far from the query or none) and rows with w_i <= 0 (s < 0 scaling the
    prior) keep their whole row; the same steep head with s > 0 does not."""
    prior = BoundPrior(get_prior("ggd"), ggd([0.0, 1.0, 1.0], [-1.0, 0.0, 1.5], [0.0, 0.0, 0.0]))
    q, k, args = bound_case(prior, "s<0 scaling the prior")  # s = -0.2 on the steep head
    first = first_keys(q, k, args._replace(skip=True))
    doc = args.doc_start[:, None, args.q_offset :].expand_as(first)
    assert torch.equal(first, doc)

    q, k, args = bound_case(prior, "s>0 scaling the prior")
    first = first_keys(q, k, args._replace(skip=True))
    assert torch.equal(first[:, :2], doc[:, :2]) and (first[:, 2] > doc[:, 2] + 50).any()


def kernel_case(Tq=128, Tk=512, D=16, seed=3):
    """Queries at the end of a long row, steep heads: every key before the first window is one no
    row reads. Returns q, k, v, keywords, the first key read and the clean key norms."""
    q, k, v = qkv(1, 2, Tq, Tk, D, seed)
    kw = dict(prior=ggd(*STEEP), q_offset=Tk - Tq)
    return q, k, v, kw


def poisoned(k, v, before):
    k = k.clone()
    v = v.clone()
    k[:, :, :before] = float("nan")
    v[:, :, :before] = float("nan")
    return k, v


@pytest.mark.parametrize("blocks", [None, (16, 32)])
def test_kernel_reads_nothing_it_skips(blocks, monkeypatch, gpu_driver):
    """Keys before every row's window hold NaN: the kernel's output and gradients are finite and
    equal the unskipped ones on clean keys, and those keys get exactly zero gradient (the GPU's
    tiles and small ones)."""
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", blocks)
    q, k, v, kw = kernel_case()
    args = AttentionArgs(**kw).resolve(q, k, v)._replace(skip=True)
    cfg = ak._configs(q.shape[-1], q.dtype, q.device)
    first = ak._group_first_keys(first_keys(q, k, args, grad=True), cfg, 1, 2, q.shape[2], "cpu")
    before = int(first.min())
    assert before >= 256  # most of the row is skipped
    key_norm = k.norm(dim=-1).amax(-1)

    def run(k, v, skip):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, **kw, impl="triton", skip=skip, key_norm=key_norm)
        out.backward(torch.ones_like(out))
        return [out, *(t.grad for t in leaves)]

    skipped = run(*poisoned(k, v, before), "zero")
    full = run(k, v, False)
    for name, a, b in zip(("out", "q", "k", "v"), skipped, full):
        assert torch.isfinite(a).all(), name
        assert (a - b).abs().max() <= 1e-6 * b.abs().max(), name
    for grad in skipped[2:]:
        assert torch.equal(grad[:, :, :before], torch.zeros_like(grad[:, :, :before]))


def test_sdpa_reads_nothing_it_skips():
    """The CPU evaluation path: NaN keys and values before every row's window give the unskipped
    output."""
    q, k, v, kw = kernel_case(Tq=300, Tk=900)
    key_norm = k.norm(dim=-1).amax(-1)
    args = AttentionArgs(**kw).resolve(q, k, v)._replace(skip=True, key_norm=key_norm)
    before = int(first_keys(q, k, args).min())
    assert before >= 500
    out = attention(q, *poisoned(k, v, before), **kw, impl="sdpa", key_norm=key_norm)
    full = attention(q, k, v, **kw, impl="sdpa", skip=False)
    assert torch.isfinite(out).all() and (out - full).abs().max() <= 1e-6
    with counting_work() as work:
        attention(q, k, v, **kw, impl="sdpa", key_norm=key_norm)
    assert work[0] < 0.1 * work[1]


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("scale_prior", [False, True])
def test_sdpa_band_matches_the_dense_formula(scale_prior, documents, monkeypatch):
    """Narrow groups go as bands (attention_sdpa._attend_band): values against dense_attention
    for every block size, with documents or without (where a row reads its block's keys before
    its first key), a positive row scale and queries at an offset, and the gradients of q, k, v
    and the row scale (the prior is fixed, as sdpa trains)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = qkv(2, 2, 90, 160, 8, seed=4)
    doc_start = None
    if documents:
        doc_start = torch.zeros(2, 160, dtype=torch.long)
        doc_start[1, 97:] = 97
    row_scale = torch.rand(1, 2, 90, generator=gen) + 0.5
    kw = dict(prior=ggd(*STEEP), doc_start=doc_start, scale_prior=scale_prior, q_offset=70)
    bands = []
    band = attention_sdpa._attend_band
    monkeypatch.setattr(attention_sdpa, "_attend_band", lambda *a: bands.append(a[6]) or band(*a))

    def run(impl, chunk_size=None):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, row_scale)]
        args = AttentionArgs(**kw, row_scale=leaves[3]).resolve(*leaves[:3])
        if impl == "dense":
            out = dense_attention(*leaves[:3], **kw, row_scale=leaves[3]).float()
        else:
            first_key = first_keys(*leaves[:2], args, grad=True)
            out = attention_sdpa.attention_sdpa(*leaves[:3], args, first_key, chunk_size)
        out.backward(torch.cos(torch.arange(out.numel()).view_as(out).float()))
        return [out] + [t.grad for t in leaves]

    dense = run("dense")
    for chunk_size in (None, 1, 7, 90):
        for a, b in zip(run("sdpa", chunk_size), dense):
            torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-4)
    assert bands  # narrow groups went as bands


CASES = {  # keywords beyond the prior: SSMax in both placements, documents
    "plain": {},
    "ssmax": dict(ssmax=[1.0, -0.5], scale_prior=False),
    "ssmax scaling the prior": dict(ssmax=[1.0, -0.5], scale_prior=True),
    "documents": dict(documents=True),
}


def case_keywords(case, Tq, Tk):
    extra = dict(CASES[case])
    kw = dict(scale_prior=extra.pop("scale_prior", False), q_offset=Tk - Tq)
    doc_start = None
    if extra.get("documents"):
        doc_start = torch.zeros(2, Tk, dtype=torch.long)
        doc_start[1, 100:] = 100
        kw["doc_start"] = doc_start
    if "ssmax" in extra:
        pos = torch.arange(Tk - Tq, Tk)
        kw["row_scale"] = torch.tensor(extra["ssmax"])[None, :, None] * (pos + 1.0).log()
    return kw


# every prior in one of the cases, the steep GGD in all
EQUAL_CASES = [(name, list(CASES)[i % len(CASES)]) for i, name in enumerate(PRIORS)]
EQUAL_CASES += [("ggd", case) for case in CASES if ("ggd", case) not in EQUAL_CASES]


@pytest.mark.parametrize("name,case", EQUAL_CASES)
def test_skipped_equals_unskipped(name, case, monkeypatch):
    """Every prior (GGD a steep one): the kernel's values and every gradient, and sdpa's values,
    with skipping equal those without, within fp32 rounding."""
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", (32, 32))
    Tq, Tk = 64, 160
    q, k, v = qkv(2, 2, Tq, Tk, 8, seed=5)
    prior = prior_values(name, 2, torch.Generator().manual_seed(2))
    if name == "ggd":
        prior = BoundPrior(prior.family, ggd(*STEEP))
    kw = case_keywords(case, Tq, Tk)
    leaves = (q, k, v, *prior.params)

    def run(impl, skip):
        tensors = [
            t.clone().requires_grad_(impl == "triton" and t.is_floating_point()) for t in leaves
        ]
        bound = BoundPrior(prior.family, tuple(tensors[3:]))
        with torch.set_grad_enabled(impl == "triton"), counting_work() as work:
            out = attention(*tensors[:3], prior=bound, **kw, impl=impl, skip=skip)
            if impl == "triton":
                out.backward(torch.cos(torch.arange(out.numel()).view_as(out).float()))
        return [out] + [t.grad for t in tensors if t.grad is not None], work

    for impl in ("triton", "sdpa"):
        (skipped, work), (full, _) = run(impl, True), run(impl, False)
        for a, b in zip(skipped, full):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1.0)
        if name == "ggd":
            assert work[0] < 0.8 * work[1]  # one head of two in ssmax: s < 0


def test_kernel_visits_the_tiles_the_windows_predict(monkeypatch):
    """The forward scores, per query block, the key blocks from its group's key start to its
    diagonal; the backward the same tiles in dK/dV and twice in dQ (its own Delta). Counted by
    _tile_scores, which every kernel calls once per tile."""
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", (32, 32))
    q, k, v, kw = kernel_case(Tq=256, Tk=512)
    args = AttentionArgs(**kw).resolve(q, k, v)._replace(skip=True)
    cfg = ak._configs(q.shape[-1], q.dtype, q.device)
    original = ak._tile_scores
    for grad in (False, True):
        starts = ak._group_first_keys(first_keys(q, k, args, grad), cfg, 1, 2, 256, "cpu")
        last_block = (args.q_offset + torch.arange(32, 257, 32) - 1) // 32  # per query block
        predicted = int((last_block + 1 - starts // 32).sum())
        assert predicted < 2 * int((last_block + 1).sum()) / 3  # of the unskipped tiles

        calls = []
        monkeypatch.setattr(
            ak, "_tile_scores", lambda *a, **kw: calls.append(1) or original(*a, **kw)
        )
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        with torch.set_grad_enabled(grad):
            out = attention(*leaves, **kw, impl="triton")
            if grad:
                out.sum().backward()
        assert len(calls) == predicted * (3 if grad else 1)


def steep_model(seed=0, skip=True):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=257, tokenizer="byte", n_layer=2, n_head=2, n_embd=16, block_size=32)
    model = GPT(cfg, skip=skip).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.theta_alpha.copy_(torch.tensor(STEEP[0]))
            block.attn.theta_beta.copy_(torch.tensor(STEEP[1]))
    return model


def test_decoding_with_a_kv_cache_skips_and_gives_the_same_tokens(monkeypatch):
    """Greedy decoding from a 600-token prompt: the same tokens and logits (<= 1e-6) with and
    without skipping; a step reads its window, not the whole cache, and evaluates the prior over its
    window only (the cache keeps the gap table from the prefill); the cache's running key norm is
    the norm recomputed over every cached key."""
    prompt = torch.randint(0, 257, (1, 600), generator=torch.Generator().manual_seed(0))
    evaluated = []  # distances per prior evaluation
    table = BoundPrior.table
    monkeypatch.setattr(
        BoundPrior, "table", lambda self, d: evaluated.append(len(d)) or table(self, d)
    )

    @torch.no_grad()
    def decode(skip):
        model = steep_model(skip=skip)
        cache = KVCache(2, 620)
        logits, _ = model(prompt, kv_cache=cache, logits_at=1)
        steps = [logits]
        evaluated.clear()
        with counting_work() as work:
            for _ in range(20):
                logits, _ = model(logits[:, -1].argmax(-1, keepdim=True), kv_cache=cache)
                steps.append(logits)
        return torch.cat(steps, 1), cache, work, max(evaluated)

    skipped, cache, work, widest = decode(True)
    full, _, _, _ = decode(False)
    assert torch.equal(skipped.argmax(-1), full.argmax(-1))
    assert (skipped - full).abs().max() <= 1e-6
    assert work[0] < 0.1 * work[1]
    assert widest < 60, widest  # the prior at a window's distances, not at the cache's 600+
    for layer in range(2):
        keys = cache.k[layer][:, : cache.length].transpose(1, 2)
        assert torch.allclose(cache.key_norm[layer], keys.norm(dim=-1).amax(-1))


def test_self_check_runs_a_steep_problem_that_skips(monkeypatch, gpu_driver):
    """The kernel's self-check also compares a steep prior's problem, one that skips tiles, so that
    a GPU's first run checks the skip path."""
    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", None)
    problem = _check_problem(
        get_prior("ggd"), (), 16, torch.float32, False, False, False, "cpu", steep=True
    )
    q, k = problem["q"], problem["k"]
    prior = BoundPrior(get_prior("ggd"), problem["params"])
    args = AttentionArgs(prior=prior).resolve(q, k, k)._replace(skip=True)
    cfg = ak._configs(16, torch.float32, q.device)
    starts = ak._group_first_keys(first_keys(q, k, args, grad=True), cfg, *q.shape[:3], "cpu")
    assert (starts > 0).any()


def test_no_skip_scores_the_same(setup, capsys):  # noqa: F811 (the fixture)
    """eval_ppl.py with and without --no_skip on a steep model: per-window losses agree to 1e-5
    relative; it prints and records the attention work, 100 % without skipping."""
    save_checkpoint(setup["ckpt"], steep_model())
    long = [a if a != "100" else "600" for a in argv(setup)]
    long[long.index("--num_seqs") + 1] = "1"
    skipped = eval_ppl.main(long)
    full = eval_ppl.main(long + ["--no_skip", "--out", setup["out"] + "_full"])
    for a, b in zip(skipped, full):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert skipped[-1]["attention_work"] < 0.2 and full[-1]["attention_work"] == 1.0
    assert "attention work: " in capsys.readouterr().out


def test_bench_skip_end_to_end(setup, tmp_path):  # noqa: F811 (the fixture)
    """dev/bench_skip.py: both timings where asked, the work measured and predicted, the
    perplexity and peak memory, a length past the split cut to it, decoding, the files."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "dev"))
    import bench_skip

    save_checkpoint(setup["ckpt"], steep_model())
    out = str(tmp_path / "bench")
    argv = ["--ckpt", setup["ckpt"], "--data_dir", setup["data"], "--out", out]
    split = len(eval_ppl.val_sequences(setup["data"], "byte", 1)[0].reshape(-1))
    lengths = ["256", "512", str(10 * split)]
    rows, decoded = bench_skip.main(
        argv + ["--lengths", *lengths, "--full_lengths", "512", "--decode_contexts", "300"]
    )
    assert [r["length"] for r in rows] == [256, 512, split - 1]
    assert [r.get("seconds_full") is not None for r in rows] == [False, True, False]
    for r in rows:
        assert r["work_share"] < 0.3 and r["predicted_share"] <= r["work_share"] + 1e-3
        assert 1 < r["ppl"] < 2000 and r["peak_mib_skip"] > 10
    assert rows[1]["max_relative_window_loss_difference"] < 1e-5
    assert [r["context"] for r in decoded] == [300] and decoded[0]["ms_per_token_skip"] > 0
    for name in ("bench_skip", "bench_decode"):
        for ext in (".json", ".csv", ".png"):
            assert os.path.getsize(os.path.join(out, name + ext)) > 0

"""The startup self-check (attention_check.py): the Triton kernel passes it (here under the interpreter), and an
implementation that is wrong in its values, its gradients, or that fails to run is refused with one line."""
import pytest
import torch

import attention_kernel as ak
from attention_check import SelfCheckError, self_check

pytest.importorskip("triton")
if not ak._interpreting():
    pytest.skip("these tests run the Triton kernel under TRITON_INTERPRET=1", allow_module_level=True)


def ggd(alpha, beta, mu, trained=(True, True, False)):
    """A GGD triple as the model holds it: theta_alpha, theta_beta trained, theta_mu frozen (the paper)."""
    return tuple(torch.tensor(x, dtype=torch.float32).requires_grad_(t) for x, t in zip((alpha, beta, mu), trained))


SMALL = dict(n_head=2, head_dim=16, batch=2, seq_len=64, device="cpu")  # under the interpreter: seconds


def test_kernel_self_check_passes_training_fp32():
    r = self_check("triton", prior=ggd([0.0, 0.0], [0.0, 0.0], [0.0, 0.0]), ssmax=True, scale_prior=True,
                   documents=True, training=True, dtype=torch.float32, **SMALL)
    assert r["ok"] and r["impl"] == "triton" and r["precision"] == "float32"
    # every trained input's gradient was compared; the frozen theta_mu's was not
    assert set(r["errors"]) == {"out", "q", "k", "v", "theta_alpha", "theta_beta", "row_scale"}
    assert r["max_err"] <= 1e-3 and r["seconds"] > 0


def test_kernel_self_check_passes_evaluation_bf16():
    r = self_check("triton", prior=ggd([0.2, -0.5], [-1.0, 0.8], [0.0, 0.3]), ssmax=True, scale_prior=False,
                   training=False, dtype=torch.bfloat16, **SMALL)
    assert r["ok"] and r["precision"] == "bfloat16"
    assert set(r["errors"]) == {"out", "decode out"}  # values only: the prefill and a KV-cache continuation


def _wrong_prior(q, k, v, *, prior=None, **kw):  # test double: right except that it ignores the prior
    return ak.attention_torch(q, k, v, prior=None, **kw)


def _wrong_gradients(q, k, v, **kw):  # test double: exact values, gradients 2% too large
    out = ak.attention_torch(q, k, v, **kw)
    return out + 0.02 * (out - out.detach())


def _crashes(q, k, v, **kw):  # test double: a kernel that does not compile on this GPU
    raise RuntimeError("PTX .version 8.7 does not support .target sm_100\nmore compiler output")


def check(training, strict=True):
    return self_check("triton", prior=ggd([0.2, -0.5], [-1.0, 0.8], [0.0, 0.0]), ssmax=True, scale_prior=True,
                      documents=training, training=training, dtype=torch.float32, strict=strict, **SMALL)


def refusal(training):
    """The one-line message and the result of a refused check."""
    with pytest.raises(SelfCheckError) as info:
        check(training)
    msg = str(info.value)
    assert "\n" not in msg and "impl=triton" in msg and msg.endswith("rerun with --attn_impl=flex or --attn_impl=torch")
    assert not info.value.result["ok"]
    return msg, info.value.result


def test_kernel_self_check_refuses_wrong_values(monkeypatch):
    monkeypatch.setattr(ak, "attention_triton", _wrong_prior)
    msg, r = refusal(training=False)
    assert r["worst"] in ("out", "decode out") and r["max_err"] > r["tolerance"]
    assert f"by {r['max_err']:.2g} in {r['worst']}" in msg
    assert check(training=False, strict=False)["ok"] is False


def test_kernel_self_check_refuses_wrong_gradients(monkeypatch):
    monkeypatch.setattr(ak, "attention_triton", _wrong_gradients)
    msg, r = refusal(training=True)
    assert r["errors"]["out"] == 0.0 and r["worst"] != "out" and r["max_err"] > r["tolerance"]
    assert check(training=False)["ok"]  # an evaluation compares values only: those are right


def test_kernel_self_check_refuses_an_impl_that_fails_to_run(monkeypatch):
    monkeypatch.setattr(ak, "attention_triton", _crashes)
    msg, r = refusal(training=False)
    assert "failed to run (RuntimeError: PTX .version 8.7 does not support .target sm_100)" in msg


def test_kernel_self_check_script_end_to_end(tmp_path, capsys, monkeypatch):
    """attention_check.py as gpu_check.sh runs it: each impl at a model size's shape, training and evaluation;
    exit status 1 when one is refused (here a Triton kernel that fails to compile)."""
    import json

    from attention_check import main
    monkeypatch.setattr(ak, "attention_triton", _crashes)
    out = tmp_path / "check.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_size", "l6", "--impls", "torch,triton", "--device", "cpu", "--dtype", "float32",
              "--seq_len", "40", "--out", str(out)])
    assert exit_info.value.code == 1
    results = json.loads(out.read_text())
    assert [(r["impl"], r["training"], r["ok"]) for r in results] == [
        ("torch", True, True), ("torch", False, True), ("triton", True, False), ("triton", False, False)]
    assert results[0]["shape"] == [2, 16, 40, 32]
    assert set(results[0]["errors"]) == {"out", "q", "k", "v", "theta_alpha", "theta_beta", "row_scale"}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].endswith(" ok") and "REFUSED: attention self-check: impl=triton" in lines[2]


def test_kernel_self_check_names_the_impl_that_auto_picks():
    r = self_check("auto", prior=ggd([0.0], [0.5], [0.0]), training=True, dtype=torch.float32,
                   **{**SMALL, "n_head": 1, "seq_len": 16})
    assert r["ok"] and r["impl"] == "cpu"  # on the CPU, training: the hand-written backward

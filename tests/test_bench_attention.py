"""bench_attention.py without a GPU: --check runs the kernel's correctness check under Triton's interpreter (so it
checks something)."""
import pytest
import torch

pytest.importorskip("triton")
import bench_attention  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of bench_attention.py")


def test_check_runs_under_the_interpreter_and_fails_on_a_wrong_kernel(monkeypatch, capsys):
    cases = [c for c in bench_attention.CPU_CHECKS if c[0].startswith(("fp32 D32", "fp16"))]
    results, failed = bench_attention.run_check("cpu", cases, empty_row_len=40)
    assert failed == 0 and [r["status"] for r in results] == ["PASS"] * 3
    import attention_kernel
    real = attention_kernel.attention_triton
    monkeypatch.setattr(attention_kernel, "attention_triton", lambda q, k, v, **kw: real(q, k, v, **kw) * 1.01)
    _, failed = bench_attention.run_check("cpu", cases[:1], empty_row_len=40)
    assert failed == 1

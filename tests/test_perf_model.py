"""dev/perf_model.py: SASS loop finding and counting on a hand-written listing, the comparison with
a measurement, and the script end to end (compiles the no-prior kernels for sm_90 with Triton's
bundled ptxas: no GPU needed)."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev"))
import perf_model as pm  # noqa: E402

# two loops: an outer one without tensor-core work and an inner one with it (one 64x64 tile, 4 warps
# per group)
LISTING = [
    (0x00, "MOV", " R1, R2"),
    (0x10, "HGMMA.64x64x16.F32.BF16", " R24, gdesc[UR4], RZ"),  # QK^T
    (0x20, "HGMMA.64x64x16.F32.BF16", " R24, R8, gdesc[UR8], R24"),  # PV
    (0x30, "MUFU.EX2", " R3, R3"),
    (0x40, "FFMA", " R4, R4, R5, R6"),
    (0x50, "FMNMX", " R4, R4, R5"),
    (0x60, "LDS", " R7, [R8]"),
    (0x70, "BRA", " 0x10"),
    (0x80, "IADD3", " R1, R1, 1, RZ"),
    (0x90, "BRA", " 0x0"),
    (0xA0, "EXIT", ""),
]


def test_hot_loop_and_counts():
    body = pm.hot_loop(LISTING)
    assert [a for a, _, _ in body] == [0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70]
    # 4 warps, HGMMA 64x64x16 = one 64 x 64 tile x 16 of head_dim per instruction and warpgroup:
    # block_d = 16
    c = pm.count_per_score(body, warps=4, kernel="fwd", block_d=16, tile=64 * 64)
    assert c["tiles_per_iter"] == pytest.approx(1.0)
    assert c["tensor_flops"] == pytest.approx(4 * 16)
    per = 32 * 4 / (64 * 64)  # thread-instructions per score of one warp-instruction
    assert c["mufu"] == pytest.approx(per) and c["mufu_kinds"] == {"EX2": pytest.approx(per)}
    assert c["fp32"] == pytest.approx(2 * per)
    assert c["issue"] == pytest.approx(5 * per)  # MUFU, FFMA, FMNMX, LDS, BRA
    assert c["loads"] == pytest.approx(per)
    clk, bound = pm.clocks_per_score(c, pm.GPUS[90])
    assert bound == "tensor" and clk == pytest.approx(64 / 4096)


def test_compare_with_measurement(tmp_path):
    summary = [
        dict(kernel_src="current", arch="sm_90", head_dim=64, variant=v, fwd_clk=f, bwd_clk=b)
        for v, f, b in (("none", 0.1, 0.3), ("ggd_ssmax", 0.2, 0.4))
    ]
    bench = {
        "table": [
            dict(impl=i, head_dim=64, T=1024, fwd_tflops=f, fwdbwd_tflops=fb)
            for i, f, fb in (
                ("kernel_bam", 100.0, 50.0),
                ("kernel_plain", 200.0, 100.0),
                ("sdpa_flash", 400.0, 200.0),
            )
        ]
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    lines = pm.compare(summary, str(path))
    cells = {line[13:].rsplit(None, 2)[0]: line.split()[-2:] for line in lines[1:]}
    assert cells["kernel_bam / kernel_plain fwd"] == ["0.50", "0.50"]
    assert cells["kernel_bam / kernel_plain f+b"] == [f"{0.4 / 0.6:.2f}", "0.50"]
    assert cells["kernel_plain / sdpa_flash fwd"][1] == "0.50"


def test_kernel_sees_a_prior_only_as_tables():
    """Variants differ in the kernels' constants only by prior or not, SSMax, and K (the parameters
    trained): cauchy launches exactly what ggd does, and theta_mu trained adds one derivative
    table."""
    import attention_kernel as ak

    launch = {
        v: pm.kernel_launches(ak, v, 64) for v in ("alibi", "ggd", "ggd_mu", "cauchy", "none")
    }
    assert launch["cauchy"] == launch["ggd"]
    k = {v: dict(launch[v][2][2]) for v in launch}  # the dQ kernel's constants
    assert (
        k["none"]["N_GRAD"],
        k["alibi"]["N_GRAD"],
        k["ggd"]["N_GRAD"],
        k["ggd_mu"]["N_GRAD"],
    ) == (0, 0, 2, 3)
    assert not k["none"]["HAS_PRIOR"] and k["alibi"]["HAS_PRIOR"]
    assert launch["ggd_mu"][:2] == launch["ggd"][:2]  # the forward and dK/dV kernels read B only


def test_every_flag_compiles_for_the_gpu():
    """The dQ kernel, the one with the most paths, compiled as a GPU would (Triton's bundled ptxas,
    outside the interpreter, which runs Python and would not see a compile error): every flag on
    (documents, GGD + SSMax scaling the prior, its own Delta pass) for sm_90, sm_100 (B200) and
    sm_75 (T4), and the per-diagonal gradient (t5_bucket) for sm_80."""
    script = """
import attention_kernel as ak
import perf_model as pm
for variant, arch in (("ggd_ssmax", 90), ("t5_bucket", 80), ("ggd_ssmax", 100), ("ggd_ssmax", 75)):
    name, fn, constants, (_, _, warps, stages) = pm.kernel_launches(ak, variant, 64)[2]
    constants = dict(constants, HAS_DOC=True)
    assert name == "dq" and constants["OWN_DELTA"]
    kernel = pm.compile_kernel(fn, constants, arch, warps, stages, fp_fusion=ak.FP_FUSION)
    print(variant, len(pm.sass(kernel.asm["cubin"])[0]))  # sm_75: no tensor-core loop to find
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(pm.__file__), os.getcwd()])
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert [line.split()[0] for line in r.stdout.splitlines()] == [
        "ggd_ssmax",
        "t5_bucket",
        "ggd_ssmax",
        "ggd_ssmax",
    ]


def test_script_end_to_end(tmp_path):
    """Compiles the forward, dK/dV and dQ kernels without a prior for sm_90 (real ptxas, outside the
    interpreter) and checks the counts that the kernel's algorithm fixes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [
            sys.executable,
            pm.__file__,
            "--archs",
            "90",
            "--head_dims",
            "64",
            "--variants",
            "none",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "perf_model.json").read_text())
    k = {row["kernel"]: row for row in data["kernels"]}
    assert {n: k[n]["tensor_flops"] for n in k} == {"fwd": 4 * 64, "dkdv": 8 * 64, "dq": 6 * 64}
    assert all(row["tiles_per_iter"] == 1.0 for row in k.values())
    assert all(
        1.0 <= row["mufu"] < 1.2 for row in k.values()
    )  # the softmax's exp2 (+ the forward's rescale)
    assert all(row["stack_bytes"] == 0 and row["regs"] <= 255 for row in k.values())
    assert (tmp_path / "perf_model.md").read_text().startswith("| GPU | D | variant")
    assert "| H100 SXM | 64 | none |" in r.stdout

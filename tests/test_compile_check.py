"""dev/compile_check.py: the kernel compiled for real NVIDIA GPUs without one. make test's subset
(l12's training kernels in bf16) for an RTX-class GPU (sm_86, 99 KiB of shared memory a block) and
an H100 (sm_90), a configuration made too large on purpose, which the check must report over the
limit, and the tiles _configs picks on each target. The compiling tests run in a Python of their
own: the tests' processes interpret the kernels (TRITON_INTERPRET=1), and only a Python without the
interpreter compiles them."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytest.importorskip("triton")


def compiler_python(*args, code=None):
    """dev/compile_check.py's command line (or code, with the script importable) in a Python that
    compiles Triton kernels."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.path.join(ROOT, "dev"))
    command = ["-c", code] if code else [os.path.join(ROOT, "dev", "compile_check.py"), *args]
    return subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("arch", [86, 90])
def test_l12_kernels_compile_and_fit(arch, tmp_path):
    """Every kernel l12's training launches (GGD + SSMax in both placements, ALiBi, NoPE, T5's
    buckets; head_dim 48 and 64) compiles for the target, fits its shared memory, runs its 16-bit
    dots on tensor cores and spills no registers."""
    r = compiler_python("--quick", "--targets", str(arch), "--jobs", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.load(open(tmp_path / "compile_check.json"))
    kernels = {row["kernel"] for row in rows}
    assert kernels == {"fwd", "preprocess", "dkdv", "dq"} and len(rows) >= 20
    for row in rows:
        assert row["target"] == f"sm_{arch}" and not row["error"] and not row["failure"], row
        assert 0 < row["shared"] <= row["shared_limit"], row
        assert row["spill_stores"] == row["spill_loads"] == 0, row
        dots = {"-"} if row["kernel"] == "preprocess" else {"mma", "wgmma", "mma + wgmma"}
        assert row["dots"] in dots and (arch == 90 or "wgmma" not in row["dots"]), row
    assert (tmp_path / "compile_check.md").read_text().startswith(f"{len(rows)} specialisations")


def test_tiles_follow_the_gpus_shared_memory(monkeypatch):
    """_configs on each target: none larger than LARGEST_TILE (the tables' reach), every BLOCK_M
    a divisor of the largest (the skipping groups), dQ's a multiple of its BLOCK_N (its sums by
    diagonal). The GPUs differ in the forward's pipeline stages only, and only by their shared
    memory: the same configuration on sm_80 and sm_90 (163 and 227 KiB), and on sm_86, sm_89 and
    sm_120 (99 KiB), where 16-bit head_dim 64 has one stage fewer."""
    import torch

    import attention_kernel as ak

    monkeypatch.syspath_prepend(os.path.join(ROOT, "dev"))
    import compile_check

    monkeypatch.setattr(ak, "INTERPRET_BLOCKS", None)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (8, 32, 48, 64, 128):
            configs = {}
            for arch in compile_check.TARGETS:
                with compile_check.stand_in(arch):
                    cfg = ak._configs(head_dim, dtype, torch.device("cpu"))
                configs[arch] = cfg
                group_m, group_n = ak._tile_groups(cfg)
                assert max(group_m, group_n) <= ak.LARGEST_TILE
                assert all(group_m % cfg[k][0] == 0 for k in ("fwd", "dkdv", "dq"))
                assert all(group_n % cfg[k][1] == 0 for k in ("fwd", "dkdv", "dq"))
                assert cfg["dq"][0] % cfg["dq"][1] == 0
            assert configs[80] == configs[90] and configs[86] == configs[89] == configs[120]
            small, large = configs[86], configs[90]
            assert {k: v for k, v in small.items() if k != "fwd"} == {
                k: v for k, v in large.items() if k != "fwd"
            }
            fewer = 1 if dtype != torch.float32 and head_dim <= 64 else 0
            assert small["fwd"] == (*large["fwd"][:3], large["fwd"][3] - fewer)


TOO_LARGE = """
import torch
import attention_kernel as ak
import compile_check as cc

# four pipeline stages of 128 x 128 tiles at head_dim 128: 224 KiB of shared memory
ak._configs = lambda *args: dict(
    fwd=(128, 128, 8, 4), dkdv=(32, 64, 8, 2), dq=(32, 16, 8, 2), pre=128
)
setting = ("nope", None, (), False, False)
with cc.launches(86) as recorded:
    cc._call(setting, torch.bfloat16, 128, (1, 2, 256, 256), False, False)
(key, launch), = recorded
row = cc.check(86, {key: dict(dtype="bf16", head_dim=128, run="evaluation", launch=launch,
                             priors=["nope"])}, jobs=1)[0]
print(row["failure"])
"""


def test_a_configuration_too_large_is_reported_over_the_limit():
    r = compiler_python(code=TOO_LARGE)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("shared memory ") and last.endswith("over the limit 101,376 B"), last


@pytest.mark.slow
def test_every_specialisation_compiles_and_fits_on_five_gpus(tmp_path):
    """The full matrix of dev/README.md (about an hour on 2 cores): every prior setting, dtype and
    head_dim class for sm_80, sm_86, sm_89, sm_90 and sm_120; no compile error, nothing over the
    shared memory, every 16-bit dot on tensor cores; and the paper's kernels (16-bit forward and
    dK/dV at head_dim 48, 64 and 128) spill nothing on sm_80 and sm_90."""
    r = compiler_python("--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.load(open(tmp_path / "compile_check.json"))
    assert {row["target"] for row in rows} == {f"sm_{a}" for a in (80, 86, 89, 90, 120)}
    assert len(rows) > 2000 and not [row for row in rows if row["failure"]]
    paper = [
        row
        for row in rows
        if row["dtype"] != "fp32"
        and row["head_dim"] in (48, 64, 128)
        and row["kernel"] in ("fwd", "dkdv")
        and row["target"] in ("sm_80", "sm_90")
    ]
    assert len(paper) > 100 and not [
        row for row in paper if row["spill_stores"] + row["spill_loads"]
    ]

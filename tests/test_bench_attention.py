"""dev/: bench_attention.py's CPU table runs, and bench.py times the model variants end to end."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev"))
import bench  # noqa: E402
import bench_attention  # noqa: E402

from model import POS_ENCODINGS  # noqa: E402


def test_cpu_table_reports_what_impl_error_refuses(tmp_path):
    """Training: sdpa is refused for the trained GGD prior (impl_error's message), the others are
    timed."""
    out = tmp_path / "cpu.json"
    assert (
        bench_attention.main(
            [
                "--cpu",
                "--train",
                "--lengths",
                "64",
                "--rounds",
                "1",
                "--doc_len",
                "20",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = {r["impl"]: r for r in json.loads(out.read_text())["cpu_table"]}
    assert rows["reference"]["status"] == "ok" and rows["sdpa_noprior"]["status"] == "ok"
    assert rows["sdpa"]["status"].startswith("refused: impl='sdpa' cannot train a prior")


def test_bench_smoke(tmp_path):
    """bench.py runs end to end on a very small model and writes the ratio it prints."""
    out = tmp_path / "bench.json"
    results = bench.main(
        [
            "--n_layer=1",
            "--n_embd=16",
            "--n_head=2",
            "--block_size=16",
            "--batch_size=2",
            "--steps=2",
            "--warmup=1",
            "--threads=1",
            "--all",
            "--device=cpu",
            f"--out={out}",
        ]
    )
    saved = json.load(open(out))
    variants = {f"{p}{'+ssmax' if s else ''}" for p in POS_ENCODINGS for s in (False, True)}
    variants.add("bam+ssmax+skip")
    assert set(saved["variants"]) == variants == set(results)
    skip_ratio = results["bam+ssmax+skip"]["median_ms"] / results["bam+ssmax"]["median_ms"]
    assert saved["ratio_skip_on_vs_off"] == skip_ratio > 0
    assert (
        saved["ratio_bam_ssmax_vs_nope"]
        == results["bam+ssmax"]["median_ms"] / results["nope"]["median_ms"]
        > 0
    )
    assert all(len(v["ms"]) == 2 for v in saved["variants"].values())
    with pytest.raises(
        SystemExit, match="bench.py: error: bam\\+ssmax: impl='sdpa' cannot train a prior"
    ):
        bench.main(
            [
                "--n_layer=1",
                "--n_embd=16",
                "--n_head=2",
                "--block_size=16",
                "--batch_size=2",
                "--steps=1",
                "--device=cpu",
                "--attn_impl=sdpa",
            ]
        )

"""The repo speaks of what it is, not of how it was made: its markdown, its Python outside tests/
(comments, docstrings, messages and names), its scripts and its committed results hold none of the
wording below."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (pattern, why it does not belong). Case-insensitive unless the pattern says (?-i:...).
WORDING = [
    # pytest's "test session starts" is a log
    (r"\bsessions?\b(?! starts)", "who made the repo, not what it is"),
    (
        r"\bthis machine\b",
        'a machine the reader does not have: name the hardware ("2-core CPU (x86-64)")',
    ),
    (r"\bthis project's\b", "name the hardware or the fact instead"),
    (r"\bnot met\b", "an acceptance verdict"),
    (r"\bacceptance\b", "an acceptance verdict"),
    (r"(?-i:\b(?:TARGET|STRETCH)\b)|\bstretch\b", "an acceptance target"),
    (r"\bquieter run\b", "a measurement's circumstances, not its hardware"),
    (r"\bearlier machine\b", "a machine the reader does not have"),
    (r"\breference notes\b", "notes the repo does not hold"),
    (r"shared/reference", "notes the repo does not hold: cite the paper or the authors' code"),
    (r"\bkeeps? working\b", "a shim for an old name"),
    (r"\bavailable to us\b", "who made the repo, not what it is"),
    (r"\bLEGACY_SETTINGS\b", "a shim for an old setting"),
    (r"\bpaper32k\b", "an alias for an old preset name"),
    (r"\bdemo_float\b", "a directory that is not committed"),
    (r"@(?=[0-9a-f]{0,39}[0-9])[0-9a-f]{7,40}\b", "a commit hash as a table row"),
]
PATTERNS = [(re.compile(p, re.I), why) for p, why in WORDING]

SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "data", "out"}
TEXT_RESULTS = (".md", ".json", ".csv", ".txt", ".log", ".jsonl")


def repo_files():
    """The repo's files, relative to ROOT: git's tracked and not-ignored files, or a walk of the
    tree without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return sorted(f for f in out.splitlines() if os.path.isfile(os.path.join(ROOT, f)))
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith("out-")]
            files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
        return sorted(files)


def checked(path):
    """Whether `path` is prose, code or a committed result that the wording rules cover."""
    if path.endswith(".md"):
        return True
    if path.startswith("tests/"):  # the tests name the wording they forbid
        return False
    if path.endswith((".py", ".sh")) or path in ("Makefile", "requirements.txt"):
        return True
    return path.startswith(("results/", "dev/results/")) and path.endswith(TEXT_RESULTS)


FILES = [f for f in repo_files() if checked(f)]


def hits(text):
    """[(line number, matched text, why)] of every forbidden phrase in `text`."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, why in PATTERNS:
            found += [(n, m.group(0), why) for m in pattern.finditer(line)]
    return found


@pytest.mark.parametrize("path", FILES)
def test_no_wording_of_how_the_repo_was_made(path):
    with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
        found = hits(f.read())
    assert not found, "\n".join(f"{path}:{n}: {m!r}: {why}" for n, m, why in found)


def test_the_files_are_found():
    assert "README.md" in FILES and any(f.endswith(".py") for f in FILES)
    assert not [f for f in FILES if f.startswith("tests/") and f.endswith(".py")]


@pytest.mark.parametrize(
    "text",
    [
        "no GPU was available to the session that wrote it",
        "on this project's 2-core CPU machine",
        "stretch (>= 0.9 at 64x) bam_ssmax: NOT met: seed 2",
        "TARGET = {'cpu': 1.10}",
        "(2 min 51 s in a quieter run of 354 tests)",
        "From the recipe search (on the earlier machine)",
        "follows the decisions of its reference notes",
        "the text of the paper was not available to us in full",
        "| H100 SXM | 48 | ggd @a9f1e05 | 0.28 |",
        "see [results/demo_float/](results/demo_float/)",
        "LEGACY_SETTINGS = {'gap_tokens': 0}",
        '"paper32k": dict(lengths=PAPER_LENGTHS)',
        "re-exported: `from attention_kernel import alibi_slopes` keeps working",
        "this machine has no CUDA GPU",
    ],
)
def test_the_patterns_catch_the_wording(text):
    assert hits(text)


@pytest.mark.parametrize(
    "text",
    [
        "target lengths in tokens; the target of each window is scored once",
        "triton.compile(src, target=GPUTarget('cuda', arch, 32))",
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
        "@dataclass(frozen=True)",
        "@triton.jit",
        "@torch.library.custom_op('bam::triton_attention_fwd', mutates_args=())",
        "a feedback loop, deadbeef, @acceded",
        "a metric is met when the run has data",
        "Measured on a 2-core CPU (x86-64): 1.35 (220 vs 163 ms per step)",
        "============================= test session starts ==============================",
    ],
)
def test_the_patterns_leave_legitimate_words(text):
    assert not hits(text)

"""`nox -s bench -- --only KEY` rewrites one section of docs/benchmarks.md: the others, and the GPU figures no
benchmark here can produce (recorded from a GPU machine), must come through unchanged."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import run_all  # noqa: E402


def test_sections_split_at_benchmark_titles_and_recorded_gpu_sections_are_their_own(tmp_path):
    comm, adam = run_all.SECTIONS["comm"][0], run_all.SECTIONS["adam"][0]
    gpu = f"{run_all.RECORDED_TITLE_PREFIX}one GPU (recorded)"
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        f"# Benchmarks\n\nheader\n\n## {comm}\n\ncomm table\n\n## {adam}\n\nadam table\n\n## A subsection\n\n"
        f"more adam\n\n## {gpu}\n\nH200 table\n"
    )
    sections = run_all._existing_sections(doc)
    assert list(sections) == ["comm", "adam", gpu]
    assert sections["comm"] == f"## {comm}\n\ncomm table\n\n"
    assert sections["adam"] == f"## {adam}\n\nadam table\n\n## A subsection\n\nmore adam\n\n"
    assert sections[gpu] == f"## {gpu}\n\nH200 table\n"

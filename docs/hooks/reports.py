"""MkDocs hook: publish benchmarks/reports/*.md under reports/, with an index, newest first.

The reports stay where the benchmarks write them (one dated file per run); the site links
them as ``reports/<file>.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPORTS = Path(__file__).resolve().parents[2] / "benchmarks" / "reports"


def _title(report: Path) -> str:
    """The report's first heading, without the leading ``# ``."""
    first = report.read_text().splitlines()[0]
    return first.removeprefix("# ").strip()


def on_files(files: Files, config: Any) -> Files:
    """Add every report and ``reports/index.md`` to the site's files."""
    reports = sorted(REPORTS.glob("*.md"), reverse=True)
    lines = ["# Benchmark reports", "",
             "One file per run, newest first, each naming its command, machine, commit and the "
             "reference it is compared with. They live in `benchmarks/reports/`; the benchmarks "
             "are in `benchmarks/`.", ""]
    for report in reports:
        files.append(File.generated(config, f"reports/{report.name}", abs_src_path=str(report)))
        lines.append(f"- [{_title(report)}]({report.name})")
    files.append(File.generated(config, "reports/index.md", content="\n".join(lines) + "\n"))
    return files

"""The docs site builds with no warning, its benchmarks page matches the results, the README is short."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _gen_benchmarks():
    spec = importlib.util.spec_from_file_location("gen_benchmarks", ROOT / "docs" / "gen_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_strict_passes(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "index.html").is_file()
    assert (site / "sync-semantics" / "index.html").is_file()


def test_benchmarks_page_is_rendered_from_the_results():
    gen = _gen_benchmarks()
    expected = gen.render(gen.load_results())
    assert gen.PAGE.read_text() == expected, "docs/benchmarks.md is stale: run python docs/gen_benchmarks.py"


def test_benchmark_plots_are_rendered_from_the_results():
    gen = _gen_benchmarks()
    plots = gen.render_plots(gen.load_results())
    assert plots, "no results file draws a plot"
    for path, svg in plots.items():
        assert path.is_file() and path.read_text() == svg, f"{path} is stale: run python docs/gen_benchmarks.py"


def test_a_plot_draws_one_line_per_series_with_its_legend():
    gen = _gen_benchmarks()
    svg = gen.svg_line_chart({"file": "x.svg", "title": "t & u", "x_label": "size", "y_label": "GB/s", "series": [
        {"name": "best", "points": [[256, 0.5], [1024, 0.4]]},
        {"name": "median", "dashed": True, "points": [[256, 0.3], [1024, 0.2]]}]})
    assert svg.count("<polyline") == 2 and svg.count("stroke-dasharray") == 2  # the line and its legend
    assert ">best<" in svg and ">median<" in svg and "t &amp; u" in svg


def test_every_results_file_names_machine_commit_command_and_date():
    gen = _gen_benchmarks()
    results = gen.load_results()
    assert len(results) >= 10
    for name, data in results:
        assert data["command"].strip(), name
        for run in data["runs"]:
            assert re.match(r"\d{4}-\d{2}-\d{2}", run["date"]), (name, run["date"])
            assert re.fullmatch(r"[0-9a-f]{7,40}", run["commit"]), (name, run["commit"])
            assert run["machine"].strip() and run["rows"], name


def test_a_results_file_with_a_short_row_is_refused(tmp_path):
    gen = _gen_benchmarks()
    bad = {"title": "t", "command": "c", "what": "w",
           "runs": [{"date": "2026-01-01", "commit": "abcdef0", "machine": "m", "conditions": "c",
                     "columns": ["a", "b"], "rows": [["only one"]]}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad.json: runs\[0\].rows\[0\] has 1 cells, expected 2"):
        gen.load_results(tmp_path)


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_readme_links_only_to_files_that_exist():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+://|#|mailto:", t)]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_readme_test_command_is_the_one_ci_runs():
    assert "\n.venv/bin/pytest -q -n 3 --dist loadgroup\n" in README.read_text()


def test_repository_paths_named_in_the_docs_exist():
    """A file the docs name (`bus/weights/checkpoint.py`) must be there: moves and splits update the docs."""
    pages = [*sorted((ROOT / "docs").glob("*.md")), README]
    tops = ("sync_protocol/", "bus/", "roles/", "deploy/", "examples/", "tests/", "benchmarks/", "docs/")
    missing = []
    for page in pages:
        for path in re.findall(r"`([a-z_]+/[A-Za-z0-9_./@-]+)`", page.read_text()):
            if path.startswith(tops) and "NAME" not in path and not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
    assert not missing, missing

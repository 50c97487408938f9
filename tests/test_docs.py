"""The manual: its generated tables are what their sources say, and its links lead somewhere."""
import json
import os
import re
import shutil
import subprocess
import sys

from hypothesis import given, settings, strategies as st

from bench.docs import blocks_of, options_table, registry
from kdcache.args import Int, Option

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS, RESULTS = os.path.join(ROOT, "docs"), os.path.join(ROOT, "bench", "results")


def docs_check(*args):
    return subprocess.run([sys.executable, "-m", "bench.docs", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def copies(tmp_path):
    """A copy of docs/ and bench/results/ to change, every block up to date (whatever the repository's are);
    (docs, results)."""
    docs, results = tmp_path / "docs", tmp_path / "results"
    shutil.copytree(DOCS, docs)
    shutil.copytree(RESULTS, results)
    proc = docs_check("--docs", str(docs), "--results", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return docs, results


def test_every_generated_block_is_up_to_date():
    proc = docs_check("--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_the_manual_has_the_benchmarks_and_options_blocks():
    names = {name for f in os.listdir(DOCS) if f.endswith(".md")
             for name, *_ in blocks_of(f, open(os.path.join(DOCS, f), encoding="utf-8").read())}
    assert {"bench.kd", "bench.demand", "bench.store", "bench.read_scale", "bench.producer", "bench.codecs",
            "bench.distill", "bench.sizing", "bench.decode", "bench.recipe", "bench.recipe_hard_labels",
            "bench.train_default", "bench.ensemble", "bench.codecs_sampled", "options.shared", "options.producer",
            "options.trainer", "options.teacher", "options.launcher"} <= names
    assert names == set(registry())  # every block bench.docs can make is in the manual: no table is typed by hand


def test_a_table_edited_by_hand_is_named_and_regenerated(tmp_path):
    docs, results = copies(tmp_path)
    page = docs / "benchmarks.md"
    text = page.read_text(encoding="utf-8")
    row = re.search(r"^\| heavy \| kdcache, warm cache \| (\d+) \|", text, re.M)
    edited = text.replace(row.group(0), f"| heavy | kdcache, warm cache | {int(row.group(1)) + 100} |")
    page.write_text(edited, encoding="utf-8")
    opts = docs / "options.md"
    opts.write_text(opts.read_text(encoding="utf-8").replace("| `--seed` | 0 |", "| `--seed` | 1 |", 1),
                    encoding="utf-8")

    proc = docs_check("--check", "--docs", str(docs), "--results", str(results))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    named = re.findall(r"block (\S+) is out of date", proc.stdout)
    assert sorted(named) == ["bench.kd", "options.shared"], proc.stdout
    assert page.read_text(encoding="utf-8") == edited  # --check writes nothing

    proc = docs_check("--docs", str(docs), "--results", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert page.read_text(encoding="utf-8") == text
    assert docs_check("--check", "--docs", str(docs), "--results", str(results)).returncode == 0


def test_a_changed_report_value_is_named(tmp_path):
    docs, results = copies(tmp_path)
    for file, change in (("store.json", lambda r: r["rows_per_s"].update(files_per_sample=1234.0)),
                         ("codecs.json", lambda r: r.update(date="2027-01-01T00:00:00+00:00"))):
        report = json.loads((results / file).read_text())
        change(report)
        (results / file).write_text(json.dumps(report))
    proc = docs_check("--check", "--docs", str(docs), "--results", str(results))
    assert proc.returncode == 1
    assert sorted(re.findall(r"block (\S+) is out of date", proc.stdout)) == ["bench.codecs", "bench.store"]
    assert "python -m bench.docs" in proc.stdout

    assert docs_check("--docs", str(docs), "--results", str(results)).returncode == 0
    page = (docs / "benchmarks.md").read_text(encoding="utf-8")
    assert "| 1.2k rows/s |" in page and "Run of 2027-01-01" in page


def test_a_missing_report_or_an_unknown_block_is_one_line(tmp_path):
    docs, results = copies(tmp_path)
    (results / "kd.json").unlink()
    proc = docs_check("--check", "--docs", str(docs), "--results", str(results))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "bench.kd" in proc.stderr and "kd.json" in proc.stderr

    shutil.copy(os.path.join(RESULTS, "kd.json"), results / "kd.json")
    page = docs / "faults.md"
    page.write_text(page.read_text(encoding="utf-8")
                    + "\n<!-- generated: bench.nosuch (python -m bench.docs) -->\n<!-- end: bench.nosuch -->\n",
                    encoding="utf-8")
    proc = docs_check("--docs", str(docs), "--results", str(results))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "bench.nosuch" in proc.stderr


# Any option a command may declare: its help, allowed values and default may hold pipes and line breaks.
@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.from_regex(r"--[a-z][a-z-]{0,12}", fullmatch=True), st.text(min_size=1, max_size=40),
                          st.one_of(st.none(), st.integers(0, 9)), st.booleans()), min_size=1, max_size=5))
def test_any_option_is_one_row_of_five_cells(decls):
    options = [Option(flag, help, action="store_true", group="g") if flag_only else
               Option(flag, help, type=Int(0, 9), default=default, group="g")
               for flag, help, default, flag_only in decls]
    lines = options_table(options).split("\n")
    assert len(lines) == 2 + len(options)
    for line, o in zip(lines[2:], options):
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == 5, line
        assert cells[0].strip().startswith(f"`{o.flag}`")
        assert " ".join(o.help.split()).replace("|", "\\|") == cells[4].strip()


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")
NAV = "[kdcache](../README.md) · manual:"


def test_every_page_carries_the_same_navigation_line_linking_every_page():
    pages = sorted(f for f in os.listdir(DOCS) if f.endswith(".md"))
    third = {f: open(os.path.join(DOCS, f), encoding="utf-8").read().split("\n")[2:3] for f in pages}
    lacking = [f for f, line in third.items() if not line or not line[0].startswith(NAV)]
    assert not lacking, f"line 3 is not the navigation line in: {', '.join(lacking)}"
    assert len({line[0] for line in third.values()}) == 1, "the navigation lines differ:\n" + "\n".join(
        f"{f}: {line[0]}" for f, line in third.items())
    linked = set(LINK.findall(third[pages[0]][0]))
    assert set(pages) - linked == set(), f"the navigation line does not link {sorted(set(pages) - linked)}"


def test_every_relative_link_leads_to_a_file():
    pages = [os.path.join(ROOT, "README.md")] + [os.path.join(DOCS, f) for f in sorted(os.listdir(DOCS))
                                                  if f.endswith(".md")]
    bad = []
    for page in pages:
        text = re.sub(r"```.*?```", "", open(page, encoding="utf-8").read(), flags=re.S)  # code is not a link
        for target in LINK.findall(text):
            if re.match(r"[a-zA-Z][a-zA-Z+.-]*:", target):  # http:, mailto: ...
                continue
            where = os.path.relpath(page, ROOT)
            if "#" in target:  # headings move; a page does not
                bad.append(f"{where}: {target} has an anchor: link the page")
            elif not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page), target))):
                bad.append(f"{where}: {target} does not exist")
    assert not bad, "\n".join(bad)


# A Python name the pages quote: `kdcache.a.b`, `kdcache.a.b(...)`, or one of the packages' bare names
# (`store.ring`, `trainer.loss.check_finite`), which name nothing since the packages live under kdcache.
QUOTED = re.compile(r"`((?:kdcache|store|trainer|pipeline|cache_builder)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)[(`]")
FILE_SUFFIXES = {"py", "json", "states", "params", "h5", "md", "npz", "csv", "txt", "rec", "idx"}


def test_every_python_name_the_pages_quote_exists():
    """`kdcache.trainer.loss.check_finite` in the manual must be importable as written; a bare
    `trainer.loss.check_finite` (the name before the packages moved under kdcache) is reported."""
    import importlib
    pages = [os.path.join(ROOT, "README.md")] + [os.path.join(DOCS, f) for f in sorted(os.listdir(DOCS))
                                                  if f.endswith(".md")]
    bad, seen = [], 0
    for page in pages:
        for name in QUOTED.findall(open(page, encoding="utf-8").read()):
            if name.rsplit(".", 1)[1] in FILE_SUFFIXES:  # a file: trainer.py, store.json
                continue
            where = os.path.relpath(page, ROOT)
            if not name.startswith("kdcache."):
                bad.append(f"{where}: `{name}` names nothing: write `kdcache.{name}`")
                continue
            seen += 1
            parts = name.split(".")
            for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                    break
                except ImportError:
                    continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                bad.append(f"{where}: `{name}` does not exist")
    assert seen > 5 and not bad, "\n".join(bad)

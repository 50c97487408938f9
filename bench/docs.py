"""The manual's generated blocks: benchmark tables from bench/results/*.json and option tables from their declarations.

    python -m bench.docs            rewrite every generated block of docs/*.md and README.md in place
    python -m bench.docs --check    exit 1 naming each block that is not what its source says; write nothing

A generated block sits between two marker lines, and only what is between them is rewritten; the prose
around it stays as written:

    <!-- generated: bench.kd (python -m bench.docs) -->
    ...
    <!-- end: bench.kd -->

A benchmark's block is its run line (date, run time, machine, the other processes' load) and the tables
its module's render(report) returns, a pure function of its JSON report, the same its main prints (a module
whose report gathers several runs may also give runs_line(report), the line that dates them).
To add a benchmark: give its module render(report) -> [(title, markdown table)], add one line to
BENCHMARKS below, and put the two marker lines where its tables go in docs/benchmarks.md.
"""
import os
import sys

if __package__ in (None, ""):  # run as a file: import the repo's packages, not this directory's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import importlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

from bench.common import ROOT, md_table, rendered, run_line  # noqa: E402
from kdcache.args import Dir, Option, Parser, add_options  # noqa: E402

# block name -> (the module whose render(report) makes its tables, its JSON report in the results folder)
BENCHMARKS = {
    "bench.kd": ("bench.kd.run", "kd.json"),
    "bench.demand": ("bench.demand.run", "demand.json"),
    "bench.store": ("bench.store.run", "store.json"),
    "bench.read_scale": ("bench.read_scale.run", "read_scale.json"),
    "bench.producer": ("bench.producer.run", "producer.json"),
    "bench.fleet": ("bench.fleet.run", "fleet.json"),
    "bench.codecs": ("bench.codecs.report", "codecs.json"),
    "bench.distill": ("bench.distill.run", "distill.json"),
    "bench.sizing": ("bench.sizing.run", "sizing.json"),
    "bench.decode": ("bench.decode.run", "decode.json"),
    "bench.checksums": ("bench.checksums.run", "checksums.json"),
    "bench.recipe": ("bench.recipe.run", "recipe_sweep.json"),
    "bench.recipe_hard_labels": ("bench.recipe.run", "recipe_sweep_hard_labels.json"),
    "bench.train_default": ("bench.train_default.run", "train_default.json"),
    "bench.ensemble": ("bench.ensemble.run", "ensemble.json"),
    "bench.ensemble_fashion": ("bench.ensemble.run", "ensemble_fashion.json"),
    "bench.codecs_sampled": ("bench.codecs.sampled", "codecs_sampled.json"),
    "bench.quality": ("bench.quality.run", "quality.json"),
    "bench.publish": ("bench.publish.run", "publish.json"),
}

# block name -> (module, the list of kdcache.args.Option it declares): each command's options with their help
OPTIONS = {
    "options.shared": ("kdcache.pipeline.options", "SHARED"),
    "options.producer": ("kdcache.cache_builder.options", "PRODUCER"),
    "options.trainer": ("kdcache.trainer.options", "TRAINER"),
    "options.teacher": ("kdcache.trainer.make_teacher", "TEACHER"),
    "options.launcher": ("kdcache.trainer.launch", "LAUNCHER"),
}

BEGIN = re.compile(r"^<!-- generated: (\S+) \(python -m bench\.docs\) -->$", re.M)
END = "<!-- end: {} -->"


class DocsError(Exception):
    """A generated block cannot be made: an unknown name, a missing end marker, a missing or unreadable report."""


def cell(text):
    """Text as one markdown table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


# -- what each block holds -------------------------------------------------------------------------------------
def other_cores(report):
    """The most cores other processes used during a run, wherever its report keeps it (None if nowhere)."""
    for value in ((report.get("load") or {}).get("other_processes_cores_max"), report.get("other_cores_worst"),
                  (report.get("cpu") or {}).get("other_cores"), report.get("other_processes_cores_mean"),
                  (report.get("cpu_during_teachers") or {}).get("other_cores")):
        if isinstance(value, dict):
            value = max((v for v in value.values() if v is not None), default=None)
        if value is not None:
            return value
    return None


def benchmark_block(name, results):
    module, file = BENCHMARKS[name]
    path = os.path.join(results, file)
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except FileNotFoundError:
        raise DocsError(f"{name}: its report {path} is missing: run python -m {module.split('_report')[0]} "
                        f"(or make bench) first") from None
    except (OSError, ValueError) as e:
        raise DocsError(f"{name}: its report {path} cannot be read ({e}): run python -m {module} again") from None
    mod = importlib.import_module(module)
    # a report gathered from several runs dates them itself: its module's runs_line(report), if it has one
    line = mod.runs_line(report) if hasattr(mod, "runs_line") else run_line(report, other_cores(report))
    return line + "\n\n" + rendered(mod.render(report))


def options_table(options):
    """Markdown: each option's flag, default, allowed values, Make variable and help, as declared."""
    rows = []
    for o in options:
        default = "-" if o.default is None or o.default is False else o.format(o.default)
        allowed = "a flag" if o.action else o.type.allowed()
        rows.append([f"`{o.flag}`" + (f" (`{o.short}`)" if o.short else ""), cell(default), cell(allowed),
                     o.make or "-", cell(o.help)])
    return md_table(["option", "default", "allowed", "Make variable", "what it sets"], rows, pad=False)


def options_block(name, results):
    module, attr = OPTIONS[name]
    return options_table(getattr(importlib.import_module(module), attr))


def registry():
    """Every block's name -> its function of the results folder, returning markdown."""
    blocks = {name: benchmark_block for name in BENCHMARKS}
    blocks.update({name: options_block for name in OPTIONS})
    return blocks


# -- the files ----------------------------------------------------------------------------------------------
def blocks_of(path, text):
    """[(name, start, end, line)] of the generated blocks in text: start and end delimit what lies between the
    two marker lines; line is the first marker's line number."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        if m.start() < pos:
            continue
        name, line = m.group(1), text.count("\n", 0, m.start()) + 1
        end = re.compile("^" + re.escape(END.format(name)) + "$", re.M).search(text, m.end())
        nxt = BEGIN.search(text, m.end())
        if end is None or (nxt is not None and nxt.start() < end.start()):
            raise DocsError(f"{path}:{line}: block {name} has no end line '{END.format(name)}' before the next "
                            f"block: add it after the block")
        out.append((name, m.end() + 1, end.start(), line))
        pos = end.end()
    return out


def regenerate(text, path, results, blocks):
    """(new text, [stale block names]) of one file."""
    out, last, stale = [], 0, []
    for name, start, end, line in blocks_of(path, text):
        if name not in blocks:
            raise DocsError(f"{path}:{line}: no generated block is called {name}: use one of "
                            f"{', '.join(sorted(blocks))}")
        body = "\n" + blocks[name](name, results).rstrip("\n") + "\n\n"
        if text[start:end] != body:
            stale.append(name)
        out += [text[last:start], body]
        last = end
    out.append(text[last:])
    return "".join(out), stale


def run(docs, results, check, also=()):
    """Rewrite (or, with check, compare) every docs/*.md and the files `also` names; returns [(file, stale block)]."""
    blocks, found = registry(), []
    for path in [os.path.join(docs, f) for f in sorted(os.listdir(docs)) if f.endswith(".md")] + list(also):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new, stale = regenerate(text, path, results, blocks)
        found += [(path, name) for name in stale]
        if stale and not check:
            from kdcache.store.osutil import write_atomic
            write_atomic(path, new.encode("utf-8"), fsync=False)  # a stopped run leaves the old page whole
    return found


CLI = [
    Option("--check", "write nothing; exit 1 naming each block that is out of date", action="store_true",
           group="run"),
    Option("--docs", "the manual's folder (default docs/ of this repository)", type=Dir(), metavar="DIR",
           group="run"),
    Option("--results", "the benchmarks' JSON reports (default bench/results/ of this repository)", type=Dir(),
           metavar="DIR", group="run"),
]


def main(argv=None):
    p = Parser(prog="python -m bench.docs", description=__doc__.split("\n\n")[0])
    add_options(p, CLI)
    args = p.parse_args(argv)
    docs = args.docs or os.path.join(ROOT, "docs")
    results = args.results or os.path.join(ROOT, "bench", "results")
    try:
        # the README's generated blocks too, when the manual is this repository's
        stale = run(docs, results, args.check, also=() if args.docs else (os.path.join(ROOT, "README.md"),))
    except DocsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, name in stale:
        rel = os.path.relpath(path)
        if args.check:
            print(f"{rel}: block {name} is out of date: run python -m bench.docs (do not edit it by hand)")
        else:
            print(f"{rel}: block {name} rewritten")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())

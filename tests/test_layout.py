"""The code's layout stays as the README's code map describes it: no import cycles, no MXNet in the store.

Module length is no rule here: files follow seams (where responsibilities part), which a review
judges and a line count cannot."""
import ast
import os

from tests.conftest import ROOT

PACKAGES = ("kdcache", "bench", "tests")
SUBPACKAGES = ("kdcache.store", "kdcache.pipeline", "kdcache.cache_builder", "kdcache.trainer")


def modules():
    """{dotted module name: path} of every project module."""
    out = {}
    for pkg in PACKAGES:
        for root, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(root, f)
    return out


def imports(name, path, known):
    """The project modules `name` imports, at the top or inside functions."""
    tree = ast.parse(open(path).read())
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def test_no_two_modules_import_each_other():
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items()}
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                    if a in graph.get(b, ()) and not (a.startswith(b + ".") or b.startswith(a + "."))})
    assert not pairs, f"modules that import each other: {pairs}"


def test_store_imports_no_mxnet_and_nothing_of_the_other_packages():
    known = modules()
    for name, path in known.items():
        if not in_package(name, "kdcache.store"):
            continue
        deps = imports(name, path, known) | {n for n in ("mxnet",) if f"import {n}" in open(path).read()}
        # kdcache.store's own modules, and kdcache's top-level helpers (kdcache.args, kdcache.signals)
        assert not [d for d in deps if not in_package(d, "kdcache.store")
                    and (not d.startswith("kdcache") or any(in_package(d, p) for p in SUBPACKAGES))], (name, deps)


# The store's folders, lowest first: a module imports only from its own folder or the ones before it
# (the README's code map says what each holds). The ring streams beside the files, on the format alone.
STORE_LAYERS = (("errors", "osutil"), ("format",), ("files", "ring"), ("write",), ("folder",), ("read",), ("derive",))


def store_layer(name):
    part = name.split(".")[2] if name.count(".") >= 2 else None
    for i, layer in enumerate(STORE_LAYERS):
        if part in layer:
            return i
    return None  # the package's face (__init__) and its command line sit above every layer


def test_the_stores_folders_import_only_downwards():
    known = modules()
    up = []
    for name, path in known.items():
        if not in_package(name, "kdcache.store") or store_layer(name) is None:
            continue
        for dep in imports(name, path, known):
            if in_package(dep, "kdcache.store") and (store_layer(dep) is None or store_layer(dep) > store_layer(name)):
                up.append(f"{name} -> {dep}")
    assert not up, f"store modules importing a folder above their own: {up}"
    folders = {d for d in os.listdir(os.path.join(ROOT, "kdcache", "store"))
               if os.path.isfile(os.path.join(ROOT, "kdcache", "store", d, "__init__.py"))}
    assert folders == {p for layer in STORE_LAYERS for p in layer} - {"errors", "osutil"}, folders


def test_nothing_imports_a_main_module_and_each_is_an_entry_point_only():
    """A command's code lives in a module anyone may import (its options, its runs, its entry point); its
    `__main__.py` only calls that entry point, so importing a package's command never runs it."""
    from kdcache.cli import COMMANDS, TEACHER_VERIFY
    known = modules()
    importers = [f"{name} -> {dep}" for name, path in known.items() for dep in imports(name, path, known)
                 if dep.rsplit(".", 1)[-1] == "__main__"]
    assert not importers, f"modules that import a __main__ module: {importers}"
    dispatched = [m for m, _ in COMMANDS.values()] + [TEACHER_VERIFY]
    assert not [m for m in dispatched if m.endswith("__main__")], dispatched
    for name, path in known.items():
        if name.startswith("kdcache.") and name.endswith(".__main__"):
            body = [n for n in ast.parse(open(path).read()).body if not isinstance(n, ast.Expr)]  # the docstring
            assert len(body) == 1 and isinstance(body[0], ast.If), f"{path}: more than the entry point's call"


def in_package(name, pkg):
    return name == pkg or name.startswith(pkg + ".")


# bench/ holds the modules every benchmark shares and one folder per benchmark, nothing else.
BENCH_SHARED = {"__init__.py", "common.py", "cli.py", "flops.py", "docs.py", "paired.py"}
BENCH_FOLDERS = sorted(d for d in os.listdir(os.path.join(ROOT, "bench"))
                       if os.path.isfile(os.path.join(ROOT, "bench", d, "__init__.py")))


def test_bench_holds_its_shared_modules_and_a_folder_per_benchmark():
    flat = {f for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py")}
    assert flat == BENCH_SHARED, f"a benchmark's module outside its folder: {sorted(flat - BENCH_SHARED)}"
    assert {"kd", "store", "codecs", "quality", "decode"} <= set(BENCH_FOLDERS), BENCH_FOLDERS


def test_every_benchmark_is_a_folder_whose_command_goes_through_bench_main():
    for name in BENCH_FOLDERS:
        folder = os.path.join(ROOT, "bench", name)
        for part in ("__init__.py", "run.py", "__main__.py"):
            assert os.path.isfile(os.path.join(folder, part)), f"bench/{name}/{part} is missing"
        assert not os.path.exists(os.path.join(ROOT, "bench", name + ".py")), f"bench/{name}.py beside its folder"
        main = ast.parse(open(os.path.join(folder, "__main__.py")).read())
        calls = {n.func.id for n in ast.walk(main) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "bench_main" in calls, f"bench/{name}/__main__.py does not call bench.cli.bench_main"
        # the folder's __init__ imports nothing: a child (python -m bench.NAME.children) loads only its own part
        init = ast.parse(open(os.path.join(folder, "__init__.py")).read())
        assert ast.get_docstring(init) and not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in init.body), name


def test_every_name_a_benchmarks_command_imports_exists():
    """Each bench/NAME/__main__.py imports its settings from its own modules: every name must be there
    (one re-exported name, dropped as unused from run.py, once broke `python -m bench.producer`)."""
    import importlib
    missing = []
    for name in BENCH_FOLDERS:
        main = ast.parse(open(os.path.join(ROOT, "bench", name, "__main__.py")).read())
        for node in ast.walk(main):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench."):
                module = importlib.import_module(node.module)
                missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    assert not missing, f"bench commands import names their modules lack: {missing}"

"""labkit and the repository's tooling import without cycles: every import in a file counts, a function's too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("labkit", "workbook")


def module_name(path: Path) -> str:
    """Return the dotted module name of a file under ROOT (a package's __init__: the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set) -> set:
    """Return the project modules a file imports anywhere in it (a from-import of a module's name: that module)."""
    out = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:  # labkit.meter.format_bytes -> labkit.meter
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] in PACKAGES:
                out.add(name)
    return out


def graph() -> dict:
    """Return {module: the project modules it imports}, a package's __init__ left out as an importer's target
    (importing labkit.meter runs labkit/__init__ first, but that is no edge of meter's own)."""
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)
    return {m: {i for i in imports_of(p, modules) if i != m and i not in PACKAGES and i != m.rpartition(".")[0]}
            for m, p in files.items()}


def cycles(edges: dict) -> list:
    """Return one cycle (a list of modules, first = last) per strongly connected group of more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_labkit_or_workbook_imports_itself_through_others():
    edges = graph()
    assert "labkit.device" in edges and "labkit.validate" in edges["labkit.device"]  # the graph sees imports
    assert cycles(edges) == []


CORE = {"labkit", "labkit.validate", "labkit.runmode", "labkit.device", "labkit.cpu", "labkit.models", "labkit.example",
        "labkit.meter", "labkit.train", "labkit.estimate", "labkit.throughput", "labkit.results", "labkit.tables",
        "labkit.progress"}  # what a learner's chapters lean on: README's "Reading labkit" table
CORE_MAX_LINES = 2000  # a teacher reads it in an evening (issue 38)


def test_import_labkit_loads_the_core_and_nothing_else():
    import subprocess
    import sys
    code = "import sys, labkit; print(sorted(m for m in sys.modules if m.split('.')[0] in ('labkit', 'workbook')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert set(eval(out)) == CORE


def test_the_core_imports_only_the_core_and_fits_an_evening():
    edges = graph()
    outside = {m: sorted(i for i in edges[m] if i not in CORE) for m in CORE}
    assert {m: i for m, i in outside.items() if i} == {}  # imports at any depth counted, a function's too
    files = {m: ROOT / (m.replace(".", "/") + ("/__init__.py" if m == "labkit" else ".py")) for m in CORE}
    lines = sum(len(p.read_text().splitlines()) for p in files.values())
    assert lines <= CORE_MAX_LINES, f"labkit's core is {lines} lines: move what a chapter does not lean on out of it"


def test_the_readme_lists_the_core():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Reading labkit", 1)[1].split("\n#", 1)[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert listed == CORE - {"labkit"}


WRONG_WAY = {  # (importer, imported): imports that would point up or sideways (issue 38)
    ("labkit.techniques.pipeline", "labkit.dist"),  # schedule arithmetic needs no rank runtime (time_actions lives in labkit.dist)
    ("labkit.techniques.l2l", "labkit.techniques.pipeline"),  # a model's stages are labkit.stages, not the pipeline's
    ("labkit.tools.closing", "labkit.planner"),  # the closing page reads figures, not the planner (RESERVE_FRACTION: gpus)
    ("labkit.tools.closing", "labkit.techniques.pipeline"),
    ("labkit.tools.closing", "labkit.pipelinerun"),
    ("labkit.techniques.pipeline", "labkit.pipelinerun"),  # the schedules know nothing of a measured run (it reads them)
    ("labkit.techniques.pipeline", "labkit.planner"),
    ("labkit.planner", "labkit.search"),  # two applications, each on the core and the chapters' references
    ("labkit.search", "labkit.planner"),
}


def test_the_library_does_not_import_the_repositorys_tooling_and_nothing_points_the_wrong_way():
    edges = graph()
    tooling = {m: sorted(i for i in edges[m] if i.startswith("workbook") or i.startswith("labkit.tools")
                         and not m.startswith("labkit.tools")) for m in edges if m.startswith("labkit")}
    assert {m: i for m, i in tooling.items() if i} == {}
    within = lambda m, package: m == package or m.startswith(package + ".")  # noqa: E731  (a package: its modules)
    wrong = sorted({(a, b) for a, b in WRONG_WAY for m, imported in edges.items()
                    if within(m, a) and any(within(i, b) for i in imported)})
    assert wrong == []


MOVED = {"labkit.plan": "labkit.planner.plan", "labkit.planplot": "labkit.planner.plot",
         "labkit.plancheck": "labkit.planner.check", "labkit.published": "labkit.planner.published",
         "labkit.allocator": "labkit.planner.allocator",  # the planner's old names (issue 38): kept for old imports
         **{f"labkit.{m}": f"labkit.techniques.{m}" for m in ("accumulation", "checkpointing", "precision", "offload",
                                                              "hosttier", "l2l", "pipeline", "zero")}}  # the techniques'


def test_the_old_module_names_warn_and_are_the_moved_modules():
    import subprocess
    import sys
    code = ("import importlib, json, warnings\n"
            f"moved, out = {MOVED!r}, {{}}\n"
            "for old, new in moved.items():\n"
            "    with warnings.catch_warnings(record=True) as seen:\n"
            "        warnings.simplefilter('always')\n"
            "        module = importlib.import_module(old)\n"
            "    out[old] = [module is importlib.import_module(new),\n"
            "                [(w.category.__name__, str(w.message)) for w in seen if new in str(w.message)]]\n"
            "print(json.dumps(out))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    import json
    for old, (same, warned) in json.loads(out).items():
        assert same, f"{old} is not {MOVED[old]}"  # one module object: a monkeypatch on either name reaches both
        assert warned == [["DeprecationWarning", f"{old} moved to {MOVED[old]}; import it from there"]]
    helped = subprocess.run([sys.executable, "-m", "labkit.plan", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert helped.returncode == 0 and "--model" in helped.stdout  # `python -m labkit.plan` still runs the command


def test_nothing_in_the_repository_uses_an_old_module_name():
    import re
    edges = graph()
    assert {m: sorted(set(i) & set(MOVED)) for m, i in edges.items() if m not in MOVED and set(i) & set(MOVED)} == {}
    names = "|".join(m.split(".")[1] for m in MOVED)
    old = re.compile(r"\blabkit\.(" + names + r")\b(?!\.py)|\blabkit/(" + names + r")\.py")  # a name, or its file
    texts = [p for p in ROOT.glob("notebooks/*.ipynb")] + [ROOT / "README.md", ROOT / "Makefile", ROOT / "CONTRIBUTING.md"]
    texts += [p for p in (ROOT / "tests").glob("*.py") if p.name != "test_imports.py"]
    texts += [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if module_name(p) not in MOVED]
    assert {p.name: old.findall(p.read_text()) for p in texts if old.search(p.read_text())} == {}


FUNCTION_MAX_LINES = 80  # issue 38: a function longer than this says why in its docstring ("on purpose")


def test_no_function_runs_past_80_lines_without_saying_why():
    long = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > FUNCTION_MAX_LINES and "on purpose" not in (ast.get_docstring(node) or ""):
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_each_notebooks_labkit_imports_are_in_module_order():
    """CONTRIBUTING's import order in the chapters too: a run of `from labkit...` lines sorted by module."""
    import json
    unsorted = []
    for path in sorted(ROOT.glob("notebooks/*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            run = []
            for line in "".join(cell["source"]).splitlines() + [""]:
                if line.startswith("from labkit"):
                    run.append(line.split()[1])
                    continue
                if run != sorted(run):
                    unsorted.append(f"{path.name} cell {i}: {run}")
                run = []
    assert unsorted == []

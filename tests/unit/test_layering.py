"""The package reads top-down: no import circle, and nothing low imports the layers above it.

Read from the source with ast (every import statement, at module level or inside a function, except
the ones under ``if TYPE_CHECKING:``, which never run), so the check sees a lazy import too.
"""

from __future__ import annotations

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (source root, package): the exporter, and gpuio, the instrumentation library in its own project folder.
PACKAGES = ((REPO, "exporter"), (os.path.join(REPO, "exporter", "instrument"), "gpuio"))
LIBRARY_FOLDER = os.path.join(REPO, "exporter", "instrument")

# The entry points and the web stack: a collector, the library or a parser never imports these.
TOP = {"exporter.cli", "exporter.__main__", "exporter.assemble", "exporter.config", "exporter.web",
       "exporter.web.server", "exporter.web.webconfig", "exporter.web.connections", "exporter.web.api",
       "exporter.tools", "exporter.tools.top", "exporter.tools.top.__main__", "exporter.tools.top.data",
       "exporter.tools.top.iostat", "exporter.tools.top.display", "exporter.tools.engines_cli",
       "exporter.tools.warm_cli", "exporter.tools.remote"}


def modules() -> dict[str, str]:
    """Every module of both packages, name -> path (a C extension's module -> its .c source: it imports none)."""
    found = {}
    for root, package in PACKAGES:
        for folder, folders, files in os.walk(os.path.join(root, package)):
            if folder == os.path.join(REPO, "exporter"):
                folders.remove("instrument")  # the library's project folder: walked as gpuio
            for name in files:
                if name.endswith((".py", ".c")):
                    path = os.path.join(folder, name)
                    parts = os.path.splitext(os.path.relpath(path, root))[0].split(os.sep)
                    if parts[-1] == "__init__":
                        parts.pop()
                    found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            if not _type_checking_only(child):
                stack.append(child)
    return found


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (a submodule named in ``from x import y`` counts as y)."""
    is_package = path.endswith("__init__.py")
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read(), path)
    targets: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            targets.add(submodule if submodule in known else source)
    return {target for target in targets if target in known and target != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) if path.endswith(".py") else set() for name, path in found.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_circle() -> None:
    edges = graph()
    assert "exporter.collectors.diskstats" in edges and edges["exporter.cli"]  # the walk found the package
    assert cycle(edges) is None, " -> ".join(cycle(edges) or [])


def test_the_checker_finds_a_circle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_below_the_entry_points_imports_them() -> None:
    edges = graph()
    upward = {(low, high) for low, targets in edges.items() if low not in TOP
              for high in targets if high in TOP}
    assert upward == set()


def test_the_instrumentation_library_imports_only_itself() -> None:
    """Inference processes import the library: it ships no exporter code (no reader, no collector)."""
    edges = graph()
    library = [name for name in edges if name.split(".")[0] == "gpuio"]
    assert "gpuio.spool" in library
    outside = {(name, target) for name in library for target in edges[name] if target.split(".")[0] != "gpuio"}
    assert outside == set()


def test_the_engine_sources_never_call_up_into_a_collector() -> None:
    """The engine package (the spool, discovery, the model) reads top-down: what the collectors share
    with it (NVML's processes, the spool files read) is handed in as functions and values."""
    edges = graph()
    package = [name for name in edges if name.startswith("exporter.engines.")]
    assert set(package) >= {"exporter.engines.model", "exporter.engines.parse", "exporter.engines.fold",
                            "exporter.engines.spool", "exporter.engines.discovery"}
    upward = {(name, target) for name in package for target in edges[name]
              if target.startswith(("exporter.collect", "exporter.tools.engines_cli", "exporter.tools.warm_cli"))}
    assert upward == set()


def test_the_library_ships_the_spool_writer_but_not_its_reader() -> None:
    defined: set[str] = set()
    for name, path in modules().items():
        if name.split(".")[0] == "gpuio" and path.endswith(".py"):
            with open(path, encoding="utf-8") as file:
                defined |= {node.name for node in ast.parse(file.read()).body
                            if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    assert "SpoolFile" in defined
    assert defined & {"SpoolReader", "Totals", "FileState", "parse", "parse_header", "WriterGpus"} == set()


def test_gpuio_top_reads_data_then_arithmetic_then_screen() -> None:
    """exporter.tools.top: the screen (display) uses the arithmetic (iostat), which uses the data; never back."""
    known = modules()
    names = set(known)
    layers = ["exporter.tools.top.data", "exporter.tools.top.iostat", "exporter.tools.top.display"]
    for rank, name in enumerate(layers):
        above = set(layers[rank + 1:]) | {"exporter.tools.top"}
        assert imports_of(name, known[name], names) & above == set(), name


# The folders of the repository, each above the ones it may import: the generators (deploy/: rules, boards,
# runbooks, manifests) read the exporter's thresholds, never the other way round; dashboards/ holds only the
# JSON Grafana loads (the Python that writes it is deploy/grafana/boards/).
# The benches reuse the tests' recordings and fakes (smartctl outputs, NVML without a GPU).
FOLDERS_BELOW = {"exporter": set(), "deploy": {"exporter"}, "bench": {"exporter", "deploy", "tests"}}


def folder_imports(folder: str) -> set[str]:
    """The top-level folders of this repository that Python files under ``folder`` import."""
    tops = {name for name in os.listdir(REPO) if os.path.isdir(os.path.join(REPO, name))} - {".git"}
    found: set[str] = set()
    for directory, folders, files in os.walk(os.path.join(REPO, folder)):
        folders[:] = [name for name in folders if name not in ("__pycache__", "node_modules", "build")]
        for name in (name for name in files if name.endswith(".py")):
            with open(os.path.join(directory, name), encoding="utf-8") as file:
                tree = ast.parse(file.read())
            for node in _import_nodes(tree):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if not node.level else [])
                found.update(module.split(".")[0] for module in modules)
    return (found & tops) - {folder}


def test_the_folders_import_one_way_down() -> None:
    for folder, allowed in FOLDERS_BELOW.items():
        assert folder_imports(folder) <= allowed, folder
    assert folder_imports("bench") >= {"exporter", "tests"}  # the walk reads imports


def test_deploy_reaches_the_exporter_through_one_module_under_either_name() -> None:
    """deploy/ runs as ``deploy`` in a checkout and as ``gpuio_exporter.deploy`` from the wheel: it names the
    exporter in deploy/exporter_modules.py alone, which imports the thresholds and options by either name."""
    naming = []
    for directory, folders, files in os.walk(os.path.join(REPO, "deploy")):
        folders[:] = [name for name in folders if name != "__pycache__"]
        for name in (name for name in files if name.endswith(".py")):
            with open(os.path.join(directory, name), encoding="utf-8") as file:
                text = file.read()
            if re.search(r"^\s*(from|import) exporter\b", text, re.M):
                naming.append(os.path.relpath(os.path.join(directory, name), REPO))
    assert naming == [os.path.join("deploy", "exporter_modules.py")]


def test_the_dashboards_folder_holds_only_what_grafana_loads() -> None:
    python = [os.path.join(directory, name) for directory, folders, files in os.walk(os.path.join(REPO, "dashboards"))
              if "node_modules" not in directory for name in files if name.endswith(".py")]
    assert python == []


# The command-line tools: what a person runs on a node.  The server and the JSON API serve what they print
# from the modules below them (the engine join), never from a CLI module.
CLIS = {"exporter.cli", "exporter.tools.engines_cli", "exporter.tools.warm_cli", "exporter.tools.top",
        "exporter.tools.top.__main__", "exporter.tools.top.data", "exporter.tools.top.iostat",
        "exporter.tools.top.display"}


def test_neither_the_server_nor_the_api_imports_a_command_line_tool() -> None:
    edges = graph()
    assert "exporter.engine_join" in edges["exporter.web.api"]  # the walk sees the API's rows
    served = {"exporter.web.server", "exporter.web.api", "exporter.web.server_metrics"}
    assert {(name, target) for name in served for target in edges[name] if target in CLIS} == set()


# The host's readers and parsers, and the client of a remote exporter: below the collector framework and
# the web stack, so that a parser is usable (and fuzzed) alone and a client carries no server code.
READERS = {"exporter.host.psi", "exporter.host.cgroups", "exporter.host.blockdev", "exporter.host.mounts",
           "exporter.host.pagecache", "exporter.host.procstat", "exporter.host.smartctl", "exporter.host.nvml_device",
           "exporter.host.hosttext", "exporter.host.abandonable", "exporter.host.lines", "exporter.tools.remote"}
ABOVE_READERS = {"exporter.collect", "exporter.web.webconfig", "exporter.web.server", "exporter.web.connections",
                 "exporter.web.api"}


def test_readers_parsers_and_the_client_import_neither_the_framework_nor_the_web_stack() -> None:
    edges = graph()
    assert set(edges) >= READERS
    assert {(name, target) for name in READERS for target in edges[name] if target in ABOVE_READERS} == set()


# The engine sources: constructed in one place, the engine service, which owns them and hands out
# snapshots; the collector, ``gpuio engines`` and the JSON API render those snapshots.
ENGINE_SOURCES = {"SpoolReader", "EngineFiles", "EngineSelection", "WriterGpus", "find_spools"}


def _constructs_an_engine_source(path: str) -> set[str]:
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    made = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if name in ENGINE_SOURCES or (name == "Discovery" and owner == "discovery"):
            made.add(name)
    return made


def test_the_engine_sources_have_one_owner_the_engine_service() -> None:
    owners = {name for name, path in modules().items() if name.startswith("exporter.")
              and path.endswith(".py") and _constructs_an_engine_source(path)}
    assert owners == {"exporter.engines.service"}
    assert _constructs_an_engine_source(modules()["exporter.engines.service"]) == ENGINE_SOURCES | {"Discovery"}


# The rooms stay livable (issue 42): a class the size of a module is a module's worth of reasons to change.
MAX_CLASS_LINES, MAX_CLASS_ATTRIBUTES = 500, 30


def class_sizes() -> dict[str, tuple[int, int]]:
    """Every class of the exporter (the library aside): module:Class -> (lines, attributes), an attribute
    being a name assigned on ``self`` anywhere in the class or a field annotated in its body."""
    sizes = {}
    for name, path in modules().items():
        if not name.startswith("exporter.") or not path.endswith(".py"):
            continue
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                stored = {sub.attr for sub in ast.walk(node)
                          if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                          and sub.value.id == "self" and isinstance(sub.ctx, ast.Store)}
                fields = {stmt.target.id for stmt in node.body
                          if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
                sizes[f"{name}:{node.name}"] = (node.end_lineno - node.lineno + 1, len(stored | fields))
    return sizes


def test_no_class_of_the_exporter_is_over_500_lines_or_30_attributes() -> None:
    sizes = class_sizes()
    assert "exporter.engines.service:EngineService" in sizes  # the walk reads the classes
    assert {name: size for name, size in sizes.items()
            if size[0] > MAX_CLASS_LINES or size[1] > MAX_CLASS_ATTRIBUTES} == {}

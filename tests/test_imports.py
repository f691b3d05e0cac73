"""The harness's modules import each other without a cycle: every import statement counts, including those inside
functions and under ``if TYPE_CHECKING:``, since each is a dependency all the same."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("evaluate", "presses", "scorers")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports (``from package import module`` names the module)."""
    paths = {module_name(path): path for package in PACKAGES for path in (REPO / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up from this module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base)
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, str] = {}

    def visit(module: str, stack: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target, [*stack, target])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_the_import_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"evaluate.report", "evaluate.report.frame", "presses.eg_chunkkv", "scorers.dropkv"} <= set(graph)
    # `from evaluate import rundir` names the module, `from evaluate.benchmarks import Sample` the package.
    assert {"evaluate.rundir", "evaluate.benchmarks"} <= graph["evaluate.report.runs"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_evaluate_presses_and_scorers():
    assert find_cycle(import_graph()) is None


def test_nothing_imports_the_command_lines_and_results_never_import_their_consumers():
    graph = import_graph()
    entry_points = {"evaluate.report.cli", "evaluate.report.leaderboard", "evaluate.__main__", "evaluate.run.repair"}
    assert entry_points <= set(graph)
    launchers = {"evaluate.report.__main__", "evaluate.score.__main__"}  # python -m evaluate.report, evaluate.score
    assert not {module for module, targets in graph.items() if targets & entry_points and module not in launchers}
    consumers = {*entry_points, "evaluate.report.plots", "evaluate.report.tracking", "evaluate.run.tracking"}
    readers = {module: targets for module, targets in graph.items() if module.startswith("evaluate.report.runs")}
    assert readers and all(not targets & consumers for targets in readers.values())


# The order docs/layout.md draws: each stage imports only the stages before it, and the shared top-level modules
# (errors, rundir, keys, registry, cost_schema) import no stage. Data flows spec -> models -> engine -> run, whose
# recorder scores with score/ and whose closing lines read results as report/ does; report/ imports no run/.
LAYERS = (
    "evaluate.benchmarks",
    "evaluate.points",
    "evaluate.models",
    "evaluate.engine",
    "evaluate.score",
    "evaluate.report",
    "evaluate.run",
)
# The entry points that start a stage's work from the command line: they may import any stage.
COMMANDS = ("evaluate.__main__",)


def in_stage(module: str, *stages: str) -> bool:
    return any(module == stage or module.startswith(stage + ".") for stage in stages)


def test_each_stage_imports_only_the_stages_before_it():
    graph = import_graph()
    for rank, layer in enumerate(LAYERS):
        for module, targets in graph.items():
            if in_stage(module, layer):
                assert not {t for t in targets if in_stage(t, *LAYERS[rank + 1 :])}, module
    shared = {m: t for m, t in graph.items() if m.count(".") == 1 and m.startswith("evaluate.") and m not in COMMANDS}
    shared = {module: targets for module, targets in shared.items() if not in_stage(module, *LAYERS)}
    assert {
        "evaluate.errors",
        "evaluate.rundir",
        "evaluate.settings",
        "evaluate.registry",
        "evaluate.cost_schema",
    } <= set(shared)
    assert not {module: targets & {t for t in targets if in_stage(t, *LAYERS)} for module, targets in shared.items()
                if any(in_stage(t, *LAYERS) for t in targets)}  # fmt: skip
    engine = {module: targets for module, targets in graph.items() if in_stage(module, "evaluate.engine")}
    assert engine and not {t for targets in engine.values() for t in targets if in_stage(t, "evaluate.score")}


def test_the_readers_load_neither_torch_nor_kvpress():
    readers = "evaluate.report.cli, evaluate.report.leaderboard, evaluate.report.plots, evaluate.score.rescore"
    code = f"import sys, {readers}; print(sorted({{'torch', 'kvpress'}} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_docs_layout_names_every_module_and_script():
    """docs/layout.md is where a newcomer finds a concept: every module of evaluate/ and every script, those
    in folders of scripts/ (gpu_check_stages/) included, is in it."""
    layout = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    modules = [path for path in (REPO / "evaluate").rglob("*.py") if path.name != "__init__.py"]
    modules = [path for path in modules if not path.parent.name.endswith("_data")]  # benchmark data, not code
    scripts = [path for path in (REPO / "scripts").rglob("*") if path.is_file() and "__pycache__" not in path.parts]
    unnamed = [str(path.relative_to(REPO)) for path in [*modules, *scripts] if f"`{path.name}`" not in layout]
    assert not unnamed


def test_nothing_past_the_points_reads_the_raw_config():
    """The points stage turns the composed config into typed specs (evaluate/points/resolve.py); every stage after
    it reads those, so only points/, the run's entry (which hands the configs to the resolver) and the command hold
    a DictConfig or read a ``.cfg``; and omegaconf is imported by those four modules alone."""
    readers, importers = [], set()
    for path in (REPO / "evaluate").rglob("*.py"):
        module = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            imported = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            imported += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if any(name.split(".")[0] == "omegaconf" for name in imported):
                importers.add(module)
            if in_stage(module, "evaluate.points", *COMMANDS, "evaluate.run.entry"):
                continue
            names = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
            if "DictConfig" in names or (isinstance(node, ast.Attribute) and node.attr == "cfg"):
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not readers
    assert importers == {"evaluate.__main__", "evaluate.run.entry", "evaluate.points.resolve", "evaluate.points.config"}


def script_imports() -> dict[str, set[str]]:
    """Each file of scripts/ -> the top-level names it imports (scripts/ and scripts/gpu_check_stages/ are on its
    sys.path, so a script imports another by its bare name)."""
    imports = {}
    for path in (REPO / "scripts").rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names.add(node.module or "")
        imports[str(path.relative_to(REPO))] = names
    return imports


def test_presses_and_scorers_stand_alone_as_kvpress_presses():
    """presses/ and scorers/ are presses as kvpress writes them: they import kvpress, torch and each other, never the
    harness, so that a press is usable (and upstreamable) without PressBench."""
    graph = import_graph()
    alone = {module: targets for module, targets in graph.items() if in_stage(module, "presses", "scorers")}
    assert alone and not {
        module: targets for module, targets in alone.items() if any(in_stage(t, "evaluate") for t in targets)
    }


def test_nothing_imports_the_scripts_and_the_scripts_share_only_their_common_modules():
    """The scripts are measurements at the end of the data flow: no module of the harness, its presses or its
    launchers imports one; among themselves they import only what they share: bench_common.py (timing and tables),
    kvpress_evaluation.py (kvpress's own evaluate.py), bench_sweep.py's workloads (bench_revisions.py times them)
    and the GPU check's stages."""
    scripts = {path.stem for path in (REPO / "scripts").rglob("*.py")} | {"gpu_check_stages"}
    for package in (*PACKAGES, "hydra_plugins"):
        for path in (REPO / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
            imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
            assert not {name for name in imported if name.split(".")[0] in {"scripts", *scripts}}, path
    shared = {"bench_common", "kvpress_evaluation", "bench_sweep", "gpu_check_stages"}
    for script, names in script_imports().items():
        assert {name.split(".")[0] for name in names} & scripts <= shared, script


def test_both_engines_implement_the_engine_protocol():
    from evaluate.engine.engine import Engine
    from evaluate.engine.pipeline_engine import PipelineEngine
    from evaluate.engine.pool_engine import PoolEngine

    for engine in (PipelineEngine, PoolEngine):
        assert issubclass(engine, Engine), engine

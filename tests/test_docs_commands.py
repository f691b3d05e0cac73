"""Every command the docs show runs as written: each ``python -m evaluate ...`` (and ``make run``) of README.md and
docs/*.md passes the command-line check, composes, and passes every check a run or sweep makes before it loads a
model; each other entry point's command parses. In process, and without running anything: a command the docs
show is one a reader copies."""

import argparse
import importlib.util
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

import evaluate.points.config
from evaluate.points.config import validate_choices
from evaluate.points.overrides import check_command_line
from evaluate.points.point import PointSpec
from evaluate.points.resolve import checked
from hydra_plugins.pressbench_gpus_launcher.grids_sweeper import expand
from tests.support import CONF_DIR

REPO = CONF_DIR.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What ``make run`` runs (the Makefile's recipe), before its ARGS.
MAKE_RUN = re.search(r"-m evaluate (.*) \$\(ARGS\)", (REPO / "Makefile").read_text()).group(1)
# The docs' placeholders, and what stands for them here.
PLACEHOLDERS = {
    "method=<name>": "method=snapkv",
    "benchmark=<name>": "benchmark=ruler_synth",
    "<ratio>": "0.5",
    "cr=...": "cr=0.5",
    "<run>": "run",
    # Your own config folder (README): one holding scorer/mine.yaml.
    "file:///path/to/conf": f"file://{REPO}/tests/fixtures/own_conf",
}
COMMAND = re.compile(r"(python -m evaluate\S*|make run)(.*)")


def code(text: str) -> list[str]:
    """The Markdown's code: fenced blocks, indented blocks and inline spans, continuation lines joined."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    indented = re.findall(r"(?:^ {4}[^\n]*\n?)+", prose, flags=re.M)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return [block.replace("\\\n", " ") for block in [*fenced, *indented, *spans]]


def commands(path: Path) -> list[str]:
    """The commands of one document, as a reader would paste them: comments and trailing remarks dropped."""
    found = []
    for block in code(path.read_text(encoding="utf-8")):
        for line in block.splitlines():
            match = COMMAND.search(line)
            if match:
                # A console's remark after the command, "   (a sweep: ...)", is not part of it.
                found.append(re.split(r"\s{2,}\(", match.group(0))[0].strip())
    return found


def all_commands() -> list[tuple[str, str]]:
    return [(path.name, command) for path in DOCS for command in commands(path)]


def argv(command: str) -> tuple[str, list[str]]:
    """The module a command runs and its arguments, placeholders filled in and ``make run`` expanded."""
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    words = shlex.split(command, comments=True)
    words = [word for word in words if word != "..." and not re.fullmatch(r"\[[A-Z_]+\]", word)]
    if words[:2] == ["make", "run"]:
        extra = [word.removeprefix("ARGS=") for word in words[2:]]
        return "evaluate", [*shlex.split(MAKE_RUN), *(arg for word in extra for arg in shlex.split(word))]
    assert words[:2] == ["python", "-m"], command
    return words[2], words[3:]


def is_hydra(override: str) -> bool:
    return override.lstrip("+~").startswith(("hydra.", "hydra/"))


def check_evaluate(args: list[str]) -> list[PointSpec]:
    """What ``python -m evaluate args`` checks before it loads a model, for its one run or every sweep point; returns
    the points checked (none for ``--cfg``)."""
    check_command_line(args)
    parsed = get_args_parser().parse_args(args)
    parser = OverridesParser.create()
    task = [override for override in parsed.overrides if not is_hydra(override)]
    fixed = [override.input_line for override in parser.parse_overrides(task) if not override.is_sweep_override()]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        base = compose("config", overrides=[*fixed, *filter(is_hydra, parsed.overrides)], return_hydra_config=True)
        if parsed.cfg:  # --cfg prints the composed config and runs nothing
            return []
        sweeper = base.hydra.sweeper
        jobs = (
            expand(parser, dict(sweeper.params or {}), list(sweeper.get("grids") or []), task)
            if parsed.multirun
            else [task]
        )
        hydra = list(filter(is_hydra, parsed.overrides))  # hydra.searchpath adds config folders to every point
        points = [compose("config", overrides=[*job, *hydra], return_hydra_config=True) for job in jobs]
    for point in points:
        validate_choices(point.hydra.runtime.choices)
        with open_dict(point):
            del point["hydra"]
    return checked(
        [OmegaConf.create(OmegaConf.to_container(point, resolve=True)) for point in points], not parsed.multirun
    )


class Parsed(Exception):
    """Raised once an entry point has parsed its arguments: the test stops it there."""


def check_parses(module: str, args: list[str], monkeypatch) -> None:
    """Run ``python -m module args`` up to its argument parsing (a bad argument exits 2 with argparse's usage)."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *arguments, **keywords):
        parse_args(self, *arguments, **keywords)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(Parsed):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def test_the_docs_show_commands_of_every_entry_point():
    modules = {argv(command)[0] for _, command in all_commands()}
    assert {"evaluate", "evaluate.report", "evaluate.score", "evaluate.report.leaderboard"} <= modules
    assert "evaluate.run.repair" in modules


@pytest.mark.parametrize(("doc", "command"), all_commands())
def test_a_documented_command_runs_as_written(doc, command, monkeypatch):
    # Composing and checking downloads nothing; a press that would download is the docs' to show.
    monkeypatch.setattr(evaluate.points.config, "hub_unreachable", lambda: None)
    module, args = argv(command)
    if module == "evaluate":
        check_evaluate(args)
    elif args:
        check_parses(module, args, monkeypatch)
    else:  # the prose names the entry point
        assert importlib.util.find_spec(module) is not None, module


def test_results_md_sweeps_press_none_beside_several_ratios_as_one_baseline_run(caplog):
    (command,) = [c for c in commands(REPO / "docs" / "results.md") if "-m press=none," in c]
    points = check_evaluate(argv(command)[1])
    (baseline,) = {point.out for point in points if point.method == "no_press"}
    assert len(points) == 9 and baseline.name.startswith("ruler_synth__smollm2-135m__no_press__cr0.00__")
    assert "press=none compresses nothing: cr=0.5,0.7,0.9 is ignored and the sweep runs it once" in caplog.text

"""The command line's overrides, checked against the keys and options the config tree knows, before Hydra composes.

Hydra refuses an unknown key in several lines with exit code 1 and suggests ``+key=value``; with the ``+`` it adds
the key, nothing reads it, and the run goes ahead at the defaults under a new hash, a variant in every report. Here
a key is known when conf/config.yaml or an option of its config group sets it. ``+`` adds only what a constructor
reads: an argument of a node that names a ``_target_`` (``+model.source.weight_scale=3.0``,
``+benchmark.dataset=ID``, ``+press.press.<argument>=...``), which that constructor checks. Everything else, and a
config group option that does not exist (``press=nosuch``), is refused in one line that names the closest known
key or option, for single runs and every point of a ``-m`` sweep alike, before any folder exists. Hydra's own
settings (``hydra.*``, ``hydra/launcher=...``) are left to Hydra.
"""

import importlib.util
from collections.abc import Iterator, Sequence
from difflib import get_close_matches
from functools import cache
from pathlib import Path

import yaml
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override
from hydra.errors import OverrideParseException

from evaluate.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Keys of conf/config.yaml that are Hydra's or the defaults list, not settings.
_NOT_SETTINGS = ("defaults", "hydra")
# kvpress's names for our settings: a command copied from kvpress's runner is pointed at ours.
ALIASES = {"compression_ratio": "cr"}


@cache
def default_setting(key: str) -> object:
    """A top-level setting's default, as conf/config.yaml sets it."""
    return _load(CONF_DIR / "config.yaml")[key]


def _load(path: Path) -> dict:
    """A config file's YAML as plain data (its interpolations as written)."""
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def check_command_line(argv: Sequence[str]) -> None:
    """Refuse the unknown keys and options among the overrides of ``python -m evaluate`` (``argv`` without the
    program name; flags such as ``-m`` and ``--cfg job`` are Hydra's and pass). A ``--config-dir`` adds its
    config groups' options, as Hydra adds them."""
    args = get_args_parser().parse_args(list(argv))
    check_overrides(args.overrides, () if args.config_dir is None else (Path(args.config_dir),))


def check_overrides(overrides: Sequence[str], config_dirs: Sequence[Path] = ()) -> None:
    """Refuse the first override whose key no config sets or whose config group has no such option. The options
    and keys are those of conf/, ``config_dirs`` and the folders ``hydra.searchpath=[...]`` adds (Hydra's way to
    bring your own configs: ``hydra.searchpath=[file:///path/to/conf] scorer=mine``)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as error:
        raise ConfigError(" ".join(str(error).split())) from None
    searched = [
        folder
        for override in parsed
        if override.key_or_group == "hydra.searchpath"
        for folder in _search_path_folders(override.value())
    ]
    _refuse_cr_with_budget(parsed)
    folders = (CONF_DIR, *config_dirs, *searched)
    for override in parsed:
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if key in groups(folders):
            _check_options(override, folders)
        else:
            _check_key(override, folders)


def _refuse_cr_with_budget(parsed: Sequence[Override]) -> None:
    """Refuse ``cr`` given beside a ``budget``: each says how much is kept, and the budget would win silently. Only
    the command line tells a ``cr`` given from conf/config.yaml's default, which every composed config has."""
    given = {override.key_or_group: override for override in parsed if not override.is_delete()}
    budget, cr = given.get("budget"), given.get("cr")
    if budget is None or cr is None or (not budget.is_sweep_override() and budget.value() is None):
        return
    budget_text, cr_text = (override.input_line.partition("=")[2] for override in (budget, cr))
    raise ConfigError(
        f"budget={budget_text} and cr={cr_text} both say how much is kept; give one: budget=N keeps N tokens of each "
        "context, cr=X removes the fraction X of them"
    )


def _search_path_folders(value) -> list[Path]:
    """The folders of a ``hydra.searchpath`` value: ``file://`` paths and ``pkg://`` packages, as Hydra reads them."""
    entries = value if isinstance(value, list) else [value]
    folders = []
    for entry in map(str, entries):
        scheme, _, where = entry.partition("://")
        if scheme == "file":
            folders.append(Path(where).expanduser())
        elif scheme == "pkg":
            spec = importlib.util.find_spec(where.replace("/", "."))
            folders += [Path(location) for location in (spec.submodule_search_locations or [])] if spec else []
        elif not where:  # a bare path is a file:// one for Hydra
            folders.append(Path(entry).expanduser())
    missing = [folder for folder in folders if not folder.is_dir()]
    if missing:
        raise ConfigError(f"hydra.searchpath names {missing[0]}, which is not a folder; give file:///absolute/path")
    return folders


@cache
def groups(folders: tuple[Path, ...] = (CONF_DIR,)) -> dict[str, tuple[str, ...]]:
    """Each config group but Hydra's, with its options: <folder>/<group>/*.yaml of each config folder, and those
    stored in code (method=)."""
    found: dict[str, set[str]] = {}
    for root in folders:
        for folder in root.iterdir():
            if folder.is_dir() and folder.name not in _NOT_SETTINGS:
                found.setdefault(folder.name, set()).update(path.stem for path in folder.glob("*.yaml"))
    for group, options in ConfigStore.instance().repo.items():
        if isinstance(options, dict) and group not in _NOT_SETTINGS:
            found.setdefault(group, set()).update(name.removesuffix(".yaml") for name in options)
    return {group: tuple(sorted(options)) for group, options in found.items()}


@cache
def settings() -> frozenset[str]:
    """The top-level settings of conf/config.yaml: present in every run, so ``+`` never adds one."""
    return frozenset(key for key in _load(CONF_DIR / "config.yaml") if key not in _NOT_SETTINGS)


@cache
def known_keys(folders: tuple[Path, ...] = (CONF_DIR,)) -> frozenset[str]:
    """Every key, dotted (``model.source.seed``), that conf/config.yaml or an option of a config group sets."""
    keys = set(_dotted(_load(CONF_DIR / "config.yaml"), ""))
    for group in groups(folders):
        keys.add(group)
        for path in (path for root in folders for path in (root / group).glob("*.yaml")):
            package = "" if "# @package _global_" in path.read_text(encoding="utf-8") else group
            keys.update(_dotted(_load(path), package))
    return frozenset(keys)


def _dotted(node: dict, prefix: str) -> Iterator[str]:
    for key, value in node.items():
        if not prefix and key in _NOT_SETTINGS:
            continue
        path = f"{prefix}.{key}" if prefix else str(key)
        yield path
        if isinstance(value, dict):
            yield from _dotted(value, path)


def _check_options(override: Override, folders: tuple[Path, ...]) -> None:
    group = override.key_or_group
    if override.is_delete() or isinstance(override.value(), Glob):
        return  # a glob chooses among the options that exist
    values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    options = groups(folders)[group]
    for value in values:
        if value is None or str(value) in options:
            continue
        close = get_close_matches(str(value), options, n=1)
        fix = f"did you mean {group}={close[0]}?" if close else f"the options are {', '.join(options)}"
        raise ConfigError(f"{group}={value} is not an option of {group}; {fix}")


def _check_key(override: Override, folders: tuple[Path, ...]) -> None:
    key, value = override.key_or_group, override.input_line.partition("=")[2]
    adds = override.is_add() or override.is_force_add()
    if key in known_keys(folders):
        if override.is_add() and key in settings():
            raise ConfigError(f"{key} is a setting already; give it without the +: {key}={value}")
        return
    parent, _, argument = key.rpartition(".")
    takes_arguments = bool(parent) and f"{parent}._target_" in known_keys(folders)
    if adds and takes_arguments:
        return  # an argument of the constructor the node names, which refuses one it does not take
    close = _closest(key, folders)
    if close:
        fix = f"did you mean {close}={value}?"
    elif takes_arguments:
        fix = f"+{key}={value} passes {argument} to the constructor of {parent}"
    else:
        fix = "the settings are listed in docs/configuration.md"
    raise ConfigError(f"unknown setting {key}; {fix}")


def _closest(key: str, folders: tuple[Path, ...]) -> str | None:
    """The known key ``key`` most likely meant: the one under the same node whose last name is closest, a sibling
    before a deeper key (``limt``: limit; ``scorer.window``: scorer.press.window_size; kvpress's
    ``compression_ratio``: cr); under a node no config sets, the closest whole key (``source.seed``: model.source.seed).
    """
    parent, _, name = key.rpartition(".")
    if parent and parent not in known_keys(folders):
        close = get_close_matches(key, known_keys(folders), n=1)
        return close[0] if close else None
    under = sorted(
        (known for known in known_keys(folders) if not parent or known.startswith(f"{parent}.")),
        key=lambda known: (-known.count("."), known),
    )
    names = {known.rpartition(".")[2]: known for known in under}  # the shallowest key of each name is kept
    if not parent:
        names.update(ALIASES)
    close = get_close_matches(name, names, n=1)
    return names[close[0]] if close else None

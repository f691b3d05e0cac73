"""The lines a single run ends with: its headline next to the uncompressed score, its files, what to run next."""

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from evaluate import rundir
from evaluate.config import effective_cr, method_name, run_dir

# Overrides that choose the press; the uncompressed run of the same samples drops them.
PRESS_OVERRIDES = ("press=", "press.", "scorer=", "scorer.", "cr=", "+press.", "+scorer.")


def _command_line_overrides() -> list[str]:
    """The run's overrides, the last one of each key only (as Hydra applies them: `make run ARGS=press=none`)."""
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    last = {override.split("=", 1)[0]: override for override in overrides}
    return list(last.values())


def uncompressed_score(cfg: DictConfig, sample_ids: set[str]) -> tuple[float, Path] | None:
    """The headline a finished ``no_press`` run under ``output_dir`` gives on exactly these samples, if one exists."""
    wanted = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("benchmark", "model")}
    for config_path in sorted(Path(cfg.output_dir).glob("*/" + rundir.CONFIG)):
        recorded = rundir.read_yaml(config_path) or {}
        config = recorded.get("config", {})
        if recorded.get("method") != "no_press" or config.get("query_aware") != cfg.query_aware:
            continue
        if any(config.get(key) != value for key, value in wanted.items()):
            continue
        rows = [
            row
            for row in rundir.read_predictions(config_path.parent / rundir.PREDICTIONS)
            if row["id"] in sample_ids and not row.get("error")
        ]
        if {row["id"] for row in rows} == sample_ids:
            return instantiate(cfg.benchmark).score(rows)["score"], config_path.parent
    return None


def run_summary(cfg: DictConfig, metrics: dict) -> str:
    out = run_dir(cfg)
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    kept = [row["kept_ratio"] for row in rows if row.get("kept_ratio") is not None]
    method = method_name(cfg)
    lines = [
        f"{method} at cr {effective_cr(cfg):.2f} on {cfg.benchmark.name} ({cfg.model.name}, {len(rows)} samples): "
        f"score {metrics['score']}"
        + (f", {100 * sum(kept) / len(kept):.1f} % of the KV pairs kept on average" if kept else "")
    ]
    overrides = _command_line_overrides()
    others = [override for override in overrides if not override.startswith(PRESS_OVERRIDES)]
    if method != "no_press":
        found = uncompressed_score(cfg, {row["id"] for row in rows})
        if found is not None:
            lines.append(f"uncompressed, same samples: score {found[0]} ({found[1]})")
        else:
            lines.append(f"uncompressed score of these samples: python -m evaluate {' '.join(['press=none', *others])}")
    lines.append(f"files: {out}/ (predictions.jsonl, metrics.json, run.json, config.yaml)")
    press = [override for override in overrides if override.startswith(("press=", "scorer="))]
    if method == "no_press":
        press = []  # a sweep of ratios means a press that compresses
    lines.append(f"next: python -m evaluate.report {cfg.output_dir}   (tables and plots of every run)")
    sweep = " ".join(["-m", *(press or ["press=chunkkv,eg_chunkkv"]), *others, "cr=0.5,0.7,0.9"])
    lines.append(f"      python -m evaluate {sweep}   (a sweep: one model load, one prefill per context)")
    return "\n".join(lines)

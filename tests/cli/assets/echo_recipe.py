"""A trivial recipe for CLI tests: instantiates its model and writes what it saw."""

import json
from pathlib import Path

from tunesmith.config import instantiate

RUNTIME_ARGS: dict = {}


def main(cfg) -> None:
    layer = instantiate(cfg.model)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"message": cfg.message, "in_features": layer.in_features, "steps": cfg.steps}
    (out / "result.json").write_text(json.dumps(record))

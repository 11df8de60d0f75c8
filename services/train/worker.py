"""The child process of a `SubprocessJob`: `python -m rollgym.train.worker job.json`.

Loads the adapter named in the spec, runs its `fit` on the dataset and writes the artefact to
`artefact.json` (atomically, last), so the parent can tell a finished step from a crashed one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson

from .jobs import ARTEFACT_FILE
from .trainers import TrainConfig, load_adapter


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rollgym.train.worker JOB.json", file=sys.stderr)
        return 2
    spec = orjson.loads(Path(argv[0]).read_bytes())
    config = TrainConfig.model_validate(spec["config"])
    adapter = load_adapter(spec["adapter"])
    artefact = adapter.fit(Path(spec["dataset"]), config)
    target = Path(config.output_dir) / ARTEFACT_FILE
    partial = target.with_suffix(f".tmp{os.getpid()}")
    partial.write_text(artefact.model_dump_json(indent=2))
    partial.replace(target)
    print(f"artefact: {artefact.model_dump_json()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

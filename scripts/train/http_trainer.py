"""A trainer that runs elsewhere, behind HTTP: an example `RemoteTrainer` for `rollgym train`.

The training service is anything that answers three routes (tests/train/test_remote_trainer.py has
a small one):

    POST   {url}/jobs        {"config": TrainConfig, "records": [...]}  -> {"id": "..."}
    GET    {url}/jobs/{id}   -> {"status": "running" | "succeeded" | "failed" | "cancelled",
                                 "artefact": Artefact | null, "error": "..." | null}
    DELETE {url}/jobs/{id}   -> cancels it

In a plan (the service's URL is the adapter's argument; PYTHONPATH=scripts/train):

    optimize: {trainer: "http_trainer:HttpTrainer", data: sft, args: {url: "http://trainer:8080", lr: 1.0e-5}}
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rollgym.train.trainers.base import Artefact, JobStatus, TrainConfig, TrainingFailed


def _call(method: str, url: str, body: Any = None, timeout: float = 30.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as exc:
        raise TrainingFailed(f"{method} {url}: HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}") from None
    except (urllib.error.URLError, TimeoutError) as exc:
        raise TrainingFailed(f"{method} {url}: the training service cannot be reached: {exc}") from None


class HttpJob:
    """A `TrainingJob` on the service."""

    def __init__(self, url: str, job_id: str, poll_s: float = 1.0) -> None:
        self.url, self.job_id, self.poll_s = url, job_id, poll_s
        self._last: dict[str, Any] = {"status": "running"}

    def _fetch(self) -> dict[str, Any]:
        self._last = _call("GET", f"{self.url}/jobs/{self.job_id}")
        return self._last

    def status(self) -> JobStatus:
        return self._fetch()["status"]

    def wait(self, timeout: float | None = None) -> Artefact:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self._fetch())["status"] == "running":
            if deadline is not None and time.monotonic() > deadline:
                raise TrainingFailed(f"job {self.job_id}: still running after {timeout} s")
            time.sleep(self.poll_s)
        if state["status"] != "succeeded":
            raise TrainingFailed(f"job {self.job_id} {state['status']}: {state.get('error') or 'no reason given'}")
        return Artefact.model_validate(state["artefact"])

    def cancel(self) -> None:
        _call("DELETE", f"{self.url}/jobs/{self.job_id}")


class HttpTrainer:
    """`submit` sends the curated records and the config to the service at `config.args["url"]`."""

    def submit(self, dataset: Path, config: TrainConfig) -> HttpJob:
        url = str(config.args.get("url") or "").rstrip("/")
        if not url:
            raise TrainingFailed("http_trainer: optimize.args.url is required (the training service)")
        records = [json.loads(line) for line in Path(dataset).read_text().splitlines() if line.strip()]
        reply = _call("POST", f"{url}/jobs", {"config": config.model_dump(), "records": records})
        return HttpJob(url, str(reply["id"]), poll_s=float(config.args.get("poll_s", 1.0)))

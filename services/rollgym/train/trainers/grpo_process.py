"""One long-lived trainer process per run: the `grpo` adapter sends every step to the same process,
which loads the model once and keeps its optimizer, LR schedule and RNG state from step to step.

    RUN/trainer/trainer.log               the process's output (all ranks)
    RUN/trainer/requests/NNNNNN.json      one per step, in order: the dataset and the TrainConfig
    STEP/train/checkpoint/                what the step left: adapter/ (or model/) + trainer_state.pt (every
                                          `checkpoint_every` steps and the last; between them, what serving reads)
    STEP/train/artefact.json              written last: the step is finished (failed.json: it failed, why)

The process runs apart from the loop (`python -m rollgym.train.trainers.grpo_process RUN/trainer`, under
torchrun with `processes: N`), so a crash or an out-of-memory kill fails the step with the end of its
log, never the loop; the next step starts a new process, which restores the previous step's
checkpoint exactly. A request whose starting point is not the state the process holds (a resumed
run, the guard serving an earlier model again) makes it load that checkpoint first.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import orjson

from ...data.jsonl import write_atomic
from ...processes import die_with_parent
from .jobs import ARTEFACT_FILE, log_cause, own_group_dies_with_parent
from .base import Artefact, JobStatus, TrainConfig, TrainingFailed
from .grpo_config import GRPOConfig
from .progress import ProgressWriter

FAILED_FILE = "failed.json"
STOP_FILE = "stop"
POLL_S = 0.05


def grpo_args(config: TrainConfig) -> GRPOConfig:
    """The step's GRPOConfig: the object the plan parsed, or (a request read back from its file, a caller
    that passed a dict) that object's fields."""
    return config.args if isinstance(config.args, GRPOConfig) else GRPOConfig.model_validate(config.args)


class StepJob:
    """A step handed to the long-lived process: finished when its artefact.json appears."""

    def __init__(self, owner: "LongLivedTrainer", output_dir: Path) -> None:
        self.owner = owner
        self.output_dir = output_dir

    def status(self) -> JobStatus:
        if (self.output_dir / ARTEFACT_FILE).is_file():
            return "succeeded"
        if (self.output_dir / FAILED_FILE).is_file() or not self.owner.alive():
            return "failed"
        return "running"

    def wait(self, timeout: float | None = None) -> Artefact:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status() == "running":
            if deadline is not None and time.monotonic() > deadline:
                raise TrainingFailed(f"grpo: still running after {timeout} s")
            time.sleep(POLL_S)
        artefact_path = self.output_dir / ARTEFACT_FILE
        if artefact_path.is_file():
            return Artefact.model_validate_json(artefact_path.read_bytes())
        failed = self.output_dir / FAILED_FILE
        if failed.is_file():
            raise TrainingFailed(f"grpo: {orjson.loads(failed.read_bytes())['error']}")
        raise TrainingFailed(f"grpo: {self.owner.death()}; end of {self.owner.log}:\n{log_cause(self.owner.log)}")

    def cancel(self) -> None:
        self.owner.close()


class LongLivedTrainer:
    """The `grpo` adapter (a `RemoteTrainer`): submit() hands the step to the run's trainer process,
    starting it on the first step, and again after it died or when the process settings change."""

    # Settings a running process cannot change: another value starts a new process.
    PROCESS_KEYS = ("finetune", "lora", "precision", "gradient_checkpointing", "compile", "threads", "processes",
                    "devices", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_backend")

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.control: Path | None = None
        self.key: Any = None
        self.number = 0
        self.stop_s = 30.0  # how long a polite stop may take: the last step's checkpoint may be written then

    @property
    def log(self) -> Path:
        assert self.control is not None
        return self.control / "trainer.log"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def death(self) -> str:
        code = None if self.process is None else self.process.poll()
        if code is not None and code < 0:
            import signal

            name = signal.Signals(-code).name
            hint = " (the kernel's out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else ""
            return f"the trainer process was killed by {name}{hint}"
        return f"the trainer process exited with status {code}"

    def submit(self, dataset: Path, config: TrainConfig) -> StepJob:
        if not config.run_dir:
            raise TrainingFailed("grpo keeps one trainer process per run: TrainConfig.run_dir is required")
        control = Path(config.run_dir) / "trainer"
        args = grpo_args(config)
        key = (config.base_model, config.seed, args.model_dump(include=set(self.PROCESS_KEYS)))
        if not self.alive() or key != self.key or control != self.control:
            self._start(control, args)
            self.key = key
        self.stop_s = 30.0 if args.checkpoint_every == 1 else 600.0
        output_dir = Path(config.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        for stale in (ARTEFACT_FILE, FAILED_FILE):
            (output_dir / stale).unlink(missing_ok=True)
        request = {"dataset": str(Path(dataset).resolve()), "config": config.model_dump()}
        write_atomic(control / "requests" / f"{self.number:06d}.json", orjson.dumps(request))
        self.number += 1
        return StepJob(self, output_dir)

    def _start(self, control: Path, args: GRPOConfig) -> None:
        self.close()
        (control / "requests").mkdir(parents=True, exist_ok=True)
        for old in (control / "requests").glob("*.json"):
            old.unlink()
        (control / STOP_FILE).unlink(missing_ok=True)
        self.control, self.number = control, 0
        command = launch_command(args, control)
        with self.log.open("ab") as log:
            if args.multi_node:
                others = [n for n in range(args.nnodes) if n != args.node_rank]
                log.write(f"the trainer waits at {args.rdzv_endpoint} for nodes {others}; on each, with "
                          f"{control} on a shared filesystem: {shlex.join(launch_command(args, control, 'NODE'))}"
                          "\n".encode())
                log.flush()
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=own_group_dies_with_parent,
                                            env={**os.environ, **trainer_environment(args, cuda_device_count())})

    def close(self) -> None:
        """Stop the process: asked politely it finishes the request at hand (and checkpoints its last step if
        that was between checkpoints); one that does not stop is sent SIGTERM (torchrun then stops its
        workers), and at last SIGKILL."""
        import signal

        if self.process is None:
            return
        if self.process.poll() is None and self.control is not None:
            (self.control / STOP_FILE).touch()
            for sent in (None, signal.SIGTERM, signal.SIGKILL):
                if sent is not None:
                    os.killpg(self.process.pid, sent)
                try:
                    self.process.wait(timeout=self.stop_s if sent is None else 15)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.process = None


def cuda_device_count() -> int:
    """The CUDA devices this process sees (0 without CUDA); torch's count, which starts no CUDA context."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def trainer_environment(args: GRPOConfig, device_count: int, visible: str | None = None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for the trainer's processes on this node: `devices`, else the first `processes`
    (nothing to set on a CPU). TrainingFailed, naming the key, when the node has fewer devices than
    processes, so no two ranks share a GPU (NCCL refuses that, late)."""
    if device_count == 0:
        return {}
    chosen = args.devices or list(range(args.processes))
    if args.processes > device_count or max(chosen) >= device_count:
        key = "devices" if args.devices else "processes"
        raise TrainingFailed(f"optimize.args.{key}: {args.devices or args.processes} but this node has "
                             f"{device_count} CUDA device(s) (one per process)")
    visible = visible if visible is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(device_count)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(names[i] for i in chosen)}


def launch_command(args: GRPOConfig, control: Path, node_rank: int | str | None = None,
                   python: str = sys.executable) -> list[str]:
    """The command that starts the trainer process(es) on a node: one process plainly; several on one node
    under `torchrun --standalone`; over several nodes, torchrun's c10d rendezvous at `rdzv_endpoint`, which
    every node runs with its own `node_rank` (default: the loop's) and the same control folder."""
    target = ["-m", "rollgym.train.trainers.grpo_process", str(control)]
    if args.processes == 1 and not args.multi_node:
        return [python, *target]
    if not args.multi_node:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank if node_rank is None else node_rank}",
                      f"--rdzv-backend={args.rdzv_backend}", f"--rdzv-endpoint={args.rdzv_endpoint}",
                      f"--rdzv-id={args.rdzv_id}"]
    return [python, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={args.processes}", *target]


# ---------------------------------------------------------------------------- the process


def _next_request(control: Path, number: int) -> dict[str, Any] | None:
    """Every rank waits for request `number` on its own, reading the file (None: asked to stop, or the
    parent is gone). No rank waits in a collective between steps: a collection can outlast the process
    group's timeout (10 min NCCL, 30 min gloo), which would kill the group and the loaded model."""
    path = control / "requests" / f"{number:06d}.json"
    parent = os.getppid()
    while not path.is_file():
        if (control / STOP_FILE).exists() or os.getppid() != parent:
            # A request written just before the stop is still taken: every rank then takes it.
            return orjson.loads(path.read_bytes()) if path.is_file() else None
        time.sleep(POLL_S)
    return orjson.loads(path.read_bytes())


def _same_path(a: str | None, b: str | None) -> bool:
    return bool(a and b) and Path(a).resolve() == Path(b).resolve()  # type: ignore[arg-type]


def serve(control: Path) -> int:
    from .grpo_trainer import DistInfo, PolicyTrainer
    from .trl_trainers import read_records

    die_with_parent(signal.SIGKILL)  # under torchrun, a worker whose launcher died must not wait in a collective forever
    dist = DistInfo()
    dist.init()
    trainer: PolicyTrainer | None = None
    number = 0
    since = 0  # steps since the trainer's last resumable checkpoint
    while True:
        request = _next_request(control, number)
        if request is None:
            if trainer is not None:  # its last step checkpointed, every background write in place
                trainer.finish()
            return 0
        number += 1
        config = TrainConfig.model_validate(request["config"])
        output_dir = Path(config.output_dir)
        started = time.perf_counter()
        try:
            args = grpo_args(config)
            loaded = 0.0
            if trainer is None or trainer.args != args or not _same_path(trainer.checkpoint, config.init_adapter):
                # A new process, other settings, or another starting point than the state held here.
                if trainer is not None:
                    trainer.finish()
                trainer = PolicyTrainer(args, config.base_model, config.seed)
                trainer.load(config.init_adapter)
                loaded, since = trainer.load_s, 0
            trained_from = time.perf_counter()
            metrics = trainer.train_records(read_records(Path(request["dataset"])), ProgressWriter(output_dir))
            train_s = time.perf_counter() - trained_from
            since += 1
            if since >= args.checkpoint_every:  # sharded: AdamW's shards written while the loop collects
                trainer.save_checkpoint(output_dir / "checkpoint", background=True)
                since = 0
            else:
                trainer.save_serving(output_dir / "checkpoint")
            metrics.update(load_s=round(loaded, 3), train_s=round(train_s, 3),
                           checkpoint_s=round(time.perf_counter() - trained_from - train_s, 3))
            serving = None
            if config.export_gguf != "none" and dist.rank == 0:
                serving = _export(trainer, config)
                metrics["export_s"] = round(time.perf_counter() - started - loaded - train_s
                                            - metrics["checkpoint_s"], 3)
            if dist.rank == 0:
                uri = trainer.checkpoint
                artefact = Artefact(kind="full_weights" if args.finetune == "full" else "lora",
                                    uri=str(Path(uri).resolve()), base_model=config.base_model,
                                    version=config.version, metrics={k: float(v) for k, v in metrics.items()},
                                    serving_uri=serving)
                trainer.checkpoint = artefact.uri
                print(f"step {number}: {config.version}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()),
                      flush=True)
                write_atomic(output_dir / ARTEFACT_FILE, artefact.model_dump_json(indent=2).encode())
        except Exception as exc:  # noqa: BLE001 - the step fails with its cause; the process takes the next
            traceback.print_exc()
            sys.stdout.flush()
            if dist.rank == 0:
                cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, TrainingFailed) else str(exc)
                write_atomic(output_dir / FAILED_FILE, orjson.dumps({"error": cause}))
            trainer = None  # its state may be half-updated: the next step loads its starting point again
            if dist.distributed:
                return 1  # the other ranks cannot be trusted to be in step any more


def _export(trainer: Any, config: TrainConfig) -> str:
    from .gguf_export import write_merged_gguf
    from .policy import gguf_of

    template = gguf_of(config.base_model)
    if template is None:
        raise TrainingFailed("export_gguf needs a GGUF base model ('bundled' or a *.gguf file)")
    path = Path(config.output_dir) / f"{config.version}.gguf"
    return str(write_merged_gguf(template, trainer.merged_deltas(), path, config.export_gguf))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rollgym.train.trainers.grpo_process RUN/trainer", file=sys.stderr)
        return 2
    return serve(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

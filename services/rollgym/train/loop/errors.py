"""The one error of `rollgym train` that ends a run: `TrainError`, whose message says which epoch (step)
and phase could not go on, and why. The command prints it and exits 1; every phase raises it (or a
subclass: `run_folder.RunFolderError`) for what it cannot get past."""


class TrainError(RuntimeError):
    """The run cannot go on; the message says which epoch and phase, and why."""


__all__ = ["TrainError"]

"""A torch function mode that catches tensors made on the default device inside the trainer's code.

On CUDA, a tensor the loss or the trainer makes without naming a device lands on the CPU and the first
`index_add_`, indexing or all-reduce with the batch's tensors fails. On a CPU-only machine the same
mistake is invisible, since the default device and the batch's device are both the CPU: this mode
makes it visible by recording every tensor factory that rollgym's trainer code calls without an
explicit `device=` (torch's and transformers' own calls are not judged here)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import rollgym.train.trainers as trainers_package

TRAINER_CODE = str(Path(trainers_package.__file__).resolve().parent)
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
             torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye}
TORCH_CODE = str(Path(torch.__file__).resolve().parent)


class DefaultDeviceFactories(TorchFunctionMode):
    """Records (file:line, factory) for each factory called from the trainer's code without `device=`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename.startswith(TORCH_CODE)
                                         or frame.f_code.co_filename == __file__):
                frame = frame.f_back
            if frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(TRAINER_CODE):
                self.calls.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)

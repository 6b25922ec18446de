"""A checkpoint's payload: its file names, and state in a form `torch.load(weights_only=True)` accepts.

Only tensors, numbers, strings, bools, None, lists, tuples and dicts go in: no pickled classes, so loading a
checkpoint can never run code from it. numpy's RNG state (which holds an ndarray) is stored as a tensor.
Snapshots are deep copies on the CPU: training goes on mutating its own tensors while a background writer
serialises the copy.
"""

from __future__ import annotations

import collections
import random
import sys
from typing import Any

import numpy as np
import torch

import elastic_qa

# Keys of the files in a checkpoint directory. Changing them breaks resuming older checkpoints.
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_FILE = "trainer.pt"


def versions() -> dict[str, str]:
    return {
        "elastic_qa": elastic_qa.__version__,
        "torch": str(torch.__version__),  # a TorchVersion object would not load with weights_only
        "python": sys.version.split()[0],
    }


def cpu_copy(obj: Any, clone: bool = True) -> Any:
    """Deep copy with every tensor cloned to CPU memory: the only training stall. `clone=False` leaves CPU
    tensors as they are (training has stopped: nothing will change them while they are written).

    GPU tensors are copied synchronously (each copy waits for the kernels that produce the tensor): the
    background writer must never read a copy still in flight.
    """
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj.detach().clone() if clone else obj.detach()
        return obj.detach().to("cpu", non_blocking=False)
    if isinstance(obj, dict):
        return {key: cpu_copy(value, clone) for key, value in obj.items()}
    if isinstance(obj, list):
        return [cpu_copy(value, clone) for value in obj]
    if isinstance(obj, tuple):
        return tuple(cpu_copy(value, clone) for value in obj)
    return obj


def rng_state() -> dict[str, Any]:
    """This process's generators: python, numpy, torch CPU and CUDA (when present)."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)  # the default, spelled out for the type checker
    assert isinstance(numpy_state, tuple)  # never the dict form: the global generator is always MT19937
    kind, keys, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        # This rank's own device only (init_distributed made it current): after a regroup the rank may sit
        # on another local device, and its generator state must follow it there.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if isinstance(state.get("cuda"), torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # the current device: this rank's


def check_safe(obj: Any, where: str = "state") -> None:
    """Refuse anything weights_only loading would reject, at save time rather than at resume time."""
    # Exact types: a str or int subclass (torch.__version__ is one) is pickled as its class.
    if obj is None or type(obj) in (bool, int, float, str, torch.dtype) or type(obj) is torch.Tensor:
        return
    if isinstance(obj, torch.nn.Parameter):
        raise TypeError(f"{where}: a Parameter, not a plain tensor")
    # Containers and keys too: a namedtuple, a dict/list subclass, an enum key are pickled as their class.
    # OrderedDict (module state dicts) and torch.Size are on weights_only's allow list.
    if type(obj) in (dict, collections.OrderedDict):
        for key, value in obj.items():
            if type(key) not in (str, int, bool):
                raise TypeError(f"{where}: key {key!r} is not a string or int")
            check_safe(value, f"{where}.{key}")
        return
    if type(obj) in (list, tuple, torch.Size):
        for i, value in enumerate(obj):
            check_safe(value, f"{where}[{i}]")
        return
    raise TypeError(f"{where}: {type(obj).__name__} cannot be loaded with weights_only=True")

"""Where each part of a model computes, for a model on one device or spread by a device map (docs/configuration.md).

A model loaded with ``device_map`` carries accelerate's hooks: each block named in the map runs on its execution
device, inputs are moved there by the hook, and an offloaded block's weights (``cpu`` or ``disk`` in the map, on the
``meta`` device in between) are brought to it only for its forward pass. So a layer's device is its hook's execution
device, not its parameters' (``meta`` when offloaded), and anything the engine runs on a layer's weights outside
the model's forward (a press's ``compress``) must bring them first (:func:`onloaded`).
"""

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from accelerate.utils import align_module_device, has_offloaded_params


def execution_device(module: torch.nn.Module, default: torch.device) -> torch.device:
    """The device ``module`` computes on: its accelerate hook's execution device, else that of its first parameter
    or buffer not offloaded, else ``default``."""
    hook = getattr(module, "_hf_hook", None)
    for part in getattr(hook, "hooks", (hook,)):  # a SequentialHook holds several
        device = getattr(part, "execution_device", None)
        if device is not None:
            return torch.device(device)  # an int is a CUDA index, as in a device map
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return default


def layer_devices(model) -> list[torch.device]:
    """The device each decoder layer computes on, in layer order."""
    return [execution_device(layer, model.device) for layer in model.model.layers]


def input_device(model) -> torch.device:
    """Where the model's input ids go (its embedding's device; ``model.device`` for a model on one device)."""
    return execution_device(model.get_input_embeddings(), model.device)


def cuda_devices(model) -> list[torch.device]:
    """The distinct CUDA devices the model computes on (none on the CPU)."""
    devices = dict.fromkeys([input_device(model), *layer_devices(model)])
    return [device for device in devices if device.type == "cuda"]


def synchronizer(model):
    """A function that waits for the work queued on every CUDA device of ``model`` (nothing to wait for on the CPU),
    so that a timing covers a pass spread over several GPUs."""
    devices = cuda_devices(model)

    def synchronize() -> None:
        for device in devices:
            torch.cuda.synchronize(device)

    return synchronize


@contextmanager
def onloaded(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s offloaded weights brought to their execution device for the block, then offloaded again (nothing
    to do where none is offloaded)."""
    with ExitStack() as stack:
        for part in module.modules():
            if has_offloaded_params(part):
                stack.enter_context(align_module_device(part))
        yield

"""A dispatch mode that records the name of every ATen (or custom) operator a piece of code runs."""

from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """`with OpLog() as log: ...` then `log.names`, e.g. ["aten.mm.default", "cs336.flash_attention_forward.default"]."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))

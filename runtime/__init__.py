"""Generated-kernel runtime: dispatch by shape and the torch ops (`flashgen.runtime.register_all()`
makes `torch.ops.flashgen.<op>` available); the decoder and its engine build on them."""
from flashgen.runtime.dispatch import Decision, Dispatcher
from flashgen.runtime.torch_ops import dispatcher, register_all

__all__ = ["Decision", "Dispatcher", "dispatcher", "register_all"]

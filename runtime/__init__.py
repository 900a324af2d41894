"""Generated-kernel runtime, in three wings: serving kernels to torch (`serving/`: dispatch by shape,
buckets, the torch ops, CUDA graph capture), the decoder that runs whole models on them (`decoder/`:
model, engine, KV cache, sampling, linears in each quant mode, MoE experts, tensor parallel, bench),
and the checkpoint dialects that feed it (`checkpoints/`: config, generation config, RoPE scaling,
weights, pre-quantized formats, tokenizer). `flashgen.runtime.register_all()` makes
`torch.ops.flashgen.<op>` available; the exports load on first use, so that importing one wing's
module (the tuner imports `serving.graphs`) does not import the others."""
from __future__ import annotations

from flashgen.lazy import exports

_EXPORTS = {"Decision": "flashgen.runtime.serving.dispatch", "Dispatcher": "flashgen.runtime.serving.dispatch",
            "dispatcher": "flashgen.runtime.serving.torch_ops", "register_all": "flashgen.runtime.serving.torch_ops"}
__all__ = list(_EXPORTS)
__getattr__ = exports("flashgen.runtime", _EXPORTS)

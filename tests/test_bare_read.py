"""benchmarks/bare_read.py: every tile of the bare read loads each word of a tensor once,
tails included (its programs' XORs fold to the XOR torch computes), in Triton's interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECK = """
import sys
sys.path.insert(0, {bench!r})
import torch
import bare_read as br
g = torch.Generator().manual_seed(7)
tensors = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g) for n in (1, 4096 + 5)]
tensors += [torch.randn(37, 130, generator=g).to(torch.bfloat16), torch.randint(0, 255, (6, 1030), dtype=torch.uint8, generator=g)]
for t in tensors:
    for cfg in {{(c.block, c.steps): c for c in br.CONFIGS}}.values():  # (warps do not change what is read)
        out = br.reader(t, cfg)()
        assert out.numel() == cfg.programs(br.words(t).numel()), (t.shape, cfg)
        assert br.xor_of(out) == br.xor_of(t), (t.shape, cfg)
    dropped = br.words(t).clone()
    dropped[-1] ^= 1  # a word the read skipped would leave the fold unchanged
    assert br.xor_of(dropped) != br.xor_of(t)
print("checked", len(tensors))
"""


def test_every_tile_reads_every_word_once():
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    done = subprocess.run([sys.executable, "-c", CHECK.format(bench=bench)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked 4" in done.stdout

"""Run by tests/test_compile_cache.py in a fresh process: `python -m tests.compile_cache_child CACHE CASES [DEVICE]`.

Enables the persistent compile cache at CACHE, then for each case of CASES (JSON: a list of [rows, backend
options]) compiles a residual RMSNorm + gated-MLP block through the fastgrpo backend (inductor) afresh
(`torch._dynamo.reset()`) and runs a forward and backward. Prints one JSON line: per case the output and input
gradient, and what Dynamo's, AOTAutograd's and inductor's counters counted for it; and the compile cache
warnings of the whole process.
"""
import json
import sys
import warnings

import torch
from torch._dynamo.utils import counters

from fastgrpo.compiler.backend import fastgrpo_backend
from fastgrpo.compiler.cache import CompileCacheWarning, enable_compile_cache

HIDDEN, INTERMEDIATE = 32, 48


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(HIDDEN, eps=1e-6)
        self.gate = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h)) * 0.5


def run_case(rows: int, options: dict, device: str) -> dict:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    block = Block().to(device)
    x = torch.randn(rows, HIDDEN).to(device).requires_grad_()
    out = torch.compile(block, backend=fastgrpo_backend, options={"inner": "inductor", **options})(x)
    out.square().sum().backward()
    return {
        "out": out.detach().double().sum().item(),
        "grad": x.grad.double().sum().item(),
        "counters": {group: dict(counters[group]) for group in ("stats", "aot_autograd", "inductor")},
    }


def main(cache: str, cases: str, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileCacheWarning)
        enable_compile_cache(cache)
        results = [run_case(rows, options, device) for rows, options in json.loads(cases)]
    messages = [str(w.message) for w in caught if issubclass(w.category, CompileCacheWarning)]
    print(json.dumps({"cases": results, "warnings": messages}))


if __name__ == "__main__":
    main(*sys.argv[1:])

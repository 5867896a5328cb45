"""Registers and spills of every Triton kernel launch the ops make, built for sm_90 through a Triton's whole pipeline
(ptxas included) on a machine without a GPU: how many programs an SM holds, and which kernels spill.

    python bench/kernel_resources.py                          # with the GPU machines' Triton (3.6), which .ci/setup
                                                              # installs in .venv/triton-device: its numbers hold there
    python bench/kernel_resources.py --triton DIR             # with the Triton in DIR (pip install --target DIR)
    python bench/kernel_resources.py --only _decode_partial_kernel _nf4_lora_linear_kernel

The launches are those tests/test_triton_compiles_for_cuda.py records (the ops run once through Triton's interpreter
with the launch configurations a GPU would get, at small and at real model dimensions): one process records them,
another builds each distinct one with the chosen Triton and reads its resources with that Triton's cuobjdump. Spills
are the stack bytes a thread. A kernel at 255 registers, or with a stack, is the first suspect when it runs far from
its floor (the rollout's LoRA merge at 8192 elements a program: 255 registers and spills, ~1/8 of the copy rate).
Rows go to bench/results/kernel_resources.jsonl (`triton` names the version that built them).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import _harness as harness  # noqa: E402

_RECORD = r"""
import json, sys
from tests import test_triton_compiles_for_cuda as t
launches = t._record_launches(t._run_every_op) + t._record_launches(t._run_ops_at_model_dims)
json.dump(launches, open(sys.argv[1], "w"))
"""

_BUILD = r"""
import json, os, re, subprocess, sys, tempfile
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from tests.test_triton_compiles_for_cuda import launch_source

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
seen = set()
for launch in json.load(open(sys.argv[1])):
    if sys.argv[2:] and launch["name"] not in sys.argv[2:]:
        continue
    source, constexprs = launch_source(launch)
    key = json.dumps([launch["module"], launch["name"], constexprs, launch["options"]], sort_keys=True, default=str)
    if key in seen:
        continue
    seen.add(key)
    row = dict(kernel=launch["name"], module=launch["module"], options=launch["options"],
               constexprs={k: str(v) if isinstance(v, tl.dtype) else v for k, v in constexprs.items()},
               triton=triton.__version__)
    try:
        built = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(built.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                                   text=True).stdout
        fields = dict(re.findall(r"(REG|STACK):(\d+)", usage))
        row.update(registers=int(fields["REG"]), spill_bytes=int(fields["STACK"]),
                   shared_bytes=built.metadata.shared)
    except Exception as error:  # reported as a row: the build failing is a finding too
        row.update(error=f"{type(error).__name__}: {str(error)[:300]}")
    print("ROW " + json.dumps(row), flush=True)
"""


def record(path: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", _RECORD, path], check=True, cwd=REPO, env=env)


def build(path: str, triton_dir: str | None, only: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (triton_dir, str(REPO), os.environ.get("PYTHONPATH", "")) if p]))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _BUILD, path, *only], check=True, cwd=REPO, env=env,
                          capture_output=True, text=True)
    return [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]


def _short(constexprs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in constexprs.items()
                    if k.isupper() and not k.endswith("DTYPE") and len(str(v)) <= 16)  # (not inline PTX)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton", default=str(REPO / ".venv" / "triton-device"),
                   help="a directory holding the Triton to build with (pip install --target DIR; default: the GPU "
                   "machines' Triton, as .ci/setup installs it)")
    p.add_argument("--only", nargs="+", default=[], metavar="KERNEL", help="only these kernels (function names)")
    args = p.parse_args(argv)
    if not (Path(args.triton) / "triton").is_dir():
        sys.exit(f"no Triton in {args.triton}: run .ci/setup, or pip install --no-deps --target DIR triton==3.6.0 "
                 "and pass --triton DIR")
    with tempfile.TemporaryDirectory() as tmp:
        launches = os.path.join(tmp, "launches.json")
        record(launches)
        rows = build(launches, args.triton, args.only)
    harness.record("kernel_resources", rows, argv)
    rows.sort(key=lambda r: (r.get("error") is None, -r.get("spill_bytes", 0), -r.get("registers", 0)))
    print(harness.markdown_table(
        ("kernel", "warps", "registers", "spill bytes", "constexprs"),
        [(r["kernel"], r["options"].get("num_warps", "-"), r.get("registers", r.get("error", "-")),
          r.get("spill_bytes", "-"), _short(r["constexprs"])) for r in rows]))
    print(f"\n{len(rows)} builds with triton {rows[0]['triton'] if rows else '-'}; "
          f"{sum(1 for r in rows if r.get('spill_bytes'))} spill, {sum(1 for r in rows if 'error' in r)} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The persistent compile cache (fastgrpo.compiler.cache) across processes, by torch's counters (not by time).

Each run is a fresh process (tests/compile_cache_child.py) that compiles a residual RMSNorm + gated-MLP block
through the fastgrpo backend with inductor on the CPU, its cache in a temporary directory; or
(tests/compile_cache_qlora_child.py) that trains and scores bench/grpo_qlora_step.py's tiny 4-bit QLoRA policy.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastgrpo.compiler import cache as compile_cache

ROOT = Path(__file__).resolve().parent.parent
SAME = [4, {}]


def run_child(module: str, *args: str) -> dict:
    """`python -m module *args` in a fresh process; the JSON of its last line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(cache: Path, *cases, device: str = "cpu") -> dict:
    return run_child("tests.compile_cache_child", str(cache), json.dumps(cases), device)


def cache_use(case: dict) -> dict:
    aot, inductor = case["counters"]["aot_autograd"], case["counters"]["inductor"]
    return {"aot_hits": aot.get("autograd_cache_hit", 0), "aot_misses": aot.get("autograd_cache_miss", 0),
            "fx_hits": inductor.get("fxgraph_cache_hit", 0), "fx_misses": inductor.get("fxgraph_cache_miss", 0),
            "bypasses": aot.get("autograd_cache_bypass", 0) + inductor.get("fxgraph_cache_bypass", 0)}


def environment_dir(cache: Path) -> Path:
    (directory,) = cache.iterdir()
    return directory


def copy_of(cold, tmp_path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(cold[0], cache)
    return cache


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A cache filled by one process, and what that process computed."""
    cache = tmp_path_factory.mktemp("compile-cache") / "cache"
    result = run(cache, SAME)
    assert result["warnings"] == []
    return cache, result["cases"][0]


def test_first_process_compiles_and_fills_the_cache(cold):
    cache, case = cold
    assert cache_use(case) == {"aot_hits": 0, "aot_misses": 1, "fx_hits": 0, "fx_misses": 2, "bypasses": 0}
    directory = environment_dir(cache)
    assert directory.name == compile_cache.environment_key()
    manifest = json.loads((directory / compile_cache.MANIFEST).read_text())
    assert any(name.startswith("torch/aotautograd/") for name in manifest)
    assert any(name.startswith("torch/fxgraph/") for name in manifest)


def test_second_process_compiles_nothing_new_and_a_changed_shape_or_option_misses(cold, tmp_path):
    cache = copy_of(cold, tmp_path)
    same, shape, option = run(cache, SAME, [6, {}], [4, {"patterns": ["rms_norm"]}])["cases"]
    # Dynamo traces again (its graph is the cache key); AOTAutograd and inductor load what the first process made.
    assert cache_use(same) == {"aot_hits": 1, "aot_misses": 0, "fx_hits": 2, "fx_misses": 0, "bypasses": 0}
    assert same["counters"]["stats"]["unique_graphs"] == 1
    assert (same["out"], same["grad"]) == (cold[1]["out"], cold[1]["grad"])
    for changed in (shape, option):
        use = cache_use(changed)
        assert use["aot_hits"] == 0 and use["aot_misses"] == 1 and use["fx_misses"] >= 1, use
    assert option["out"] == pytest.approx(same["out"], rel=1e-5)


def _damage(path: Path) -> None:
    path.write_bytes(b"damaged")


@pytest.mark.parametrize("recorded", [True, False], ids=["in-manifest", "written-after-manifest"])
def test_damaged_cache_files_are_removed_with_one_warning_and_rebuilt(cold, tmp_path, recorded):
    """Compiled kernels and generated modules damaged, with the manifest that recorded them (found before any
    compile; with the cache entries and inductor's CPU probe libraries), or without it (each found when it fails
    to load, and compiled again)."""
    cache = copy_of(cold, tmp_path)
    directory = environment_dir(cache)
    if recorded:
        damaged = [*directory.rglob("*.so"), *directory.rglob("c*.py"), *directory.glob("torch/fxgraph/*/*/*"),
                   *directory.glob("torch/aotautograd/*/*")]
    else:
        damaged = [*directory.rglob("*.main.so"), *directory.rglob("c*.py")]
        (directory / compile_cache.MANIFEST).unlink()
    assert damaged
    for path in damaged:
        _damage(path)

    result = run(cache, SAME)
    (case,) = result["cases"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "removed" in result["warnings"][0]
    assert (case["out"], case["grad"]) == (cold[1]["out"], cold[1]["grad"])
    if recorded:  # removed before any compile: what follows is a cold compile, rebuilt as in the first process
        return
    again = run(cache, SAME)  # what failed to load was compiled again and recorded: no warning, all hits
    assert again["warnings"] == []
    assert cache_use(again["cases"][0])["aot_hits"] == 1
    assert (again["cases"][0]["out"], again["cases"][0]["grad"]) == (cold[1]["out"], cold[1]["grad"])


@pytest.mark.gpu
def test_gpu_second_process_loads_graphs_and_triton_kernels(tmp_path):
    """On CUDA the second process compiles nothing either: AOTAutograd and FX graph hits, and Triton's cache (inductor's
    kernels, fastgrpo's own RMSNorm kernel) gains no file: every kernel is loaded, none compiled."""
    cache = tmp_path / "cache"
    first = run(cache, SAME, device="cuda")["cases"][0]

    def triton_files():
        return {p for p in cache.glob("*/triton/**/*") if p.is_file()}

    compiled = triton_files()
    assert compiled
    second = run(cache, SAME, device="cuda")
    assert second["warnings"] == []
    assert cache_use(second["cases"][0]) == {"aot_hits": 1, "aot_misses": 0, "fx_hits": 2, "fx_misses": 0, "bypasses": 0}
    assert (second["cases"][0]["out"], second["cases"][0]["grad"]) == (first["out"], first["grad"])
    assert triton_files() == compiled


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_qlora_layer_graphs_load_from_the_cache_in_a_second_process(tmp_path):
    """A QLoRA layer graph that computes gradients calls bitsandbytes' 4-bit matmul, a custom autograd.Function,
    which AOTAutograd's cache bypasses unless its setting allows them (compiler/cache.py). Neither process
    bypasses; the second loads both layer graphs (with gradients, and the no-grad scoring one) from the cache,
    compiles no inductor graph, and computes the same bits."""
    cache = tmp_path / "cache"
    cold = run_child("tests.compile_cache_qlora_child", str(cache))
    warm = run_child("tests.compile_cache_qlora_child", str(cache))
    assert cache_use(cold)["bypasses"] == 0 and cache_use(warm)["bypasses"] == 0, (cold["counters"], warm["counters"])
    graphs = cold["counters"]["stats"]["unique_graphs"]
    assert graphs == 2 and warm["counters"]["stats"]["unique_graphs"] == graphs
    cold_aot, warm_aot = cold["counters"]["aot_autograd"], warm["counters"]["aot_autograd"]
    assert cold_aot.get("autograd_cache_saved", 0) == graphs, cold_aot
    assert warm_aot.get("autograd_cache_hit", 0) == graphs and warm_aot.get("autograd_cache_saved", 0) == 0, warm_aot
    # No frame compile restarts (a symbolic float specialized in AOTAutograd would make Dynamo trace the layer again
    # after a lookup that misses in every process: compiler/regions.py specializes floats up front).
    assert cold_aot["autograd_cache_miss"] == graphs and warm_aot.get("autograd_cache_miss", 0) == 0, (cold_aot, warm_aot)
    use = cache_use(warm)
    assert use["fx_misses"] == 0 and use["fx_hits"] == cache_use(cold)["fx_misses"], (use, cache_use(cold))
    assert [warm[k] for k in ("hidden", "grads", "scored")] == [cold[k] for k in ("hidden", "grads", "scored")]


def _scaled_grad(scale: float):
    """x * 2 whose backward multiplies the gradient by `scale`: classes alike but for their backward."""

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * scale

    return Scaled


def test_custom_autograd_functions_are_cached_by_their_forward_and_backward():
    """A graph that calls a custom autograd.Function is saved and loaded (not bypassed); one whose function differs
    only in its backward is a miss, so a hit never runs another function's backward."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_inductor_cache

    from fastgrpo.compiler.backend import fastgrpo_backend

    def run(function, scale):
        torch._dynamo.reset()
        counters.clear()
        x = torch.arange(8.0, requires_grad=True)
        compiled = torch.compile(lambda x: function.apply(x).sin(), backend=fastgrpo_backend,
                                 options={"inner": "inductor"})
        compiled(x).sum().backward()
        torch.testing.assert_close(x.grad, (x * 2).cos().detach() * scale)
        return {key: counters["aot_autograd"][key]
                for key in ("autograd_cache_bypass", "autograd_cache_miss", "autograd_cache_hit")}

    doubled, tripled = _scaled_grad(2.0), _scaled_grad(3.0)
    with fresh_inductor_cache():
        assert run(doubled, 2.0) == {"autograd_cache_bypass": 0, "autograd_cache_miss": 1, "autograd_cache_hit": 0}
        assert run(doubled, 2.0) == {"autograd_cache_bypass": 0, "autograd_cache_miss": 0, "autograd_cache_hit": 1}
        assert run(tripled, 3.0) == {"autograd_cache_bypass": 0, "autograd_cache_miss": 1, "autograd_cache_hit": 0}


def test_environment_key_follows_every_version_and_fastgrpo_source(monkeypatch):
    key = compile_cache.environment_key()
    for name in ("python", "torch", "triton", "transformers", "fastgrpo"):
        changed = {**compile_cache.environment(), name: "other"}
        monkeypatch.setattr(compile_cache, "environment", lambda changed=changed: changed)
        assert compile_cache.environment_key() != key, name
        monkeypatch.undo()
    assert compile_cache.environment()["fastgrpo"] == compile_cache.source_hash()


def test_cache_key_tag_keeps_the_users_tag():
    with torch.compiler.config.patch(cache_key_tag="mine"):
        with compile_cache.tagged_cache_keys():
            assert torch.compiler.config.cache_key_tag == f"mine|{compile_cache.cache_key_tag()}"
            with compile_cache.tagged_cache_keys():  # nested: added once
                assert torch.compiler.config.cache_key_tag == f"mine|{compile_cache.cache_key_tag()}"
        assert torch.compiler.config.cache_key_tag == "mine"


def test_setting_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "root"))
    assert compile_cache.resolve_root(None) == tmp_path / "root" / "compile"
    assert compile_cache.resolve_root(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.resolve_root(None) == tmp_path / "env"
    for off in ("off", "OFF", "none", "0", False):
        assert compile_cache.resolve_root(off) is None
    with pytest.raises(ValueError, match="'off'"):
        compile_cache.resolve_root(" ")


def test_only_the_most_recent_environments_are_kept(tmp_path):
    """Beyond the most recently used, environments unused for a day are removed; newer ones are left (another
    fastgrpo tree's run may be using them), and so is what is not an environment directory."""
    now = time.time()
    ages = [3600 * hours for hours in (1, 2, 30, 3, 40)]  # two beyond the kept ones are older than a day
    for i, age in enumerate(ages):
        old = tmp_path / f"env-{i}"
        old.mkdir()
        (old / compile_cache.ENVIRONMENT).write_text("{}")
        os.utime(old / compile_cache.ENVIRONMENT, (now - age, now - age))
    (tmp_path / "not-ours").mkdir()
    compile_cache._prune(tmp_path, keep=tmp_path / "current")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env-0", "env-1", "env-3", "not-ours"]


def test_cuda_graphs_skip_the_host_cpu_vector_probe():
    """A graph on CUDA compiles its host code (if any) without probing the CPU's vector instructions; a CPU graph
    and a user's own setting are left alone."""
    from torch._inductor import config as inductor_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fastgrpo.compiler.backend import cpu_vector_probe_off

    with FakeTensorMode():
        on_cuda = torch.empty(2, device="cuda")
    assert cpu_vector_probe_off([on_cuda, 3]) == {"cpp.vec_isa_ok": False}
    assert cpu_vector_probe_off([torch.zeros(2), 3]) == {}
    with inductor_config.patch({"cpp.vec_isa_ok": True}):  # (monkeypatch's undo deletes a config entry it set)
        assert cpu_vector_probe_off([on_cuda]) == {}


def test_combo_kernels_on_cuda_graphs_where_asked(monkeypatch):
    """Combo kernels are asked of inductor for graphs on CUDA only, by the option or, when it is unset, unless
    $FASTGRPO_COMBO_KERNELS=0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fastgrpo.compiler.backend import combo_kernels
    from fastgrpo.compiler.options import Options

    with FakeTensorMode():
        on_cuda = torch.empty(2, device="cuda")
    monkeypatch.delenv("FASTGRPO_COMBO_KERNELS", raising=False)
    assert combo_kernels(Options(), [on_cuda]) == {"combo_kernels": True}
    assert combo_kernels(Options(), [torch.zeros(2)]) == {}
    assert combo_kernels(Options(combo_kernels=False), [on_cuda, 3]) == {}
    monkeypatch.setenv("FASTGRPO_COMBO_KERNELS", "0")
    assert combo_kernels(Options(), [on_cuda]) == {}
    assert combo_kernels(Options(combo_kernels=True), [on_cuda]) == {"combo_kernels": True}


def test_graphs_calling_the_attention_pass_functions_are_cached():
    """A graph whose SDPA call the attention pass reroutes (through a Python function of fastgrpo's) is saved and
    loaded by AOTAutograd's cache, not bypassed: on CUDA every decoder layer's training graph has one."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_inductor_cache

    from fastgrpo.compiler.backend import fastgrpo_backend
    from fastgrpo.compiler.report import fusion_reports

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    def run():
        torch._dynamo.reset()
        counters.clear()
        q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i)).requires_grad_()
                   for i in range(3))
        compiled = torch.compile(attend, backend=fastgrpo_backend,
                                 options={"inner": "inductor", "keep_attention_output": True})
        compiled(q, k, v).backward()
        copies = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.testing.assert_close(q.grad, torch.autograd.grad(attend(*copies), copies[0])[0])
        return {key: counters["aot_autograd"][key]
                for key in ("autograd_cache_bypass", "autograd_cache_miss", "autograd_cache_hit")}

    with fresh_inductor_cache():
        assert run() == {"autograd_cache_bypass": 0, "autograd_cache_miss": 1, "autograd_cache_hit": 0}
        assert any(r["patterns"]["attention"]["matched"] for r in fusion_reports())  # the pass did reroute it
        assert run() == {"autograd_cache_bypass": 0, "autograd_cache_miss": 0, "autograd_cache_hit": 1}

"""The `fastgrpo` torch.compile backend.

Dynamo hands over a forward-only, pre-autograd torch-level graph. The passes rewrite the
patterns they know into `fastgrpo::` custom ops (each with its own recomputing backward), and
attention calls into SDPA calls that prefer cuDNN's kernel where it runs; the report records what
matched, and the rewritten graph goes on to the inner compiler: inductor by default, so
everything we do not match is compiled as usual.
"""
import copy
import os
import warnings

import torch
from torch import fx

from fastgrpo.compiler.cache import (cacheable_autograd_functions, cacheable_pass_functions, recovering,
                                     tagged_cache_keys)
from fastgrpo.compiler.options import Options
from fastgrpo.compiler.report import format_reports, new_report, publish
from fastgrpo.passes import PASSES, autocast, linear_forms
from fastgrpo.passes._fx import all_graph_modules, error_summary, is_kind


def _on_cuda(example_inputs) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def _kernels_used(example_inputs) -> str:
    if _on_cuda(example_inputs):
        return "triton (cuda)"
    return "torch (cpu: no CUDA tensors in this graph)"


class PassFailedWarning(UserWarning):
    """A pattern pass raised on a graph: that graph's rewrites by the pass were undone, and the fusion report lists
    it as not accelerated with the error."""


def _copy_graph(sub: fx.GraphModule) -> fx.Graph:
    """A copy of the graph's nodes to put back (example values are shared, not copied)."""
    before = copy.deepcopy(sub.graph)
    for node, copied in zip(sub.graph.nodes, before.nodes):
        # What Dynamo sets on a node besides its meta (a placeholder's source), which a copy leaves out; a Node's
        # own fields (in its __dict__ on torches whose Node is plain Python) are the copy's already.
        for key, attribute in vars(node).items():
            if key not in vars(copied):
                setattr(copied, key, attribute)
    return before


def _apply_pass(name: str, sub: fx.GraphModule, record, opts: Options) -> None:
    """Runs one pass on one graph, through the contract stated in passes/__init__.py. If it raises, the graph is put
    back as it was before the pass, the sites it recorded there are dropped and the error is reported and warned about. A bug in one pattern then costs that
    pattern on that graph, not the user's run."""
    before, sites = _copy_graph(sub), len(record.sites)
    try:
        PASSES[name].apply(sub, record, opts)
    except Exception as error:
        sub.graph = before  # the setter recompiles the module's code
        del record.sites[sites:]
        reason = f"the pass raised {error_summary(error)}"
        record.miss("(whole graph)", f"{reason}; this graph compiles without this pattern")
        warnings.warn(f"fastgrpo: pattern {name!r} {reason}. The graph compiles without it (see "
                      "fastgrpo.fusion_reports()); please report this with the model's name.", PassFailedWarning,
                      stacklevel=2)


def _write_linears(sub: fx.GraphModule) -> None:
    """Matmul and einsum spellings of a linear written as `F.linear` (passes/linear_forms.py); should that raise,
    the graph is put back as it was and the patterns see those products as written, with a warning."""
    if not any(is_kind(node, "matmul", "addmm", "einsum") for node in sub.graph.nodes):
        return
    before = _copy_graph(sub)
    try:
        linear_forms.apply(sub)
    except Exception as error:
        sub.graph = before
        warnings.warn(f"fastgrpo: reading matmuls as linears raised {error_summary(error)}; this graph's patterns "
                      "see them as written. Please report this with the model's name.", PassFailedWarning,
                      stacklevel=2)


def cpu_vector_probe_off(example_inputs) -> dict:
    """Inductor config for a graph on CUDA: no probing of the host CPU's vector instructions.

    Inductor validates each vector ISA the CPU reports (AMX, AVX-512, AVX2) by compiling a C++ probe and loading it
    in a child Python process (on torch 2.11 one `import torch` each: ~5 s a probe), once per process, whenever a
    graph needs C++ (a host-side kernel) or its FX-cache entry is looked up. On an H200 host that was 25-50 s of the
    first step, cold or warm (`bench/grpo_train_step.py --profile-first`). A CUDA graph's host code, if any, is
    scalar bookkeeping: it compiles without vector instructions. A user's `TORCHINDUCTOR_VEC_ISA_OK` or
    `config.cpp.vec_isa_ok` wins."""
    from torch._inductor import config as inductor_config

    if not _on_cuda(example_inputs) or inductor_config.cpp.vec_isa_ok is not None:
        return {}
    return {"cpp.vec_isa_ok": False}


def combo_kernels(options: Options, example_inputs) -> dict:
    """Inductor config turning combo kernels on for a graph on CUDA, where `options.combo_kernels` (None: unless
    $FASTGRPO_COMBO_KERNELS=0) asks for them; a user's `inductor_config` wins."""
    wanted = options.combo_kernels
    if wanted is None:
        wanted = os.environ.get("FASTGRPO_COMBO_KERNELS", "1") != "0"
    return {"combo_kernels": True} if wanted and _on_cuda(example_inputs) else {}


def _inner_compiler(options: Options, mode: str | None):
    if options.inner == "eager":
        return lambda gm, example_inputs: gm.forward
    if options.inner == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    config = dict(list_mode_options(mode)) if mode else {}
    config.update(options.inductor_config)
    # Cache keys carry fastgrpo's source hash, and a damaged cache file is recompiled, not fatal (compiler/cache.py);
    # the inner compile is wrapped too, for the backward that AOTAutograd may compile later, outside this call.
    # Graphs that call custom autograd functions (bitsandbytes' 4-bit matmul) are cached as well.
    inner = recovering(compile_fx_inner)

    def compile(gm, example_inputs):
        patches = {**cpu_vector_probe_off(example_inputs), **combo_kernels(options, example_inputs), **config}
        with tagged_cache_keys(), cacheable_autograd_functions(), cacheable_pass_functions():
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    return compile


def fastgrpo_backend(gm: fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """Registered as `torch.compile(..., backend="fastgrpo")` through the `torch_dynamo_backends` entry point."""
    opts = Options.parse(options)
    report = new_report(_kernels_used(example_inputs), opts.inner)
    if opts.patterns:
        for sub in all_graph_modules(gm):
            _write_linears(sub)
    ambient = autocast.ambient_autocast(example_inputs)
    if ambient is not None and opts.patterns:
        device, to = ambient
        count = sum(autocast.apply(sub, device, to) for sub in all_graph_modules(gm))
        report.autocast = f"{str(to).removeprefix('torch.')} on {device}, casts written into {count} matmuls"
    for name in opts.patterns:
        record = report.record(name)
        for sub in all_graph_modules(gm):
            _apply_pass(name, sub, record, opts)
    compiled = _inner_compiler(opts, mode)(gm, example_inputs)
    # Only a graph that compiled is reported: Dynamo abandons a compile whose inner compiler asks it to restart
    # its analysis (e.g. after specializing a symbolic float such as PEFT's LoRA scaling) and traces again.
    publish(report)
    if opts.print_report:
        print(format_reports([report.as_dict()]))
    return compiled

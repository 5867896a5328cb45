"""fastgrpo::gated_mlp and fastgrpo::act_mul against float64 references, HF modules and PEFT
(torch path and Triton path)."""
import contextlib
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torch.utils._python_dispatch import TorchDispatchMode

from fastgrpo.kernels import _lora_gemm, _row_chunks
from fastgrpo.kernels._dispatch import triton_on_cpu
from fastgrpo.kernels.act_mul import act_mul
from fastgrpo.kernels.gated_mlp import gated_mlp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the largest reference magnitude. Low-precision results round g and u to the base
# dtype before the activation, as HF + PEFT do; a missing scale, sign or factor is off by O(1).
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
ACTIVATIONS = ["silu", "gelu_tanh"]
# The Triton interpreter evaluates sigmoid's exp(-x) in numpy, which warns on overflow to inf (harmless).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def path_ctx(path):
    """"torch": CPU torch implementation; "triton": Triton kernels through the interpreter on CPU
    tensors; "cuda": CUDA tensors (Triton kernels compiled for the GPU)."""
    return triton_on_cpu() if path == "triton" else contextlib.nullcontext()


@contextlib.contextmanager
def rows_per_chunk(rows):
    """Force gated_mlp to walk x in chunks of `rows` rows (None: its own sizing, one chunk at test sizes)."""
    previous, _row_chunks.ROWS_PER_CHUNK = _row_chunks.ROWS_PER_CHUNK, rows
    try:
        yield
    finally:
        _row_chunks.ROWS_PER_CHUNK = previous


def act64(t, activation):
    return F.silu(t) if activation == "silu" else F.gelu(t, approximate="tanh")


class _RoundGrad(torch.autograd.Function):
    """Identity whose backward rounds the gradient to `dtype`."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).double(), None


def rounded(t, dtype):
    """float64 t rounded to `dtype` as the base model stores it, and its gradient rounded the same
    way (HF + PEFT keep g, u and their gradients in the model's dtype)."""
    return _RoundGrad.apply(t + (t.to(dtype).double() - t).detach(), dtype)


def ref_gated_mlp(x, w_gate, w_up, ga, gb, ua, ub, scale, activation, dtype, lora_dtype, down=None):
    """HF + PEFT in float64, rounding each intermediate PEFT materialises (and its gradient) to the
    dtype PEFT holds it in; only the op's own fp32 accumulation and final rounding then differ.
    down: None, or (w_down, A, B, scale) of the down projection (A, B None without LoRA)."""

    def proj(inp, w, a, b, s):
        y = rounded(inp @ w.T, dtype)
        if a is not None:
            xa = rounded(inp @ a.T, lora_dtype)
            y = y + rounded(rounded(xa @ b.T, lora_dtype) * s, lora_dtype)
        return rounded(y, dtype)

    h = act64(proj(x, w_gate, ga, gb, scale), activation) * proj(x, w_up, ua, ub, scale)
    return h if down is None else proj(rounded(h, dtype), *down)


def assert_close(actual, expected, dtype, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(expected.double().abs().max().item() if expected.numel() else 0.0, 1e-3)
    assert err <= TOL[dtype] * scale, f"{what}: max abs err {err:.3e} > {TOL[dtype]} * {scale:.3e}"


def make_mlp(c, device="cpu"):
    """Inputs for one case: x (possibly a non-contiguous view), weights (possibly row slices of a
    fused gate_up weight), LoRA factors per the case's layout."""
    gen = torch.Generator().manual_seed(c["seed"])
    dtype, hidden, inter, rank = c["dtype"], c["hidden"], c["inter"], c["rank"]
    lora_dtype = torch.float32 if c["fp32_adapters"] else dtype

    def rand(*shape, std=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * std).to(dt).to(device)

    rows = c["rows"]
    if c["x_transposed"]:
        x = rand(hidden, rows, 2).transpose(0, 1)[..., 0]  # [rows, hidden] with strides (2, 2 * rows)
        x = x.reshape(1, rows, hidden) if c["x_3d"] else x
    else:
        x = rand(1, rows, hidden) if c["x_3d"] else rand(rows, hidden)
    w_std = hidden**-0.5
    if c["fused"]:
        w_gate_up = rand(2 * inter, hidden, std=w_std)
        w_gate, w_up = w_gate_up[:inter], w_gate_up[inter:]
        leaves = [w_gate_up]
    else:
        w_gate, w_up = rand(inter, hidden, std=w_std), rand(inter, hidden, std=w_std)
        leaves = [w_gate, w_up]
    ga = gb = ua = ub = None
    lora = c["lora"]
    if lora in ("gate", "both", "shared_a"):
        ga, gb = rand(rank, hidden, std=w_std, dt=lora_dtype), rand(inter, rank, std=0.5, dt=lora_dtype)
    if lora in ("up", "both"):
        ua, ub = rand(rank, hidden, std=w_std, dt=lora_dtype), rand(inter, rank, std=0.5, dt=lora_dtype)
    if lora == "shared_a":  # LoRA on a fused gate_up_proj: one A, B split by rows
        b = rand(2 * inter, rank, std=0.5, dt=lora_dtype)
        gb, ua, ub = b[:inter], ga, b[inter:]
    return x, w_gate, w_up, leaves, (ga, gb, ua, ub)


def make_down(c, device="cpu"):
    """The case's down projection as [w_down, A, B] (A, B None without LoRA), or None."""
    if c.get("down", "none") == "none":
        return None
    gen = torch.Generator().manual_seed(c["seed"] + 2)
    lora_dtype = torch.float32 if c["fp32_adapters"] else c["dtype"]
    std = c["inter"] ** -0.5

    def rand(*shape, std, dt):
        return (torch.randn(*shape, generator=gen) * std).to(dt).to(device)

    w_down = rand(c["hidden"], c["inter"], std=std, dt=c["dtype"])
    if c["down"] == "plain":
        return [w_down, None, None]
    return [w_down, rand(c["rank"], c["inter"], std=std, dt=lora_dtype), rand(c["hidden"], c["rank"], std=0.5, dt=lora_dtype)]


def run_mlp(c, x, w_gate, w_up, factors, down):
    """gated_mlp on one case's inputs, with its down projection (scale 0.75) and save mode."""
    w_down, da, db = down if down is not None else (None, None, None)
    return gated_mlp(x, w_gate, w_up, *factors, c["scale"], c["activation"], w_down, da, db, 0.75,
                     c.get("save_projections", False))


def mlp_leaves(c, device="cpu"):
    """make_mlp's and make_down's inputs with gradients required per the case:
    (x, w_gate, w_up, factors, down, leaves)."""
    x, w_gate, w_up, weight_leaves, factors = make_mlp(c, device)
    down = make_down(c, device)
    if down is not None:
        weight_leaves = [*weight_leaves, down[0]]
    x = x.detach().requires_grad_(c["x_grad"])
    for w in weight_leaves:
        w.requires_grad_(c["train_base"])
    lora_leaves = []
    for f in factors:
        if f is not None and f._base is None and not any(f is t for t in lora_leaves):
            lora_leaves.append(f.requires_grad_())
    if c["lora"] == "shared_a":
        b_full = factors[1]._base.requires_grad_()
        factors = (factors[0], b_full[: c["inter"]], factors[0], b_full[c["inter"]:])
        lora_leaves.append(b_full)
    if down is not None and down[1] is not None:
        lora_leaves += [down[1].requires_grad_(), down[2].requires_grad_()]
    leaves = ([x] if c["x_grad"] else []) + (weight_leaves if c["train_base"] else []) + lora_leaves
    if c["fused"]:
        w_gate, w_up = weight_leaves[0][: c["inter"]], weight_leaves[0][c["inter"]:]
    else:
        w_gate, w_up = weight_leaves[:2]
    return x, w_gate, w_up, factors, down, leaves


def check_mlp(c, path, device="cpu"):
    x, w_gate, w_up, factors, down, leaves = mlp_leaves(c, device)
    dtype = c["dtype"]
    scale, activation = c["scale"], c["activation"]
    with path_ctx(path), rows_per_chunk(c["rows_per_chunk"]):
        h = run_mlp(c, x, w_gate, w_up, factors, down)
    width = c["inter"] if down is None else c["hidden"]
    assert h.dtype == dtype and h.shape == (*x.shape[:-1], width) and h.is_contiguous()

    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    sub = {id(t): t64 for t, t64 in zip(leaves, leaves64)}

    def to64(t):
        if t is None:
            return None
        if id(t) in sub:
            return sub[id(t)]
        if t._base is not None and id(t._base) in sub:  # row slice of a fused leaf
            base64 = sub[id(t._base)]
            return base64.as_strided(t.shape, t.stride(), t.storage_offset() - t._base.storage_offset())
        return t.detach().double()

    lora_dtype = torch.float32 if c["fp32_adapters"] else dtype
    down64 = None if down is None else (*(to64(t) for t in down), 0.75)
    ref = ref_gated_mlp(to64(x), to64(w_gate), to64(w_up), *(to64(f) for f in factors), scale, activation, dtype,
                        lora_dtype, down64)
    assert_close(h, ref, dtype, "h")
    if not leaves:
        return
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    dh = torch.randn(*reversed(h.shape), generator=gen).to(dtype).to(device).permute(*reversed(range(h.dim())))
    with path_ctx(path), rows_per_chunk(c["rows_per_chunk"]):
        grads = torch.autograd.grad(h, leaves, dh)
    grads64 = torch.autograd.grad(ref, leaves64, dh.double())
    for leaf, got, want in zip(leaves, grads, grads64):
        assert got.dtype == leaf.dtype
        assert_close(got, want, dtype, f"grad of {tuple(leaf.shape)} {leaf.dtype}")


def mlp_cases(chunk_rows):
    """Random cases; rows_per_chunk None runs one chunk, a number forces chunks of that many rows."""
    return st.fixed_dictionaries(dict(
        seed=st.integers(0, 2**16),
        rows=st.integers(1, 70),
        hidden=st.integers(1, 33),
        inter=st.integers(1, 45),
        rank=st.integers(1, 9),
        dtype=st.sampled_from(DTYPES),
        fp32_adapters=st.booleans(),
        lora=st.sampled_from(["none", "gate", "up", "both", "shared_a"]),
        fused=st.booleans(),
        x_transposed=st.booleans(),
        x_3d=st.booleans(),
        x_grad=st.booleans(),
        train_base=st.booleans(),
        scale=st.sampled_from([0.5, 2.0]),
        activation=st.sampled_from(ACTIVATIONS),
        rows_per_chunk=st.sampled_from(chunk_rows),
        down=st.sampled_from(["none", "plain", "lora"]),
        save_projections=st.booleans(),
    ))


@settings(max_examples=40, deadline=None)
@given(c=mlp_cases([None, 4, 16]))
def test_gated_mlp_torch_path(c):
    check_mlp(c, "torch")


@settings(max_examples=25, deadline=None)
@given(c=mlp_cases([None, 16]))  # the interpreter's cost grows with the chunk count
def test_gated_mlp_triton_path(c):
    check_mlp(c, "triton")


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_h_written_over_the_chunks_buffers(path, dtype):
    """The op writes h over g in forward and over dh in backward (each element read before it is written):
    with every gradient wanted, in fp32 too, where `.float()` hands the torch path the very tensor it writes."""
    c = dict(seed=3, rows=40, hidden=24, inter=20, rank=3, dtype=dtype, fp32_adapters=dtype == torch.float32,
             lora="both", fused=False, x_transposed=False, x_3d=True, x_grad=True, train_base=True, scale=2.0,
             activation="silu", rows_per_chunk=16, down="lora", save_projections=False)
    check_mlp(c, path)


def check_act_mul(gate, up, activation, path):
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    with path_ctx(path):
        h = act_mul(gate, up, activation)
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    assert h.dtype == out_dtype and h.shape == gate.shape and h.is_contiguous()
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = act64(g64, activation) * u64
    assert_close(h, ref, out_dtype, "h")
    dh = torch.randn(*reversed(h.shape)).to(out_dtype).to(h.device).permute(*reversed(range(h.dim())))
    with path_ctx(path):
        d_gate, d_up = torch.autograd.grad(h, (gate, up), dh)
    ref_gate, ref_up = torch.autograd.grad(ref, (g64, u64), dh.double())
    assert d_gate.dtype == gate.dtype and d_up.dtype == up.dtype
    assert_close(d_gate, ref_gate, gate.dtype, "d_gate")
    assert_close(d_up, ref_up, up.dtype, "d_up")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), width=st.integers(1, 150), dtype=st.sampled_from(DTYPES),
       activation=st.sampled_from(ACTIVATIONS), chunked=st.booleans(), path=st.sampled_from(["torch", "triton"]))
def test_act_mul(rows, width, dtype, activation, chunked, path):
    if chunked:  # Phi3: gate_up_proj(x).chunk(2, dim=-1), two views with row stride 2I
        gate, up = (torch.randn(2, rows, 2 * width) * 3).to(dtype).chunk(2, dim=-1)
    else:
        gate, up = (torch.randn(2, 2, rows, width) * 3).to(dtype).unbind(0)
    check_act_mul(gate, up, activation, path)


def test_act_mul_mixed_dtypes():
    gate = torch.randn(5, 7).to(torch.bfloat16)
    up = torch.randn(5, 7)
    check_act_mul(gate, up, "silu", "torch")


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_matches_hf_modules_in_bf16(path):
    """Literal transformers modules in bf16: LlamaMLP (silu) and GemmaMLP (gelu_pytorch_tanh),
    output of act_fn(gate_proj(x)) * up_proj(x) taken at down_proj's input."""
    from transformers import GemmaConfig, LlamaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    configs = [(LlamaMLP, LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4, hidden_act="silu"), "silu"),
               (GemmaMLP, GemmaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4,
                                            hidden_act="gelu_pytorch_tanh"),
                "gelu_tanh")]
    for cls, config, activation in configs:
        mlp = cls(config).to(torch.bfloat16)
        x = torch.randn(3, 11, 48).to(torch.bfloat16)
        captured = {}
        mlp.down_proj.register_forward_pre_hook(lambda m, args: captured.update(h=args[0]))
        mlp(x)
        with path_ctx(path):
            h = gated_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, activation=activation)
        assert_close(h, captured["h"], torch.bfloat16, cls.__name__)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_matches_peft_lora_fp32_adapters_on_bf16(path):
    """PEFT LoRA (fp32 adapters, bf16 base, r=4, alpha=8) on gate_proj and up_proj: forward
    and the gradients of x and of every LoRA factor, against PEFT's own autograd in bf16."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(1)
    mlp = LlamaMLP(LlamaConfig(hidden_size=40, intermediate_size=72, num_attention_heads=4, hidden_act="silu")).to(torch.bfloat16)
    model = get_peft_model(mlp, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["gate_proj", "up_proj"]))
    layers = [model.base_model.model.gate_proj, model.base_model.model.up_proj]
    for layer in layers:
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.3)
    factors = [t for layer in layers for t in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]
    assert all(t.dtype == torch.float32 for t in factors)
    scale = layers[0].scaling["default"]
    x = torch.randn(2, 9, 40).to(torch.bfloat16).requires_grad_()
    captured = {}
    model.base_model.model.down_proj.register_forward_pre_hook(lambda m, args: captured.update(h=args[0]))
    model(x)
    h_peft = captured["h"]
    dh = torch.randn_like(h_peft)
    grads_peft = torch.autograd.grad(h_peft, [x, *factors], dh)
    with path_ctx(path):
        h = gated_mlp(x, layers[0].base_layer.weight, layers[1].base_layer.weight, *factors, scale, "silu")
        grads = torch.autograd.grad(h, [x, *factors], dh)
    assert_close(h, h_peft, torch.bfloat16, "h vs PEFT")
    for name, got, want in zip(["x", "gate A", "gate B", "up A", "up B"], grads, grads_peft):
        assert got.dtype == want.dtype
        assert_close(got, want, torch.bfloat16, f"d{name} vs PEFT")


def _saved(fn, *args):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args)
    return out, saved


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_gated_mlp_saves_only_x_and_references(path, chunk):
    """Recomputing mode: nothing of [tokens x intermediate] is kept."""
    rows, hidden, inter, rank = 64, 24, 96, 4
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w_gate_up = torch.randn(2 * inter, hidden, dtype=torch.bfloat16)
    factors = [torch.randn(rank, hidden, requires_grad=True), torch.randn(inter, rank, requires_grad=True),
               torch.randn(rank, hidden, requires_grad=True), torch.randn(inter, rank, requires_grad=True)]
    inputs = [x, w_gate_up[:inter], w_gate_up[inter:], *factors]
    with path_ctx(path), rows_per_chunk(chunk):
        h, saved = _saved(gated_mlp, *inputs, 2.0)
    # Everything saved is an input tensor itself (no copy, no new allocation) ...
    assert all(any(t.data_ptr() == i.data_ptr() and t.shape == i.shape for i in inputs) for t in saved)
    # ... and no saved tensor has a [tokens x intermediate] footprint.
    assert not any(t.numel() >= rows * inter for t in saved)
    activation_bytes = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() == x.data_ptr())
    assert activation_bytes == x.numel() * x.element_size()


def chunk_case(layout, dtype, rows=37, down="none", save_projections=False):
    """A case per LoRA layout: distinct gate/up factors, one A shared by a fused gate_up (PEFT on
    Phi3), and full fine-tuning of a fused weight without LoRA."""
    return dict(seed=3, rows=rows, hidden=20, inter=50, rank=4, dtype=dtype, fp32_adapters=True, lora=layout,
                fused=layout != "both", x_transposed=True, x_3d=True, x_grad=True, train_base=layout == "none",
                scale=2.0, activation="silu", rows_per_chunk=None, down=down, save_projections=save_projections)


def h_and_grads(c, path, chunk, device="cpu"):
    x, w_gate, w_up, factors, down, leaves = mlp_leaves(c, device)
    with path_ctx(path), rows_per_chunk(chunk):
        h = run_mlp(c, x, w_gate, w_up, factors, down)
        dh = torch.randn(h.shape, generator=torch.Generator().manual_seed(c["seed"] + 1)).to(h.dtype).to(device)
        grads = torch.autograd.grad(h, leaves, dh)
    return [h, *grads]


# Chunked vs one chunk: the same arithmetic per row, and per-chunk partial sums of the weight and
# LoRA gradients added in fp32, so only fp32 summation order (and, for bf16 outputs, the one final
# rounding it can flip) differs. Rounding a chunk's partial sum to bf16 is off by ~1e-1 here.
CHUNK_TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-8}
# On CUDA, cuBLAS picks other kernels (split-K orders) for other row counts, and the kernels' in-tile LoRA
# products run in 3-pass TF32 (about fp32, not IEEE fp32): fp32 gradients summed over 3000 rows in another
# order differed by up to 2.1e-4 of their largest entry on the H200. The bound of a reordered fp32 sum is
# n * 2^-24 times the sum of the terms' magnitudes, which for these cancelling sums is far above the result.
CUDA_CHUNK_TOL = {torch.float32: 1e-3, torch.bfloat16: 4 * 2**-8}


def assert_chunked_matches(one, chunked, dtype, tols=CHUNK_TOL):
    for i, (a, b) in enumerate(zip(one, chunked)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
        tol = tols[torch.float32 if a.dtype == torch.float32 else dtype]
        err = (a.double() - b.double()).abs().max().item()
        assert err <= tol * a.double().abs().max().item(), f"output {i}: chunked differs by {err:.3e}"


@pytest.mark.parametrize("path, layout, dtype", [
    *(("torch", layout, dtype) for layout in ("both", "shared_a", "none") for dtype in (torch.float32, torch.bfloat16)),
    # The Triton kernels per chunk: LoRA x-side gradients and B gradients, with distinct and shared A.
    ("triton", "both", torch.float32), ("triton", "shared_a", torch.bfloat16),
])
def test_chunks_match_one_chunk(path, layout, dtype):
    c = chunk_case(layout, dtype)
    one = h_and_grads(c, path, None)
    assert_chunked_matches(one, h_and_grads(c, path, 5), dtype)  # 8 chunks, the last of 2 rows


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("layout, down", [("both", "lora"), ("shared_a", "lora"), ("none", "plain")])
def test_saved_projections_and_down_chunks_match(path, layout, down):
    """With the down projection and saved gate/up, chunked == one chunk, and recomputing the
    projections == saving them (the same arithmetic on the same values: equal up to fp32
    summation order)."""
    saving = chunk_case(layout, torch.bfloat16, down=down, save_projections=True)
    one = h_and_grads(saving, path, None)
    assert_chunked_matches(one, h_and_grads(saving, path, 5), torch.bfloat16)
    assert_chunked_matches(one, h_and_grads(dict(saving, save_projections=False), path, 5), torch.bfloat16)


class _Temporaries(TorchDispatchMode):
    """Watches the storages that aten ops return while active, inside fastgrpo ops too (their CPU
    implementations run with this mode still active). A storage lives while a Python tensor on it
    does; temporaries are the storages made and freed before the mode exits (so not the inputs,
    nor the outputs the caller holds)."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.sizes = []  # (bytes, op) per storage, in creation order
        self.events = []  # (storage index, +bytes at creation / -bytes when its last tensor dies)
        self.live = {}  # data_ptr -> [storage index, bytes, tensors alive]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fastgrpo":
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._created(t, str(func))
        return out

    def _created(self, t, op):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.inputs:
            return
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [len(self.sizes), t.untyped_storage().nbytes(), 0]
            self.sizes.append((entry[1], op))
            self.events.append((entry[0], entry[1]))
        entry[2] += 1
        weakref.finalize(t, self._dropped, ptr)

    def _dropped(self, ptr):
        entry = self.live[ptr]
        entry[2] -= 1
        if entry[2] == 0:
            del self.live[ptr]
            self.events.append((entry[0], -entry[1]))

    def temporaries(self):
        """((bytes, op) of the largest temporary, peak bytes of temporaries alive at once)."""
        kept = {entry[0] for entry in self.live.values()}
        alive = peak = 0
        for index, delta in self.events:
            if index not in kept:
                alive += delta
                peak = max(peak, alive)
        largest = max((size for index, size in enumerate(self.sizes) if index not in kept), default=(0, None))
        return largest, peak


def _mlp_temporaries(path, rows, chunk):
    """Temporaries of gated_mlp's forward and of its backward: bf16 x and fused gate_up weight,
    fp32 LoRA on gate and up, gradients for x, the weight and every factor."""
    hidden, inter, rank = 12, 96, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).requires_grad_()
    w_gate_up = (torch.randn(2 * inter, hidden, generator=gen) * 0.3).to(torch.bfloat16).requires_grad_()
    factors = [torch.randn(*shape, generator=gen).requires_grad_()
               for shape in ((rank, hidden), (inter, rank), (rank, hidden), (inter, rank))]
    inputs = [x, w_gate_up, w_gate_up[:inter], w_gate_up[inter:], *factors]
    dh = torch.randn(rows, inter, generator=gen).to(torch.bfloat16)
    with path_ctx(path), rows_per_chunk(chunk):
        with _Temporaries(inputs) as fwd:
            h = gated_mlp(x, *inputs[2:], 2.0)
        with _Temporaries([*inputs, h, dh]) as bwd:
            grads = torch.autograd.grad(h, [x, w_gate_up, *factors], dh)
        assert len(grads) == 6  # held until the watch ends: outputs, not temporaries
    return fwd.temporaries(), bwd.temporaries()


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_gated_mlp_temporaries_bounded_by_chunk(path):
    """No temporary inside forward or backward is larger than one chunk's [rows, 2I] fp32 buffer,
    and the peak of temporaries alive at once does not grow with the token count (32 vs 128
    rows in chunks of 16). Without chunking both grow, so the test sees full-size temporaries
    (or the previous chunk's buffers kept alive) if they come back."""
    chunk, inter = 16, 96
    chunk_bytes = chunk * 2 * inter * 4
    small, large = _mlp_temporaries(path, 2 * chunk, chunk), _mlp_temporaries(path, 8 * chunk, chunk)
    for name, (small_pass, large_pass) in zip(("forward", "backward"), zip(small, large)):
        (largest, op), peak = large_pass
        assert largest <= chunk_bytes, f"{name}: {op} made a {largest}-byte temporary > one chunk's {chunk_bytes}"
        assert peak <= small_pass[1], f"{name}: temporaries peak at {peak} bytes for 128 rows, {small_pass[1]} for 32"
    unchunked = _mlp_temporaries(path, 8 * chunk, None)
    for (_, peak), (_, peak_unchunked) in zip(large, unchunked):
        assert peak_unchunked > 2 * peak


class _InPlaceAdds(TorchDispatchMode):
    """Shapes of the tensors that in-place adds (addmm_, add_) write into, of the operands of products (mm), and
    of the results of concatenations (cat)."""

    def __init__(self):
        super().__init__()
        self.shapes = []
        self.products = []
        self.concatenated = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fastgrpo":  # look inside the op's implementation too
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)
        if func in (torch.ops.aten.addmm_.default, torch.ops.aten.add_.Tensor):
            self.shapes.append(tuple(args[0].shape))
        if func == torch.ops.aten.mm.default:
            self.products.append((tuple(args[0].shape), tuple(args[1].shape)))
        result = func(*args, **kwargs)
        if func in (torch.ops.aten.cat.default, torch.ops.aten.cat.out):
            self.concatenated.append(tuple(result.shape))
        return result


@pytest.mark.parametrize("lora", ["both", "shared_a", "up", "gate"])
def test_adapters_in_the_base_dtype_join_the_projection_gemms(lora):
    """GPU path (here the Triton interpreter's), adapters in x's dtype (as autocast runs them): g and u with
    their LoRA terms come from one GEMM over [x | s xa], and the backward's dh from one over [dy | dxa], so
    nothing adds a rank-r product into a [rows, I] buffer afterwards (a read and a write of it); the down
    projection's output and its LoRA input h @ A^T come from one GEMM of h, so no skinny product reads h in
    the forward; dx and
    dL/d(xa) come from one GEMM of [dg | du], so nothing adds into a chunk's dx in place either (with the
    projections recomputed or saved); results as the separate products give them. fp32 adapters on a bf16
    base, a decode step's few rows and the CPU torch path keep the separate products."""
    hidden, inter, out_width, rank, rows = 12, 40, 10, 4, 24  # rows >= 2 x hidden: joined
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype).requires_grad_()

    for dtype, adapters, joined in ((torch.float32, torch.float32, True), (torch.bfloat16, torch.float32, False)):
        x, w_gate, w_up, w_down = rand(rows, hidden, dtype=dtype), rand(inter, hidden, dtype=dtype), \
            rand(inter, hidden, dtype=dtype), rand(out_width, inter, dtype=dtype)
        ga, gb = (rand(rank, hidden, dtype=adapters), rand(inter, rank, dtype=adapters)) if lora != "up" else (None, None)
        ua, ub = (ga, rand(inter, rank, dtype=adapters)) if lora == "shared_a" else \
            (rand(rank, hidden, dtype=adapters), rand(inter, rank, dtype=adapters)) if lora != "gate" else (None, None)
        da, db = rand(rank, inter, dtype=adapters), rand(out_width, rank, dtype=adapters)
        factors = (ga, gb, ua, ub)
        assert _lora_gemm.joined_weight(w_gate, w_up, factors, rows) is None  # the torch path
        with path_ctx("triton"):
            built = _lora_gemm.joined_weight(w_gate, w_up, factors, rows)
            assert (built is not None) == joined
            if joined:  # [[W_g, B_g, 0], [W_u, 0, B_u]], one B column block for a shared A, none without adapter
                rank_g, rank_u = (rank if ga is not None else 0), (rank if ua is not None and ua is not ga else 0)
                want = torch.zeros(2 * inter, hidden + rank_g + rank_u, dtype=dtype)
                want[:inter, :hidden], want[inter:, :hidden] = w_gate, w_up
                if ga is not None:
                    want[:inter, hidden:hidden + rank] = gb
                if ua is not None:
                    start = hidden if ua is ga else hidden + rank_g
                    want[inter:, start:start + rank] = ub
                assert torch.equal(built, want)
            assert _lora_gemm.joined_weight(w_gate, w_up, factors, rows=2) is None  # a decode step
        leaves = [t for t in dict.fromkeys((x, ga, gb, ua, ub, da, db)) if t is not None]
        g = x.float() @ w_gate.float().T + (0.5 * (x.float() @ ga.float().T) @ gb.float().T if ga is not None else 0)
        u = x.float() @ w_up.float().T + (0.5 * (x.float() @ ua.float().T) @ ub.float().T if ua is not None else 0)
        h = F.silu(g) * u
        ref = h @ w_down.float().T + 2.0 * (h @ da.float().T) @ db.float().T
        ref_grads = torch.autograd.grad(ref, leaves, torch.ones_like(ref))
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for save_projections in (False, True):
            chunk = 6  # rows: no accumulator has this shape ([A_g; A_u] is [8, hidden])
            with path_ctx("triton"), rows_per_chunk(chunk), _InPlaceAdds() as forward:
                y = gated_mlp(x, w_gate, w_up, ga, gb, ua, ub, 0.5, "silu", w_down, da, db, 2.0, save_projections)
            with path_ctx("triton"), rows_per_chunk(chunk), _InPlaceAdds() as backward:
                grads = torch.autograd.grad(y, leaves, torch.ones_like(y))
            adds = forward.shapes + backward.shapes
            assert ((chunk, inter) not in adds) == joined, adds  # a chunk's g, u or dh
            assert ((chunk, hidden) not in adds) == joined, adds  # a chunk's dx
            skinny_on_h = ((chunk, inter), (inter, rank))
            assert (skinny_on_h not in forward.products) == joined, forward.products
            assert ((chunk, inter), (inter, out_width + rank)) in forward.products or not joined
            # [W_down; A_down] is built once a call, not once for each of the backward's four chunks
            assert backward.concatenated.count((out_width + rank, inter)) == joined, backward.concatenated
            for got, want in zip((y, *grads), (ref, *ref_grads)):
                assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol


def test_rows_per_chunk_sizing():
    """Default chunks: g/u buffer within 256 MiB, whole multiples of 128 rows, never under 1024."""
    for inter, dtype in ((8960, torch.bfloat16), (14336, torch.bfloat16), (8960, torch.float32),
                         (53248, torch.bfloat16)):
        n = _row_chunks.rows_per_chunk(inter, dtype)
        assert n % 128 == 0 and n >= 1024
        assert n == 1024 or n * 2 * inter * dtype.itemsize <= 256 * 2**20 < (n + 128) * 2 * inter * dtype.itemsize
    assert _row_chunks.rows_per_chunk(8960, torch.bfloat16) == 7424


@pytest.mark.parametrize("rows", [1, 1024, 7424, 7425, 10240, 34816, 133120])
def test_chunks_are_as_few_and_as_even_as_the_caps_allow(rows):
    """Rows split into ceil(rows / cap) chunks of one size (whole multiples of 128 rows, the last shorter), where the
    cap keeps a chunk's g/u buffer within 256 MiB and, above 1024 rows, within 4x the bytes of x: 10240 rows of
    Qwen2.5-1.5B's MLP (x 30 MiB) are three chunks of 3456, 34816 rows five of 7040."""
    hidden, inter, dtype = 1536, 8960, torch.bfloat16
    cap = _row_chunks.rows_per_chunk(inter, dtype, rows * hidden * dtype.itemsize)
    assert cap == 1024 or cap * 2 * inter * dtype.itemsize <= min(256 * 2**20, 4 * rows * hidden * dtype.itemsize)
    chunks = _row_chunks.row_chunks(rows, inter, dtype, hidden)
    sizes = [end - start for start, end in chunks]
    assert chunks[0][0] == 0 and chunks[-1][1] == rows and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert len(chunks) == -(-rows // cap)
    assert all(size == sizes[0] for size in sizes[:-1]) and sizes[-1] <= sizes[0] <= cap
    assert len(chunks) == 1 or (sizes[0] % 128 == 0 and sizes[0] < -(-rows // len(chunks)) + 128)
    assert {10240: [3456, 3456, 3328], 34816: [7040] * 4 + [6656]}.get(rows, sizes) == sizes


@pytest.mark.parametrize("with_down", [False, True])
def test_saved_projections_keep_gate_and_up_only(with_down):
    """save_projections keeps x and one [tokens, 2I] buffer of projections, nothing else of
    [tokens x I] - in particular not h, the down projection's input, when the op includes down."""
    rows, hidden, inter, rank = 64, 24, 96, 4
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w_gate_up = torch.randn(2 * inter, hidden, dtype=torch.bfloat16)
    factors = [torch.randn(rank, hidden, requires_grad=True), torch.randn(inter, rank, requires_grad=True)] * 2
    down = [torch.randn(hidden, inter, dtype=torch.bfloat16), torch.randn(rank, inter, requires_grad=True),
            torch.randn(hidden, rank, requires_grad=True)] if with_down else [None, None, None]
    out, saved = _saved(gated_mlp, x, w_gate_up[:inter], w_gate_up[inter:], *factors, 2.0, "silu", *down, 0.5, True)
    big = [t for t in saved if t.numel() >= rows * inter]
    assert [tuple(t.shape) for t in big] == [(rows, 2 * inter)]
    assert out.shape == (rows, hidden if with_down else inter)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("save_projections", [False, True])
@pytest.mark.parametrize("down", ["lora", "none"])
def test_checkpoint_recompute_computes_only_what_is_saved(path, save_projections, down):
    """skip_output_on_recompute: inside checkpoint_recompute() the output is zeros and the saved projections are
    bitwise those of a full forward (the backward that reads them is unchanged); outside it, or without the flag,
    the op computes everything."""
    from fastgrpo.kernels._dispatch import checkpoint_recompute

    c = chunk_case("both", torch.bfloat16, down=down, save_projections=save_projections)
    x, w_gate, w_up, factors, down_args, _ = mlp_leaves(c)
    w_down, da, db = down_args if down_args is not None else (None, None, None)
    op = torch.ops.fastgrpo.gated_mlp
    args = (x, w_gate, w_up, *factors, c["scale"], c["activation"], w_down, da, db, 0.75, save_projections)
    calls = []
    with path_ctx(path), rows_per_chunk(16):  # several chunks
        full_out, full_saved = op(*args, True)
        with checkpoint_recompute():
            out, saved = op(*args, True)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: calls.append(t) or t, lambda t: t):
                unflagged_out, _ = op(*args, False)
    assert not torch.any(full_out == 0) and torch.equal(out, torch.zeros_like(full_out))
    assert torch.equal(saved, full_saved) and saved.numel() == (x.numel() // 20 * 100 if save_projections else 0)
    assert torch.equal(unflagged_out, full_out) and calls  # the flag alone decides; autograd still saves


def test_act_mul_saves_gate_and_up():
    gate, up = torch.randn(2, 6, 10, requires_grad=True).unbind(0)
    _, saved = _saved(act_mul, gate, up)
    assert [(t.data_ptr(), t.shape) for t in saved] == [(gate.data_ptr(), gate.shape), (up.data_ptr(), up.shape)]


def test_gated_mlp_errors():
    x = torch.randn(3, 8)
    w = torch.randn(5, 8)
    a, b = torch.randn(2, 8), torch.randn(5, 2)
    with pytest.raises(ValueError, match="activation must be one of"):
        gated_mlp(x, w, w, activation="relu")
    with pytest.raises(ValueError, match="needs both A and B"):
        gated_mlp(x, w, w, a, None)
    with pytest.raises(ValueError, match="must be A"):
        gated_mlp(x, w, w, a, b.t())
    with pytest.raises(ValueError, match="must have x's dtype"):
        gated_mlp(x, w.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="must both be"):
        gated_mlp(x, w, w[:4])
    with pytest.raises(TypeError, match="supports float32"):
        gated_mlp(x.double(), w.double(), w.double())
    with pytest.raises(ValueError, match="must match in shape"):
        act_mul(x, x[:2])


def test_opcheck():
    x = torch.randn(8, 3, 12).transpose(0, 1)  # non-contiguous [3, 8, 12]
    w_gate_up = torch.randn(20, 12)
    w_gate, w_up = w_gate_up[:10], w_gate_up[10:]
    a, b = torch.randn(2, 12, requires_grad=True), torch.randn(10, 2, requires_grad=True)
    xg = x.detach().requires_grad_()
    op = torch.ops.fastgrpo
    torch.library.opcheck(op.gated_mlp, (xg, w_gate, w_up, None, None, None, None, 1.0, "silu"))
    torch.library.opcheck(op.gated_mlp, (xg, w_gate, w_up, a, b, a, b.detach(), 0.5, "gelu_tanh"))
    dh = torch.randn(10, 3, 8).permute(1, 2, 0)
    torch.library.opcheck(op.gated_mlp_backward,
                          (dh, x, w_gate, w_up, a.detach(), b.detach(), None, None, 0.5, "silu",
                           [True, False, True, True, True, False, False, False, False, False]))
    w_down, da, db = torch.randn(12, 10), torch.randn(3, 10, requires_grad=True), torch.randn(12, 3, requires_grad=True)
    torch.library.opcheck(op.gated_mlp, (xg, w_gate, w_up, a, b, None, None, 0.5, "silu", w_down, da, db, 2.0, True))
    torch.library.opcheck(op.gated_mlp, (xg, w_gate, w_up, None, None, None, None, 1.0, "silu", w_down, None, None,
                                         1.0, False))
    torch.library.opcheck(op.gated_mlp, (xg, w_gate, w_up, a, b, None, None, 0.5, "silu", w_down, da, db, 2.0, True, True))
    d_out = torch.randn(3, 8, 12)
    saved = torch.randn(24, 20)
    torch.library.opcheck(op.gated_mlp_backward,
                          (d_out, x, w_gate, w_up, a.detach(), b.detach(), None, None, 0.5, "silu",
                           [True, False, False, True, True, False, False, True, True, True],
                           w_down, da.detach(), db.detach(), 2.0, saved))
    gate, up = torch.randn(6, 2, 14).chunk(2, dim=-1)
    torch.library.opcheck(op.act_mul, (gate.requires_grad_(), up, "silu"))
    torch.library.opcheck(op.act_mul_backward, (torch.randn(7, 2, 6).permute(2, 1, 0), gate.detach(), up, "gelu_tanh"))


def test_gated_mlp_under_torch_compile():
    x = torch.randn(2, 5, 12, requires_grad=True)
    w_gate, w_up = torch.randn(2, 16, 12).unbind(0)
    a, b = torch.randn(3, 12, requires_grad=True), torch.randn(16, 3, requires_grad=True)

    def f(x, a, b):
        return (gated_mlp(x, w_gate, w_up, a, b, None, None, 2.0) ** 2).sum()

    eager = torch.autograd.grad(f(x, a, b), (x, a, b))
    compiled = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(x, a, b), (x, a, b))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@settings(max_examples=30, deadline=None)
@given(c=mlp_cases([None, 1, 4, 16]))
def test_gated_mlp_cuda(c):
    check_mlp(c, "cuda", device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 128])
@pytest.mark.parametrize("lora", ["none", "both", "shared_a"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_mlp_cuda_large(lora, activation, chunk):
    """Shapes that use several row blocks, column splits and LoRA ranks past one tile; one chunk
    and six (the last of 60 rows)."""
    c = dict(seed=5, rows=700, hidden=256, inter=1300, rank=16, dtype=torch.bfloat16, fp32_adapters=True,
             lora=lora, fused=lora != "both", x_transposed=False, x_3d=True, x_grad=True, train_base=lora == "none",
             scale=2.0, activation=activation, rows_per_chunk=chunk)
    check_mlp(c, "cuda", device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["both", "shared_a", "none"])
def test_chunks_match_one_chunk_cuda(layout, dtype):
    c = dict(chunk_case(layout, dtype, rows=3000), hidden=256, inter=1300, rank=16, x_transposed=False)
    one = h_and_grads(c, "cuda", None, device="cuda")
    chunked = h_and_grads(c, "cuda", 448, device="cuda")  # 7 chunks, the last of 312 rows
    assert_chunked_matches(one, chunked, dtype, CUDA_CHUNK_TOL)


@pytest.mark.gpu
def test_gated_mlp_cuda_peak_memory_bounded():
    """Qwen2.5-1.5B's MLP (H 1536, I 8960), 32k tokens, bf16 base, fp32 LoRA r=16 on gate and up,
    default chunking (5 chunks): beyond h (forward) and dx (backward), each pass's peak stays
    within one chunk's working set (g/u buffer 254 MiB; with fp32 adapters on a bf16 base one
    projection's LoRA term or gradient in fp32, 254 MiB; x in fp32 44 MiB: <= 2.25 x 256 MiB; 552 /
    554 MiB on the H200), where one chunk of all rows needs two or more [tokens x I] tensors
    (>= 1120 MiB); both give the same results."""
    tokens, hidden, inter, rank = 32768, 1536, 8960, 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, std=1.0, dtype=torch.float32):
        return (torch.randn(*shape, device="cuda", generator=gen) * std).to(dtype)

    x = rand(tokens, hidden, dtype=torch.bfloat16).requires_grad_()
    w_gate_up = rand(2 * inter, hidden, std=hidden**-0.5, dtype=torch.bfloat16)
    factors = [rand(rank, hidden, std=hidden**-0.5).requires_grad_(), rand(inter, rank, std=0.1).requires_grad_(),
               rand(rank, hidden, std=hidden**-0.5).requires_grad_(), rand(inter, rank, std=0.1).requires_grad_()]
    dh = rand(tokens, inter, dtype=torch.bfloat16)
    full_bytes = tokens * inter * 2

    def run(chunk):
        with rows_per_chunk(chunk):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            h = gated_mlp(x, w_gate_up[:inter], w_gate_up[inter:], *factors, 2.0)
            torch.cuda.synchronize()
            fwd = torch.cuda.max_memory_allocated() - base - full_bytes
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            grads = torch.autograd.grad(h, [x, *factors], dh)
            torch.cuda.synchronize()
            bwd = torch.cuda.max_memory_allocated() - base - x.numel() * x.element_size()
        return [h, *grads], fwd, bwd

    run(tokens)  # warm-up: Triton compilation and cuBLAS workspaces outside the measured peaks
    chunked, fwd, bwd = run(None)
    one, fwd_one, bwd_one = run(tokens)
    mib = 2**20
    print(f"\nextra peak MiB, chunked ({_row_chunks.rows_per_chunk(inter, torch.bfloat16)} rows) / one chunk: "
          f"forward {fwd / mib:.0f} / {fwd_one / mib:.0f}, backward {bwd / mib:.0f} / {bwd_one / mib:.0f}")
    budget = 2.25 * _row_chunks.CHUNK_BYTES
    assert fwd <= budget and bwd <= budget, (fwd / mib, bwd / mib)
    assert fwd_one >= 2 * full_bytes and bwd_one >= 2 * full_bytes  # the measurement sees full-size temporaries
    assert_chunked_matches(one, chunked, torch.bfloat16, CUDA_CHUNK_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_mul_cuda(dtype):
    gate, up = (torch.randn(2, 300, 2 * 1000, device="cuda") * 3).to(dtype).chunk(2, dim=-1)
    check_act_mul(gate, up, "silu", "cuda")
    check_act_mul(gate, up, "gelu_tanh", "cuda")

"""How fastgrpo::gated_mlp walks the rows of x in chunks, and the fp32 gradient sums over those chunks.

Forward and backward handle x a chunk of rows at a time, so no [tokens x intermediate] temporary is larger
than a chunk: full size are only the op's output and incoming gradient (h and dh when the op stops before
the down projection) and the saved projections. A chunk's largest temporary is its [rows, 2I] projection
buffer in x's dtype (g and u; dg and du overwrite it in backward, or take a buffer of their own when g and u
are saved ones; with the down projection h is written over g in forward, and in backward dh, [rows, I],
comes beside it and h is written over dh). CHUNK_BYTES caps that buffer, so the working set stays fixed as
contexts grow (bf16: at most 7424 rows at I = 8960, 4608 at I = 14336), and CHUNK_INPUT_MULTIPLE keeps it in
proportion to x at short contexts. The other per-chunk temporaries are [rows, H] (x cast to the adapters'
dtype; x joined with its LoRA inputs, [rows, H + r]) or [rows, r], beside a weight-sized one per call (the
joined weights of _lora_gemm) - except with fp32 adapters on a bf16/fp16 base outside autocast, where one
projection's LoRA term (forward) or gradient (backward) is an fp32 [rows, I] temporary beside the buffer. The
CPU torch path chunks the same way; its fp32 activation temporaries make its chunks a few times larger in
bytes.

Weight and LoRA gradients are summed over chunks in fp32 accumulators, in chunk order: deterministic, and
equal to a one-chunk result up to fp32 summation order.
"""
import torch

# A chunk's [rows, 2I] projection buffer holds at most this many bytes ...
CHUNK_BYTES = 256 * 2**20
# ... and at most this many times the bytes of x: at short contexts (1024-token GRPO rows: x 30 MiB) a 256 MiB
# buffer, with dh beside it, would be the largest part of the step's working memory beyond the weights.
CHUNK_INPUT_MULTIPLE = 4
# Chunks have at least this many rows, in whole multiples of 128 (the matmul tiles), so that each cuBLAS call
# is large enough to run at full speed.
MIN_CHUNK_ROWS = 1024
# Set by tests to force many small chunks; None sizes chunks from CHUNK_BYTES.
ROWS_PER_CHUNK: int | None = None


def rows_per_chunk(inter: int, dtype: torch.dtype, input_bytes: int | None = None) -> int:
    """Rows of x that gated_mlp's forward and backward handle at most per step for intermediate size `inter`
    (and an x of `input_bytes`, if given)."""
    if ROWS_PER_CHUNK is not None:
        return ROWS_PER_CHUNK
    budget = CHUNK_BYTES if input_bytes is None else min(CHUNK_BYTES, CHUNK_INPUT_MULTIPLE * input_bytes)
    per_row = 2 * inter * dtype.itemsize
    return max(MIN_CHUNK_ROWS, budget // per_row // 128 * 128)


def row_chunks(n_rows, inter, dtype, hidden, most_rows=None):
    """(start, end) of each chunk: as few chunks as rows_per_chunk() (or `most_rows`, if fewer) allows, of equal size
    up to the last (whole multiples of 128 rows): 34816 rows are five chunks of 7040, not four of 7424 and one of
    5120, whose working set would be the larger ones'."""
    step = most = rows_per_chunk(inter, dtype, n_rows * hidden * dtype.itemsize)
    if most_rows is not None and ROWS_PER_CHUNK is None:
        step = most = min(most, most_rows)
    if ROWS_PER_CHUNK is None and n_rows > most:
        chunks = -(-n_rows // most)
        per_chunk = -(-n_rows // chunks)
        step = min(most, -(-per_chunk // 128) * 128)
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def mm_fp32(a, b):
    """a @ b in fp32; bf16/fp16 operands are multiplied without rounding the product to their dtype."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def accumulate(acc, name, a, b):
    """acc[name] += a @ b in fp32, if acc holds `name` (a gradient that is needed). The first chunk's
    product becomes the accumulator (no zero fill: two launches fewer per gradient); later chunks' are
    added by the GEMM itself, without first rounding them to the operands' dtype, so a gradient summed
    over chunks differs from a one-chunk result only by fp32 summation order."""
    if name not in acc:
        return
    if acc[name] is None:
        acc[name] = mm_fp32(a, b)
    elif a.dtype == torch.float32 or not a.is_cuda:
        acc[name].addmm_(a.float(), b.float())
    else:  # one GEMM: its epilogue adds the fp32 product into the accumulator
        torch.addmm(acc[name], a, b, out_dtype=torch.float32, out=acc[name])


def summed(acc, name, like):
    """The fp32 sum of acc[name] over all chunks (zeros when there were no rows)."""
    total = acc[name]
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if total is None else total

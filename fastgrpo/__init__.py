"""fastgrpo: a torch.compile backend and TRL GRPO integration for fast, memory-lean RL fine-tuning.

    model = torch.compile(model, backend="fastgrpo")   # registered by entry point; no import needed
    fastgrpo.fusion_reports()                           # what matched where, and what did not and why
"""
from fastgrpo.compiler import clear_fusion_reports, compile_repeated_blocks, format_reports, fusion_reports

__all__ = ["compile_repeated_blocks", "fusion_reports", "clear_fusion_reports", "format_reports"]

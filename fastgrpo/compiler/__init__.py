from fastgrpo.compiler.backend import fastgrpo_backend
from fastgrpo.compiler.options import Options
from fastgrpo.compiler.regions import compile_repeated_blocks
from fastgrpo.compiler.report import clear_fusion_reports, format_reports, fusion_reports, fusion_summary

__all__ = ["fastgrpo_backend", "Options", "compile_repeated_blocks", "fusion_reports", "clear_fusion_reports", "format_reports",
           "fusion_summary"]

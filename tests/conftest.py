"""Test-wide settings. The environment must be set before triton or vllm are imported."""
import os

import torch

if not torch.cuda.is_available():
    # No GPU: the Triton kernels run on CPU tensors through Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("FASTGRPO_TEST_DEVICE"):
    # FASTGRPO_TEST_DEVICE=cuda runs the CPU tests on the GPU (every factory call and model lands there):
    # how the pass tests, written for CI, are checked on the device.
    torch.set_default_device(os.environ["FASTGRPO_TEST_DEVICE"])
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The trainers the tests build keep their compile caches in a directory of this run, not in ~/.cache/fastgrpo.
if "FASTGRPO_COMPILE_CACHE" not in os.environ:
    import tempfile

    _COMPILE_CACHE = os.environ["FASTGRPO_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="fastgrpo-test-compile-cache-")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI must be reproducible: the same examples every run (a new failure shows up as a code change,
# not as luck). Run with HYPOTHESIS_PROFILE=explore for fresh random examples.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    # A pass that raises is survived in a user's run (its graph put back, reported, warned); in the tests it is a
    # failure. Added here, not in pyproject.toml: pytest resolves the class by importing fastgrpo (and so triton),
    # which must come after TRITON_INTERPRET is set above.
    config.addinivalue_line("filterwarnings", "error::fastgrpo.compiler.backend.PassFailedWarning")


def pytest_sessionfinish(session, exitstatus):
    if "_COMPILE_CACHE" in globals():
        import shutil

        shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: extra threads only contend. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_runtest_logreport(report):
    """FASTGRPO_FAILURE_LOG=path appends each failure to `path` as it happens: a device run cut short by its
    time box still leaves the reasons (pytest's summary comes only at the end)."""
    path = os.environ.get("FASTGRPO_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist: the controller writes
        with open(path, "a") as log:
            log.write(f"== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")

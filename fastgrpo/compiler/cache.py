"""Persistent compile caches: what inductor, AOTAutograd and Triton compiled is kept for the next process.

`enable_compile_cache(setting)` points torch's caches at `<root>/<environment>/`: `torch/` is
`TORCHINDUCTOR_CACHE_DIR` (inductor's FX graph cache, AOTAutograd's cache, generated code, compiled C++
kernels, Dynamo's profile of which sizes vary) and `triton/` is `TRITON_CACHE_DIR` (every Triton kernel,
inductor's and fastgrpo's own). The root is the setting (a directory), else `$FASTGRPO_COMPILE_CACHE`, else
`<FASTGRPO_CACHE or ~/.cache/fastgrpo>/compile`; "off" turns every compile cache off instead
(`torch.compiler.config.force_disable_caches`).

Keys. The environment directory is named by a hash of Python, torch, triton, transformers and the bytes of
fastgrpo's own source files, so a change of any of them starts from an empty directory (the
`KEEP_ENVIRONMENTS` most recently used are kept, others once unused for a day). Inside it torch keys each entry by the graph it compiles
(the model, its shapes and the backend's options are in the rewritten graph: the fastgrpo ops and their
arguments), input sizes, dtypes and strides, and its own config. The backend also adds fastgrpo's source
hash to every key it makes (`cache_key_tag`), for the caches this module does not place (torch's default
`/tmp/torchinductor_<user>`): the custom ops' autograd formulas are traced into AOTAutograd's entries but
are not part of torch's key.

Custom autograd functions. AOTAutograd's cache refuses a graph that calls a custom `torch.autograd.Function`
(Dynamo's `autograd_function_apply` node) unless
`torch._functorch.config.autograd_cache_allow_custom_autograd_functions` is on; such a graph then compiles again in
every process. A QLoRA layer's graph has one per 4-bit projection (bitsandbytes' `MatMul4Bit`) whenever it
computes gradients. Dynamo traces the function's forward and backward into subgraphs of the graph it hands over,
so both are in the cache key: the backend turns the setting on for the graphs it compiles
(`cacheable_autograd_functions`). Its environment variable `TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=0`
still turns it off.

Pass functions. Where the attention pass reroutes an SDPA call, the graph calls a Python function of fastgrpo's
(`fastgrpo.kernels.attention.attention`, `passes.attention.sdpa_preferring_cudnn`), which AOTAutograd traces
into torch ops but whose call its cache refuses like any function outside torch: every CUDA training graph of a
decoder layer compiled again in each process. The backend marks these functions cacheable through inductor's
`unsafe_marked_cacheable_functions`, keyed by fastgrpo's source hash, so an edit of them is another key
(`cacheable_pass_functions`).

Integrity. torch writes each file atomically, but a file can be damaged afterwards (disk, copies, tools).
After every inductor compile of the backend a manifest stores each file's SHA-256 (`record`: only new or
changed files are hashed); at the next enable a file that no longer matches is deleted, with one warning,
and compiled again when needed. This covers the files inductor compiles to probe the CPU's vector
instructions, whose damage would otherwise make it pick other ones. A file that fails to load without being
caught so (one written by a process that ended before recording it) makes the compile fail: the backend
then deletes the cache files the error names and compiles again (`recovering`), with one warning.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "FASTGRPO_COMPILE_CACHE"
OFF_VALUES = ("off", "none", "0", "false", "no")
# Environment directories kept under the root (most recently used first); older ones are removed once unused for
# PRUNE_AFTER_S (a run of another fastgrpo tree may still be writing to one).
KEEP_ENVIRONMENTS = 3
PRUNE_AFTER_S = 24 * 3600
MANIFEST = "fastgrpo-manifest.json"
ENVIRONMENT = "fastgrpo-environment.json"


class CompileCacheWarning(UserWarning):
    """A compile cache file was damaged: it was removed and its graph compiled again."""


def fastgrpo_cache_root() -> Path:
    """fastgrpo's cache directory: $FASTGRPO_CACHE, or ~/.cache/fastgrpo."""
    return Path(os.environ.get("FASTGRPO_CACHE") or Path.home() / ".cache" / "fastgrpo")


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """SHA-256 over fastgrpo's source files (paths and bytes): any edit gives another hash."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cache_key_tag() -> str:
    """What the backend adds to torch's cache keys (see the module docstring)."""
    return f"fastgrpo-{source_hash()[:16]}"


def tagged_cache_keys():
    """A context in which torch's cache keys include `cache_key_tag()` (after any tag of the user's)."""
    current = torch.compiler.config.cache_key_tag
    ours = cache_key_tag()
    if ours in current:
        return contextlib.nullcontext()
    return torch.compiler.config.patch(cache_key_tag=f"{current}|{ours}" if current else ours)


def cacheable_autograd_functions():
    """A context in which AOTAutograd caches graphs that call custom autograd functions (see the module
    docstring); a torch without the setting caches as it does."""
    from torch._functorch import config

    if not hasattr(config, "autograd_cache_allow_custom_autograd_functions"):
        return contextlib.nullcontext()
    return config.patch(autograd_cache_allow_custom_autograd_functions=True)


def cacheable_pass_functions():
    """A context in which AOTAutograd caches graphs that call the Python functions the passes make graph calls
    (`passes.CALL_TARGETS`, see the module docstring), each keyed by fastgrpo's source hash, beside the user's."""
    from torch._inductor import config

    from fastgrpo.passes import CALL_TARGETS

    marked = {f"{f.__module__}.{f.__name__}": f"fastgrpo-{source_hash()}" for f in CALL_TARGETS}
    return config.patch(unsafe_marked_cacheable_functions={**config.unsafe_marked_cacheable_functions, **marked})


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """What the environment directory's name hashes."""
    return {
        "python": sys.version,
        "torch": f"{torch.__version__} {torch.version.git_version} cuda {torch.version.cuda}",
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "fastgrpo": source_hash(),
    }


def environment_key() -> str:
    text = json.dumps(environment(), sort_keys=True)
    return f"torch-{torch.__version__}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def resolve_root(setting: str | os.PathLike | bool | None) -> Path | None:
    """The cache root for a setting (see the module docstring); None when caching is off."""
    if setting is None or setting is True:
        setting = os.environ.get(ENV_VAR)
    if setting is None or setting is True:
        return fastgrpo_cache_root() / "compile"
    if setting is False or str(setting).strip().lower() in OFF_VALUES:
        return None
    if not str(setting).strip():
        raise ValueError(f"compile cache setting {setting!r}: give a directory, or 'off' to turn the caches off")
    return Path(setting).expanduser()


def _files(directory: Path):
    """Cache files under `directory`, with (size, mtime_ns): not lock files nor temporary files."""
    for path in directory.rglob("*"):
        name = path.name
        if name.startswith(".") or name.endswith(".lock") or "locks" in path.parts or not path.is_file():
            continue
        try:
            stat = path.stat()
        except FileNotFoundError:  # removed meanwhile by another process
            continue
        yield path, (stat.st_size, stat.st_mtime_ns)


def _sha256(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(handle, "w") as f:
        f.write(text)
    os.replace(temporary, path)


@dataclass
class CompileCache:
    """One environment directory of the persistent compile cache (see the module docstring)."""

    directory: Path
    # relative path -> [size, mtime_ns, sha256] as last recorded
    _manifest: dict = field(default_factory=dict, repr=False)

    @property
    def torch_dir(self) -> Path:
        return self.directory / "torch"

    @property
    def triton_dir(self) -> Path:
        return self.directory / "triton"

    def verify(self) -> list[str]:
        """Delete every file whose bytes differ from the manifest's record, and every entry of inductor's and
        AOTAutograd's caches whose bytes do not hash to its name (torch names them so: this covers entries
        written after the last manifest too); returns their paths relative to the directory."""
        try:
            self._manifest = json.loads((self.directory / MANIFEST).read_text())
        except FileNotFoundError:
            self._manifest = {}
        except (OSError, ValueError):  # the manifest itself is damaged: nothing left to check against
            self._manifest = {}
            (self.directory / MANIFEST).unlink(missing_ok=True)
        damaged = [relative for relative, (_, _, recorded) in self._manifest.items()
                   if _sha256(self.directory / relative) != recorded]
        damaged += [path.relative_to(self.directory).as_posix() for path in self._misnamed_entries()]
        for relative in dict.fromkeys(damaged):
            self._manifest.pop(relative, None)
            (self.directory / relative).unlink(missing_ok=True)
        return list(dict.fromkeys(damaged))

    def _misnamed_entries(self) -> list[Path]:
        try:
            from torch._inductor.codecache import sha256_hash
        except ImportError:  # another torch: the manifest alone checks
            return []
        entries = [*self.torch_dir.glob("fxgraph/*/*/*"), *self.torch_dir.glob("aotautograd/*/*")]
        return [path for path in entries
                if path.is_file() and not path.name.startswith(".") and sha256_hash(path.read_bytes()) != path.name]

    def record(self) -> None:
        """Write the manifest: every cache file with its SHA-256 (only new or changed files are hashed)."""
        if not self.directory.is_dir():
            return
        manifest = {}
        for path, (size, mtime) in _files(self.directory):
            relative = path.relative_to(self.directory).as_posix()
            if relative in (MANIFEST, ENVIRONMENT):
                continue
            known = self._manifest.get(relative)
            if known is not None and known[:2] == [size, mtime]:
                manifest[relative] = known
            elif (digest := _sha256(path)) is not None:
                manifest[relative] = [size, mtime, digest]
        self._manifest = manifest
        _write_atomic(self.directory / MANIFEST, json.dumps(manifest, sort_keys=True))


_active: CompileCache | None = None
_turned_off = False


def active_cache() -> CompileCache | None:
    """The cache `enable_compile_cache` set up in this process, if any."""
    return _active


def _last_used(directory: Path) -> float:
    """When a process last enabled the environment directory or recorded a compile in it."""
    times = [path.stat().st_mtime for path in (directory / ENVIRONMENT, directory / MANIFEST) if path.is_file()]
    return max(times, default=0.0)


def _prune(root: Path, keep: Path) -> None:
    """Remove the environment directories under `root` beyond the KEEP_ENVIRONMENTS most recently used, once unused
    for PRUNE_AFTER_S."""
    ours = sorted((p for p in root.iterdir() if (p / ENVIRONMENT).is_file() and p != keep), key=_last_used, reverse=True)
    for stale in ours[KEEP_ENVIRONMENTS - 1 :]:
        if time.time() - _last_used(stale) > PRUNE_AFTER_S:
            shutil.rmtree(stale, ignore_errors=True)


def enable_compile_cache(setting: str | os.PathLike | bool | None = None) -> CompileCache | None:
    """Keep compiled graphs and kernels across processes under the setting's directory (see the module
    docstring); returns the cache, or None when the setting turns caching off. Call it before the first compile
    of the process. Calling it again with the same setting returns the same cache."""
    global _active, _turned_off
    root = resolve_root(setting)
    if root is None:
        torch.compiler.config.force_disable_caches = _turned_off = True
        _active = None
        return None
    directory = root / environment_key()
    if _active is not None and _active.directory == directory:
        return _active
    directory.mkdir(parents=True, exist_ok=True)
    # Written on every enable: its mtime says when the environment was last used (for pruning).
    _write_atomic(directory / ENVIRONMENT, json.dumps(environment(), indent=1, sort_keys=True))
    _prune(root, keep=directory)
    cache = CompileCache(directory)
    damaged = cache.verify()
    if damaged:
        _report_damage(
            f"fastgrpo: {len(damaged)} compile cache file(s) in {directory} no longer matched what was written "
            f"({', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}); removed, their graphs compile again.")
    if _turned_off:  # an earlier call's "off", not the user's own setting
        torch.compiler.config.force_disable_caches = _turned_off = False
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache.torch_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache.triton_dir)
    if _active is None:
        atexit.register(lambda: _active is not None and _active.record())
    _active = cache
    return cache


def _named_cache_files(error: BaseException, directory: str) -> list[Path]:
    """Existing files under `directory` that `error` or the errors it came from name in their message, or whose
    code their traceback runs through (a generated module that fails while it is executed)."""
    prefix = directory.rstrip(os.sep) + os.sep
    pattern = re.compile(re.escape(prefix) + r"[^\s'\":,;()]+")
    found, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        named = pattern.findall(str(error))
        traceback = error.__traceback__
        while traceback is not None:
            named.append(traceback.tb_frame.f_code.co_filename)
            traceback = traceback.tb_next
        for name in named:
            path = Path(name.rstrip("."))
            if name.startswith(prefix) and path.is_file() and path not in found:
                found.append(path)
        error = error.__cause__ or error.__context__
    return found


def recovering(compile_fn):
    """`compile_fn` (inductor's inner compile) with its cache keys tagged; when it fails on files of the cache
    directory in use, the files the error names are deleted and it runs again, as long as each failure names
    new ones; after each compile the active cache's manifest is written (see the module docstring)."""

    @functools.wraps(compile_fn)
    def compile_with_recovery(*args, **kwargs):
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        from torch._inductor.utils import clear_caches

        removed, reason = [], None
        with tagged_cache_keys():
            while True:
                try:
                    result = compile_fn(*args, **kwargs)
                    break
                except Exception as error:
                    damaged = [p for p in _named_cache_files(error, cache_dir()) if p not in removed]
                    if not damaged:
                        raise
                    reason = reason or f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    for path in damaged:
                        path.unlink(missing_ok=True)
                    removed += damaged
                    clear_caches()  # inductor's in-memory code caches may hold what failed to load
        if _active is not None:
            _active.record()
        if removed:
            _report_damage(f"fastgrpo: compile cache file(s) {', '.join(map(str, removed))} could not be loaded "
                             f"({reason}); removed and compiled again.")
        return result

    return compile_with_recovery


_warned = False


def _report_damage(message: str) -> None:
    """The first report of damaged cache files in a process is a warning, later ones are logged."""
    global _warned
    if _warned:
        logger.info(message)
        return
    _warned = True
    warnings.warn(message + " Later damaged files are removed the same way and logged (logger fastgrpo.compiler.cache).",
                  CompileCacheWarning, stacklevel=3)

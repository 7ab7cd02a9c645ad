"""Compiled programs kept on disk across processes and runs (`standby.programs_dir`): a restarted
job, a rejoining process and the next run of the same config load a plan's executables instead of
compiling them.

Why not JAX's persistent compilation cache (`standby.cache_dir`)? On XLA:CPU an executable that
cache loaded cannot be serialized again, so it can be neither rebound to other devices nor shipped
to another process (`Executables.portable_ok`), and the cache's key includes the device assignment:
every device set of one program is its own entry. The store keeps the serialized form itself
(`executables.Portable`), keyed by the program: the lowered train and checksum modules, the JAX and
jaxlib versions, the backend, its version and the device kind, the process count, every scalar JAX
setting and the `XLA_FLAGS` but those of the client (the backends allowed, how many devices,
asynchronous dispatch), and, on the CPU backend, the host CPU's model and instruction-set flags
(XLA:CPU compiles for the host). A stored program loads onto any device set of its mesh shape, as a
rebind does (`executables.rebind`), and keeps its serialized form, so it can be rebound and shipped
again.

An entry that cannot be read (truncated, written by another version) is deleted and the plan
compiled; entries are written whole (a temporary file renamed), so concurrent writers of one
key leave one whole entry. The directory is kept under `max_mb` by deleting the entries read
longest ago.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
import platform
import re
from importlib import metadata
from pathlib import Path

import jax

from .executables import Portable


def default_dir() -> Path:
    """`$ELASJAX_CACHE_DIR/programs`, else `$XDG_CACHE_HOME/elasjax/programs`, else
    `~/.cache/elasjax/programs`."""
    base = os.environ.get("ELASJAX_CACHE_DIR")
    if base:
        return Path(base) / "programs"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "elasjax" / "programs"


@functools.cache
def _host_cpu() -> str:
    """The host CPU's model and instruction-set flags (what XLA:CPU compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


def _jaxlib_version() -> str:
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return ""


# Settings of the client, not of a compile: which backends it may use (the backend itself is in
# the key), how many devices it has (the program's own device count is in its module) and
# whether it dispatches asynchronously. A plan's compile worker sets the first two where the
# training process may have left them alone or used `XLA_FLAGS`, and the two processes must find
# each other's entries (tests/test_program_store.py).
_CLIENT_SETTINGS = frozenset({"jax_platforms", "jax_num_cpu_devices",
                              "jax_cpu_enable_async_dispatch"})
_CLIENT_SIZE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def _jax_settings() -> str:
    """Every scalar JAX setting (some change the compile options, not the module) but the
    client's own."""
    vals = getattr(jax.config, "values", {})
    return repr(sorted((k, v) for k, v in vals.items()
                       if isinstance(v, (bool, int, float, str, type(None)))
                       and k not in _CLIENT_SETTINGS))


def _xla_flags() -> str:
    """`XLA_FLAGS` but the client's size, in order."""
    return " ".join(_CLIENT_SIZE_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).split())


class ProgramStore:
    """A directory of serialized programs (see the module docstring)."""

    def __init__(self, path: str | Path, max_mb: float = 2048.0):
        self.path = Path(path).expanduser()
        self.max_bytes = int(max_mb * 1e6)
        self.loaded = 0  # plans loaded from the store
        self.stored = 0  # plans written to it
        self.unreadable = 0  # entries found broken (deleted; the plan compiled)

    @staticmethod
    def from_setting(setting: str | None, max_mb: float) -> "ProgramStore | None":
        """`standby.programs_dir`: None (no store), "auto" (`default_dir`) or a path."""
        if setting is None:
            return None
        return ProgramStore(default_dir() if setting == "auto" else setting, max_mb)

    def key(self, modules: list[str], device) -> str:
        """The digest naming `modules` (the lowered programs' text) compiled for devices like
        `device` (its backend, that backend's version, the device kind)."""
        backend = device.client
        h = hashlib.sha256()
        # the process count too, a precaution: a program compiled in one process runs in a
        # multi-process job (a launch job's compile worker is one process; the ZeRO demo under
        # launch with two kills ends bitwise on the one-process run, experiments/RESULTS.md "A
        # compile worker under launch"), but nothing checked that for every program
        parts = [jax.__version__, _jaxlib_version(), backend.platform, backend.platform_version,
                 device.device_kind, str(jax.process_count()), _xla_flags(),
                 _jax_settings()]
        if backend.platform == "cpu":
            parts.append(_host_cpu())
        for part in [*parts, *modules]:
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:40]

    def get(self, key: str) -> Portable | None:
        f = self.path / f"{key}.pkl"
        try:
            with open(f, "rb") as fh:
                got = pickle.load(fh)
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - broken entry: compiled again, written again
            self.unreadable += 1
            f.unlink(missing_ok=True)
            return None
        if not isinstance(got, Portable):
            self.unreadable += 1
            f.unlink(missing_ok=True)
            return None
        os.utime(f)  # read now: the last to go when the directory is trimmed
        self.loaded += 1
        return got

    def put(self, key: str, portable: Portable) -> None:
        """Keep `portable` under `key`, without a fresh state's program: that one bakes in
        the seed and the initial values, which the key (the train and checksum programs) does
        not name (tests/test_program_store.py)."""
        if portable.init is not None:
            portable = dataclasses.replace(portable, init=None)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = self.path / f".{key}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                pickle.dump(portable, fh, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self.path / f"{key}.pkl")
            self.stored += 1
            self._trim()
        except OSError:  # a full or read-only disk costs a compile next time, nothing else
            pass

    def _trim(self) -> None:
        entries = []
        for f in self.path.glob("*.pkl"):
            try:
                st = f.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, f))
        total = sum(s for _, s, _ in entries)
        for _, size, f in sorted(entries):
            if total <= self.max_bytes:
                break
            f.unlink(missing_ok=True)
            total -= size

    def __repr__(self) -> str:
        return f"ProgramStore({str(self.path)!r})"

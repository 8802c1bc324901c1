"""PyTorch's own CUDA allocations in managed memory, scoped, under a tiermem role.

    import torch, tiermem
    with tiermem.torch_memory.torch_allocations("activation"):
        loss = model(x).sum()          # every tensor torch allocates here is managed memory,
        loss.backward()                # the backward's gradients too (see NOTE [routing])
    tiermem.torch_memory.is_managed(model.fc.weight.grad)    # True; the tensors outlive the block

The managed allocation is a small C allocator (``csrc/managed_alloc.c``) that torch calls
through ``torch.cuda.memory.CUDAPluggableAllocator``. It is compiled at first use into a
per-user cache (``build_torch_allocator()`` does it ahead of time): see NOTE [building].

NOTE [routing]
    ``torch.cuda.use_mem_pool`` routes only the calling thread, and autograd runs the backward
    of CUDA tensors on its own device thread, so the gradients would escape the pool.
    ``torch._C._cuda_beginAllocateToPool(device, pool_id)`` instead routes every allocation on
    that device, from every thread and stream, to the pool (its stream filter accepts all
    streams; CUDA graph capture uses the same mechanism). So :func:`torch_allocations` is
    process-wide for its device, not thread-local: while a block is open, other threads'
    allocations on that device are managed too, under the block's role.

    torch's caching allocator lets one pool be routed at a time per entry, and refuses to route
    the same pool twice. So this module keeps the open blocks of each device in entry order and
    routes exactly one pool, the newest block's: nesting works (the inner role wins, the outer
    one comes back), blocks may close out of order (from several threads), and a block of the
    same role and advice as the one already routed shares its pool.

NOTE [pools live for the process]
    There is one ``torch.cuda.MemPool`` per (device, role, advice), created on first use and
    never destroyed, with one pluggable allocator for all of them. torch caches freed blocks
    inside a pool: a pool's segments keep the advice they were made with, so a block is reused
    only under the same advice, and a tensor made in a block stays valid after the block ends
    (its pool is still there). The cost is that a pool's cached segments are returned to the
    C allocator only with the pool, that is, not before the process ends; they count against
    the cap meanwhile, as torch's own cache counts against the GPU.

NOTE [building]
    The library is compiled with the C compiler (``$CC``, gcc, cc or clang) against the CUDA
    runtime headers of the CUDA major version torch was built with. nvcc is not used to compile
    even where it is installed: the file has no device code, nvcc would only add a device-link
    stub and libcudadevrt, and it calls the same host compiler anyway. nvcc's location helps to
    find the CUDA headers.

    One CUDA runtime per process: the library is linked against ``libcudart.so.<major>`` by
    that name and without an rpath, and it is loaded only after torch has loaded its own
    libcudart. The dynamic loader matches the library's DT_NEEDED entry by soname against the
    libraries already loaded, so the allocator binds to torch's runtime (whether torch took it
    from the CUDA toolkit or from the nvidia-cuda-runtime wheel) and never loads a second one.
    Linking the static runtime (nvcc's default) would give the allocator a private runtime with
    its own error state; an rpath could load a different runtime of the same major ahead of
    torch's.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..base.limits import resolve_cap
from ..errors import BuildError, ConfigError, ConfigTypeError, CUDAUnavailableError, RoleError, TierMemError
from ..roles import DEFAULT_POLICIES, Location, Policy, Role, as_role

__all__ = ["torch_allocations", "TorchAllocations", "is_managed", "torch_allocator_stats", "TorchAllocatorStats",
           "torch_managed_allocations", "ManagedAllocation", "set_torch_managed_cap", "build_torch_allocator",
           "find_cuda", "find_compiler", "build_command", "compile_library", "CudaPaths"]

SOURCE = Path(__file__).parent / "csrc" / "managed_alloc.c"
LIBRARY_NAME = "libtiermem_managed_alloc.so"
ABI_VERSION = 1                  # must match TM_ABI_VERSION in the C file
ENV_CACHE = "TIERMEM_CACHE_DIR"

# tm_set_advice's preferred-location values (TM_PREFER_* in the C file).
_PREFER = {None: 0, Location.HOST: 1, Location.DEVICE: 2}
_ROLES = list(Role)              # a role's id in C is its index here

_INSTALL_COMPILER = ("install a C compiler (Debian/Ubuntu: apt-get install gcc; RHEL: dnf install gcc), "
                     "or point CC at one")


# ---------------------------------------------------------------------------------------------
# Finding CUDA and a compiler, and building (NOTE [building])

@dataclasses.dataclass(frozen=True)
class CudaPaths:
    """Where the CUDA runtime headers and library are. ``version`` is CUDART_VERSION (13000 is 13.0)."""

    root: str
    include_dir: str
    lib_dir: str
    cudart: str          # the file to link: libcudart.so.<major>, or libcudart.so
    version: int

    @property
    def major(self) -> int:
        return self.version // 1000


def _cudart_version(header: Path) -> int | None:
    try:
        m = re.search(r"^\s*#\s*define\s+CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _candidate_roots(env: Mapping[str, str], which: Callable[[str], str | None]) -> list[str]:
    roots = [env.get("CUDA_HOME"), env.get("CUDA_PATH")]
    nvcc = which("nvcc")
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    roots.append("/usr/local/cuda")
    roots += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    # The nvidia-cuda-runtime wheels that torch depends on carry the headers too.
    for site in sys.path:
        roots += sorted(glob.glob(os.path.join(site, "nvidia", "cu[0-9]*")), reverse=True)
        roots.append(os.path.join(site, "nvidia", "cuda_runtime"))
    seen: list[str] = []
    for r in roots:
        if r and r not in seen:
            seen.append(r)
    return seen


def _probe_root(root: str) -> CudaPaths | None:
    for inc in (Path(root) / "include", Path(root) / "targets" / "x86_64-linux" / "include"):
        version = _cudart_version(inc / "cuda_runtime_api.h")
        if version is None:
            continue
        major = version // 1000
        for lib in (Path(root) / "lib64", Path(root) / "lib", Path(root) / "targets" / "x86_64-linux" / "lib"):
            for name in (f"libcudart.so.{major}", "libcudart.so"):
                if (lib / name).exists():
                    return CudaPaths(root, str(inc), str(lib), name, version)
    return None


def find_cuda(want_major: int | None = None, *, env: Mapping[str, str] | None = None,
              which: Callable[[str], str | None] = shutil.which, roots: list[str] | None = None) -> CudaPaths:
    """The first CUDA installation with runtime headers and libcudart, of major ``want_major``
    (torch's) when given. Looks in CUDA_HOME, CUDA_PATH, nvcc's installation, /usr/local/cuda*
    and the nvidia-cuda-runtime wheels. Raises :class:`BuildError` saying what to install."""
    env = os.environ if env is None else env
    found = [p for p in (_probe_root(r) for r in (roots if roots is not None else _candidate_roots(env, which))) if p]
    for p in found:
        if want_major is None or p.major == want_major:
            return p
    if found:
        have = ", ".join(f"{p.root} (CUDA {p.major})" for p in found)
        raise BuildError(
            f"tiermem's torch allocator must be built against CUDA {want_major}, the CUDA torch uses, but "
            f"only found {have}. Install the CUDA {want_major} runtime headers (the CUDA toolkit, or "
            f"pip install nvidia-cuda-runtime-cu{want_major}) and set CUDA_HOME to it")
    raise BuildError(
        "tiermem's torch allocator needs the CUDA runtime headers (cuda_runtime_api.h) and libcudart to build, "
        "and none were found in CUDA_HOME, CUDA_PATH, nvcc's directory, /usr/local/cuda* or the nvidia pip "
        f"packages. Install the CUDA toolkit{f' {want_major}' if want_major else ''} and set CUDA_HOME to it")


def find_compiler(*, env: Mapping[str, str] | None = None, which: Callable[[str], str | None] = shutil.which) -> str:
    """The C compiler: $CC, else gcc, cc or clang on PATH. Raises :class:`BuildError`."""
    env = os.environ if env is None else env
    cc = env.get("CC")
    if cc:
        path = which(cc)
        if not path:
            raise BuildError(f"CC={cc!r} is not an executable on PATH; {_INSTALL_COMPILER}")
        return path
    for name in ("gcc", "cc", "clang"):
        path = which(name)
        if path:
            return path
    raise BuildError(f"tiermem's torch allocator is compiled at first use, and no C compiler was found "
                     f"(tried $CC, gcc, cc, clang); {_INSTALL_COMPILER}")


def build_command(compiler: str, cuda: CudaPaths, source: str | os.PathLike[str], output: str | os.PathLike[str]) -> list[str]:
    """The compile-and-link command. Links libcudart by name, without an rpath (NOTE [building])."""
    return [compiler, "-O2", "-std=c11", "-fPIC", "-shared", "-Wall", "-I", cuda.include_dir, str(source),
            "-o", str(output), "-L", cuda.lib_dir, f"-l:{cuda.cudart}", "-lpthread"]


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """$TIERMEM_CACHE_DIR, else $XDG_CACHE_HOME/tiermem, else ~/.cache/tiermem."""
    env = os.environ if env is None else env
    if env.get(ENV_CACHE):
        return Path(env[ENV_CACHE])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiermem"


def library_path(source: bytes, key: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Path:
    """Where the library built from ``source`` with ``key`` (versions, paths) lives in the cache."""
    h = hashlib.sha256(source)
    for k in sorted(key):
        h.update(f"\0{k}={key[k]}".encode())
    return cache_dir(env) / h.hexdigest()[:16] / LIBRARY_NAME


def _torch_cuda_major() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    v = torch.version.cuda
    return int(v.split(".")[0]) if v else None


def build_torch_allocator(force: bool = False) -> Path:
    """Compile the allocator into the cache, unless it is there already; return its path.

    Safe to call from several processes: each builds into a temporary file that is renamed
    into place. Raises :class:`BuildError` (no compiler, no CUDA headers, the compiler failed).
    """
    import torch
    major = _torch_cuda_major()
    if major is None:
        raise CUDAUnavailableError(f"torch {torch.__version__} is built without CUDA; tiermem's torch allocator "
                                   f"needs a CUDA build of torch")
    cuda = find_cuda(major)
    compiler = find_compiler()
    source = SOURCE.read_bytes()
    out = library_path(source, {"abi": ABI_VERSION, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                                "cudart": cuda.version, "include": cuda.include_dir, "lib": cuda.lib_dir,
                                "cudart_file": cuda.cudart, "compiler": os.path.realpath(compiler)})
    if out.exists() and not force:
        return out
    return compile_library(compiler, cuda, out)


def compile_library(compiler: str, cuda: CudaPaths, output: str | os.PathLike[str], source: str | os.PathLike[str] = SOURCE) -> Path:
    """Compile ``source`` into ``output``: into a temporary file first, renamed into place, so
    that concurrent builds and crashes never leave a partial library. Raises :class:`BuildError`."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = build_command(compiler, cuda, source, tmp)
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise BuildError(f"could not run the C compiler {compiler}: {e}; {_INSTALL_COMPILER}") from e
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
            raise BuildError(f"building tiermem's torch allocator failed (exit {proc.returncode}):\n"
                             f"  {' '.join(cmd)}\n{tail}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# ---------------------------------------------------------------------------------------------
# The loaded library

_lock = threading.RLock()      # guards everything below, and every routing change
_lib: Any = None
_allocator: Any = None         # the CUDAPluggableAllocator, shared by all pools; never freed
_pools: dict[tuple, Any] = {}  # (device, role, advice args) -> torch.cuda.MemPool; never freed
_open: dict[int, list[TorchAllocations]] = {}   # device -> open blocks, in entry order
_routed: dict[int, Any] = {}   # device -> the MemPool routed now


def _torch_cuda() -> Any:
    """torch, once it is known to have a usable CUDA device; else :class:`CUDAUnavailableError`."""
    try:
        import torch
    except ImportError as e:
        raise CUDAUnavailableError("torch is not installed; install tiermem's torch extra: pip install 'tiermem[torch]'") from e
    if not torch.version.cuda:
        raise CUDAUnavailableError(f"torch {torch.__version__} is built without CUDA; install a CUDA build of torch")
    if not torch.cuda.is_available():
        raise CUDAUnavailableError("torch sees no CUDA GPU (no GPU, or no usable driver); "
                                   "tiermem's torch allocations need one")
    return torch


def _bind(lib: Any) -> Any:
    c = ctypes
    sigs = {
        "tm_abi_version": ([], c.c_int), "tm_cudart_version": ([], c.c_int), "tm_max_devices": ([], c.c_int),
        "tm_set_advice": ([c.c_int] * 7, c.c_int), "tm_get_advice": ([c.c_int, c.POINTER(c.c_int)], c.c_int),
        "tm_set_cap": ([c.c_longlong], c.c_int), "tm_stat_names": ([], c.c_char_p),
        "tm_get_stats": ([c.POINTER(c.c_longlong), c.c_int], c.c_int), "tm_reset_peak": ([], None),
        "tm_last_error": ([], c.c_int),
        "tm_live_allocations": ([c.POINTER(c.c_uint64), c.POINTER(c.c_uint64), c.POINTER(c.c_int),
                                 c.POINTER(c.c_int), c.c_longlong], c.c_longlong),
        "tm_concurrent_managed_access": ([c.c_int], c.c_int), "tm_pointer_type": ([c.c_void_p], c.c_int),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def _load(device: int) -> Any:
    """The loaded library (built first if needed). On first load, sets the cap from tiermem's
    managed cap (NOTE [managed cap] in base/limits.py) for ``device``."""
    global _lib, _allocator
    with _lock:
        if _lib is not None:
            return _lib
        torch = _torch_cuda()
        torch.cuda.init()          # torch's libcudart is loaded before ours (NOTE [building])
        path = build_torch_allocator()
        lib = _bind(ctypes.CDLL(str(path)))
        if lib.tm_abi_version() != ABI_VERSION:
            raise BuildError(f"{path} has ABI {lib.tm_abi_version()}, this tiermem needs {ABI_VERSION}; "
                             f"delete it and build again")
        free, total = torch.cuda.mem_get_info(device)
        limit, _ = resolve_cap(None, None, free=free, total=total)
        lib.tm_set_cap(limit)
        # Loads the same library again by path: dlopen returns the same handle, so torch's calls and
        # ours share one set of counters.
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(str(path), "tm_alloc", "tm_free")
        _lib = lib
        return lib


# ---------------------------------------------------------------------------------------------
# Advice and routing

def advice_args(role: Role, policy: Policy, prefetch: bool, *, concurrent_managed_access: bool = True) -> tuple[int, ...]:
    """tm_set_advice's arguments after the device: role id, preferred, read-mostly, accessed-by
    device, accessed-by host, prefetch. Without concurrent managed access all advice and the
    prefetch are left out (as tiermem does elsewhere: they do nothing useful there)."""
    if not concurrent_managed_access:
        return (_ROLES.index(role), 0, 0, 0, 0, 0)
    return (_ROLES.index(role), _PREFER[policy.preferred_location], int(policy.read_mostly),
            int(policy.accessed_by_device), int(policy.accessed_by_host), int(prefetch))


@dataclasses.dataclass(eq=False)
class TorchAllocations:
    """One open :func:`torch_allocations` block: what it routes, and to which pool."""

    role: Role
    device: int
    policy: Policy
    prefetch: bool
    pool: Any = dataclasses.field(repr=False)      # the torch.cuda.MemPool
    _args: tuple[int, ...] = dataclasses.field(repr=False, default=())


def _pool_for(torch: Any, device: int, key: tuple) -> Any:
    pool = _pools.get(key)
    if pool is None:
        with torch.cuda.device(device):     # a MemPool belongs to the current device
            pool = torch.cuda.MemPool(_allocator.allocator())
        _pools[key] = pool
    return pool


def _reroute(torch: Any, device: int) -> None:
    """Route ``device``'s allocations to the newest open block's pool, or to none (NOTE [routing])."""
    blocks = _open.get(device) or []
    want = blocks[-1] if blocks else None
    current = _routed.get(device)
    if want is not None and current is want.pool:
        return
    if current is not None:
        torch._C._cuda_endAllocateToPool(device, current.id)
        torch._C._cuda_releasePool(device, current.id)
        _routed.pop(device, None)
    if want is not None:
        # Set before routing: torch calls tm_alloc under its allocator lock, which routing takes too.
        if _lib.tm_set_advice(device, *want._args) != 0:
            raise TierMemError(f"tm_set_advice{(device, *want._args)} refused its arguments")
        torch._C._cuda_beginAllocateToPool(device, want.pool.id)
        _routed[device] = want.pool


def _policy_for(role: Role) -> Policy:
    """The role's policy in the default Tier when one exists (its overrides apply), else the default."""
    from ..base import default as _default
    tier = _default.peek()
    return tier.policies[role] if tier is not None else DEFAULT_POLICIES[role]


@contextlib.contextmanager
def torch_allocations(role: Role | str = Role.ACTIVATION, device: int | None = None, *,
                      policy: Policy | None = None, prefetch: bool | None = None) -> Iterator[TorchAllocations]:
    """Within the block, torch's CUDA allocations on ``device`` are CUDA managed memory with the
    memory advice of ``role``.

    Process-wide for the device, not thread-local: allocations from every thread, the autograd
    backward's included, go to the block's pool (NOTE [routing]). Blocks nest; the innermost
    role wins. Tensors made in the block stay valid after it (NOTE [pools live for the process]).

    role      the tiermem role whose policy advises the new memory (its override in the default
              Tier applies, if that Tier exists).
    device    CUDA device index; None: torch's current device.
    policy    advise with this :class:`Policy` instead of the role's.
    prefetch  prefetch each new segment to the device on its stream when it is allocated; None:
              unless the policy prefers the host.

    Advice is set when torch allocates a new segment; blocks torch reuses from the pool keep it.
    The memory counts against a cap, tiermem's managed cap by default (see
    :func:`set_torch_managed_cap`); past it, torch raises ``torch.OutOfMemoryError``.
    Raises :class:`CUDAUnavailableError` (no GPU or no CUDA torch) or :class:`BuildError`.
    """
    r = as_role(role)
    if policy is not None and not isinstance(policy, Policy):
        raise RoleError(f"policy must be a tiermem Policy, got {type(policy).__name__}")
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ConfigTypeError(f"prefetch must be True, False or None, got {prefetch!r}")
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
        raise ConfigTypeError(f"device must be a CUDA device index (an int >= 0) or None, got {device!r}")
    if device is not None and device < 0:
        raise ConfigError(f"device must be a CUDA device index (an int >= 0) or None, got {device!r}")
    torch = _torch_cuda()
    dev = torch.cuda.current_device() if device is None else device
    if dev >= torch.cuda.device_count():
        raise CUDAUnavailableError(f"device {dev} does not exist; torch sees {torch.cuda.device_count()} GPU(s)")
    lib = _load(dev)
    if dev >= lib.tm_max_devices():
        raise ConfigError(f"device {dev} is past the {lib.tm_max_devices()} devices the allocator tracks")
    pol = policy if policy is not None else _policy_for(r)
    pf = (pol.preferred_location is not Location.HOST) if prefetch is None else prefetch
    args = advice_args(r, pol, pf, concurrent_managed_access=lib.tm_concurrent_managed_access(dev) == 1)
    with _lock:
        block = TorchAllocations(r, dev, pol, pf, _pool_for(torch, dev, (dev, *args)), args)
        _open.setdefault(dev, []).append(block)
        try:
            _reroute(torch, dev)
        except BaseException:
            _open[dev].remove(block)
            raise
    try:
        yield block
    finally:
        with _lock:
            _open[dev].remove(block)
            _reroute(torch, dev)


# ---------------------------------------------------------------------------------------------
# Reading it back

def is_managed(tensor: Any) -> bool:
    """Whether ``tensor``'s memory is CUDA managed memory (cudaPointerGetAttributes). False for
    CPU and empty tensors."""
    if not getattr(tensor, "is_cuda", False):
        return False
    ptr = tensor.data_ptr()
    if ptr == 0:
        return False
    try:
        from ..cuda import runtime as _cuda
        return _cuda.pointer_kind(ptr) == "managed"
    except CUDAUnavailableError:      # no cuda-bindings: ask through the allocator's library
        return _load(tensor.device.index).tm_pointer_type(ptr) == 3


@dataclasses.dataclass(frozen=True)
class TorchAllocatorStats:
    """The C allocator's counters, over all devices. Bytes are raw segment bytes as torch asked
    for them (torch rounds and caches: see NOTE [pools live for the process]).

    live_bytes, peak_bytes   managed bytes held now, and the most held at once (since reset)
    allocations, frees       segments allocated and freed
    refused                  allocations refused by the cap
    failed                   allocations cudaMallocManaged (or a bad argument) refused
    hints_failed             advice or prefetch calls that failed (the memory was still given)
    live_allocations         segments held now
    cap_bytes                the cap on live_bytes
    """

    live_bytes: int
    peak_bytes: int
    allocations: int
    frees: int
    refused: int
    failed: int
    hints_failed: int
    live_allocations: int
    cap_bytes: int

    def as_dict(self) -> dict[str, int]:
        """Flat keys ``torch_managed.<field>``."""
        return {f"torch_managed.{k}": v for k, v in dataclasses.asdict(self).items()}


def _loaded() -> Any:
    if _lib is None:
        raise TierMemError("tiermem's torch allocator is not loaded yet: open a torch_allocations() block first")
    return _lib


def torch_allocator_stats() -> TorchAllocatorStats:
    lib = _loaded()
    names = lib.tm_stat_names().decode().split(",")
    buf = (ctypes.c_longlong * len(names))()
    lib.tm_get_stats(buf, len(names))
    return TorchAllocatorStats(**{n: int(v) for n, v in zip(names, buf)})


@dataclasses.dataclass(frozen=True)
class ManagedAllocation:
    """One live segment of the C allocator: its address, size in bytes, role and device."""

    ptr: int
    nbytes: int
    role: Role
    device: int


def torch_managed_allocations() -> list[ManagedAllocation]:
    """The live segments, for a budget enforcer to choose from. A snapshot: thread-safe, but
    segments may come and go right after."""
    lib = _loaded()
    n = 0
    while True:
        cap = n + 64
        ptrs, sizes = (ctypes.c_uint64 * cap)(), (ctypes.c_uint64 * cap)()
        roles, devices = (ctypes.c_int * cap)(), (ctypes.c_int * cap)()
        n = lib.tm_live_allocations(ptrs, sizes, roles, devices, cap)
        if n <= cap:
            return [ManagedAllocation(int(ptrs[i]), int(sizes[i]), _ROLES[roles[i]], int(devices[i])) for i in range(n)]


def set_torch_managed_cap(cap: int | str | None = None, *, allow_oversubscribe: bool | None = None,
                          device: int | None = None) -> int:
    """Set the cap on the allocator's live managed bytes and return it in bytes.

    ``cap`` takes what tiermem's managed cap takes (bytes, "4GiB", "50%" of the device), and the
    same opt-in for more than the device's free memory (NOTE [managed cap] in base/limits.py); None:
    the default, TIERMEM_MANAGED_CAP or the free memory of ``device`` now. The cap covers all
    devices together, and it is separate from the cap of tiermem's own tensors.
    """
    torch = _torch_cuda()
    dev = torch.cuda.current_device() if device is None else device
    lib = _load(dev)
    free, total = torch.cuda.mem_get_info(dev)
    limit, _ = resolve_cap(cap, allow_oversubscribe, free=free, total=total)
    lib.tm_set_cap(limit)
    return limit

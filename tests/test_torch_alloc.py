"""The torch allocator without a GPU: finding CUDA and a compiler, the build command, the cache
path, the errors that say what to install, argument checks, and the C allocator's refusals
(built and called where gcc and the CUDA headers exist, with no GPU needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tiermem import Policy, Role, TierMemError
from tiermem.errors import BuildError, CUDAUnavailableError, RoleError
from tiermem.pytorch import allocator as ta
from tiermem.roles import DEFAULT_POLICIES


def _fake_cuda(root, version=13000, lib="lib64", cudart="libcudart.so.13"):
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime_api.h").write_text(f"/* header */\n#define CUDART_VERSION  {version}\n")
    (root / lib).mkdir()
    (root / lib / cudart).write_bytes(b"")
    return str(root)


def _no_which(name):
    return None


# ---------------------------------------------------------------------------------------------
# Finding CUDA

def test_find_cuda_reads_the_header_version_and_the_versioned_runtime(tmp_path):
    root = _fake_cuda(tmp_path / "cuda-13.0")
    found = ta.find_cuda(13, roots=[root])
    assert found == ta.CudaPaths(root, f"{root}/include", f"{root}/lib64", "libcudart.so.13", 13000)
    assert found.major == 13


def test_find_cuda_prefers_torchs_major_over_an_earlier_root(tmp_path):
    old = _fake_cuda(tmp_path / "cuda-12.4", version=12040, cudart="libcudart.so.12")
    new = _fake_cuda(tmp_path / "cuda-13.0", version=13000, lib="lib")
    assert ta.find_cuda(13, roots=[old, new]).root == new
    assert ta.find_cuda(12, roots=[old, new]).root == old
    assert ta.find_cuda(None, roots=[old, new]).root == old


def test_find_cuda_takes_an_unversioned_runtime(tmp_path):
    root = _fake_cuda(tmp_path / "cuda", cudart="libcudart.so")
    assert ta.find_cuda(13, roots=[root]).cudart == "libcudart.so"


def test_find_cuda_skips_a_root_without_the_runtime_library(tmp_path):
    root = tmp_path / "headers-only"
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    with pytest.raises(BuildError, match="CUDA runtime headers"):
        ta.find_cuda(13, roots=[str(root)])


def test_find_cuda_says_which_major_is_needed_when_only_another_is_installed(tmp_path):
    old = _fake_cuda(tmp_path / "cuda-12.4", version=12040, cudart="libcudart.so.12")
    with pytest.raises(BuildError) as e:
        ta.find_cuda(13, roots=[old])
    msg = str(e.value)
    assert "CUDA 13" in msg and f"{old} (CUDA 12)" in msg and "CUDA_HOME" in msg


def test_no_cuda_anywhere_says_what_to_install(tmp_path):
    with pytest.raises(BuildError) as e:
        ta.find_cuda(13, roots=[str(tmp_path / "nothing")])
    msg = str(e.value)
    assert "cuda_runtime_api.h" in msg and "Install the CUDA toolkit 13" in msg and "CUDA_HOME" in msg


def test_candidate_roots_order(tmp_path):
    nvcc = tmp_path / "tk" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("")
    env = {"CUDA_HOME": "/opt/home", "CUDA_PATH": "/opt/path"}
    roots = ta._candidate_roots(env, lambda name: str(nvcc) if name == "nvcc" else None)
    assert roots[:4] == ["/opt/home", "/opt/path", str(tmp_path / "tk"), "/usr/local/cuda"]
    assert len(roots) == len(set(roots))


# ---------------------------------------------------------------------------------------------
# The compiler and the command

def test_no_compiler_says_what_to_install():
    with pytest.raises(BuildError) as e:
        ta.find_compiler(env={}, which=_no_which)
    msg = str(e.value)
    assert "no C compiler" in msg and "apt-get install gcc" in msg and "CC" in msg


def test_a_bad_CC_is_named():
    with pytest.raises(BuildError, match=r"CC='nosuchcc' is not an executable"):
        ta.find_compiler(env={"CC": "nosuchcc"}, which=_no_which)


def test_compiler_order():
    have = {"cc": "/usr/bin/cc", "clang": "/usr/bin/clang", "mycc": "/opt/mycc"}
    assert ta.find_compiler(env={}, which=have.get) == "/usr/bin/cc"
    assert ta.find_compiler(env={"CC": "mycc"}, which=have.get) == "/opt/mycc"
    assert ta.find_compiler(env={}, which={**have, "gcc": "/usr/bin/gcc"}.get) == "/usr/bin/gcc"


def test_build_command_links_the_shared_runtime_by_soname_without_rpath():
    cuda = ta.CudaPaths("/cuda", "/cuda/include", "/cuda/lib64", "libcudart.so.13", 13000)
    cmd = ta.build_command("/usr/bin/gcc", cuda, "/src/a.c", "/out/a.so")
    assert cmd == ["/usr/bin/gcc", "-O2", "-std=c11", "-fPIC", "-shared", "-Wall", "-I", "/cuda/include",
                   "/src/a.c", "-o", "/out/a.so", "-L", "/cuda/lib64", "-l:libcudart.so.13", "-lpthread"]
    assert not any("rpath" in part for part in cmd)
    assert not any("static" in part for part in cmd)


def test_a_failing_compiler_reports_the_command_and_its_output(tmp_path):
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\necho 'fatal: something broke' >&2\nexit 3\n")
    cc.chmod(0o755)
    cuda = ta.CudaPaths("/cuda", "/cuda/include", "/cuda/lib64", "libcudart.so.13", 13000)
    with pytest.raises(BuildError) as e:
        ta.compile_library(str(cc), cuda, tmp_path / "out" / "lib.so")
    assert "exit 3" in str(e.value) and "fatal: something broke" in str(e.value) and str(cc) in str(e.value)
    assert os.listdir(tmp_path / "out") == []        # no partial library, no temporary left


def test_a_missing_compiler_binary_is_a_build_error(tmp_path):
    cuda = ta.CudaPaths("/cuda", "/cuda/include", "/cuda/lib64", "libcudart.so.13", 13000)
    with pytest.raises(BuildError, match="could not run the C compiler"):
        ta.compile_library(str(tmp_path / "gone"), cuda, tmp_path / "lib.so")


# ---------------------------------------------------------------------------------------------
# The cache

def test_cache_dir_precedence(tmp_path):
    assert ta.cache_dir({"TIERMEM_CACHE_DIR": "/a", "XDG_CACHE_HOME": "/b"}) == ta.Path("/a")
    assert ta.cache_dir({"XDG_CACHE_HOME": "/b"}) == ta.Path("/b/tiermem")
    assert ta.cache_dir({}) == ta.Path(os.path.expanduser("~")) / ".cache" / "tiermem"


def test_library_path_changes_with_the_source_and_every_key():
    env = {"TIERMEM_CACHE_DIR": "/c"}
    base = ta.library_path(b"src", {"torch": "2.11", "cudart": 13000}, env)
    assert base.parent.parent == ta.Path("/c") and base.name == ta.LIBRARY_NAME
    assert ta.library_path(b"src", {"cudart": 13000, "torch": "2.11"}, env) == base     # order does not matter
    assert ta.library_path(b"src2", {"torch": "2.11", "cudart": 13000}, env) != base
    assert ta.library_path(b"src", {"torch": "2.12", "cudart": 13000}, env) != base
    assert ta.library_path(b"src", {"torch": "2.11", "cudart": 13020}, env) != base


def test_the_source_ships_with_the_package():
    assert ta.SOURCE.is_file()
    text = ta.SOURCE.read_text()
    assert f"#define TM_ABI_VERSION {ta.ABI_VERSION}" in text


# ---------------------------------------------------------------------------------------------
# Advice and arguments

@pytest.mark.parametrize("role", list(Role))
def test_advice_args_follow_the_role_policy(role):
    pol = DEFAULT_POLICIES[role]
    args = ta.advice_args(role, pol, True)
    preferred = {None: 0, "host": 1, "device": 2}[pol.preferred_location.value if pol.preferred_location else None]
    assert args == (list(Role).index(role), preferred, int(pol.read_mostly), int(pol.accessed_by_device),
                    int(pol.accessed_by_host), 1)
    assert ta.advice_args(role, pol, False)[-1] == 0
    assert ta.advice_args(role, pol, True, concurrent_managed_access=False) == (list(Role).index(role), 0, 0, 0, 0, 0)


def test_advice_args_of_a_custom_policy():
    pol = Policy("host", read_mostly=True, accessed_by_device=True, accessed_by_host=True)
    assert ta.advice_args(Role.INPUT, pol, False) == (list(Role).index(Role.INPUT), 1, 1, 1, 1, 0)


@pytest.mark.parametrize("kwargs, error, pattern", [
    ({"role": "activations"}, RoleError, "unknown role 'activations'"),
    ({"role": "weight", "policy": "host"}, RoleError, "policy must be a tiermem Policy, got str"),
    ({"prefetch": 1}, TierMemError, "prefetch must be True, False or None, got 1"),
    ({"device": -1}, TierMemError, "device must be a CUDA device index .* got -1"),
    ({"device": "cuda:0"}, TierMemError, "got 'cuda:0'"),
    ({"device": True}, TierMemError, "got True"),
])
def test_arguments_are_checked_before_cuda_is_touched(kwargs, error, pattern, monkeypatch):
    monkeypatch.setattr(ta, "_torch_cuda", lambda: pytest.fail("CUDA touched before the arguments were checked"))
    with pytest.raises(error, match=pattern):
        with ta.torch_allocations(**kwargs):
            pass


def test_no_gpu_is_a_clear_error(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CUDAUnavailableError, match="torch sees no CUDA GPU"):
        with ta.torch_allocations("activation"):
            pass


def test_a_cpu_torch_is_a_clear_error(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(CUDAUnavailableError, match="built without CUDA"):
        with ta.torch_allocations("activation"):
            pass
    with pytest.raises(CUDAUnavailableError, match="built without CUDA"):
        ta.build_torch_allocator()


def test_stats_before_loading_say_what_to_do(monkeypatch):
    monkeypatch.setattr(ta, "_lib", None)
    with pytest.raises(TierMemError, match="open a torch_allocations"):
        ta.torch_allocator_stats()
    with pytest.raises(TierMemError, match="open a torch_allocations"):
        ta.torch_managed_allocations()


def test_cpu_tensors_are_not_managed():
    torch = pytest.importorskip("torch")
    assert ta.is_managed(torch.ones(4)) is False
    assert ta.is_managed(object()) is False


def test_stats_dict_keys():
    s = ta.TorchAllocatorStats(*range(9))
    assert list(s.as_dict()) == [f"torch_managed.{f}" for f in (
        "live_bytes", "peak_bytes", "allocations", "frees", "refused", "failed", "hints_failed",
        "live_allocations", "cap_bytes")]


# ---------------------------------------------------------------------------------------------
# The C allocator itself, built and called without a GPU

def _real_cuda():
    try:
        return ta.find_cuda(None), ta.find_compiler()
    except BuildError as e:
        pytest.skip(f"cannot build here: {e}")


_DRIVE = textwrap.dedent("""
    import ctypes, json, sys
    cudart, lib_path = sys.argv[1], sys.argv[2]
    ctypes.CDLL(cudart, mode=ctypes.RTLD_GLOBAL)   # as torch would have: found by soname afterwards
    lib = ctypes.CDLL(lib_path)
    lib.tm_alloc.restype = ctypes.c_void_p
    lib.tm_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.tm_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.tm_set_cap.argtypes = [ctypes.c_longlong]
    lib.tm_stat_names.restype = ctypes.c_char_p
    names = lib.tm_stat_names().decode().split(",")
    def stats():
        buf = (ctypes.c_longlong * len(names))()
        lib.tm_get_stats(buf, len(names))
        return dict(zip(names, buf))
    out = {"abi": lib.tm_abi_version(), "cudart": lib.tm_cudart_version()}
    out["cap0"] = lib.tm_alloc(1 << 20, 0, None)              # the cap starts at 0: refused
    out["bad_size"] = lib.tm_alloc(-5, 0, None)
    out["bad_device"] = lib.tm_alloc(1 << 20, 99, None)
    out["set_cap"] = lib.tm_set_cap(1 << 30)
    out["bad_cap"] = lib.tm_set_cap(-1)
    out["no_gpu"] = lib.tm_alloc(1 << 20, 0, None)            # cudaMallocManaged fails: NULL
    lib.tm_free(ctypes.c_void_p(0x1000), 1 << 20, 0, None)    # not ours: left alone
    lib.tm_free(None, 0, 0, None)
    out["bad_advice"] = [lib.tm_set_advice(-1, 0, 0, 0, 0, 0, 0), lib.tm_set_advice(0, 0, 7, 0, 0, 0, 0)]
    out["good_advice"] = lib.tm_set_advice(3, 2, 2, 1, 1, 0, 1)
    adv = (ctypes.c_int * 6)()
    lib.tm_get_advice(3, adv)
    out["advice"] = list(adv)
    out["live"] = lib.tm_live_allocations(None, None, None, None, 0)
    if out["no_gpu"]:                                         # a GPU after all: give it back
        lib.tm_free(ctypes.c_void_p(out["no_gpu"]), 1 << 20, 0, None)
        out["live_after_free"] = lib.tm_live_allocations(None, None, None, None, 0)
    out["stats"] = stats()
    print(json.dumps(out))
""")


def test_the_c_allocator_refuses_without_crashing(tmp_path):
    cuda, cc = _real_cuda()
    lib = ta.compile_library(cc, cuda, tmp_path / "lib.so")
    proc = subprocess.run([sys.executable, "-c", _DRIVE, os.path.join(cuda.lib_dir, cuda.cudart), str(lib)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["abi"] == ta.ABI_VERSION and out["cudart"] == cuda.version
    assert out["cap0"] is None and out["bad_size"] is None and out["bad_device"] is None
    assert out["set_cap"] == 0 and out["bad_cap"] == -1
    assert out["bad_advice"] == [-1, -1] and out["good_advice"] == 0
    assert out["advice"] == [2, 2, 1, 1, 0, 1]
    common = {"live_bytes": 0, "refused": 1, "cap_bytes": 1 << 30, "hints_failed": 0, "live_allocations": 0}
    if out["no_gpu"] is None:     # no GPU: cudaMallocManaged refuses, and NULL comes back
        assert out["live"] == 0
        assert out["stats"] == {**common, "peak_bytes": 0, "allocations": 0, "frees": 0, "failed": 3}
        assert "cudaMallocManaged(1048576) failed" in proc.stderr
    else:                         # a GPU: the allocation is registered, and freed
        assert (out["live"], out["live_after_free"]) == (1, 0)
        assert out["stats"] == {**common, "peak_bytes": 1 << 20, "allocations": 1, "frees": 1, "failed": 2}
    # Each kind of failure is logged once, on stderr, and says what happened.
    assert "refused 1048576 bytes: 0 in use, the cap is 0 bytes" in proc.stderr
    assert "not an allocation of this allocator" in proc.stderr
    assert proc.stderr.count("bad arguments") == 1

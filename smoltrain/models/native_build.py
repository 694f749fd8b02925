"""Our decode kernels' library (q4_0.c and kernels.c), built for this machine and loaded through ctypes.

The C files are compiled once per machine (-march=native on x86, -mcpu=native on Arm: the
cache key holds the CPU's flags, so hosts sharing a home directory each get their own) into
~/.cache/smolcluster, a directory only its owner may use, atomically, so ranks starting together
do not trip over each other. A library is loaded only from that private directory, owned by the
user, and only when its bytes hash to what the build wrote beside it: a `.so` planted there is
rebuilt over, never run. A compiler without OpenMP (Apple's clang) builds with -fopenmp-simd,
one thread a call. A failed build is cached with its reason (one failure per compiler, not one
per process) and said once. `library()` is None (and `status()` says why) where no C compiler
is found, the build fails, the CPU has neither AVX2 nor NEON, or SMOL_NATIVE=0.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "q4_0.c", HERE / "kernels.c")
ISA = {0: "c", 1: "avx2", 2: "avx512-vnni", 3: "neon", 4: "neon-dotprod"}  # simd() -> name
OPENMP_FLAGS = (["-fopenmp"], ["-fopenmp-simd"], [])  # Apple's clang has no -fopenmp


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def arm() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smolcluster"


def compiler() -> str | None:
    """$CC (a name on PATH or a path; one that is not there is no compiler: never another in its
    place), else cc, gcc or clang on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _arch_flags(march: str | None) -> list[list[str]]:
    if march:
        return [[f"-march={march}"]]
    return [["-mcpu=native"], []] if arm() else [["-march=native"]]


def build(lib: Path, march: str | None = None, cc: str | None = None) -> list[str]:
    """Compile the C files into `lib` (for `march`: the tests build each instruction path) and
    write its sha256 beside it. Returns the flags that built it; raises OSError with the
    compiler's first error line where none did."""
    cc = cc or compiler()
    if not cc:
        raise OSError(f"no C compiler (CC={os.environ['CC']!r} not found)" if os.environ.get("CC") else "no C compiler")
    fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so")
    os.close(fd)
    why = ""
    try:
        for arch in _arch_flags(march):
            for omp in OPENMP_FLAGS:
                flags = ["-O3", *arch, *omp]
                cmd = [cc, *flags, "-shared", "-fPIC", *map(str, SOURCES), "-o", tmp, "-lm"]
                try:
                    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                except (OSError, subprocess.TimeoutExpired) as e:
                    raise OSError(f"{cc}: {e}") from None
                if run.returncode == 0:
                    digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
                    _write(lib.with_suffix(".sha256"), digest)
                    os.replace(tmp, lib)
                    return flags
                errors = [x for x in run.stderr.splitlines() if "error" in x] or run.stderr.splitlines() or ["?"]
                why = why or f"{Path(cc).name} {' '.join(flags)}: {errors[0].strip()}"
        raise OSError(why)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def private(d: Path) -> Path:
    """`d`, created 0700; refused (OSError) where it is a link or another user's, narrowed to 0700
    where it is ours but open to others: whoever can write there runs code in every rank."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{d} is not a directory of its own (a link?)")
    if st.st_uid != os.getuid():
        raise OSError(f"{d} belongs to uid {st.st_uid}, not this user ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def trusted(lib: Path) -> str | None:
    """Why `lib` must not be loaded, or None: a regular file of this user's that only they may
    write, whose bytes hash to the sha256 its build wrote beside it."""
    side = lib.with_suffix(".sha256")
    for p in (lib, side):
        try:
            st = os.lstat(p)
        except OSError:
            return f"{p.name} is missing"
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return f"{p} is not a file only this user may write"
    if hashlib.sha256(lib.read_bytes()).hexdigest() != side.read_text().strip():
        return f"{lib} does not hash to what its build wrote"
    return None


def _bind(so: ctypes.CDLL) -> ctypes.CDLL:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    so.q4_0_mm.argtypes = [p, i, i, p, p, i, p, i]
    so.q8_0_mm.argtypes = [p, i, i, p, p, i, p, i]
    so.f32_gemv.argtypes = [p, i, p, i, p, i]
    so.rms_norm_row.argtypes = [p, p, i, f, p]
    so.attend_row.argtypes = [p, i, i, i, p, p, p, p, i, i, p, i]
    so.swiglu_row.argtypes = [p, i, p]
    so.layer_norm_row.argtypes = [p, p, p, i, f, p]
    so.gelu_row.argtypes = [p, i, i, p]
    for fn in (so.q4_0_mm, so.q8_0_mm, so.f32_gemv, so.simd, so.openmp, so.attend_row):
        fn.restype = i
    for fn in (so.rms_norm_row, so.swiglu_row, so.layer_norm_row, so.gelu_row):
        fn.restype = None
    return so


def load(lib: Path) -> ctypes.CDLL:
    """A library built by `build` (the tests load each instruction path's), refused (OSError)
    unless `trusted`."""
    why = trusted(lib)
    if why:
        raise OSError(why)
    return _bind(ctypes.CDLL(str(lib)))


def _key() -> str:
    src = b"".join(p.read_bytes() for p in SOURCES)
    return hashlib.sha256(src + platform.machine().encode() + _cpu_flags().encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def status() -> tuple[ctypes.CDLL | None, str | None]:
    """(the built kernels, None) or (None, why not), once per process."""
    if os.environ.get("SMOL_NATIVE", "1") == "0":
        return None, "SMOL_NATIVE=0"
    try:
        d = private(cache_dir())
    except OSError as e:
        return None, f"kernel cache not private: {e}"
    lib = d / f"kernels-{_key()}.so"
    if trusted(lib):  # absent, or not what our build wrote: build it (over whatever is there)
        cc = compiler()
        if not cc:
            return None, "no C compiler" + (f" (CC={os.environ['CC']!r} not found)" if os.environ.get("CC") else "")
        st = os.stat(cc)
        failed = (
            d / f"kernels-{_key()}-{hashlib.sha256(f'{cc}{st.st_mtime}{st.st_size}'.encode()).hexdigest()[:8]}.failed"
        )
        if failed.exists():
            return None, f"build failed earlier: {failed.read_text().strip()} ({failed}; delete it to retry)"
        try:
            build(lib, cc=cc)
        except OSError as e:
            _write(failed, str(e))
            print(f"smoltrain: the decode kernels did not build ({e}); torch's kernels run instead", file=sys.stderr)
            return None, f"build failed: {e}"
    try:
        so = load(lib)
    except OSError as e:
        return None, f"could not load {lib.name}: {e}"
    if so.simd() == 0:  # plain C would be slower than torch's kernels
        return None, "this CPU has neither AVX2 nor NEON"
    return so, None


def library() -> ctypes.CDLL | None:
    return status()[0]


def isa(so: ctypes.CDLL | None = None) -> str | None:
    so = so or library()
    return None if so is None else ISA.get(so.simd(), "c")

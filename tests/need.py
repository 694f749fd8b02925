"""Skips that cannot hide a regression.

A test may skip only when this machine truly cannot run it *and* the user could not have
fixed that: not root, so no network namespaces. As root, a missing system package or a sim
that does not come up is a failure with the command that fixes it (`make system-deps`).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

import pytest

FIX = "run `make system-deps` (as root) to install the system packages"


def _root() -> bool:
    return os.geteuid() == 0


def need_sim() -> None:
    """Skip without root; fail as root when the sim cannot run here."""
    from smolnet.sim import net

    reason = net.unavailable_reason()
    if reason is None:
        return
    if _root():
        pytest.fail(f"the sim cannot run as root: {reason}; {FIX}", pytrace=False)
    pytest.skip(reason)


def sim_up(sim, **kw):
    """sim.up(**kw); a SimUnavailable skips only when not root.

    Each test owns its sim name, so a sim of that name still up is a leftover of a killed
    earlier run: it is taken down first rather than failing every test that needs it."""
    need_sim()
    name = kw.get("name")
    if name and sim.status(name) is not None:
        sim.down(name=name)
    try:
        return sim.up(**kw)
    except sim.SimUnavailable as e:
        if _root():
            pytest.fail(f"sim up failed as root: {e}", pytrace=False)
        pytest.skip(str(e))


def need_tool(name: str) -> None:
    """A system tool the test drives: skip without root, fail as root (it should be installed)."""
    if shutil.which(name):
        return
    if _root():
        pytest.fail(f"{name} is not installed; {FIX}", pytrace=False)
    pytest.skip(f"{name} is not installed")


def need_cgroup() -> None:
    """CPU caps for sim hosts: skip without root, fail as root when no cpu cgroup is usable."""
    from smolnet.sim import cgroup

    need_sim()
    reason = cgroup.unavailable_reason()
    if reason is None:
        return
    if _root():
        pytest.fail(f"no cpu cgroup for the sim's CPU caps: {reason}", pytrace=False)
    pytest.skip(reason)


@contextmanager
def sim_cluster(tmp_path_factory, name: str, **kw):
    """A module's sim: (state, inventory path, folder), always taken down again. Each module
    passes its own name and subnet."""
    from smolnet.sim import cluster as sim

    d = tmp_path_factory.mktemp(name)
    inv = d / f"{name}.yml"
    st = sim_up(sim, name=name, inventory=str(inv), **kw)
    try:
        yield st, inv, d
    finally:
        sim.down(name=name)


def native_expected() -> bool:
    """Where the native decode kernels must build: Linux on x86-64 or aarch64 with gcc (a system
    package, `make system-deps`), and CI, which installs it."""
    import platform
    import sys

    arch = platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
    return os.environ.get("CI") == "true" or (sys.platform == "linux" and arch and shutil.which("gcc") is not None)


def need_native() -> None:
    """The native decode kernels (smoltrain/models/q4_0.c, kernels.c): skip with the reason on a
    host that cannot have them (no AVX2 or NEON, a compiler-less Mac), fail where they should
    be there (native_expected) with what went wrong."""
    from smoltrain.models import native_build

    if native_build.library() is not None:
        return
    why = native_build.status()[1]
    if native_expected():
        pytest.fail(f"the native decode kernels are not available here ({why}); {FIX}", pytrace=False)
    pytest.skip(f"no native decode kernels on this host: {why}")

"""Test tiers, assigned here so that every test lands in exactly one.

- unit: in-process, no subprocess, no listening service; seconds in all.
- process: starts local processes or services (agents, ranks, ansible-inventory, linters).
- sim: needs the single-machine cluster (root and network namespaces).
- provision: runs the real playbooks (on the sim or on localhost); the slowest.

`make test` runs them all (two pytest-xdist workers, every file in SIM_FILES on one of them,
then the `quiet` ones alone); `make test-unit` (etc.) one tier (`pytest -m unit`). A test
file must be listed in TIERS (tests/test_tiers.py fails otherwise); a test already marked
with a tier (e.g. one sim test in a process file) keeps its own mark.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# plan and run read reports/compute.json when it exists: a report a demo or a bench left in
# this checkout must not change what the tests plan (a test that wants one passes --compute)
os.environ["SMOL_COMPUTE"] = "/nonexistent/smolcluster-tests/compute.json"
# local training ranks start from a warm server per key (smolnet.warm), and the key holds the
# folder and environment: tests run from many tmp folders, so each server (~150 MB) leaves after
# a minute idle rather than ten
os.environ.setdefault("SMOL_WARM_IDLE", "60")
# `run` draws no loss curve (about 0.6 s of a controller's CPU, ~100 runs in the suite); the test
# that checks the picture asks for it (test_strategies.test_report_schema_and_png)
os.environ.setdefault("SMOL_CHARTS", "0")
# Two pytest-xdist workers share two cores: an OpenMP thread that spins at a barrier holds the
# core its peer thread needs while the other worker's processes run. A 2-thread tiny8 run beside
# one busy process ran 222 tokens/s, 7,877 with threads that sleep (bench/results/busy-threads.json);
# the quick demo's 100-step training took 80 s, then 29 (2026-12-07). Threads sleep here, in this
# process and its children (the sim's hosts run one thread each: smolnet/sim/inventory.py); the
# quiet phase runs alone, at the default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TIER_NAMES = ("unit", "process", "sim", "provision")
TIERS = {
    "unit": [
        "test_errors.py",
        "test_model.py",
        "test_optim.py",
        "test_lora_fixed_cost.py",
        "test_plan.py",
        "test_plan_tuning.py",
        "test_report.py",
        "test_run_config.py",
        "test_schemas.py",
        "test_comm_wire.py",
        "test_tiers.py",
        "test_docs.py",
        "test_compute_plan.py",
        "test_cfs.py",
        "test_planner_formulas.py",
        "test_placement.py",
        "test_placement_plan.py",
        "test_rank_timings.py",
        "test_calibrate_cluster.py",
        "test_calibrate_pace.py",
        "test_calibrate_together.py",
        "test_registry.py",
        "test_serve_units.py",
        "test_sim_fastpair.py",
        "test_quant.py",
        "test_diloco_plan.py",
        "test_pace_plan.py",
        "test_cost_core.py",
        "test_decode_plan.py",
        "test_plan_builder.py",
        "test_bench_summary.py",
        "test_bench_decode.py",
        "test_finetune_data.py",
        "test_lora.py",
        "test_sim_random.py",
        "test_startup.py",
        "test_mesh_plan.py",
    ],
    "process": [
        "test_hf_train.py",
        "test_lora_plan_runs.py",
        "test_mesh_lora.py",
        "test_roster.py",
        "test_qlora.py",
        "test_checkpoint_activations.py",
        "test_backends.py",
        "test_kernels_c.py",
        "test_agent.py",
        "test_cli.py",
        "test_comm.py",
        "test_comm_groups.py",
        "test_mesh.py",
        "test_mesh_auto_run.py",
        "test_mesh_placement.py",
        "test_comm_bench.py",
        "test_comm_failure.py",
        "test_inventory.py",
        "test_lint_gates.py",
        "test_launcher.py",
        "test_matrix.py",
        "test_plan_local.py",
        "test_run.py",
        "test_strategies.py",
        "test_setup.py",
        "test_bootstrap.py",
        "test_faults_checkpoint.py",
        "test_faults_input.py",
        "test_faults_lease.py",
        "test_faults_listen.py",
        "test_faults_run.py",
        "test_faults_wire.py",
        "test_faults_channels.py",
        "test_faults_loads.py",
        "test_faults_private.py",
        "test_infer.py",
        "test_wire_probe.py",
        "test_infer_export.py",
        "test_infer_mesh.py",
        "test_finetune_export.py",
        "test_infer_serve.py",
        "test_serve_hostile.py",
        "test_placement_run.py",
        "test_demo_report.py",
        "test_demo_sections.py",
        "test_machine.py",
        "test_diloco.py",
        "test_warm.py",
    ],
    "sim": [
        "test_demo.py",
        "test_faults_sim.py",
        "test_calibrate_sim.py",
        "test_infer_sim.py",
        "test_placement_sim.py",
        "test_sim_cpu.py",
        "test_sim_hidden.py",
        "test_matrix_sim.py",
        "test_remote.py",
        "test_run_sim.py",
        "test_sim.py",
    ],
    "provision": [
        "test_provision.py",
        "test_provision_render.py",
        "test_provision_fresh.py",
        "test_provision_darwin.py",
    ],
}
FILE_TIER = {f: tier for tier, files in TIERS.items() for f in files}
# Tests that hold a measured rate or CPU share to a truth (shaped goodput, a cap read from pace,
# capped hosts in the order of their caps, placement by measured speed): `make test` runs them
# alone after the rest, which runs on two pytest-xdist workers and would take their CPU.
QUIET = {
    "test_sim.py",
    "test_matrix_sim.py",
    "test_sim_cpu.py",
    "test_sim_hidden.py",
    "test_placement_sim.py",
}
# Tests of those files that hold no measured figure (a sim's build and teardown): they run in the
# parallel phase, where a second of theirs costs the suite about half one (test_tiers checks the names).
NOT_QUIET = {
    "test_sim.py::test_down_leaves_nothing_and_up_down_up_works",
    "test_sim.py::test_failed_up_rolls_back",
    "test_sim.py::test_down_after_lost_state_finds_leftovers_by_name",
}


# Provision files whose playbooks run only against this machine, in check mode or under a
# temporary root: no namespace, subnet or sshd of the sim's, so they run beside it (the sim
# worker's share of `make test` was 594 of 604 s with them, 2026-12-07).
LOCAL_PLAYBOOKS = {"test_provision_render.py", "test_provision_darwin.py"}
# Files that build sims or run the playbooks on them (fixed namespace names and subnets):
# `make test`'s pytest-xdist workers run them all on one worker, one after another. The sim and
# provision tiers, and the process files with a test marked sim (test_tiers checks that none
# is missing).
SIM_FILES = (set(TIERS["sim"]) | set(TIERS["provision"]) | {"test_comm_bench.py", "test_setup.py"}) - LOCAL_PLAYBOOKS


def pytest_xdist_make_scheduler(config, log):
    """A file's tests run on one worker, in order (module fixtures are built once, and a test may
    read what the ones before it left, e.g. test_infer_serve's metrics), and the sim files all on
    the same worker: one scope for all of them, one per file for the rest. (pytest-xdist 3.8's
    `--dist loadgroup` groups by rewriting an item's `_nodeid`, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SimFilesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "sim" if Path(path).name in SIM_FILES else path

    return SimFilesOnOneWorker(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIER_NAMES):
            tier = FILE_TIER.get(Path(str(item.fspath)).name)
            if tier is None:
                raise pytest.UsageError(f"{item.fspath}: not in tests/conftest.py TIERS; add it to one tier")
            item.add_marker(getattr(pytest.mark, tier))
        name = Path(str(item.fspath)).name
        if name in QUIET and f"{name}::{item.originalname}" not in NOT_QUIET:
            item.add_marker(pytest.mark.quiet)


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory):
    """Temporary folders of the suite's processes (the logs a failed run keeps on purpose, and
    the tests fail runs on purpose) go under this session's pytest folder, which pytest prunes,
    not loose in /tmp."""
    tmp = tmp_path_factory.mktemp("tmp")
    patch = pytest.MonkeyPatch()
    patch.setenv("TMPDIR", str(tmp))  # child processes
    patch.setattr(tempfile, "tempdir", str(tmp))  # this one
    yield tmp
    patch.undo()


@pytest.fixture
def needs_sim():
    """Skip only when not root; as root a sim that cannot run is a failure (see tests/need.py)."""
    from need import need_sim

    need_sim()


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    """A cluster secret file (0600) the module's runs share."""
    from runtools import write_secret

    return write_secret(tmp_path_factory.mktemp("secret") / "secret")

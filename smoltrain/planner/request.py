"""One plan request and the one builder every command calls.

`plan`, `run` (the plan it shows and records), `plan --compare`, `generate` and `serve`
(the infer plan beside what they measured), placement and the demo all describe a request
as a PlanRequest and get the plan from `build_plan`: the same ranks (device profiles or the
compute report, cores shared when the ranks run on this machine), the same links (the
links report, CPU-adjusted as the plan charges them), the same placement search, so they
report identical numbers for the same request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from smolnet.errors import UsageError
from smoltrain.models.spec import ModelSpec, ModelSpecError, get_model
from smoltrain.planner import placement_plan
from smoltrain.planner.placement import PlacementError


@dataclass
class PlanRequest:
    strategy: str
    model: ModelSpec | str
    mode: str = "train"  # train or infer (batch-1 decode)
    world: int | None = None  # default: the hosts, else 2
    dtype: str = "fp32"
    batch: int = 8
    seq: int = 64
    microbatches: int = 1
    placement: str | dict | None = None  # even, auto, or a placement document; None: auto when measured
    hosts: list | None = None  # inventory (or links-report) hosts in rank order; None: rank0..rank{N-1}
    links: dict | None = None  # a smolnet.links/1 report; None: reports/links.json when it covers the hosts
    link_class: str | None = None
    compute: str | bool | None = None  # a compute report; None: reports/compute.json when present; False: none
    calibration: object = None  # a DeviceProfile, a file, False, or None (the default file when present)
    local: bool = False  # the ranks share this machine (`--local N`): its cores are split among them
    overlap: bool = True  # dp's buckets may hide behind backward
    single: bool = True  # add the single-host verdict
    strict: bool = False  # raise a PlacementError (a run must not start) instead of recording it
    compute_dtype: str | None = None  # the matmuls' dtype where it differs from `dtype` (planner.widths)
    quantize: str | None = None  # inference weights' format
    wire_dtype: str | None = None  # inference activations on the wire
    outer: dict | None = None  # an outer-step strategy's settings (planner.diloco.options)
    tuning: object = None  # train: planner.tuning.Tuning (LoRA, a quantised base, checkpointing); None: full
    lanes: int = 1  # infer: decode steps in flight through a pp chain (serve: one per stage, up to its batch)

    @property
    def widths(self) -> dict:
        """What make_plan takes beyond the shape: the widths (planner.widths) and `outer`."""
        return {
            "compute_dtype": self.compute_dtype,
            "quantize": self.quantize,
            "wire_dtype": self.wire_dtype,
            "outer": self.outer,
            "tuning": self.tuning,
        }


@dataclass
class Setting:
    """What a request resolves to: the model, every rank it may use, and the links."""

    model: ModelSpec
    ranks: list
    lm: object
    compute_source: str


def model_of(model: ModelSpec | str) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    try:
        return get_model(model)
    except ModelSpecError as e:
        raise UsageError(str(e)) from None


def default_links(hosts) -> dict | None:
    """The newest links report covering these hosts (`smolnet matrix` writes reports/links.json),
    else None (`--local` ranks, or hosts nobody measured)."""
    if not hosts:
        return None
    from smoltrain.planner.links import find_report

    return find_report([h.name for h in hosts])


def resolve(req: PlanRequest) -> Setting:
    from smoltrain.planner import compute as measured
    from smoltrain.planner.devices import load_calibration
    from smoltrain.planner.links import link_model
    from smoltrain.planner.ranks import busy_ranks, in_placement_order, resolve_ranks, share_machine

    model = model_of(req.model)
    hosts = list(req.hosts) if req.hosts is not None else None
    if hosts is not None and isinstance(req.placement, dict):  # the placement's ranks first, in its order
        hosts = in_placement_order(hosts, req.placement)
    world = req.world or (len(hosts) if hosts else 2)
    if world < 1:
        raise UsageError(f"--world must be positive, got {world}")
    if hosts is not None and world > len(hosts):
        raise UsageError(f"--world {world} is larger than the {len(hosts)} hosts available")
    hosts = hosts[:world] if hosts is not None else None
    cal = req.calibration
    if isinstance(cal, (str, os.PathLike)):
        cal = load_calibration(str(cal), required=True)
    elif cal is None:
        cal = load_calibration(None)
    elif cal is False:
        cal = None
    ranks = resolve_ranks(world, hosts, cal)
    source = "nominal"
    if req.compute is not False:
        ranks, source = measured.apply(ranks, hosts, req.compute or None, model)
    if req.local and world > 1:
        ranks = share_machine(ranks, busy=busy_ranks(req.strategy, world, req.microbatches, req.mode))
    links = req.links if req.links is not None or req.link_class else default_links(hosts)
    lm = link_model([r.name for r in ranks], hosts, links, req.link_class)
    return Setting(model, ranks, lm, source)


def build_plan(req: PlanRequest, setting: Setting | None = None) -> dict:
    """The plan of this request, placed: under the given placement document exactly, else
    under the placement the search chooses (`even` or `auto`), with its `placement` section."""
    from smoltrain.planner.plan import make_plan

    st = setting or resolve(req)
    kw = dict(
        dtype=req.dtype,
        batch=req.batch,
        seq=req.seq,
        microbatches=req.microbatches,
        mode=req.mode,
        ranks=st.ranks,
        lm=st.lm,
        overlap=req.overlap,
        single=req.single,
        **req.widths,
    )
    world = len(st.ranks)
    if isinstance(req.placement, dict):  # the run's own split and order (plan --compare, generate)
        exact = placement_plan.place_dict(req.placement)
        plan = make_plan(req.strategy, st.model, len(exact["order"]), placement=exact, **kw)
        plan["placement"] = dict(
            req.placement, predicted={exact.get("mode", "even"): placement_plan.predicted_of(plan)}
        )
    elif placement_plan.applies(req.strategy, req.mode) and req.strategy:
        how = placement_plan.default_mode(req.placement, st.compute_source == "measured")
        ask = placement_plan.Ask(
            req.strategy,
            how,
            st.model,
            st.ranks,
            st.lm,
            req.mode,
            req.dtype,
            req.batch,
            req.seq,
            req.microbatches,
            req.overlap,
            req.widths,
            req.lanes,
        )
        try:
            chosen = placement_plan.search(ask)
        except PlacementError as e:
            if req.strict:
                raise
            plan = make_plan(req.strategy, st.model, world, **kw)
            plan["placement"] = {"mode": how, "strategy": req.strategy, "error": str(e)}
        else:
            plan = make_plan(req.strategy, st.model, chosen.world, placement=placement_plan.place_dict(chosen), **kw)
            plan["placement"] = placement_plan.section(ask, chosen, plan)
    else:
        plan = make_plan(req.strategy, st.model, world, **kw)
    plan["compute_source"] = st.compute_source if plan["compute_source"] == "measured" else "nominal"
    if req.local and world > 1:
        plan["notes"].append(f"--local: the {world} ranks share this machine's {os.cpu_count()} cores and its memory")
    from smoltrain.mesh import Mesh

    plan["mesh"] = Mesh(((req.strategy, plan["world_size"]),)).report()  # the 1-D mesh S=world (contract §12)
    return plan

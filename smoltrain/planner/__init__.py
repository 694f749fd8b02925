"""Predict, before anything runs, the bytes each strategy puts on each link, the time per
step and what limits it (capacity, memory bandwidth, compute, link bandwidth or latency).

The one builder is planner.plan.make_plan; commands reach it through planner.request.build_plan."""

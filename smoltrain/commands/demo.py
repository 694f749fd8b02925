"""`smoltrain demo`: the whole flow on the built-in cluster (smoltrain/demo/)."""

from __future__ import annotations


def add_arguments(p) -> None:
    from smoltrain.demo.flow import add_arguments as add

    add(p)


def run(args) -> int:
    from smoltrain.demo.flow import run as demo

    return demo(args)

"""The link report: judge each measured direction (`assess`), then write links.json, links.md,
links.png and the terminal table (`render`). Callers use `smolnet.report.<name>` for both.
"""

from smolnet.files import write_text_atomic as write_atomic
from smolnet.report.assess import (
    ASYMMETRIC,
    BELOW_CEILING,
    BLACKHOLE_FRACTION,
    BLACKHOLE_MBIT,
    MTU_TOLERANCE,
    RTT_KEYS,
    SCHEMA,
    STATUSES,
    WARNINGS,
    assess_links,
    build_report,
    ceiling_mbit,
    validate_report,
)
from smolnet.report.render import findings, render_md, render_png, rich_table, write_report

__all__ = [
    "ASYMMETRIC",
    "BELOW_CEILING",
    "BLACKHOLE_FRACTION",
    "BLACKHOLE_MBIT",
    "MTU_TOLERANCE",
    "RTT_KEYS",
    "SCHEMA",
    "STATUSES",
    "WARNINGS",
    "assess_links",
    "build_report",
    "ceiling_mbit",
    "findings",
    "render_md",
    "render_png",
    "rich_table",
    "validate_report",
    "write_atomic",
    "write_report",
]

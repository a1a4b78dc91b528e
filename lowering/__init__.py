"""HOW each device runs the rules: one table per device, keyed by rule name (``python -m qbackend.lowering``)."""
from __future__ import annotations

from qbackend.patterns import RULES

from . import cpu, xpu
from .sibling_linears import merge_sibling_linears
from .stem import fuse_max_pool
from .base import EmitContext, Lowering, Unsupported
from .common import SIBLING

TABLES = {"cpu": cpu.TABLE, "xpu": xpu.TABLE}
# Exact graph rewrites a device needs before its rules run (e.g. signed -> unsigned activations).
PREPARE = {"cpu": cpu.PREPARE, "xpu": xpu.PREPARE}
# Exact rewrites of the lowered graph (ctx, report) -> None. XPU: untested without the hardware,
# and its 2-D-only qlinear gives each sibling its own reshaped input.
FINISH = {"cpu": (merge_sibling_linears, fuse_max_pool), "xpu": ()}


def finish(ctx: EmitContext, report) -> None:
    """The device's rewrites of the lowered graph, then the emitters' marks dropped on every
    device (a mark holds an int8 weight alive next to its packed copy)."""
    for rewrite in FINISH[ctx.device]:
        rewrite(ctx, report)
    for node in ctx.gm.graph.nodes:
        node.meta.pop(SIBLING, None)


def check_tables(tables=TABLES, rules=RULES) -> None:
    """Every table key names a rule and every rule has an entry on every device."""
    names = {rule.name for rule in rules}
    for device, table in tables.items():
        unknown = set(table) - names
        missing = names - set(table)
        if unknown or missing:
            raise RuntimeError(f"lowering table {device!r}: unknown rules {sorted(unknown)}, missing rules {sorted(missing)}")
        for name, entry in table.items():
            if not isinstance(entry, (Lowering, Unsupported)):
                raise RuntimeError(f"lowering table {device!r}[{name!r}] is {entry!r}, not a Lowering or Unsupported")


check_tables()


def support_matrix() -> str:
    devices = sorted(TABLES)
    rows = ["| rule | " + " | ".join(devices) + " |", "|---" * (len(devices) + 1) + "|"]
    for rule in RULES:
        cells = []
        for device in devices:
            entry = TABLES[device][rule.name]
            cells.append(f"no: {entry.reason}" if isinstance(entry, Unsupported) else "yes: " + (", ".join(entry.needs) or "the graph's own ops"))
        rows.append(f"| {rule.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


__all__ = ["TABLES", "PREPARE", "FINISH", "finish", "EmitContext", "Lowering", "Unsupported", "check_tables", "support_matrix"]

"""The table :func:`~ttile.torch.tune` prints: what serves each converted layer."""
from __future__ import annotations

from ..runtime.inverted_residual import BlockPlan


def format_table(rows) -> str:
    """The table :func:`tune` prints; its last column says what was lost (fusion that
    could not be tried, a degraded kernel choice), empty when nothing was."""
    lines = ["| layer | replaces | input | layout | kernel | threads | tuned for | epilogue "
             "| lost |", "|---|---|---|---|---|---|---|---|---|"]
    for name, source, shape, layout, kp, not_fused in rows:
        if isinstance(kp, BlockPlan):
            lines.append(f"| {name} | {source} | {'x'.join(map(str, shape))} | {layout} | "
                         f"inverted residual, {kp.verdict.value} | {kp.threads} | "
                         f"{kp.note} | {kp.epilogue} | |")
            continue
        tuned = ("" if kp.tuned_cpu is None else
                 f"{kp.tuned_cpu} x{kp.tuned_threads}")
        lost = "; ".join(x for x in (f"not fused: {not_fused}" if not_fused else "",
                                     kp.degraded) if x)
        lines.append(f"| {name} | {source} | {'x'.join(map(str, shape))} | {layout} | "
                     f"{kp.kind.value} | {kp.threads} | {tuned} | {kp.epilogue} | {lost} |")
    return "\n".join(lines)

"""Rich display of free-benchmark findings: an HTML table by severity and a one-line summary.

``Findings(results, summary)`` renders as HTML in a notebook and as text in a terminal; the
``%%freebench`` magic displays one after the cell ran.
"""
from __future__ import annotations

import html
import math

from ..plot import SEVERE_KINDS, merged_findings, step_ranges

#: columns shown, in order: (header, column of ``merged_findings``)
COLUMNS = (("API", "api_name"), ("steps", "steps"), ("kind", "kind"), ("max_rel", "max_rel"),
           ("threshold", "threshold"), ("× threshold", "ratio"), ("dtype", "dtype"),
           ("shape", "shape"), ("output", "output_index"), ("call site", "call_site"))
NUMERIC = ("max_rel", "threshold", "ratio", "output_index")

_STYLE = """<style>
.probekit-findings {font-size: 12px; margin: 4px 0;}
.probekit-findings .pk-summary {margin: 2px 0 6px 0;}
.probekit-findings .pk-flagged {color: #b71c1c; font-weight: 600;}
.probekit-findings .pk-ok {color: #1b5e20; font-weight: 600;}
.probekit-findings table {border-collapse: collapse;}
.probekit-findings th {text-align: left; padding: 3px 8px; border-bottom: 1px solid #999;}
.probekit-findings td {text-align: left; padding: 2px 8px; border-bottom: 1px solid #ddd;
  font-family: var(--jp-code-font-family, monospace); vertical-align: top;}
.probekit-findings td.num {text-align: right;}
.probekit-findings tr.pk-severe td {background: rgba(183, 28, 28, 0.10);}
.probekit-findings .pk-more {color: #666; margin-top: 4px;}
</style>"""


def _fmt(column: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if column in ("max_rel", "threshold", "max_abs"):
        return f"{float(value):.3g}"
    if column == "ratio":
        v = float(value)
        return "∞" if math.isinf(v) else f"{v:,.1f}×"
    if column == "steps":
        return step_ranges(value)
    if column == "output_index":
        try:
            return str(int(value))
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def summary_line(summary: dict | None, n_rows: int = 0) -> str:
    """``"1,204 calls seen · 310 checked · 894 skipped (in-place 600, ...) · 3 flagged · 2 steps"``."""
    if not summary:
        return f"{n_rows} findings"
    parts = [f"{summary.get('calls', 0):,} calls seen", f"{summary.get('checked', 0):,} checked"]
    skipped = dict(summary.get("skipped") or {})
    n_skipped = sum(skipped.values())
    if n_skipped:
        reasons = ", ".join(f"{reason} {count:,}" for reason, count in
                            sorted(skipped.items(), key=lambda kv: -kv[1]))
        parts.append(f"{n_skipped:,} skipped ({reasons})")
    else:
        parts.append("0 skipped")
    parts.append(f"{summary.get('flagged', n_rows):,} flagged")
    if summary.get("steps"):            # completed steps (step() calls); none in a one-off cell
        steps = summary["steps"]
        parts.append(f"{steps} step{'s' if steps != 1 else ''}")
    return " · ".join(parts)


class Findings:
    """Free-benchmark results as a table by severity plus a summary line."""

    def __init__(self, results, summary: dict | None = None, *, top: int = 25, name: str = "",
                 mode: str = ""):
        self.results = results
        self.summary = summary
        self.top = top
        #: the user-namespace name of the FreeBench (pointed to when rows are cut)
        self.name = name
        #: "pert_mode, handler, stage" shown in the heading
        self.mode = mode

    @classmethod
    def of(cls, bench, **kwargs) -> "Findings":
        """From a ``FreeBench``: its ``results``, ``summary`` and mode."""
        section = bench.config.free_benchmark
        kwargs.setdefault("mode", f"{section.pert_mode}, {section.handler_type}, "
                                  f"{section.fuzz_stage}")
        return cls(bench.results, bench.summary, **kwargs)

    def _title(self) -> str:
        return f"Free benchmark ({self.mode})" if self.mode else "Free benchmark"

    @property
    def calls(self):
        """One row per flagged API call, most severe first (``plot.merged_findings``)."""
        return merged_findings(self.results)

    def _flagged(self) -> int:
        if self.summary and "flagged" in self.summary:
            return int(self.summary["flagged"])
        return len(self.results)

    def _headline(self, calls) -> str:
        flagged = self._flagged()
        if not flagged:
            return "no findings"
        where = f" in {len(calls)} API call{'s' if len(calls) != 1 else ''}" if len(calls) else ""
        return f"{flagged} finding{'s' if flagged != 1 else ''}{where}"

    def _more(self, calls) -> str:
        where = f"{self.name}.results" if self.name else "results"
        return f"… {len(calls) - self.top} more API calls in {where}"

    def _repr_html_(self) -> str:
        calls = self.calls
        head = (f'<span class="pk-flagged">⚠ {self._headline(calls)}</span>' if self._flagged()
                else '<span class="pk-ok">✓ no findings</span>')
        out = [_STYLE, '<div class="probekit-findings">',
               f'<div class="pk-summary"><b>{html.escape(self._title())}</b> {head} — '
               f'{html.escape(summary_line(self.summary, len(self.results)))}</div>']
        if len(calls):
            cols = [(h, c) for h, c in COLUMNS if c in calls.columns]
            out.append("<table><thead><tr><th>#</th>" +
                       "".join(f"<th>{html.escape(h)}</th>" for h, _ in cols) +
                       "</tr></thead><tbody>")
            for i, (_, row) in enumerate(calls.head(self.top).iterrows(), 1):
                severe = row["kind"] in SEVERE_KINDS
                cells = "".join(f'<td class="{"num" if c in NUMERIC else ""}">'
                                f'{html.escape(_fmt(c, row[c]))}</td>' for _, c in cols)
                out.append(f'<tr class="{"pk-severe" if severe else ""}"><td>{i}</td>{cells}</tr>')
            out.append("</tbody></table>")
            if len(calls) > self.top:
                out.append(f'<div class="pk-more">{html.escape(self._more(calls))}</div>')
        out.append("</div>")
        return "\n".join(out)

    def __repr__(self) -> str:
        calls = self.calls
        lines = [f"{self._title()}: {self._headline(calls)} — "
                 f"{summary_line(self.summary, len(self.results))}"]
        for i, (_, row) in enumerate(calls.head(self.top).iterrows(), 1):
            lines.append(f"{i:>3}. {row['api_name']} (steps {_fmt('steps', row['steps'])}) "
                         f"{row['kind']} max_rel={_fmt('max_rel', row['max_rel'])} "
                         f"threshold={_fmt('threshold', row['threshold'])} "
                         f"{row['dtype']} {row['shape']} {row['call_site']}")
        if len(calls) > self.top:
            lines.append("  " + self._more(calls))
        return "\n".join(lines)

"""The findings view: one table of free-benchmark findings, merged per API call and ordered by
severity, under a one-line summary. Headless (no IPython): ``FreeBench`` renders itself with it,
and the notebook layer subclasses it only to show call sites as notebook cells
(``probekit.notebook.display.Findings``), the way tqdm's notebook front-end subclasses its core.
"""
from __future__ import annotations

import html
import math

from .results import KIND_ORDER, by_severity

#: columns shown, in order: (header, column of ``merged_findings``)
COLUMNS = (("API", "api_name"), ("steps", "steps"), ("kind", "kind"), ("cause", "cause"),
           ("max_rel", "max_rel"),
           ("threshold", "threshold"), ("× threshold", "ratio"), ("dtype", "dtype"),
           ("shape", "shape"), ("output", "output_index"), ("call site", "call_site"),
           ("module", "module"))
NUMERIC = ("max_rel", "threshold", "ratio", "output_index")
#: columns of the hot spots table
HOT_COLUMNS = (("API", "api_name"), ("cause", "cause"), ("max_rel", "max_rel"),
               ("threshold", "threshold"), ("× threshold", "ratio"), ("checks", "count"),
               ("dtype", "dtype"), ("shape", "shape"), ("call site", "call_site"))

# Inline styles: notebook front-ends (and nbconvert's templates) style tables with selectors
# more specific than a <style> block of ours would be; inline attributes always win.
_TH = "text-align:left;padding:3px 8px;border-bottom:1px solid #999;white-space:nowrap"
_TD = ("text-align:{align};padding:2px 8px;border-bottom:1px solid #ddd;white-space:nowrap;"
       "font-family:var(--jp-code-font-family,monospace);vertical-align:top")
_SEVERE_ROW = "background:rgba(183,28,28,0.10)"
_FLAGGED = "color:#b71c1c;font-weight:600"
_OK = "color:#1b5e20;font-weight:600"


#: what makes two findings "the same API call" across steps
CALL_KEYS = ("api_name", "stage", "kind", "dtype", "shape", "output_index")


def merged_findings(results):
    """One row per API call (``CALL_KEYS``) over all steps, most severe first (the free
    benchmark's own ``by_severity`` order): the worst row's values plus ``steps`` (sorted step
    numbers) and ``count`` (rows merged)."""
    import pandas as pd

    df = by_severity(as_frame(results))
    if df.empty:
        return df.assign(steps=pd.Series(dtype=object), count=pd.Series(dtype="int64"))
    keys = [k for k in CALL_KEYS if k in df]
    rows = []
    for _, group in df.groupby(keys, sort=False, dropna=False):
        row = group.iloc[0].copy()
        row["steps"] = sorted({int(s) for s in group["step"]})
        row["count"] = len(group)
        rows.append(row)
    return pd.DataFrame(rows).reset_index(drop=True)


def step_ranges(steps) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0–2, 5, 7–8"``."""
    parts, steps = [], sorted(steps)
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}–{steps[j]}")
        i = j + 1
    return ", ".join(parts)


def as_frame(results):
    """A ``FreeBench`` (its ``results``) or a findings DataFrame -> the DataFrame."""
    import pandas as pd

    if hasattr(results, "results") and not isinstance(results, pd.DataFrame):
        results = results.results
    if not isinstance(results, pd.DataFrame):
        raise TypeError(f"expected a FreeBench or its results DataFrame, got "
                        f"{type(results).__name__}")
    return results


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
    if column == "dtype":
        return str(value).removeprefix("torch.")
    if column == "output_index":
        try:
            return str(int(value))
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def summary_line(summary: dict | None, n_rows: int = 0) -> str:
    """``"1,204 calls seen · 310 checked (47 % of 660 floating-point calls) · 894 skipped (view
    600, ...) · 3 flagged · 2 steps"`` (the share when the summary has it; steps only once
    ``step()`` was called)."""
    if not summary:
        return f"{n_rows} findings"
    calls = summary.get("calls", 0)
    checked = f"{summary.get('checked', 0):,} checked"
    n_float = summary.get("float_calls")
    if n_float:
        share = 100 * summary.get("checked_share", 0.0)
        pct = f"{share:.0f}" if share >= 1 or share == 0 else f"{share:.1g}"
        checked += (f" ({pct} % of {n_float:,} floating-point "
                    f"call{'' if n_float == 1 else 's'})")
    parts = [f"{calls:,} call{'' if calls == 1 else 's'} seen", checked]
    skipped = dict(summary.get("skipped") or {})
    n_skipped = sum(skipped.values())
    if n_skipped:
        reasons = ", ".join(f"{reason} {count:,}" for reason, count in
                            sorted(skipped.items(), key=lambda kv: -kv[1]))
        parts.append(f"{n_skipped:,} skipped ({reasons})")
    else:
        parts.append("0 skipped")
    parts.append(f"{summary.get('flagged', n_rows):,} flagged")
    hot = summary.get("hotspots", 0) + summary.get("pending", 0)
    if hot:              # what the dtype predicts: kept apart (FreeBench.hotspots)
        parts.append(f"{hot:,} hot spot{'' if hot == 1 else 's'}")
    unexplained = summary.get("unexplained", 0)
    if unexplained:      # flags whose analysis could not run (judging.settle)
        parts.append(f"{unexplained:,} unexplained")
    cost = summary.get("budget_cost")
    if cost is not None:   # what the budget measured the probe to cost (budget.py)
        every = summary.get("budget_every", 1)
        probed = f", 1 step in {every} probed" if every > 1 else ""
        parts.append(f"budget: {100 * cost:.0f} % over the plain step{probed}")
    if summary.get("steps"):            # completed steps (step() calls); none in a one-off cell
        steps = summary["steps"]
        filtered = summary.get("steps_filtered", 0)
        parts.append(f"{steps} step{'s' if steps != 1 else ''}"
                     + (f" ({filtered:,} left out by the step filter)" if filtered else ""))
    return " · ".join(parts)


def impact_cell(impact) -> str:
    """A finding's ``impact`` column: "beyond bf16 noise" / "within bf16 noise", "" when not
    measured (``fb.impact``)."""
    if impact is None:
        return ""
    prec = str(getattr(impact, "control", "")).partition(":")[0]
    return f"{impact.kind} {prec} noise".strip()


class Summary(dict):
    """``FreeBench.summary``: the counts, a dict whose ``str()`` is ``summary_line``."""

    def __str__(self) -> str:
        return summary_line(self)


class Findings:
    """Free-benchmark results as a table by severity plus a summary line."""

    def __init__(self, results, summary: dict | None = None, *, top: int = 25, name: str = "",
                 mode: str = "", hotspots=None, impacts=None):
        self.results = results
        self.summary = summary
        #: ``FreeBench.impacts``: {api_name: ``Impact``} of the findings ``fb.impact`` measured
        self.impacts = dict(impacts or {})
        #: ``FreeBench.hotspots`` to show under the findings (None: not shown, the default)
        self.hotspots = hotspots
        self.top = top
        #: the user-namespace name of the FreeBench (pointed to when rows are cut)
        self.name = name
        #: "pert_mode, handler, stage" shown in the heading
        self.mode = mode

    @classmethod
    def of(cls, bench, hotspots: bool = False, **kwargs) -> "Findings":
        """From a ``FreeBench``: its ``results``, ``summary`` and mode (and, with ``hotspots``,
        its hot spots in a table of their own)."""
        section = bench.config.free_benchmark
        kwargs.setdefault("mode", f"{section.pert_mode}, {section.handler_type}, "
                                  f"{section.fuzz_stage}")
        kwargs.setdefault("impacts", getattr(bench, "impacts", None))
        return cls(bench.results, bench.summary, hotspots=bench.hotspots if hotspots else None,
                   **kwargs)

    def _title(self) -> str:
        return f"Free benchmark ({self.mode})" if self.mode else "Free benchmark"

    @property
    def calls(self):
        """One row per flagged API call, most severe first (``plot.merged_findings``), and,
        where ``fb.impact`` measured it, its ``impact``: "beyond" or "within" what rounding at
        its precision explains."""
        calls = merged_findings(self.results)
        if self.impacts and len(calls):
            calls = calls.assign(impact=[impact_cell(self.impacts.get(n))
                                         for n in calls["api_name"]])
        return calls

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
        more = len(calls) - self.top
        return f"… {more} more API call{'s' if more != 1 else ''} in {where}"

    def _repr_html_(self) -> str:
        calls = self.calls
        head = (f'<span style="{_FLAGGED}">⚠ {self._headline(calls)}</span>' if self._flagged()
                else f'<span style="{_OK}">✓ no findings</span>')
        out = ['<div class="probekit-findings" style="font-size:12px;margin:4px 0">',
               f'<div class="pk-summary" style="margin:2px 0 6px 0"><b>'
               f'{html.escape(self._title())}</b> {head} — '
               f'{html.escape(summary_line(self.summary, len(self.results)))}</div>']
        if len(calls):
            cols = self._columns(calls)
            out.append('<table style="border-collapse:collapse;margin:0"><thead><tr>' +
                       "".join(f'<th style="{_TH}">{html.escape(h)}</th>'
                               for h in ["#", *(h for h, _ in cols)]) + "</tr></thead><tbody>")
            for i, (_, row) in enumerate(calls.head(self.top).iterrows(), 1):
                severe = KIND_ORDER.get(row["kind"], 3) < 2        # NaN/Inf, sign flip
                cells = "".join(
                    f'<td style="{_TD.format(align="right" if c in NUMERIC else "left")}">'
                    f'{html.escape(self._cell(c, row[c]))}</td>' for _, c in cols)
                style = f' style="{_SEVERE_ROW}"' if severe else ""
                out.append(f'<tr class="{"pk-severe" if severe else "pk-row"}"{style}>'
                           f'<td style="{_TD.format(align="right")}">{i}</td>{cells}</tr>')
            out.append("</tbody></table>")
            if len(calls) > self.top:
                out.append(f'<div class="pk-more" style="color:#666;margin-top:4px">'
                           f'{html.escape(self._more(calls))}</div>')
        if self.hotspots is not None:
            out.append(self._hotspots_html())
        out.append("</div>")
        return "\n".join(out)

    def _hotspots_html(self) -> str:
        """The hot spots: what the dtype predicts (not findings), worst check per call site."""
        hot = self.hotspots
        head = (f'<div class="pk-hotspots" style="margin:8px 0 4px 0;color:#555"><b>Hot spots'
                f'</b> — {len(hot)} call site{"" if len(hot) == 1 else "s"} whose output moved '
                f'more than a correct kernel\'s rounding explains, by what their dtype predicts '
                f'(not findings)</div>')
        if hot.empty:
            return head
        cols = [(h, c) for h, c in HOT_COLUMNS if c in hot.columns]
        rows = ["<table class='pk-hotspots' style='border-collapse:collapse;margin:0'><thead><tr>"
                + "".join(f'<th style="{_TH}">{html.escape(h)}</th>' for h, _ in cols)
                + "</tr></thead><tbody>"]
        for _, row in hot.head(self.top).iterrows():
            rows.append("<tr>" + "".join(
                f'<td style="{_TD.format(align="right" if c in NUMERIC + ("count",) else "left")}">'
                f'{html.escape(self._cell(c, row[c]))}</td>' for _, c in cols) + "</tr>")
        rows.append("</tbody></table>")
        return head + "".join(rows)

    @staticmethod
    def _columns(calls) -> list:
        """``COLUMNS`` present in ``calls``; ``output`` only when some API has several outputs."""
        cols = [(h, c) for h, c in COLUMNS if c in calls.columns]
        if "output_index" in calls and (calls["output_index"].fillna(0) == 0).all():
            cols = [(h, c) for h, c in cols if c != "output_index"]
        if "module" in calls and not (calls["module"].fillna("") != "").any():
            cols = [(h, c) for h, c in cols if c != "module"]   # no module scope
        if "impact" in calls and (calls["impact"] != "").any():   # fb.impact measured some
            cols.insert(4, ("impact", "impact"))
        return cols

    @staticmethod
    def _cause(row) -> str:
        cause = _fmt("cause", row.get("cause"))
        return f" ({cause})" if cause else ""

    def _cell(self, column: str, value) -> str:
        if column == "call_site":
            return self.site(value)
        return _fmt(column, value)

    def site(self, value) -> str:
        """How a call site is shown (``file.py:line``; front-ends may say more)."""
        return "" if value is None else str(value)

    def __repr__(self) -> str:
        calls = self.calls
        lines = [f"{self._title()}: {self._headline(calls)} — "
                 f"{summary_line(self.summary, len(self.results))}"]
        for i, (_, row) in enumerate(calls.head(self.top).iterrows(), 1):
            lines.append(f"{i:>3}. {row['api_name']} (steps {_fmt('steps', row['steps'])}) "
                         f"{row['kind']}{self._cause(row)} "
                         f"max_rel={_fmt('max_rel', row['max_rel'])} "
                         f"threshold={_fmt('threshold', row['threshold'])} "
                         f"{_fmt('dtype', row['dtype'])} {row['shape']} "
                         f"{self._cell('call_site', row['call_site'])}"
                         + (f" [impact: {row['impact']}]" if row.get("impact") else ""))
        if len(calls) > self.top:
            lines.append("  " + self._more(calls))
        return "\n".join(lines)

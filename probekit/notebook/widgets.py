"""Config panels: ipywidgets controls built from the config fields, validated by the config itself.

``FreeBenchPanel()`` and ``GradProbePanel()`` edit the same frozen ``Config`` the core uses: a
dropdown per enumerated key, tag inputs for name lists, numeric inputs for counts, thresholds and
bounds. Every change is validated at once and the message is shown in the panel (the offending
control is outlined); nothing invalid is ever applied. ``panel.config`` is the validated config of
the current values (``ConfigError`` if they are invalid); ``Apply`` (or ``panel.apply()``) makes it
``panel.applied`` and, for ``FreeBenchPanel``, the defaults of ``%%freebench``.

Without a front-end nothing is printed: messages go to ``HTML`` widgets, and tests call
``apply()`` directly (exceptions inside button callbacks are swallowed by ipywidgets).
"""
from __future__ import annotations

import html
from typing import Callable

import ipywidgets as w

from ..config import (CONTROL_DTYPES, FUZZ_DEVICES, FUZZ_LEVELS, FUZZ_STAGES, GRAD_LEVELS, GRAD_POINTS,
                      HANDLER_TYPES, HASH_ALGORITHMS, PERT_MODES, THRESHOLD_KEYS, Config,
                      ConfigError, config_for)
from .forms import describe, parse_ints, parse_numbers

#: enumerated keys -> accepted values (the config module's own tuples)
CHOICES = {"pert_mode": PERT_MODES, "handler_type": HANDLER_TYPES, "fuzz_stage": FUZZ_STAGES,
           "fuzz_device": FUZZ_DEVICES, "fuzz_level": FUZZ_LEVELS, "grad_level": GRAD_LEVELS,
           "hash": HASH_ALGORITHMS, "grad_point": GRAD_POINTS,
           "control": (None, *(f"{d}{r}" for d in CONTROL_DTYPES for r in ("", ":cast")))}

HELP = {
    "pert_mode": "How inputs are perturbed before the API is re-run",
    "handler_type": "check: record findings; fix: use the improved output "
                    "(improve_precision / to_cpu)",
    "fuzz_stage": "Check the forward outputs or the input gradients (backward)",
    "fuzz_device": "Where the re-runs compute: the tensors' own device (msprobe's value 'npu'), "
                   "or cpu (only with pert_mode to_cpu)",
    "fuzz_level": "msprobe's only level",
    "scope": "Exact API call names, e.g. Torch.matmul.0.forward (empty = all)",
    "list": "API names; every call whose name contains one is checked (empty = all)",
    "module": "Module names (model.named_modules()); only calls made inside them are checked, "
              "submodules included (empty = everywhere)",
    "if_preheat": "Sample calls during the first steps, then check risky APIs only",
    "preheat_step": "Number of preheat steps",
    "max_sample": "Calls sampled per API per preheat step",
    "budget": "Overhead budget: fraction of the plain step time the probe may cost on average "
              "(e.g. 0.2); empty: every call is checked",
    "dump_path": "Folder for the outputs",
    "rank": "Ranks to probe, comma separated (empty = all)",
    "step": "Steps to probe, comma separated (empty = all)",
    "grad_level": "L0: hash+stats; L1: stats+signs; L2: L1+interval distribution",
    "param_list": "Parameter names to monitor (empty = all)",
    "bounds": "Interval bounds, ascending, comma separated",
    "hash": "Digest of the L0 hash column",
    "flush_every": "Steps buffered in memory between writes",
    "flush_seconds": "Longest a recorded step waits in memory before it is written (s)",
    "significance": "Also record which elements are above their tensor's rounding level "
                    "(noise-aware comparison; costs ~1.3x per step)",
    "grad_point": "step: the gradients optimizer.step() is handed (after clipping); backward: "
                  "the raw ones at the end of the last backward pass before it",
    "sample": "Sign bits of at most this many elements per parameter, a fixed sample chosen "
              "by global index (0 = every element; 65536 keeps a 7B model at ~4 MB per step)",
    "start_step": "First step of this run (a restart); empty: a restart starts at the "
                  "optimizer's step count (else after the store's newest); a new store, 0",
    "overwrite": "Replace what the dump folder holds, even when its last run crashed",
    "resume": "Continue what the dump folder holds (a restart); off: a run that is not a "
              "restart replaces it when its last run ended cleanly",
    "durable": "fsync every commit: the steps survive a power loss, not only the process",
    "control": "Record this run as a control for a test at that precision: the reference's code "
               "with each low-precision op rounded at random (compare_grads(..., control=)); "
               "off: a plain run",
    "control_seed": "Seed of the control's own rounding generator (two controls: 0 and 1)",
    "check_replicas": "Check every replicated parameter (DDP, HSDP, DTensor Replicate, tied) "
                      "against its copies on the other ranks at every step (one all-gather)",
    "tied": "Parameters holding the same values wherever held, e.g. an embedding and the last "
            "stage's output layer: names separated by commas, groups by semicolons",
}

LABELS = {"handler_type": "handler", "fuzz_stage": "stage", "fuzz_device": "device",
          "fuzz_level": "level", "if_preheat": "preheat", "preheat_step": "preheat steps",
          "max_sample": "max samples", "dump_path": "dump path", "param_list": "params",
          "grad_level": "level", "flush_every": "flush every", "flush_seconds": "flush after s",
          "grad_point": "gradients", "start_step": "start step", "control_seed": "control seed",
          "check_replicas": "check replicas", "tied": "tied",
          "pert_mode": "perturbation", "list": "API names", "module": "modules"}

_DESC = {"description_width": "100px"}


def own_device() -> str:
    """The accelerator the tensors of this machine would be on: cuda, npu, or cpu."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_available", lambda: False)():
        return "npu"
    return "cpu"


def choice_labels(key: str) -> list:
    """(label, value) pairs of an enumerated key's dropdown. ``fuzz_device`` keeps msprobe's
    values, but its ``npu`` means "the tensors' own device": it is shown as what that is here,
    so a machine without an NPU shows no 'npu'."""
    if key == "fuzz_device":
        return [(f"tensors' own ({own_device()})" if v == "npu" else v, v) for v in CHOICES[key]]
    return [("off" if v is None else str(v), v) for v in CHOICES[key]]


def shown_value(key: str, value) -> str:
    """A value as the static view shows it (a choice by its label)."""
    if key in CHOICES:
        return dict((v, label) for label, v in choice_labels(key)).get(value, repr(value))
    return repr(value)
class ConfigPanel(w.VBox):
    """Controls for the common keys and one section of the config (subclasses name it)."""

    TASK = ""
    TITLE = ""
    #: (group title, [JSON keys of the section or common keys])
    GROUPS: tuple = ()

    def __init__(self, config=None, *, on_apply: Callable | None = None):
        super().__init__()
        base = self._initial(config)
        #: the config the panel started from: keys without a control (seed...) come from it
        self.base = base
        self.controls: dict = {}
        self.applied: Config | None = None
        self.error: str = ""
        self.error_key: str = ""
        self._callbacks = [on_apply] if on_apply else []
        values = self._json_values(base)
        rows = [w.HTML(f"<b style='font-size:1.15em'>{html.escape(self.TITLE)}</b>")]
        for title, keys in self.GROUPS:
            items = [item for key in keys for item in self._control(key, values[key])]
            rows.append(w.HTML(f"<span style='color:#666'>{html.escape(title)}</span>"))
            rows.append(w.GridBox(items, layout=w.Layout(
                grid_template_columns="repeat(2, 330px)", grid_gap="2px 20px")))
        self.apply_button = w.Button(description="Apply", button_style="primary", icon="check",
                                     tooltip=self._apply_tooltip())
        self.apply_button.on_click(self.apply)
        self.status = w.HTML()
        self.preview = w.HTML()
        preview = w.Accordion(children=[self.preview], titles=("config.json",),
                              selected_index=None)
        rows += [w.HBox([self.apply_button, self.status],
                        layout=w.Layout(align_items="center", margin="6px 0 0 0")), preview]
        self.children = rows
        self.add_class("probekit-panel")
        self.layout.border = "1px solid #ccc"
        self.layout.padding = "6px 10px"
        self.layout.width = "max-content"
        for control in self.controls.values():
            for c in (control if isinstance(control, dict) else {"": control}).values():
                c.observe(self._changed, names="value")
        self.validate()

    # -- building --------------------------------------------------------------------------
    def _initial(self, config) -> Config:
        return config_for(self.TASK, config)

    def _json_values(self, config: Config) -> dict:
        data = config.to_dict()
        return {**{k: data[k] for k in ("dump_path", "rank", "step")}, **data[self.TASK]}

    def _control(self, key: str, value) -> list:
        """The widget(s) editing ``key``, each filling one cell of the group's grid."""
        label = LABELS.get(key, key)
        # width auto: grid items stretch to their cell (100% would overflow by the margins)
        common = dict(description=label, tooltip=HELP.get(key, key), style=_DESC,
                      layout=w.Layout(width="auto"))
        if key in CHOICES:
            options = (choice_labels(key) if key in ("fuzz_device", "control")
                       else list(CHOICES[key]))
            control = w.Dropdown(options=options, value=value, **common)
        elif key == "thresholds":
            sub = {k: w.FloatText(value=float(value.get(k, 0.0)), description=k, style=_DESC,
                                  tooltip=f"threshold for calls computing in {k}; 0: from "
                                          "its unit roundoff (default)",
                                  layout=w.Layout(width="auto")) for k in THRESHOLD_KEYS}
            self.controls[key] = sub
            return list(sub.values())
        elif isinstance(value, bool):
            control = w.Checkbox(value=value, indent=True, **common)
        elif isinstance(value, int):
            control = w.IntText(value=value, **common)
        elif isinstance(value, float):
            control = w.FloatText(value=value, **common)
        elif key in ("scope", "list", "module", "param_list"):
            control = w.TagsInput(value=list(value), allow_duplicates=False,
                                  placeholder="all (type a name, Enter)",
                                  tooltip=HELP.get(key, key), layout=w.Layout(flex="1 1 auto"))
            self.controls[key] = control
            title = html.escape(HELP.get(key, key), quote=True)
            name = w.HTML(f"<div title='{title}' style='text-align:right;padding-right:8px'>"
                          f"{html.escape(label)}</div>", layout=w.Layout(width="100px"))
            return [w.HBox([name, control], layout=w.Layout(width="auto",
                                                            align_items="center"))]
        elif key == "budget":
            control = w.Text(value="" if value is None else str(value),
                             placeholder="off (every call)", **common)
        elif key == "start_step":
            control = w.Text(value="" if value is None else str(value),
                             placeholder="auto (the optimizer's step)", **common)
        elif key in ("bounds", "rank", "step"):
            control = w.Text(value=", ".join(str(v) for v in value),
                             placeholder="all" if key != "bounds" else "-1, 0, 1", **common)
        elif key == "tied":
            control = w.Text(value="; ".join(", ".join(g) for g in value),
                             placeholder="none (embed.weight, head.weight; ...)", **common)
        else:
            control = w.Text(value=str(value), **common)
        self.controls[key] = control
        return [control]

    # -- values and validation ---------------------------------------------------------------
    def values(self) -> dict:
        """The controls' values as config keys (JSON names); ``ConfigError`` for unparsable text."""
        out = {}
        for key, control in self.controls.items():
            if key == "thresholds":
                out[key] = {k: c.value for k, c in control.items() if c.value}
            elif key in ("rank", "step"):
                out[key] = parse_ints(key, control.value)
            elif key == "bounds":
                out[key] = parse_numbers(f"{self.TASK}.bounds", control.value)
            elif key == "tied":
                out[key] = [[n.strip() for n in group.split(",") if n.strip()]
                            for group in control.value.split(";") if group.strip()]
            elif key == "budget":
                out[key] = _optional_number(f"{self.TASK}.budget", control.value)
            elif key == "start_step":
                text = control.value.strip()
                out[key] = None if not text else (
                    int(text) if text.lstrip("-").isdigit() else text)  # the config names a bad one
            else:
                value = control.value
                out[key] = list(value) if isinstance(control, w.TagsInput) else value
        return out

    @property
    def config(self) -> Config:
        """The validated frozen config of the current values (``ConfigError`` if invalid)."""
        values = self.values()
        common = {k: values.pop(k) for k in ("dump_path", "rank", "step")}
        return self.base.replace(**common, **{self.TASK: values})

    def validate(self) -> Config | None:
        """Validate the current values and show the result; the config, or ``None``."""
        try:
            config = self.config
        except ConfigError as exc:
            self._show_error(str(exc), exc.field)
            return None
        self._show_error("")
        self.preview.value = (f"<pre style='margin:0;font-size:11px'>"
                              f"{html.escape(config.to_json())}</pre>")
        if self.applied is not None and config == self.applied:
            self._status("ok", self._applied_text(config))
        else:
            self._status("pending", "✓ valid, not applied yet: press Apply")
        return config

    def _show_error(self, message: str, key: str | None = None) -> None:
        self.error = message
        key = "list" if key == "api_list" else key
        self.error_key = key if key in self.controls else ""
        for name, control in self.controls.items():
            for c in (control.values() if isinstance(control, dict) else [control]):
                c.layout.border = "2px solid #d32f2f" if name == self.error_key else ""
        self.apply_button.disabled = bool(message)
        if message:
            self._status("error", f"✗ {message}")

    def _status(self, kind: str, text: str) -> None:
        color = {"error": "#c62828", "ok": "#2e7d32", "pending": "#555"}[kind]
        self.status.value = (f"<span class='probekit-status probekit-{kind}' "
                             f"style='color:{color};font-weight:600'>{html.escape(text)}</span>")

    def _changed(self, change) -> None:
        self.validate()

    # -- apply -------------------------------------------------------------------------------
    def on_apply(self, callback: Callable) -> None:
        """Call ``callback(config)`` after each successful apply."""
        self._callbacks.append(callback)

    def apply(self, button=None) -> Config | None:
        """Validate; if valid make it ``applied``, run the callbacks and show what was applied."""
        config = self.validate()
        if config is None:
            return None
        self.applied = config
        self._use(config)
        for callback in self._callbacks:
            callback(config)
        self._status("ok", self._applied_text(config))
        return config

    def _use(self, config: Config) -> None:
        """What applying means beyond ``applied`` (subclasses)."""

    def _apply_tooltip(self) -> str:
        return "Validate and keep these settings as panel.applied"

    def _applied_text(self, config: Config) -> str:
        return f"✓ Applied: {describe(config)}"

    def set(self, **values) -> None:
        """Set controls by config key (``panel.set(pert_mode="bit_noise", list=["matmul"])``)."""
        for key, value in values.items():
            key = "list" if key == "api_list" else key
            if key not in self.controls:
                raise KeyError(f"{key!r} is not a control of this panel; accepted: "
                               f"{', '.join(self.controls)}")
            control = self.controls[key]
            if key == "thresholds":
                for k, c in control.items():
                    c.value = value.get(k, 0.0)
            elif isinstance(control, w.Text) and not isinstance(value, str):
                control.value = ", ".join(str(v) for v in value)
            else:
                control.value = list(value) if isinstance(control, w.TagsInput) else value

    def __repr__(self) -> str:
        state = f"invalid: {self.error}" if self.error else "valid"
        return f"{type(self).__name__}({state})"

    def _repr_mimebundle_(self, **kwargs):
        """The widget, plus a static HTML table of the settings for front-ends without widgets."""
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        try:
            values = self.config.to_dict()
            values = {**{k: values[k] for k in ("dump_path", "rank", "step")}, **values[self.TASK]}
        except ConfigError:
            values = {}
        cell = "padding:1px 8px;text-align:left"
        rows = "".join(f"<tr><td style='{cell}'>{html.escape(LABELS.get(k, k))}</td>"
                       f"<td style='{cell}'><code>{html.escape(shown_value(k, v))}</code>"
                       "</td></tr>"
                       for k, v in values.items())
        bundle["text/html"] = (f"<div><b>{html.escape(self.TITLE)}</b> (static view)"
                               f"<table>{rows}</table>{self.status.value}</div>")
        return bundle


class FreeBenchPanel(ConfigPanel):
    """Free-benchmark settings. Apply makes them the defaults of ``%%freebench``
    (``use_for_magic=False`` to only keep them in ``panel.applied``)."""

    TASK = "free_benchmark"
    TITLE = "Free benchmark settings"
    GROUPS = (
        ("What to check", ["pert_mode", "handler_type", "fuzz_stage", "fuzz_device",
                           "fuzz_level"]),
        ("Which APIs", ["scope", "list", "module"]),
        ("Preheat", ["if_preheat", "preheat_step", "max_sample"]),
        ("Overhead budget", ["budget"]),
        ("Threshold overrides (0: from the dtype)", ["thresholds"]),
        ("Where", ["dump_path", "rank", "step", "resume", "overwrite"]),
    )

    def __init__(self, config=None, *, on_apply=None, use_for_magic: bool = True):
        self.use_for_magic = use_for_magic
        #: True once an apply made the settings the %%freebench defaults
        self.magic_defaults_set = False
        if config is None:
            from .magics import get_defaults

            config = get_defaults()
        super().__init__(config, on_apply=on_apply)

    def _use(self, config: Config) -> None:
        from IPython import get_ipython

        shell = get_ipython()
        if self.use_for_magic and shell is not None:
            from .magics import set_defaults

            set_defaults(config, shell)
            self.magic_defaults_set = True

    def _apply_tooltip(self) -> str:
        return "Validate and make these settings the defaults of %%freebench"

    def _applied_text(self, config: Config) -> str:
        where = " (now the %%freebench defaults)" if self.magic_defaults_set else ""
        return f"✓ Applied{where}: {describe(config)}"


class GradProbePanel(ConfigPanel):
    """Grad-probe settings; ``panel.applied`` / ``panel.config`` feed ``GradProbe(config=...)``."""

    TASK = "grad_probe"
    TITLE = "Grad probe settings"
    GROUPS = (
        ("What to record", ["grad_level", "grad_point", "bounds", "hash", "significance",
                            "sample", "flush_every", "flush_seconds"]),
        ("Which parameters", ["param_list"]),
        ("Where", ["dump_path", "rank", "step"]),
        ("Restarts", ["resume", "start_step", "overwrite", "durable"]),
        ("Control run", ["control", "control_seed"]),
        ("Distributed", ["check_replicas", "tied"]),
    )


__all__ = ["ConfigPanel", "FreeBenchPanel", "GradProbePanel"]


def _optional_number(key: str, text: str):
    """``None`` for empty text, else the number (``ConfigError`` naming ``key`` otherwise)."""
    text = text.strip()
    if not text or text.lower() in ("none", "null", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not valid; accepted: a number > 0 (e.g. 0.2), or "
                          "empty for no budget") from None

"""Every probekit file path and dotted name the docs mention exists (the docs follow the tree).

``probekit/grads/store/store.py`` must be a file; ``probekit.grads.compare.compare`` a module or
package; ``probekit.freebench.repro.of_call`` a module followed by a name it defines (imported
and looked up, except under ``probekit.mindspore``, whose modules import MindSpore: there the
module part must exist).
"""
import glob
import importlib
import importlib.util
import os
import re

import probekit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(probekit.__file__)))
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
PATH_RE = re.compile(r"(?<![\w/.])probekit/[\w/]+\.(?:py|c)\b")
DOTTED_RE = re.compile(r"(?<![\w/.])probekit(?:\.[A-Za-z_]\w*)+")


def mentions(text: str) -> tuple:
    return sorted(set(PATH_RE.findall(text))), sorted(set(DOTTED_RE.findall(text)))


def _module_file(name: str):
    base = os.path.join(ROOT, *name.split("."))
    for f in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(f):
            return f
    return None


def missing_dotted(name: str):
    """Why ``name`` does not exist (``None`` when it does)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if _module_file(module):
            rest = parts[i:]
            break
    else:
        return "no such module"
    if not rest or module.startswith("probekit.mindspore"):
        return None
    obj = importlib.import_module(module)
    for attr in rest:
        if not hasattr(obj, attr):
            return f"{module} has no {'.'.join(rest)}"
        obj = getattr(obj, attr)
    return None


def test_the_scanner_finds_what_is_stale(tmp_path):
    paths, dotted = mentions("see `probekit/grads/nope.py`, probekit/plot.py and "
                             "`probekit.grads.nope.compute`, probekit.triage, probekit.plot.")
    assert paths == ["probekit/grads/nope.py", "probekit/plot.py"]
    assert dotted == ["probekit.grads.nope.compute", "probekit.plot", "probekit.triage"]
    assert missing_dotted("probekit.grads.nope.compute") == "probekit.grads has no nope.compute"
    assert missing_dotted("probekit.freebench.judge.scales.nope") == \
        "probekit.freebench.judge.scales has no nope"
    assert missing_dotted("probekit.freebench.repro.of_call") is None
    assert missing_dotted("probekit.nope") == "probekit has no nope"


def test_every_module_named_in_the_docs_exists():
    stale = []
    for doc in DOCS:
        with open(doc, encoding="utf-8") as fh:
            paths, dotted = mentions(fh.read())
        name = os.path.relpath(doc, ROOT)
        stale += [(name, p, "no such file") for p in paths
                  if not os.path.isfile(os.path.join(ROOT, p))]
        stale += [(name, d, why) for d in dotted if (why := missing_dotted(d))]
    assert stale == []


def test_the_architecture_page_is_current():
    """docs/architecture.md is what tools/architecture.py draws from today's imports."""
    spec = importlib.util.spec_from_file_location(
        "_probekit_architecture", os.path.join(ROOT, "tools", "architecture.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as fh:
        assert fh.read() == tool.render(), "run: python tools/architecture.py"

"""``make demo``: execute ``notebooks/01_quickstart.ipynb`` headless (both probes on a model with
a planted ill-conditioned op) and write ``{out}/quickstart.html`` (plots inline) and
``{out}/quickstart_summary.txt``; the run's dumps land in ``{out}/quickstart_run``. Then
``notebooks/04_triage.ipynb`` the same way: ``{out}/triage.html``, ``{out}/triage_summary.txt``.
With ``--pictures DIR`` (``--no-notebooks``: only that) the README's snippets run too (in ``{out}/readme``) and the pictures the
README shows are copied to ``DIR`` (``make demo``: ``docs/img``).

The README's snippets are read here (``readme_blocks``) and run here (``run_readme``), by
``make demo`` and by the test that checks that every snippet runs as written and prints what
the README says it prints (``tests/integration/test_readme.py``):

* a ```` ```python ```` block is a script, run with this Python in the README's working folder
  (one folder for all of them, in order, so later ones may use what earlier ones wrote); a
  ```` ```text ```` block right after it is its literal output (stdout and stderr together);
* a ```` ```json file=NAME ```` block is written to ``NAME`` first;
* in a ```` ```bash ```` block the ``probekit ...`` lines are run (they must exit 0); install
  lines (``pip``) are checked by the install test instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
README = PROJECT_ROOT / "README.md"
_FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_PICTURE = re.compile(r"!\[[^\]]*\]\((docs/img/[^)\s]+\.png)\)")


@dataclasses.dataclass
class Block:
    """One fenced block of the README: ``lang``, ``code``, its literal ``output`` (python blocks
    followed by a text block), the ``file`` a json block is written to, its line number."""

    lang: str
    code: str
    line: int
    output: str | None = None
    file: str | None = None


def readme_blocks(text: str) -> list:
    """The README's fenced blocks in order, each python block with the text block after it."""
    blocks = []
    for m in _FENCE.finditer(text):
        lang, info, code = m.group(1), m.group(2), m.group(3)
        line = text.count("\n", 0, m.start()) + 1
        follows = blocks and blocks[-1].lang == "python" and blocks[-1].output is None and \
            text[blocks[-1]._end:m.start()].strip() == ""
        if lang == "text" and follows:
            blocks[-1].output = code
            continue
        block = Block(lang, code, line)
        name = re.search(r"\bfile=(\S+)", info)
        block.file = name.group(1) if name else None
        block._end = m.end()
        blocks.append(block)
    return blocks


def readme_pictures(text: str) -> list:
    """The pictures the README shows (``docs/img/NAME.png``), in order."""
    return _PICTURE.findall(text)


def snippet_env() -> dict:
    """The environment of a README snippet: this checkout's probekit first on the path, no
    buffering (stdout and stderr interleave as in a terminal), matplotlib headless and on its
    own defaults (no user ``matplotlibrc``: ``MPLCONFIGDIR`` a folder of probekit's in the
    temporary directory, which keeps only matplotlib's font cache), so a picture is the same
    bytes wherever it is drawn with the same matplotlib."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH"))
                                        if p)
    env.update(PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    env.pop("MATPLOTLIBRC", None)
    import tempfile

    config = Path(tempfile.gettempdir()) / "probekit-mplconfig"
    config.mkdir(parents=True, exist_ok=True)
    env["MPLCONFIGDIR"] = str(config)
    return env


def run_readme(workdir, *, text: str | None = None, timeout: int = 300) -> list:
    """Run the README's snippets in ``workdir``: [(block, what it printed)] for the python
    blocks and the ``probekit`` lines of bash blocks; raises ``RuntimeError`` when one fails."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    text = README.read_text(encoding="utf-8") if text is None else text
    env = snippet_env()
    done = []
    for block in readme_blocks(text):
        if block.lang == "json" and block.file:
            (workdir / block.file).write_text(block.code, encoding="utf-8")
            continue
        if block.lang == "python":
            cmds = [[sys.executable, "-c", block.code]]
        elif block.lang == "bash":
            cmds = [[sys.executable, "-m", "probekit.cli", *line.split("#")[0].split()[1:]]
                    for line in block.code.splitlines() if line.startswith("probekit ")]
        else:
            continue
        for cmd in cmds:
            out = subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, timeout=timeout)
            if out.returncode != 0:
                raise RuntimeError(f"README line {block.line}: {' '.join(cmd[2:])[:80]!r} exited "
                                   f"{out.returncode}:\n{out.stdout[-3000:]}")
            done.append((block, out.stdout))
    return done


def draw_pictures(dest, workdir) -> list:
    """Run the README's snippets in ``workdir`` and copy the pictures the README shows to
    ``dest`` (by file name: ``docs/img/findings.png`` is the ``findings.png`` a snippet saved)."""
    text = README.read_text(encoding="utf-8")
    run_readme(workdir, text=text)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for picture in readme_pictures(text):
        name = Path(picture).name
        shutil.copyfile(Path(workdir) / name, dest / name)
        copied.append(dest / name)
    return copied


def refresh_outputs(text: str, ran: list) -> str:
    """``text`` with each python block's text block replaced by what it printed (``ran`` from
    ``run_readme``): for maintainers, after a change of what the snippets print."""
    printed = {block.line: out for block, out in ran if block.lang == "python"}
    pieces, last, pending = [], 0, None
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m.group(1) == "python":
            pending = printed.get(line)
            continue
        if m.group(1) == "text" and pending is not None:
            start = m.start(3)
            pieces += [text[last:start], pending]
            last = m.end(3)
        pending = None
    return "".join(pieces) + text[last:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probekit.demo")
    parser.add_argument("--out", default="demo_out")
    parser.add_argument("--pictures", metavar="DIR", default=None,
                        help="also run the README's snippets and copy its pictures here")
    parser.add_argument("--no-notebooks", action="store_true",
                        help="only the README's pictures (make docs)")
    parser.add_argument("--refresh-readme", action="store_true",
                        help="rewrite the README's output blocks with what its snippets print")
    args = parser.parse_args(argv)
    if not args.no_notebooks:
        from .notebook.run import demo  # the notebook layer runs the quickstart in a real kernel

        print(demo(args.out))
    if args.refresh_readme:
        text = README.read_text(encoding="utf-8")
        README.write_text(refresh_outputs(text, run_readme(Path(args.out) / "readme", text=text)),
                          encoding="utf-8")
        print(f"README outputs refreshed: {README}")
    if args.pictures:
        for path in draw_pictures(args.pictures, Path(args.out) / "readme"):
            print(f"README picture: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 28, point 2: the README is a front page whose every snippet runs as written.

The snippets run in one folder, in order, through ``probekit.demo.run_readme`` (what
``make demo`` runs to draw the README's pictures): each python block prints exactly the text
block under it, the ``probekit`` command lines exit 0, and the pictures the README shows are the
ones its snippets draw."""
import re
from pathlib import Path

import pytest

from probekit.demo import PROJECT_ROOT, README, readme_blocks, readme_pictures, run_readme

TEXT = README.read_text(encoding="utf-8")
DOCS = sorted((PROJECT_ROOT / "docs").glob("*.md"))


@pytest.mark.slow
def test_every_snippet_runs_and_prints_what_the_readme_shows(tmp_path):
    ran = run_readme(tmp_path, text=TEXT)
    python = [b for b in readme_blocks(TEXT) if b.lang == "python"]
    assert [b for b, _ in ran if b.lang == "python"] == python and len(python) == 3
    for block, printed in ran:
        if block.output is not None:
            assert printed == block.output, f"README line {block.line}"
    assert sum(b.lang == "bash" for b, _ in ran) == 2  # the two probekit command lines
    pictures = {p: (tmp_path / Path(p).name).read_bytes() for p in readme_pictures(TEXT)}
    for picture, drawn in pictures.items():
        # `make demo` redraws them: the committed bytes are what the snippets draw
        assert drawn == (PROJECT_ROOT / picture).read_bytes(), picture
    # run again in the same folder (`make demo` twice): each run is not a restart, so it
    # replaces the last one's recording and findings (one line each says so) and draws the
    # same pictures, byte for byte (issue 36)
    again = run_readme(tmp_path, text=TEXT)
    replaced = re.compile(r"\[probekit\] (grad_probe: \S+ held steps 0\.\.\d+ of a run that ended "
                          r"cleanly; this run is not a restart, so it replaces them|Free "
                          r"benchmark: \S+ held 1 finding\(s\) of an earlier run; this run is "
                          r"not a restart and the last one ended cleanly, so this run replaces "
                          r"them) \(resume=True (continues a store|appends)\)\n")
    assert [b for b, _ in again] == [b for b, _ in ran]
    lines = 0
    for (block, first), (_, second) in zip(ran, again):
        lines += len(replaced.findall(second))
        assert replaced.sub("", second) == first, f"README line {block.line}"
    assert lines == 4  # fb_run, run_fp32, run_bf16, msprobe_run
    for picture, drawn in pictures.items():
        assert (tmp_path / Path(picture).name).read_bytes() == drawn, picture


def test_the_readme_is_a_front_page():
    lines = TEXT.splitlines()
    # about 120 lines of prose around three runnable scripts and their literal output
    assert len(lines) <= 172 and len(TEXT.split()) <= 1050
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:3] == ["## Install", "## Free benchmark: which operation is numerically broken?",
                            "## Grad probe: where do two runs part?"]
    assert "## FAQ" in headings
    for question in ("grad store is empty", "bf16 shows divergence", "No findings",
                     "msprobe config"):
        assert question in TEXT
    assert len(readme_pictures(TEXT)) == 2


def test_links_of_the_readme_and_docs_lead_to_files():
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"


PIP = re.compile(r"pip install ([^\n`#]*)")


def test_every_pip_line_installs_this_project():
    """The package index's `probekit` is another project: a pip line names this one by path
    (``.``, ``".[s3]"``, a built wheel) or by its distribution name, probekit-precision."""
    bad = []
    for page in [README, *DOCS, PROJECT_ROOT / "Makefile"]:
        for args in PIP.findall(page.read_text(encoding="utf-8")):
            for arg in args.split():
                name = arg.strip("'\"")
                if re.match(r"probekit(\[|$)", name):
                    bad.append(f"{page.name}: pip install {args.strip()}")
    assert bad == []
    assert "pip install .  " in TEXT and 'pip install ".[s3]"' in TEXT
    assert "pip install dist/probekit_precision-*.whl" in TEXT

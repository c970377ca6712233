import logging
import os

import pytest

from probekit.log import Once, get_logger
from probekit.paths import safe_join, safe_name


@pytest.mark.parametrize("name,expected", [
    ("layer.0.weight", "layer.0.weight"),
    ("../../etc/passwd", "_.._etc_passwd"),
    ("..", "_"),
    ("a/b\\c:d e", "a_b_c_d_e"),
    ("", "_"),
    ("Torch.matmul.0.forward", "Torch.matmul.0.forward"),
])
def test_safe_name(name, expected):
    assert safe_name(name) == expected


def test_safe_name_long_names_stay_distinct():
    a, b = safe_name("x" * 300 + "a"), safe_name("x" * 300 + "b")
    assert len(a) == 200 and len(b) == 200 and a != b


def test_safe_join_stays_inside(tmp_path):
    for evil in ("../x", "/abs/path", "..", "a/../../b"):
        path = safe_join(tmp_path, evil)
        assert os.path.dirname(path) == os.path.realpath(tmp_path)


def test_safe_join_refuses_symlink_escape(tmp_path):
    (tmp_path / "link").symlink_to("/")
    with pytest.raises(ValueError, match="outside"):
        safe_join(tmp_path, "link")


def test_logger_prefix_and_hierarchy(caplog):
    log = get_logger("grads.store")
    assert log.logger.name == "probekit.grads.store"
    with caplog.at_level(logging.INFO, logger="probekit"):
        log.info("hello %d", 3)
    assert caplog.records[-1].getMessage() == "[probekit] hello 3"


def test_once():
    once = Once()
    assert [once("a"), once("a"), once("b")] == [True, False, True]
    once.clear()
    assert once("a")


def test_safe_name_keeps_the_extension_of_a_long_name():
    """A long name is cut before its extension, so a picture stays a ``.png`` (matplotlib took
    the text after the last dot as the format) and a sign file a ``.npy``."""
    import hashlib

    name = "enc." + "x" * 250 + "_similarities.png"
    got = safe_name(name)
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    assert got == "enc." + "x" * 181 + f"-{digest}.png" and len(got) == 200
    assert safe_name("x" * 300) == "x" * 189 + "-" + hashlib.sha1(b"x" * 300).hexdigest()[:10]


def test_unique_names_give_each_name_its_own_file_whatever_the_order():
    from probekit.paths import unique_names

    names = ["a/b", "a_b", "层.w", "权.w", "ok.w", "summary"]
    got = unique_names(names, ".npy")
    assert got[1] == "a_b.npy" and got[4] == "ok.w.npy" and got[5] == "summary.npy"
    assert got[0].startswith("a_b-") and got[2].startswith("_.w-") and got[3].startswith("_.w-")
    assert len(set(got)) == len(got) and all(g.endswith(".npy") for g in got)
    back = unique_names(names[::-1], ".npy")[::-1]
    assert back == got
    # a name that would take a file of the folder's own is moved off it
    pics = unique_names(["summary", "x"], "_similarities.png", taken={"summary_similarities.png"})
    assert pics[0].startswith("summary_similarities-") and pics[0].endswith(".png")
    assert pics[1] == "x_similarities.png"

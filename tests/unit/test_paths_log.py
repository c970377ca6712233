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

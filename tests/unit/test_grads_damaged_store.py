"""A damaged grad store (a file lost, cut short or overwritten, a folder removed, a partial
copy) is a ``GradStoreError`` naming the file and saying what is wrong, never values made up
from fill bytes nor a raw error from deep inside json, numpy or zarr; a dump_path that cannot be
made says so before anything is recorded."""
import os
import shutil

import pytest
import torch

from probekit.errors import GradCompareError, GradStoreError
from probekit.grads import GradProbe, compare_grads, open_grads
from probekit.grads.store import store as store_mod

G = os.path.join("grads.zarr", "rank0")


def _record(path, width=4, shift=0.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradProbe(model, optimizer=opt, dump_path=str(path)):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, width) + shift).sum().backward()
            opt.step()
    return str(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    return _record(root / "base"), _record(root / "ref", shift=1e-3)


def _copy(base, tmp_path, name="d"):
    dest = str(tmp_path / name)
    shutil.copytree(base, dest)
    return dest


@pytest.mark.parametrize("array", ["norm", "max", "present", "step"])
def test_a_lost_statistics_chunk_is_an_error_not_fill_values(base, tmp_path, array):
    d = _copy(base[0], tmp_path)
    os.remove(os.path.join(d, G, array, "c", "0", "0") if array != "step"
              else os.path.join(d, G, array, "c", "0"))
    with pytest.raises(GradStoreError, match=rf"{array}/c/0(/0)?: missing, though the store's "
                                             r"commit\.json counts the rows it holds as written"):
        open_grads(d)


def test_a_lost_sign_chunk_of_a_large_row_is_an_error(tmp_path, monkeypatch):
    """Rows over the chunk size are stored one step a chunk file, every file written (their
    fill is 0): a lost one read as zeros once gave a false divergence at step 0."""
    monkeypatch.setattr(store_mod, "_TARGET_CHUNK_BYTES", 8)
    d, ref = _record(tmp_path / "d", width=64), _record(tmp_path / "ref", width=64)
    assert open_grads(d)["direction"].values.any()
    os.remove(os.path.join(d, G, "direction", "c", "1", "0"))
    with pytest.raises(GradStoreError, match=r"direction/c/1/0: missing, though"):
        open_grads(d)["direction"].values
    with pytest.raises(GradStoreError, match=r"direction/c/1/0: missing, though"):
        compare_grads(ref, d)
    # the significance bits leave out chunks of all ones by design: one missing reads as ones
    sig = os.path.join(ref, G, "significant", "c", "0", "0")
    if os.path.exists(sig):
        os.remove(sig)
    assert (open_grads(ref)["significant"].values[0, :8] == 255).all()


@pytest.mark.parametrize("damage,match", [
    (lambda d: _write(d, "zarr.json", "{not json"),
     r"rank0/zarr\.json: not valid JSON \(Expecting property name"),
    (lambda d: _write(d, "commit.json", "{{{"), r"rank0/commit\.json: not valid JSON"),
    (lambda d: _write(d, "commit.json", '{"steps": -1}'),
     r"commit\.json: unreadable commit marker \{'steps': -1\}; accepted: \{\"steps\": <count"),
    (lambda d: _write(d, "commit.json", '{"steps": 3, "runs": "x"}'),
     r"commit\.json: unreadable commit marker"),
    (lambda d: _write(d, "max/zarr.json", "garbage"),
     r"rank0: cannot be read \(JSONDecodeError: Expecting value"),
    (lambda d: _write(d, "max/zarr.json", "{}"),
     r"rank0: cannot be read \(MetadataValidationError"),
    (lambda d: shutil.rmtree(os.path.join(d, G, "param")),
     r"rank0: no param array \(every rank group has step, param, max, min, norm\): the store "
     r"is damaged"),
    (lambda d: _cut(d, "direction/c/0/0", 5),
     r"direction/c/0/0: 5 bytes, too short for a shard index"),
    (lambda d: _cut(d, "max/c/0/0", 5), r"rank0/max/c/0/0: 5 bytes, expected \d+$"),
])
def test_damaged_files_are_named(base, tmp_path, damage, match):
    d = _copy(base[0], tmp_path)
    damage(d)
    with pytest.raises(GradStoreError, match=match) as err:
        open_grads(d)["direction"].values
    assert str(err.value).count("grads.zarr") == 1        # the path once, not twice


def _write(d, member, text):
    with open(os.path.join(d, G, member), "w") as fh:
        fh.write(text)


def _cut(d, member, n):
    path = os.path.join(d, G, member)
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(data[:n])


def test_a_lost_direction_folder_is_damage_not_a_level(base, tmp_path):
    d = _copy(base[0], tmp_path)
    shutil.rmtree(os.path.join(d, G, "direction"))
    with pytest.raises(GradCompareError, match=r"recorded at grad_level 'L1', but its rank "
                                               r"group of rank 0 holds no direction array: "
                                               r"the store is damaged"):
        compare_grads(base[1], d)


def test_a_dump_path_that_cannot_be_made_is_named_before_recording():
    """A folder the config's check cannot rule out (no file in the way) that the system refuses:
    /proc takes no new folders, even from root."""
    from probekit.errors import ConfigError

    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(GradStoreError, match=r"grad_probe: dump_path '/proc/probekit-none/sub' "
                                             r"cannot be created \(.+\); accepted: a folder "
                                             r"that exists or can be created"):
        GradProbe(model, dump_path="/proc/probekit-none/sub").start()
    assert not os.path.exists("/proc/probekit-none")
    with pytest.raises(ConfigError, match=r"accepted: a non-empty path string without NUL"):
        GradProbe(model, dump_path="a\0b")

"""Raw Zarr v3 chunk I/O: the chunk files of the grad store's arrays, read and written directly.

The store keeps every array uncompressed (sign bits are random; the statistics barely compress),
so a chunk file is the chunk's little-endian C-order bytes (``bytes`` codec, default ``c/<i>/<j>``
keys); the sign bits of a small model are shards of steps (``sharding_indexed``: each step's
bytes one after the other, then the index), so a shard holds only the steps written. Reading and
writing those files without Zarr's codec pipeline or event loop is what makes the comparison
fast and lets a write run anywhere (the store's writing thread, an ``atexit`` handler, a signal
handler). ``plain_meta`` and ``bits_meta`` are the checks that an array has such a layout;
anything else goes through Zarr. Every file is replaced with ``probekit.atomic.atomic_write``
(through the storage's ``write``: fsync'd only when the store is ``durable``).
"""
from __future__ import annotations

import json
import mmap
import os

import numpy as np

from ...errors import GradStoreError
from .storage import LOCAL

_PLAIN_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "int64": np.int64, "float64": np.float64}


def plain_meta(array_path: str, fs=LOCAL, sharded: bool = False) -> dict | None:
    """The ``zarr.json`` of an array whose chunk files can be read and written directly: Zarr
    v3, uncompressed (the ``bytes`` codec alone, little-endian), a regular chunk grid, the
    default ``c/<i>/<j>`` chunk keys, a data type of ``_PLAIN_DTYPES``; None for anything else
    (another writer's layout: read through Zarr instead)."""
    try:
        meta = json.loads(fs.read(fs.join(array_path, "zarr.json")))
    except (OSError, ValueError):
        return None
    codecs = meta.get("codecs", [])
    key_enc = meta.get("chunk_key_encoding", {})
    if sharded and [c.get("name") for c in codecs] == ["sharding_indexed"]:
        conf = codecs[0].get("configuration", {})
        chunk = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", [])
        inner = conf.get("codecs", [])
        index = conf.get("index_codecs", [])
        if (len(chunk) != 2 or list(conf.get("chunk_shape", [])) != [1, chunk[1]]
                or [c.get("name") for c in inner] != ["bytes"]
                or [c.get("name") for c in index] != ["bytes"]
                or index[0].get("configuration", {}).get("endian", "little") != "little"
                or conf.get("index_location", "end") != "end"):
            return None
        codecs = [{"name": "bytes"}]
    if (meta.get("data_type") not in _PLAIN_DTYPES or not meta.get("shape")
            or [c.get("name") for c in codecs] != ["bytes"]
            or codecs[0].get("configuration", {}).get("endian", "little") != "little"
            or meta.get("chunk_grid", {}).get("name") != "regular"
            or key_enc.get("name") != "default"
            or key_enc.get("configuration", {}).get("separator", "/") != "/"):
        return None
    return meta


def check_rows(stored: int, n: int, group_path: str, name: str) -> None:
    if stored < n:
        raise GradStoreError(f"{group_path}/{name}: {stored} steps stored but {n} committed; "
                             "the store is damaged")


def set_rows(array_path: str, n: int, fs=LOCAL, fsync: bool = True) -> None:
    """Set the first dimension of a Zarr v3 array's metadata to ``n`` (atomic rewrite)."""
    meta_path = fs.join(array_path, "zarr.json")
    meta = json.loads(fs.read(meta_path))
    if meta["shape"][0] == int(n):
        return
    meta["shape"][0] = int(n)
    fs.write(meta_path, json.dumps(meta, indent=2).encode(), fsync=fsync)


def write_plain_chunk(array_path: str, i: int, block: np.ndarray, fs=LOCAL,
                      fsync: bool = True, fresh: bool = False) -> str:
    """Write chunk ``i`` of an uncompressed array chunked along its first dimension only:
    ``block`` is the whole chunk (rows past the data are the fill value). Returns the folder
    the file was renamed into. ``fresh``: the chunk holds no committed row, so no reader reads
    it and it is written in place (no temporary file and rename)."""
    block = np.asarray(block)
    tail = block.shape[1:]
    folder = fs.join(array_path, "c", str(i))
    if tail:
        name = fs.join(folder, *(["0"] * len(tail)))
    else:
        name = folder
    fs.makedirs(fs.dirname(name))
    fs.write(name, np.ascontiguousarray(block, dtype=block.dtype.newbyteorder("<")).tobytes(),
             fsync=fsync, atomic=not fresh)
    return fs.dirname(name)


def _all_fill(row: np.ndarray, fill: int) -> bool:
    """Is every byte of ``row`` the fill value? (a word at a time, first and last byte first;
    for the fills of the bit arrays, 0 and 255, one reduction and no temporary array)"""
    if row.size == 0:
        return True
    if row[0] != fill or row[-1] != fill:
        return False
    if row.size % 8 == 0 and row.flags.c_contiguous:
        words = row.view(np.uint64)
        if fill == 255:
            return bool(words.min() == _ONES)
        if fill == 0:
            return not words.any()
        return bool(np.all(words == np.uint64(0x0101010101010101 * fill)))
    return bool(np.all(row == fill))


_ONES = np.uint64(2 ** 64 - 1)


#: a missing inner chunk in a shard index (Zarr v3 ``sharding_indexed``)
_MISSING = np.uint64(2 ** 64 - 1)


def write_bits_chunk(array_path: str, meta: dict, i: int, rows: list, fs=LOCAL,
                     fsync: bool = True, fresh: bool = False) -> set:
    """Write chunk ``i`` (rows ``i*cr...``) of a packed-bit array ``(step, byte)`` from
    ``rows`` (1-D uint8 arrays of ``ncols`` bytes: the chunk's first rows, the others not written
    yet). Returns the folders files were renamed into. ``fresh``: the chunk holds no committed
    row (its files are written in place, ``write_plain_chunk``).

    A sharded array (``bits_meta`` kind "sharded": one shard file per ``cr`` steps, an inner
    chunk per step) gets a shard holding only the given rows that are not all fill value (a
    short run's last shard is as long as its steps, not padded to ``cr``), then the shard index
    (``(offset, nbytes)`` per step, missing ones 2**64-1). A plain array gets each of its column
    chunks written whole (rows past ``rows`` = fill); a chunk of only fill bytes, when the fill
    is not 0, is not written (an earlier file of it is removed)."""
    cr, cc = meta["chunk"]
    ncols, fill = meta["shape"][1], meta["fill"]
    folder = fs.join(array_path, "c", str(i))
    fs.makedirs(folder)
    if meta["kind"] == "sharded":
        path = fs.join(folder, "0")
        index = np.full((cr, 2), _MISSING, dtype="<u8")
        parts, pos = [], 0
        for k, row in enumerate(rows):
            if _all_fill(row, fill):
                continue
            parts.append(np.ascontiguousarray(row, dtype=np.uint8))
            index[k] = (pos, cc)
            pos += cc
        if not parts:
            fs.remove(path)
            return {folder}
        fs.write(path, b"".join([*(p.data for p in parts), index.tobytes()]), fsync=fsync,
                 atomic=not fresh)
        return {folder}
    ncol_chunks = -(-ncols // cc)

    def put(path, data, pad=0):
        if fill and (not pad or fill == 0) and _all_fill(np.ravel(data), fill):
            fs.remove(path)
            return
        fs.write(path, data, pad=pad, fsync=fsync, atomic=not fresh)

    if cr == 1:  # one step per chunk (large models): the row's pieces as they are
        row = rows[0]
        for j in range(ncol_chunks):
            piece = row[j * cc:(j + 1) * cc]
            if fill and piece.size < cc:
                piece = np.concatenate([piece, np.full(cc - piece.size, fill, np.uint8)])
            put(fs.join(folder, str(j)), piece, pad=cc - piece.size)
        return {folder}
    block = np.full((cr, ncol_chunks * cc), fill, np.uint8)
    for k, row in enumerate(rows):
        block[k, :ncols] = row
    for j in range(ncol_chunks):
        put(fs.join(folder, str(j)), np.ascontiguousarray(block[:, j * cc:(j + 1) * cc]))
    return {folder}


def bits_meta(array_path: str, fs=LOCAL) -> dict | None:
    """How a packed-bit array ``(step, byte)`` uint8 is stored, when its chunk files can be read
    and written directly: ``{"kind": "plain"|"sharded", "shape", "chunk": (rows, cols),
    "fill"}``; None for any other layout (read through Zarr).

    "plain": uncompressed chunks (``plain_meta``). "sharded": Zarr v3 ``sharding_indexed``, a
    shard of ``rows`` steps, inner chunks of one step ``(1, cols)`` stored uncompressed
    (``bytes``), the index at the end, uncompressed, without checksum."""
    meta = plain_meta(array_path, fs, sharded=True)
    if meta is None or len(meta["shape"]) != 2 or meta["data_type"] != "uint8":
        return None
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    kind = "sharded" if meta["codecs"][0]["name"] == "sharding_indexed" else "plain"
    return {"kind": kind, "shape": list(meta["shape"]), "chunk": (int(chunk[0]), int(chunk[1])),
            "fill": int(meta.get("fill_value", 0) or 0)}


def unit_slices(reader, key) -> tuple:
    """``(r0, r1, c0, c1)`` of ``reader[key]`` for the (step, byte) bit readers (``RawChunks``,
    ``JoinedBits``, ``AssembledBits``), which read unit-step slices only."""
    if not isinstance(key, tuple):
        key = (key,)
    key = key + (slice(None),) * (2 - len(key))
    if not all(isinstance(k, slice) for k in key[:2]):
        raise IndexError(f"{type(reader).__name__} supports unit-step slices only, got {key!r}")
    r0, r1, rs = key[0].indices(reader.shape[0])
    c0, c1, cs = key[1].indices(reader.shape[1])
    if rs != 1 or cs != 1:
        raise IndexError(f"{type(reader).__name__} supports unit-step slices only, got {key!r}")
    return r0, r1, c0, c1


class RawChunks:
    """Read-only array over an uncompressed Zarr v3 array, reading its chunk files directly.

    The sign bits are stored without compression (they are random bits), so a chunk file is
    the chunk's C-order bytes (Zarr v3, ``bytes`` codec, default chunk key encoding
    ``c/<i>/<j>``; a missing file is all fill value where the writer leaves such chunks out,
    an error where it writes every one: ``every_chunk``); a sharded array (``bits_meta``) has one
    file per shard of steps holding each step's bytes and an index. Reading them with
    ``readinto``/``preadv`` straight into the result avoids the copies of the generic codec
    pipeline, which matters for the comparison's throughput. ``open`` returns None for an array
    stored any other way. ``row0``: the stored row that is row 0 here (``window``: a range of a
    group's rows, as a segment of a restarted store takes them).
    """

    ndim = 2

    def __init__(self, path, shape, chunk_shape, dtype, fill, n_rows, fs=LOCAL,
                 kind: str = "plain", row0: int = 0):
        self.path, self.chunk_shape, self.fs = path, tuple(chunk_shape), fs
        self.dtype = np.dtype(dtype)
        self.fill = fill
        self.kind = kind
        # its writer (``write_bits_chunk``) writes every chunk of a plain array of fill 0 (it
        # leaves out chunks only of a nonzero fill, and a shard's rows of the fill): a missing
        # one is damage, not rows of the fill value
        self.every_chunk = kind == "plain" and not fill
        self.row0 = int(row0)
        self.shape = (int(n_rows), int(shape[1]))

    @classmethod
    def open(cls, path: str, n_rows: int, fs=LOCAL, row0: int = 0):
        """Rows ``row0 .. row0 + n_rows`` of the array at ``path`` (at most those stored)."""
        meta = bits_meta(path, fs)
        if meta is None:
            return None
        n = max(0, min(n_rows, meta["shape"][0] - row0))
        return cls(path, meta["shape"], meta["chunk"], "uint8", meta["fill"], n, fs,
                   meta["kind"], row0)

    def window(self, r0: int, r1: int) -> "RawChunks":
        """Rows ``r0:r1`` of this array, as an array of their own."""
        return RawChunks(self.path, (r1 - r0, self.shape[1]), self.chunk_shape, self.dtype,
                         self.fill, r1 - r0, self.fs, self.kind, self.row0 + r0)

    def __getitem__(self, key):
        return self.read(*unit_slices(self, key))

    def read(self, r0: int, r1: int, c0: int = 0, c1: int | None = None, out=None):
        """Rows ``r0:r1``, columns ``c0:c1``; into ``out`` when given (a buffer reused across
        calls reads faster: fresh memory costs a page fault per page)."""
        c1 = self.shape[1] if c1 is None else c1
        shape = (max(0, r1 - r0), max(0, c1 - c0))
        out = np.empty(shape, self.dtype) if out is None else out
        if out.shape != shape:
            raise ValueError(f"out has shape {out.shape}, expected {shape}")
        if shape[0] == 0 or shape[1] == 0:
            return out
        r0, r1 = r0 + self.row0, r1 + self.row0  # stored rows from here on
        if self.kind == "sharded":
            return self._read_shards(r0, r1, c0, c1, out)
        cr, cc = self.chunk_shape
        if self.fs.remote:
            return self._read_remote(r0, r1, c0, c1, out)
        buf = None
        for i in range(r0 // cr, -(-r1 // cr)):
            for j in range(c0 // cc, -(-c1 // cc)):
                rows = slice(max(r0, i * cr), min(r1, (i + 1) * cr))
                cols = slice(max(c0, j * cc), min(c1, (j + 1) * cc))
                dest = out[rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0]
                path = os.path.join(self.path, "c", str(i), str(j))
                whole = dest.shape == (cr, cc) and dest.flags.c_contiguous
                if not whole and buf is None:
                    buf = np.empty(cr * cc, self.dtype)
                try:
                    with open(path, "rb", buffering=0) as fh:
                        got = fh.readinto(dest if whole else buf)
                except FileNotFoundError:
                    if self.every_chunk:
                        raise missing_chunk(path) from None
                    dest[...] = self.fill
                    continue
                if got != cr * cc:
                    raise GradStoreError(f"{path}: {got} bytes, expected {cr * cc}")
                if whole:
                    continue
                chunk = buf.reshape(cr, cc)
                dest[...] = chunk[rows.start - i * cr:rows.stop - i * cr,
                                  cols.start - j * cc:cols.stop - j * cc]
        return out

    def _read_remote(self, r0, r1, c0, c1, out):
        """The same rows and columns from an object store: every chunk object needed is
        fetched in one concurrent request."""
        cr, cc = self.chunk_shape
        keys = [(i, j) for i in range(r0 // cr, -(-r1 // cr))
                for j in range(c0 // cc, -(-c1 // cc))]
        paths = {k: self.fs.join(self.path, "c", str(k[0]), str(k[1])) for k in keys}
        got = self.fs.read_many(paths.values())
        for (i, j), path in paths.items():
            rows = slice(max(r0, i * cr), min(r1, (i + 1) * cr))
            cols = slice(max(c0, j * cc), min(c1, (j + 1) * cc))
            dest = out[rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0]
            raw = got[path]
            if raw is None:
                if self.every_chunk:
                    raise missing_chunk(path, self.fs)
                dest[...] = self.fill
                continue
            if len(raw) != cr * cc:
                raise GradStoreError(f"{self.fs.url(path)}: {len(raw)} bytes, expected "
                                     f"{cr * cc}")
            dest[...] = np.frombuffer(raw, self.dtype).reshape(cr, cc)[
                rows.start - i * cr:rows.stop - i * cr, cols.start - j * cc:cols.stop - j * cc]
        return out

    def _read_shards(self, r0, r1, c0, c1, out):
        """Stored rows ``r0:r1`` of a sharded array: per shard, its index, then each run of
        consecutive steps stored one after the other in one read (straight into ``out`` when
        whole rows are asked for)."""
        cr, cc = self.chunk_shape
        shards = range(r0 // cr, -(-r1 // cr))
        paths = {i: self.fs.join(self.path, "c", str(i), "0") for i in shards}
        got = self.fs.read_many(paths.values()) if self.fs.remote else None
        whole_cols = c0 == 0 and c1 == cc
        for i, path in paths.items():
            k0, k1 = max(r0, i * cr) - i * cr, min(r1, (i + 1) * cr) - i * cr
            dest = out[i * cr + k0 - r0:i * cr + k1 - r0]
            if got is not None:
                raw = got[path]
                if raw is None:
                    dest[...] = self.fill
                    continue
                index = _shard_index(raw[len(raw) - 16 * cr:], cr, path, len(raw))
                data = np.frombuffer(raw, np.uint8)
                for k, m, off in _index_runs(index, k0, k1, cc, path):
                    rows = dest[k - k0:m - k0]
                    if off is None:
                        rows[...] = self.fill
                    else:
                        rows[...] = data[off:off + (m - k) * cc].reshape(m - k, cc)[:, c0:c1]
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                dest[...] = self.fill
                continue
            try:
                size = os.fstat(fd).st_size
                index = _shard_index(os.pread(fd, 16 * cr, max(0, size - 16 * cr)), cr, path,
                                     size)
                for k, m, off in _index_runs(index, k0, k1, cc, path):
                    rows = dest[k - k0:m - k0]
                    if off is None:
                        rows[...] = self.fill
                    elif whole_cols and rows.flags.c_contiguous:
                        if os.preadv(fd, [rows], off) != rows.nbytes:
                            raise GradStoreError(f"{path}: shorter than its index says")
                    else:
                        raw = os.pread(fd, (m - k) * cc, off)
                        if len(raw) != (m - k) * cc:
                            raise GradStoreError(f"{path}: shorter than its index says")
                        rows[...] = np.frombuffer(raw, np.uint8).reshape(m - k, cc)[:, c0:c1]
            finally:
                os.close(fd)
        return out


def _shard_index(raw: bytes, cr: int, path, size: int) -> np.ndarray:
    if size < 16 * cr or len(raw) != 16 * cr:
        raise GradStoreError(f"{path}: {size} bytes, too short for a shard index of {cr} "
                             "chunks")
    return np.frombuffer(raw, "<u8").reshape(cr, 2)


def _index_runs(index: np.ndarray, k0: int, k1: int, cc: int, path):
    """(k, m, offset): rows ``k:m`` of a shard stored one after the other from byte ``offset``
    (None: rows not stored, the fill value)."""
    k = k0
    while k < k1:
        off, nb = int(index[k, 0]), int(index[k, 1])
        if off == int(_MISSING):
            m = k + 1
            while m < k1 and int(index[m, 0]) == int(_MISSING):
                m += 1
            yield k, m, None
            k = m
            continue
        if nb != cc:
            raise GradStoreError(f"{path}: an inner chunk of {nb} bytes, expected {cc}")
        m = k + 1
        while m < k1 and int(index[m, 0]) == off + (m - k) * cc and int(index[m, 1]) == cc:
            m += 1
        yield k, m, off
        k = m


def _stored_rows(raw: RawChunks, rows) -> np.ndarray:
    """The stored rows of ``raw``'s rows ``rows`` (its ``window`` shifts them); rows it does not
    hold (past the committed ones it was opened with) are refused, so nothing past them is read
    or mapped."""
    rows = np.asarray(rows, np.int64)
    if rows.size and (int(rows[0]) < 0 or int(rows[-1]) >= raw.shape[0]):
        raise GradStoreError(f"{raw.path}: rows {int(rows[0])}..{int(rows[-1])} asked of "
                             f"{raw.shape[0]} committed")
    return rows + raw.row0


def read_rows(raw: RawChunks, rows: np.ndarray, c0: int, c1: int, out: np.ndarray) -> None:
    """Rows ``rows`` (sorted indices) and columns ``c0:c1`` of ``raw`` into ``out`` ((len(rows),
    c1 - c0) uint8, C-contiguous): exactly those bytes of each chunk file or shard, read into
    place with ``os.preadv`` (whole rows at once where they are contiguous in the file and in
    ``out``); a missing chunk file, shard or step of a shard is its fill value. From an object
    store: the chunk objects (``RawChunks.read``)."""
    if not len(rows) or c1 <= c0:
        return
    if raw.fs.remote:
        _stored_rows(raw, rows)
        rows = np.asarray(rows, np.int64)
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        block = raw.read(lo, hi, c0, c1)
        out[...] = block if hi - lo == rows.size else block[rows - lo]
        return
    rows = _stored_rows(raw, rows)
    cr, cc = raw.chunk_shape
    which = rows // cr
    starts = np.flatnonzero(np.concatenate([[True], which[1:] != which[:-1]]))
    stops = np.append(starts[1:], rows.size)
    for a, z in zip(starts, stops):
        i = int(which[a])
        local = rows[a:z] - i * cr
        together = z - a == 1 or bool(np.all(np.diff(local) == 1))
        for j in range(c0 // cc, (c1 - 1) // cc + 1):
            lo, hi = max(c0, j * cc), min(c1, (j + 1) * cc)
            path = os.path.join(raw.path, "c", str(i), str(j))
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if raw.every_chunk:
                    raise missing_chunk(path) from None
                out[a:z, lo - c0:hi - c0] = raw.fill
                continue
            try:
                if raw.kind == "sharded":
                    _read_shard_rows(fd, path, cr, cc, local, lo - j * cc, hi - j * cc,
                                     out[a:z], lo - c0, raw.fill)
                    continue
                if together and hi - lo == cc and out.shape[1] == cc:  # whole rows, one read
                    want = (z - a) * cc
                    got = _pread(fd, out[a:z].reshape(-1), int(local[0]) * cc)
                else:
                    want = (z - a) * (hi - lo)
                    got = 0
                    for k in range(a, z):
                        got += _pread(fd, out[k, lo - c0:hi - c0],
                                      int(local[k - a]) * cc + lo - j * cc)
            finally:
                os.close(fd)
            if got != want:
                raise GradStoreError(f"{path}: {got} bytes where {want} were expected; the "
                                     "chunk file is shorter than its chunk")


#: shard indexes read (offsets per step, validated), by the file's path and identity: a shard
#: replaced by its writer (more steps: a new file, renamed over) is another entry
_SHARD_TABLES: dict = {}


def _shard_table(fd: int, path: str, cr: int, cc: int) -> np.ndarray:
    """The byte offset in shard file ``fd`` of each of its ``cr`` steps, -1 for a step not
    stored (the fill value): its index, read from the file's end once per file (cached by path,
    inode, size and modification time); an error when the index points past the steps' bytes
    (a shard shorter than its index says) or holds a step of another size."""
    st = os.fstat(fd)
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns, cr, cc)
    table = _SHARD_TABLES.get(key)
    if table is not None:
        return table
    size = st.st_size
    index = _shard_index(os.pread(fd, 16 * cr, max(0, size - 16 * cr)), cr, path, size)
    offs, nbs = index[:, 0], index[:, 1]
    there = offs != _MISSING
    if np.any(nbs[there] != cc):
        raise GradStoreError(f"{path}: an inner chunk of {int(nbs[there][nbs[there] != cc][0])} "
                             f"bytes, expected {cc}")
    if np.any(offs[there] + np.uint64(cc) > np.uint64(size - 16 * cr)):
        raise GradStoreError(f"{path}: shorter than its index says")
    table = np.where(there, offs, 0).astype(np.int64)
    table[~there] = -1
    table.setflags(write=False)
    if len(_SHARD_TABLES) >= 4096:
        _SHARD_TABLES.clear()
    _SHARD_TABLES[key] = table
    return table


def _read_shard_rows(fd, path, cr, cc, local, lo, hi, out, col, fill) -> None:
    """Steps ``local`` of a shard, bytes ``lo:hi`` of each, into ``out[:, col:col + hi - lo]``;
    steps stored one after the other in one read when whole rows are asked for."""
    offs = _shard_table(fd, path, cr, cc)[local]
    dest = out[:, col:col + hi - lo]
    whole = lo == 0 and hi == cc and out.shape[1] == cc
    k, n = 0, len(offs)
    while k < n:
        if offs[k] < 0:
            dest[k] = fill
            k += 1
            continue
        m = k + 1
        if whole:
            while m < n and offs[m] == offs[m - 1] + cc:
                m += 1
            got, want = _pread(fd, dest[k:m].reshape(-1), int(offs[k])), (m - k) * cc
        else:
            got, want = _pread(fd, dest[k], int(offs[k]) + lo), hi - lo
        if got != want:
            raise GradStoreError(f"{path}: {got} bytes where {want} were expected; the shard "
                                 "is shorter than its index says")
        k = m


def _pread(fd: int, dest: np.ndarray, offset: int) -> int:
    """Bytes of file ``fd`` from ``offset`` read into ``dest`` (contiguous); how many."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [dest], offset)
    os.lseek(fd, offset, os.SEEK_SET)  # no preadv here (Windows): seek, then read into place
    with os.fdopen(os.dup(fd), "rb", buffering=0) as fh:
        return fh.readinto(dest) or 0


_PAGE = mmap.ALLOCATIONGRANULARITY


def map_rows(raw: RawChunks, rows: np.ndarray, c0: int, c1: int):
    """Rows ``rows`` and columns ``c0:c1`` of ``raw`` as a read-only (len(rows), c1 - c0) view
    of the page cache (``mmap`` of the one chunk file or shard holding them all: no copy; rows
    keep the file's row stride), a row of the fill value repeated (a chunk or a shard's steps
    never written), or None when they span several files, lie in an object store, are not
    consecutive, or are not one after the other in their shard (then ``read_rows`` copies
    them). Only the bytes of the rows asked for are mapped, and only rows the array holds (its
    committed ones) can be asked for: never bytes past the committed steps, nor past a shard's
    steps (its index's end is checked against the file's)."""
    n = len(rows)
    if raw.fs.remote or not n or c1 <= c0 or not hasattr(mmap, "PROT_READ"):
        return None
    rows = _stored_rows(raw, rows)
    cr, cc = raw.chunk_shape
    r0 = int(rows[0])
    i, j = r0 // cr, c0 // cc
    if (int(rows[-1]) // cr != i or (c1 - 1) // cc != j
            or (n > 1 and int(rows[-1]) - r0 != n - 1)):
        return None
    path = os.path.join(raw.path, "c", str(i), str(j))
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if raw.every_chunk:
            raise missing_chunk(path) from None
        return np.broadcast_to(np.full(c1 - c0, raw.fill, np.uint8), (n, c1 - c0))
    try:
        if raw.kind == "sharded":
            k = r0 - i * cr
            offs = _shard_table(fd, path, cr, cc)[k:k + n]
            o0, o1 = int(offs[0]), int(offs[-1])
            if n == 1 or (o1 - o0 == (n - 1) * cc and o0 >= 0
                          and (n == 2 or bool(np.all(np.diff(offs) == cc)))):
                if o0 < 0:  # one step, not stored
                    return np.broadcast_to(np.full(c1 - c0, raw.fill, np.uint8), (1, c1 - c0))
            elif np.all(offs < 0):
                return np.broadcast_to(np.full(c1 - c0, raw.fill, np.uint8), (n, c1 - c0))
            else:
                return None  # steps not one after the other: copied
            first = o0 + c0 - j * cc
            last = o1 + c1 - j * cc
        else:
            size = os.fstat(fd).st_size
            if size != cr * cc:
                raise GradStoreError(f"{path}: {size} bytes, expected {cr * cc}")
            first = (r0 - i * cr) * cc + (c0 - j * cc)
            last = (r0 + n - 1 - i * cr) * cc + (c1 - j * cc)
        start = first - first % _PAGE
        m = mmap.mmap(fd, last - start, flags=mmap.MAP_SHARED | _POPULATE,
                      prot=mmap.PROT_READ, offset=start)
    finally:
        os.close(fd)
    buf = np.frombuffer(m, np.uint8)
    return np.lib.stride_tricks.as_strided(buf[first - start:], (n, c1 - c0), (cc, 1),
                                           writeable=False)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def missing_chunk(path: str, fs=LOCAL) -> GradStoreError:
    """The error for a chunk file a committed row needs and the store does not hold (its writer
    writes every chunk of the array: a file lost or removed since, or a partial copy)."""
    return GradStoreError(
        f"{fs.url(path) if fs.remote else path}: missing, though the store's commit.json counts "
        "the rows it holds as written (a file lost or removed, or a partial copy of the store); "
        "copy the store again, or record the run again")


def read_plain(array_path: str, n: int, fs=LOCAL, missing_ok: bool = False):
    """(dimension names, the first ``n`` rows) of an uncompressed Zarr v3 array chunked along its
    first dimension only, read straight from its chunk files; None for any other layout. A
    missing chunk file is an error (``missing_chunk``), or with ``missing_ok`` (an array added to
    a store after its first rows: the replica check's) rows of the fill value."""
    meta = plain_meta(array_path, fs)
    if meta is None:
        return None
    dtype = _PLAIN_DTYPES[meta["data_type"]]
    shape = meta["shape"]
    grid = meta["chunk_grid"]
    chunk = grid["configuration"]["chunk_shape"]
    if list(chunk[1:]) != list(shape[1:]):
        return None
    check_rows(shape[0], n, fs.dirname(array_path), os.path.basename(array_path.rstrip("/")))
    cr, tail = chunk[0], tuple(shape[1:])
    out = np.empty((n, *tail), dtype=np.dtype(dtype).newbyteorder("<"))
    per_chunk = cr * int(np.prod(tail, dtype=np.int64)) * out.dtype.itemsize
    zero_idx = "/".join("0" for _ in tail)
    names = [fs.join(array_path, f"c/{i}/{zero_idx}" if tail else f"c/{i}")
             for i in range(-(-n // cr))]
    got = fs.read_many(names)
    for i, name in enumerate(names):
        rows = out[i * cr:min(n, (i + 1) * cr)]
        raw = got[name]
        if raw is None:
            if not missing_ok:
                raise missing_chunk(name, fs)
            rows[...] = meta.get("fill_value", 0)
            continue
        if len(raw) != per_chunk:
            raise GradStoreError(f"{fs.url(name) if fs.remote else name}: {len(raw)} bytes, "
                                 f"expected {per_chunk}")
        rows[...] = np.frombuffer(raw, out.dtype).reshape(cr, *tail)[:rows.shape[0]]
    return tuple(meta.get("dimension_names") or ()), out.astype(dtype, copy=False)


def _backend_class():
    """xarray backend array over a ``RawChunks`` (or anything with its ``shape``, ``dtype`` and
    ``[rows, cols]`` slicing), made on first use (xarray is imported then) and reachable as the
    module attribute ``_BitsBackend`` (module ``__getattr__``), so a lazily read Dataset
    pickles: a dask worker reads the chunk files itself."""
    cls = globals().get("_BitsBackendClass")
    if cls is not None:
        return cls
    from xarray.backends import BackendArray
    from xarray.core import indexing

    class _BitsBackend(BackendArray):
        def __init__(self, arr):
            self.arr, self.shape, self.dtype = arr, arr.shape, arr.dtype

        def __getitem__(self, key):
            return indexing.explicit_indexing_adapter(
                key, self.shape, indexing.IndexingSupport.OUTER_1VECTOR, self._get)

        def _get(self, key):
            rows, cols = key
            if isinstance(rows, (int, np.integer)):
                return self._get((slice(int(rows), int(rows) + 1), cols))[0]
            if isinstance(cols, (int, np.integer)):
                return self._get((rows, slice(int(cols), int(cols) + 1)))[:, 0]
            if isinstance(cols, np.ndarray):
                return self._get((rows, slice(None)))[:, cols]
            if isinstance(rows, np.ndarray):  # outer indexing on steps: read the covering range
                lo, hi = int(rows.min()), int(rows.max()) + 1
                return self.arr[lo:hi, cols][rows - lo]
            return self.arr[rows, cols]

    _BitsBackend.__module__, _BitsBackend.__qualname__ = __name__, "_BitsBackend"
    globals()["_BitsBackendClass"] = _BitsBackend
    return _BitsBackend


def __getattr__(name):
    if name == "_BitsBackend":
        return _backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lazy_bits(raw: "RawChunks"):
    """Wrap ``raw`` for xarray: nothing is read until values are asked for, and then only the
    selected rows (no dask involved)."""
    from xarray.core import indexing

    return indexing.LazilyIndexedArray(_backend_class()(raw))


#: ``Variable.encoding`` key under which ``open_grads`` leaves the chunk reader of a bit array
#: and the steps it was opened with (xarray copies a variable's encoding through selections)
RAW_KEY = "probekit_raw_chunks"


def bits_variable(dims: tuple, raw: RawChunks, steps):
    """A lazily read bit array for a Dataset that remembers its ``RawChunks`` (``raw_bits``)."""
    import xarray as xr

    return xr.Variable(dims, lazy_bits(raw), encoding={RAW_KEY: (raw, np.asarray(steps))})


def raw_bits(ds, name: str = "direction"):
    """The ``RawChunks`` behind ``ds[name]`` while it still holds exactly the rows ``open_grads``
    read — the same steps in the same order and every byte — else None. Lets the comparison
    read rows straight into reused buffers; any selection falls back to ``ds[name]`` itself."""
    var = ds[name].variable
    got = var.encoding.get(RAW_KEY)
    if got is None:
        return None
    raw, steps = got
    if var.shape != raw.shape or not np.array_equal(np.asarray(ds["step"].values), steps):
        return None
    return raw


class Rows:
    """Rows of a (step, byte) DataArray read like ``RawChunks`` (``read(r0, r1, out=)``): bits
    held any other way (in memory, an msprobe dump, dask arrays with ``chunks="auto"``)."""

    def __init__(self, da) -> None:
        self.da, self.shape = da, tuple(da.shape)

    def read(self, r0: int, r1: int, c0: int = 0, c1: int | None = None, out=None):
        sel = self.da.isel(step=slice(r0, r1), byte=slice(c0, c1))
        rows = np.ascontiguousarray(sel.values, dtype=np.uint8)
        if out is not None:
            out[...] = rows
            return out
        return rows


def bit_reader(ds, name: str = "direction"):
    """What the rows of ``ds[name]`` are read from: its chunk files straight (``raw_bits``:
    ``RawChunks``, or an assembled run's ``AssembledBits``) while the Dataset holds exactly what
    ``open_grads`` read, else ``Rows`` over the variable."""
    raw = raw_bits(ds, name)
    return raw if raw is not None else Rows(ds[name])


class JoinedBits:
    """(step, byte) packed bits of several readers one after the other along ``step`` (the
    segments of a restarted store): reads like ``RawChunks`` (``read(r0, r1, c0, c1, out=)``
    and unit-step slices), each part into its rows of ``out``; pickles when its parts do."""

    ndim = 2
    dtype = np.dtype(np.uint8)

    def __init__(self, parts: list) -> None:
        self.parts = list(parts)
        widths = {int(p.shape[1]) for p in self.parts}
        if len(widths) > 1:
            raise ValueError(f"JoinedBits: parts of different widths {sorted(widths)}")
        self.starts = np.concatenate([[0], np.cumsum([int(p.shape[0]) for p in self.parts])])
        self.shape = (int(self.starts[-1]), widths.pop() if widths else 0)

    def __getitem__(self, key):
        return self.read(*unit_slices(self, key))

    def read(self, r0: int, r1: int, c0: int = 0, c1: int | None = None, out=None):
        c1 = self.shape[1] if c1 is None else c1
        shape = (max(0, r1 - r0), max(0, c1 - c0))
        out = np.empty(shape, self.dtype) if out is None else out
        if out.shape != shape:
            raise ValueError(f"out has shape {out.shape}, expected {shape}")
        for part, lo, hi in zip(self.parts, self.starts[:-1], self.starts[1:]):
            a, b = max(r0, int(lo)), min(r1, int(hi))
            if a < b:
                part.read(a - int(lo), b - int(lo), c0, c1, out=out[a - r0:b - r0])
        return out

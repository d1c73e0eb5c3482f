"""The client-state store (fedopt_kernels.sim.client_state, client_state_files): exact bits, the
mapping's rules, copy-on-write around checkpoints, and what it refuses.

A store in files keeps every entry a checkpoint's position names until the next checkpoint is in
place; these tests write, checkpoint, write again and fail writes, then take a checkpoint's
position back in a new store object (what a resumed process does) and read what it recorded.
"""

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fedopt_kernels.sim.client_state import ClientStateError, Layout
from fedopt_kernels.sim.client_state_files import BLOCK, HEADER, ClientStateFiles
from fedopt_kernels.sim.client_state_memory import MIRROR, MemoryClientState

CPU = torch.device("cpu")
IDENTITY = {"algorithm": "scaffold", "seed": 0, "clients": 7}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def like(dtype=torch.float32):
    # odd sizes, a scalar and an empty tensor among them
    return [torch.empty(3, 5, dtype=dtype), torch.empty((), dtype=dtype), torch.empty(0, dtype=dtype), torch.empty(7)]


def entry(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in like(dtype):
        v = torch.randn(t.shape, generator=g, dtype=torch.float64) * 10 ** float(seed % 7 - 3)
        out.append(v.to(t.dtype))
    out[0].view(-1)[0] = float("-0.0")  # the sign of zero is a bit too
    return out


def raw(t):
    return t.reshape(-1).view(torch.uint8)


def bits_equal(a, b):
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(raw(x), raw(y)) for x, y in zip(a, b)
    )


def files(folder, num_clients=200, identity=IDENTITY, dtype=torch.float32, **kw):
    return ClientStateFiles(folder, Layout(like(dtype)), num_clients, identity, CPU, **kw)


STORES = {
    "memory": lambda tmp, dtype=torch.float32: MemoryClientState(Layout(like(dtype)), 200, CPU),
    "files": lambda tmp, dtype=torch.float32: files(tmp / "store", dtype=dtype),
}


@pytest.mark.parametrize("kind", list(STORES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_entries_come_back_bit_for_bit(tmp_path, kind, dtype):
    store = STORES[kind](tmp_path, dtype)
    store.start()
    written = {cid: entry(cid, dtype) for cid in (0, 1, BLOCK - 1, BLOCK, 199)}
    for cid, e in written.items():
        store[cid] = e
    store[1] = written[1] = entry(50, dtype)  # rewritten
    assert sorted(store) == sorted(written) and len(store) == len(written)
    for cid, e in written.items():
        assert cid in store and bits_equal(store[cid], e)
    assert 2 not in store and 200 not in store
    with pytest.raises(KeyError):
        store[2]
    got = store[0]
    got[0].add_(1.0)  # a read is the caller's copy
    assert bits_equal(store[0], written[0])


@pytest.mark.parametrize("kind", list(STORES))
def test_bad_entries_and_ids_are_refused_and_change_nothing(tmp_path, kind):
    store = STORES[kind](tmp_path)
    store.start()
    store[3] = entry(3)
    bad = entry(4)
    bad[0] = bad[0][:, :4]
    with pytest.raises(ValueError, match=r"client 3's state \[0\] is \(3, 4\)"):
        store[3] = bad
    with pytest.raises(ValueError, match="client 3's state has 3 tensors"):
        store[3] = entry(4)[:3]
    with pytest.raises(ValueError, match=r"torch.float64"):
        store[3] = [t.double() for t in entry(4)]
    for cid in (-1, 200, 1.0, True):
        with pytest.raises(KeyError, match="client id must be an integer"):
            store[cid] = entry(4)
    assert list(store) == [3] and bits_equal(store[3], entry(3))


def test_a_checkpointed_position_survives_later_writes_and_a_failed_one(tmp_path, monkeypatch):
    store = files(tmp_path)
    store.start()
    store[5], store[70] = entry(5), entry(70)
    position = store.checkpoint(tmp_path, IDENTITY)
    store.committed()
    store[5] = entry(6)  # after the checkpoint: another slot
    store[5] = entry(7)  # and again: the same other slot, the checkpoint's stays
    store[9] = entry(9)
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(ClientStateError, match=r"client 70's state to .*block-000001.bin failed \(No space left\)"):
        store[70] = entry(71)
    monkeypatch.setattr(os, "pwrite", real)
    with pytest.raises(ClientStateError, match="not usable further"):
        store[5]
    again = files(tmp_path)  # a resumed process
    again.load(tmp_path, IDENTITY, position)
    assert sorted(again) == [5, 70]
    assert bits_equal(again[5], entry(5)) and bits_equal(again[70], entry(70))


def test_a_pinned_entry_deleted_then_written_goes_to_its_own_other_slot(tmp_path):
    """After a checkpoint, deleting a client's entry and writing it again leaves its neighbours' and
    the checkpoint's entries intact (client 0 included: its slot is at the start of the file)."""
    store = files(tmp_path)
    store.start()
    for cid in (0, 4, 5):
        store[cid] = entry(cid)
    position = store.checkpoint(tmp_path, IDENTITY)
    store.committed()
    store[4] = entry(44)
    for cid in (5, 0):
        del store[cid]
        store[cid] = entry(100 + cid)
    assert bits_equal(store[4], entry(44))
    assert bits_equal(store[5], entry(105)) and bits_equal(store[0], entry(100))
    again = files(tmp_path)  # the checkpoint's entries are intact
    again.load(tmp_path, IDENTITY, position)
    assert all(bits_equal(again[cid], entry(cid)) for cid in (0, 4, 5))


def test_without_checkpoints_a_write_never_covers_the_entry_it_replaces(tmp_path):
    store = files(tmp_path)
    store.start()
    slots = []
    for k in range(4):
        store[0] = entry(k)
        slots.append(int(store.current[0]))
    assert slots == [0, 1, 0, 1]


def test_only_changed_entries_are_written_for_a_checkpoint(tmp_path):
    """The memory store copies to its files beside the checkpoint only what changed since the last."""
    store = MemoryClientState(Layout(like()), 200, CPU)
    store.start()
    for cid in range(10):
        store[cid] = entry(cid)
    store.checkpoint(tmp_path, IDENTITY)
    store.committed()
    mirror = store._mirror
    written = []
    setitem = type(mirror).__setitem__
    type(mirror).__setitem__ = lambda self, cid, v: (written.append(cid), setitem(self, cid, v))[1]
    try:
        store[4] = entry(40)
        store[11] = entry(11)
        position = store.checkpoint(tmp_path, IDENTITY)
        store.committed()
    finally:
        type(mirror).__setitem__ = setitem
    assert written == [4, 11]
    back = MemoryClientState(Layout(like()), 200, CPU)
    back.load(tmp_path, IDENTITY, position)
    assert sorted(back) == list(range(10)) + [11]
    assert bits_equal(back[4], entry(40)) and bits_equal(back[3], entry(3))
    assert (tmp_path / MIRROR / HEADER).is_file()


@pytest.mark.parametrize(
    "change,named",
    [
        (dict(identity={**IDENTITY, "seed": 1}), "seed: 0 in the store, 1 now"),
        (dict(identity={**IDENTITY, "algorithm": "feddyn"}), "algorithm: 'scaffold' in the store, 'feddyn' now"),
        (dict(num_clients=201), "training clients: 200 in the store, 201 now"),
        (dict(dtype=torch.float64), "tensors: "),
    ],
)
def test_a_store_of_another_run_model_or_algorithm_is_refused_naming_the_difference(tmp_path, change, named):
    store = files(tmp_path)
    store.start()
    store[1] = entry(1)
    with pytest.raises(ClientStateError, match=rf"client state in {tmp_path} belongs to another run.*{named}"):
        files(tmp_path, **change)
    assert bits_equal(store[1], entry(1))


def test_a_position_from_before_another_run_started_is_refused(tmp_path):
    store = files(tmp_path)
    store.start()
    store[1] = entry(1)
    old = store.checkpoint(tmp_path, IDENTITY)
    files(tmp_path).start()  # a new run in the same folder
    with pytest.raises(ClientStateError, match="another run has started in it since"):
        files(tmp_path).load(tmp_path, IDENTITY, old)
    damaged = {**old, "current": torch.full((200,), 3, dtype=torch.int8)}
    head = json.loads((tmp_path / HEADER).read_text())
    with pytest.raises(ClientStateError, match="damaged"):
        files(tmp_path).load(tmp_path, IDENTITY, {**damaged, "token": head["token"]})


def test_a_folder_that_cannot_be_written_is_a_named_error(tmp_path):
    (tmp_path / "plain").write_text("a file")
    with pytest.raises(ClientStateError, match="is a file, not a folder"):
        files(tmp_path / "plain")
    with pytest.raises(ClientStateError, match=r"client state .*plain/store.*Not a directory"):
        files(tmp_path / "plain" / "store").start()
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / HEADER).write_text("{not json")
    with pytest.raises(ClientStateError, match="header .* is damaged"):
        files(tmp_path / "damaged")


@pytest.mark.slow
def test_a_full_disk_raises_and_keeps_what_was_saved(tmp_path):
    """A real failed write (the file-size limit stands in for a full disk; the kernel refuses the
    write): a named error, and the checkpointed entries read back in a new process."""
    script = textwrap.dedent(
        f"""
        import resource, signal, sys, json, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_client_state import files, entry, IDENTITY
        from fedopt_kernels.sim.client_state import ClientStateError
        store = files(__import__("pathlib").Path({str(tmp_path)!r}))
        store.start()
        store[0] = entry(0)
        pos = store.checkpoint(store.folder, IDENTITY)
        torch.save(pos, {str(tmp_path / "pos.pt")!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        size = (store.folder / "block-000000.bin").stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))
        real = os.pwrite
        def pwrite(*args):
            try:
                return real(*args)
            except OSError as exc:
                print("PWRITE", exc.errno)
                raise
        os.pwrite = pwrite
        try:
            store[BLOCK_ID] = entry(1)
        except ClientStateError as exc:
            print("REFUSED", exc)
        store.close()
        opened = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                opened.append(os.readlink(f"/proc/self/fd/{{fd}}"))
            except OSError:
                pass  # the listing's own descriptor, closed by now
        print("OPEN", sum(str(store.folder) in p for p in opened))
        """
    ).replace("BLOCK_ID", str(BLOCK))  # a new block file, past the limit
    done = subprocess.run([sys.executable, "-c", "import os\n" + script], capture_output=True, text=True, timeout=120)
    assert "REFUSED writing client 64's state to" in done.stdout, done.stdout + done.stderr
    assert "block-000001.bin failed" in done.stdout
    assert f"PWRITE {errno.EFBIG}" in done.stdout  # the write itself failed, as on a full disk
    assert "OPEN 0" in done.stdout  # and no descriptor of the store's files is left open
    back = files(tmp_path)
    back.load(tmp_path, IDENTITY, torch.load(tmp_path / "pos.pt", weights_only=True))
    assert list(back) == [0] and bits_equal(back[0], entry(0))

"""The NVMe pager through its binding: torch tensors round-trip bit for bit, corruption and I/O
failures raise clear OSErrors naming the file, offset and size, and bad arguments are refused."""

from __future__ import annotations

import errno
import os
import resource
import signal
import threading

import pytest
import torch

from asteria import _core

TIMEOUT = 30.0


def host_buffers(k: int, nbytes: int) -> torch.Tensor:
    """k read-ahead buffers of nbytes each: pinned memory where CUDA is available, as in training."""
    return torch.zeros(k, nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture
def directory(tmp_path):
    return str(tmp_path / "pages")


def test_round_trip_of_torch_tensors(directory):
    gen = torch.Generator().manual_seed(0)
    shapes = {0: (32, 32), 1: (17, 9), 2: (64,), 3: (5, 5, 5)}
    dtypes = {0: torch.float32, 1: torch.bfloat16, 2: torch.float64, 3: torch.float32}
    record_bytes = 32 * 32 * 4
    buffers = host_buffers(2, record_bytes)
    with _core.Pager(directory, buffers, io_threads=2) as pager:
        assert pager.mode in ("o_direct", "buffered")
        assert pager.record_bytes == record_bytes and pager.slot_bytes == 8192 and pager.num_buffers == 2
        written = {}
        for version in (1, 2, 3):
            tickets = []
            for key, shape in shapes.items():
                t = torch.randn(shape, generator=gen).to(dtypes[key])
                written[key] = t
                tickets.append(pager.write(key, version, t))
            for ticket in tickets:
                pager.wait(ticket, TIMEOUT)
        order = [3, 1, 0, 2, 1]
        pager.read_ahead(order)
        for key in order:
            index, version, nbytes = pager.acquire(key, TIMEOUT)
            expected = written[key]
            assert version == 3 and nbytes == expected.numel() * expected.element_size()
            got = buffers[index, :nbytes].view(expected.dtype).view(expected.shape)
            assert torch.equal(got, expected)
            pager.release(index)
        dst = torch.empty(32, 32)
        assert pager.read(0, dst, TIMEOUT) == (3, record_bytes)
        assert torch.equal(dst, written[0])
        assert pager.version(0) == 3 and pager.version(99) is None
        assert pager.keys() == [0, 1, 2, 3]
        stats = pager.stats()
        assert stats["writes"] == 12 and stats["reads"] == 6
        assert stats["bytes_written"] == 12 * 8192 and stats["mode"] == pager.mode
        assert stats["read_ahead_hits"] + stats["read_ahead_misses"] == 5
        assert stats["checksum_failures"] == 0
    assert pager.closed
    assert not os.path.exists(directory), "close() removes the files and the directory the pager created"


def test_corrupted_page_raises_checksum_error_and_keeps_previous_version(directory):
    buffers = host_buffers(1, 4000)
    with _core.Pager(directory, buffers) as pager:
        v1, v2 = torch.arange(1000, dtype=torch.float32), -torch.arange(1000, dtype=torch.float32)
        pager.wait(pager.write(7, 1, v1), TIMEOUT)
        pager.wait(pager.write(7, 2, v2), TIMEOUT)
        path = pager.path_of(7)
        flip_byte(path, pager.slot_bytes + 64 + 123)  # version 2 lives in slot 1
        pager.read_ahead([7])
        with pytest.raises(_core.ChecksumError) as info:
            pager.acquire(7, TIMEOUT)
        e = info.value
        assert isinstance(e, OSError) and isinstance(e, _core.PagerIOError)
        assert e.errno == errno.EBADMSG
        assert e.filename == path and e.offset == pager.slot_bytes and e.size == pager.slot_bytes
        message = str(e)
        for part in (path, f"at offset {pager.slot_bytes}", f"{pager.slot_bytes} bytes", "payload CRC32C", "version 2"):
            assert part in message
        assert pager.version(7) == 1
        dst = torch.empty(1000)
        assert pager.read(7, dst, TIMEOUT) == (1, 4000)
        assert torch.equal(dst, v1)
        assert pager.stats()["checksum_failures"] == 1


def test_full_file_limit_fails_the_write_and_keeps_previous_version(directory):
    buffers = host_buffers(1, 8000)
    with _core.Pager(directory, buffers) as pager:
        v1 = torch.full((2000,), 1.5)
        pager.wait(pager.write(3, 1, v1), TIMEOUT)
        saved = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            resource.setrlimit(resource.RLIMIT_FSIZE, (pager.slot_bytes, saved[1]))  # slot 1 lies past the limit
            ticket = pager.write(3, 2, torch.full((2000,), 2.5))
            with pytest.raises(_core.PagerIOError) as info:
                pager.wait(ticket, TIMEOUT)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, saved)
            signal.signal(signal.SIGXFSZ, handler)
        e = info.value
        assert e.errno == errno.EFBIG and e.filename == pager.path_of(3) and e.offset == pager.slot_bytes
        assert os.strerror(errno.EFBIG) in str(e) and "previous version stays live" in str(e)
        dst = torch.empty(2000)
        assert pager.read(3, dst, TIMEOUT) == (1, 8000)
        assert torch.equal(dst, v1)


def test_a_failed_first_write_says_no_earlier_version_remains(directory):
    buffers = host_buffers(1, 8000)
    with _core.Pager(directory, buffers) as pager:
        saved = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, saved[1]))  # less than the first slot
            ticket = pager.write(3, 1, torch.full((2000,), 1.5))
            with pytest.raises(_core.PagerIOError) as info:
                pager.wait(ticket, TIMEOUT)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, saved)
            signal.signal(signal.SIGXFSZ, handler)
        assert "the key has no earlier version to read instead" in str(info.value)
        assert "previous version stays live" not in str(info.value)


def test_removed_file_raises_a_clear_error(directory):
    with _core.Pager(directory, host_buffers(1, 4096)) as pager:
        pager.wait(pager.write(1, 1, torch.ones(1024)), TIMEOUT)
        os.unlink(pager.path_of(1))
        with pytest.raises(_core.PagerIOError, match="missing") as info:
            pager.read(1, torch.empty(1024), TIMEOUT)
        assert info.value.errno == errno.ENOENT and info.value.filename == pager.path_of(1)


def test_blocked_acquire_releases_the_gil(directory):
    buffers = host_buffers(1, 4096)
    with _core.Pager(directory, buffers, io_threads=1) as pager:
        for key in (1, 2):
            pager.wait(pager.write(key, 1, torch.full((1024,), float(key))), TIMEOUT)
        pager.read_ahead([1, 2])
        index, _, _ = pager.acquire(1, TIMEOUT)  # the only buffer is now held
        result = {}
        started = threading.Event()

        def second():
            started.set()
            result["acquired"] = pager.acquire(2, TIMEOUT)  # blocks until the main thread releases

        thread = threading.Thread(target=second)
        thread.start()
        assert started.wait(TIMEOUT)
        pager.release(index)  # needs the GIL while the other thread blocks in acquire
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        index2, version, _ = result["acquired"]
        assert version == 1 and torch.equal(buffers[index2].view(torch.float32), torch.full((1024,), 2.0))
        pager.release(index2)


def test_keep_files_reopens_pages(directory):
    data = torch.randn(500)
    with _core.Pager(directory, host_buffers(1, 2000), keep_files=True) as pager:
        pager.wait(pager.write(5, 4, data), TIMEOUT)
    with pytest.raises(ValueError, match="keep_files=True to reopen"):
        _core.Pager(directory, host_buffers(1, 2000))
    with _core.Pager(directory, host_buffers(1, 2000), keep_files=True) as pager:
        assert pager.version(5) == 4 and pager.stats()["recovered_keys"] == 1
        dst = torch.empty(500)
        assert pager.read(5, dst, TIMEOUT) == (4, 2000)
        assert torch.equal(dst, data)


def test_bad_arguments(directory, tmp_path):
    buffers = host_buffers(2, 4096)
    with pytest.raises(ValueError, match=r"Invalid buffers shape \(4096\)"):
        _core.Pager(directory, torch.zeros(4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"Invalid buffers shape \(0, 4\)"):
        _core.Pager(directory, torch.zeros(0, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"Invalid record_bytes=4097: must be in \[1, 4096\]"):
        _core.Pager(directory, buffers, record_bytes=4097)
    with pytest.raises(ValueError, match="Invalid io_threads=0"):
        _core.Pager(directory, buffers, io_threads=0)
    with pytest.raises(TypeError):
        _core.Pager(directory, torch.zeros(4, 8)[:, ::2])  # rows not contiguous: never silently copied
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        _core.Pager(str(tmp_path / "file"), buffers)
    with _core.Pager(directory, buffers) as pager:
        with pytest.raises(ValueError, match="in use by another pager"):
            _core.Pager(directory, buffers)
        with pytest.raises(ValueError, match="Invalid bytes=4100"):
            pager.write(1, 1, torch.zeros(1025))
        with pytest.raises(ValueError, match="Invalid version=0"):
            pager.write(1, 0, torch.zeros(4))
        with pytest.raises(ValueError, match="Invalid key=-1"):
            pager.write(-1, 1, torch.zeros(4))
        pager.wait(pager.write(1, 2, torch.zeros(4)), TIMEOUT)
        with pytest.raises(ValueError, match="Invalid version=2: must exceed the live version 2"):
            pager.write(1, 2, torch.zeros(4))
        with pytest.raises(ValueError, match="Invalid timeout_s=0"):
            pager.wait(1, 0.0)
        with pytest.raises(ValueError, match="ticket 12345 is unknown"):
            pager.wait(12345, TIMEOUT)
        with pytest.raises(KeyError, match="key 9 was never written"):
            pager.read_ahead([1, 9])
        with pytest.raises(KeyError, match="key 9 was never written"):
            pager.acquire(9, TIMEOUT)
        with pytest.raises(ValueError, match="Invalid index=0: is not held"):
            pager.release(0)
        with pytest.raises(ValueError, match="Invalid index=5: is out of range"):
            pager.release(5)
        with pytest.raises(ValueError, match="holds only 8"):
            pager.read(1, torch.zeros(2), TIMEOUT)
        with pytest.raises(TypeError):
            pager.read(1, torch.zeros(8)[::2], TIMEOUT)
        with pytest.raises(TimeoutError, match="waiting for a free buffer"):
            pager.read_ahead([1, 1, 1])
            pager.acquire(1, TIMEOUT)
            pager.acquire(1, TIMEOUT)
            pager.acquire(1, 0.05)  # both buffers held: the third read cannot start
    with pytest.raises(_core.CancelledError, match="closed"):
        pager.read_ahead([1])

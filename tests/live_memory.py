"""Bytes of device memory that live arrays hold, and their peak, polled from a thread."""

import threading

import jax


def live_bytes() -> int:
    """Bytes of the distinct device buffers that live arrays hold.

    A buffer is counted once however many arrays alias it (Orbax assembles a
    restored array from per-device arrays of the same buffers; ``addressable_data``
    makes such aliases too).
    """
    buffers = {}
    for array in jax.live_arrays():
        try:
            for shard in array.addressable_shards:
                data = shard.data
                buffers[(shard.device.id, data.unsafe_buffer_pointer())] = data.nbytes
        except RuntimeError:  # deleted (donated) while we looked
            continue
    return sum(buffers.values())


class PeakLiveBytes:
    """The most bytes of live device arrays seen between ``start`` and ``stop``, polled
    from a thread (what PITFALLS.md measured 3.0x one state with, before the plan)."""

    def start(self) -> "PeakLiveBytes":
        self.peak, self._stop = live_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, live_bytes())

    def stop(self) -> int:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, live_bytes())
        return self.peak

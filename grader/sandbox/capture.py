"""What a box prints: its stdout and stderr, drained by a thread so that it never blocks, bounded in memory."""
from __future__ import annotations

import os
import select
import threading

from .procfs import ThreadDelay


class Capture:
    """Drains a process's stdout and stderr so that it never blocks on a full pipe.

    Keeps the first ``limit`` bytes of each stream and a short rolling tail; counts
    the rest. Memory use stays bounded however much the process prints.
    """

    TAIL = 4096

    def __init__(self, streams, limit):
        self.limit = limit
        self.lock = threading.Lock()
        self.reset()
        self.thread = threading.Thread(target=self._drain, args=(streams,), daemon=True, name="sandbox-output")
        self.thread.start()
        self._delay = None  # the draining thread's run-queue delay (procfs.ThreadDelay), opened when first read

    def run_delay(self) -> float:
        """Seconds the draining thread has waited for a processor (Linux; 0 where unknown). A box that prints
        more than its pipes hold waits for this thread: while the machine keeps the thread waiting, the box's
        wait is the machine's load, not the learner's time (``channel.Waiting``)."""
        if self._delay is None:
            self._delay = ThreadDelay(self.thread.native_id)
        return self._delay()

    def reset(self):
        with self.lock:
            self.head = {"stdout": bytearray(), "stderr": bytearray()}
            self.tail = {"stdout": b"", "stderr": b""}
            self.dropped = {"stdout": 0, "stderr": 0}

    def _drain(self, streams):
        fds = {stream.fileno(): (name, stream) for name, stream in streams.items()}
        while fds:
            ready, _, _ = select.select(list(fds), [], [])
            for fd in ready:
                chunk = os.read(fd, 1 << 20)
                name, stream = fds[fd]
                if not chunk:
                    stream.close()
                    del fds[fd]
                    continue
                with self.lock:
                    head = self.head[name]
                    room = max(0, self.limit - len(head))
                    head += chunk[:room]
                    self.dropped[name] += len(chunk) - min(room, len(chunk))
                    self.tail[name] = (self.tail[name] + chunk)[-self.TAIL:]

    def text(self, name):
        """What the stream held (truncated, with a note saying how much was dropped)."""
        with self.lock:
            text = self.head[name].decode(errors="replace")
            if self.dropped[name]:
                text += f"\n[... {self.dropped[name]} more bytes dropped; the end was:]\n"
                text += self.tail[name].decode(errors="replace")
        return text

    def dropped_bytes(self):
        with self.lock:
            return sum(self.dropped.values())

    def last_lines(self, name, count=12):
        with self.lock:
            data = self.tail[name] if self.dropped[name] else bytes(self.head[name][-self.TAIL:])
        return "\n".join(data.decode(errors="replace").rstrip().splitlines()[-count:])

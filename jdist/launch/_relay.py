"""Relay the output of child processes to the console with ``[rank N]`` prefixes, live.

A thread per pipe reads whatever the child wrote (not line by line), so progress bars
that redraw with a carriage return (tqdm) update while they run: each ``\\r`` update is
forwarded at once and gets its own prefix. Several ranks share one :class:`Console`,
which keeps their lines apart: when another rank writes while a line is open (a bar
being drawn), the open line is ended first, and the interrupted rank's next piece
starts a new prefixed line.

Routine runtime messages that users cannot act on (gloo's "Rank N is connected to N
peer ranks", the coordination service's "experimental recoverable task" warning) are
kept off the console unless ``verbose``; log files get every byte.
"""

from __future__ import annotations

import os
import re
import select
import threading
from collections import deque
from collections.abc import Sequence
from typing import IO

__all__ = ["Console", "Relay", "NOISE", "start_relay", "binary_stream"]

# gloo prints "[Gloo] Rank N is connected to N peer ranks. Expected number of connected
# peer ranks is : N" to stdout as eight writes, one per token, and a process's threads
# (one per local device) print theirs at once: a line may hold the tokens of several
# messages in any order, and a message's last tokens may open the next line
_GLOO_WORD = (rb"\[Gloo\] Rank| is connected to| peer ranks\."
              rb"|Expected number of connected peer ranks is :")
_GLOO_RUN = re.compile(rb"(?:^\d+)?(?:" + _GLOO_WORD + rb")(?:" + _GLOO_WORD + rb"|\d+|\s)*$")
_GLOO_ONLY = re.compile(rb"(?:" + _GLOO_WORD + rb"|\d+|\s)*")  # a leftover line
_GLOO_OPEN = b"[Gloo] Rank "
_RECOVERABLE = re.compile(rb"Using experimental recoverable task feature")
NOISE = re.compile(_GLOO_WORD + rb"|" + _RECOVERABLE.pattern)
# a partial line that may become a noise line is held until it is complete (a held
# part may end in the middle of a token: "[Glo")
_MAYBE_NOISE = re.compile(rb"\[Gloo\]|[WIEF]\d{4} |\[(?:G(?:l(?:o(?:o)?)?)?)?$"
                          rb"| is connected to| peer ranks\.|Expected number of")
_SETTLE_S = 0.03  # how long a partial line waits for its end before it is shown


def _noise_start(line: bytes, after_gloo: bool = False) -> int | None:
    """Where routine messages start in ``line`` (they run to its end), or None.

    ``after_gloo``: a gloo message begun on an earlier line has not ended, so a line of
    nothing but its tokens and numbers is the rest of it.
    """
    cuts = []
    if after_gloo and _GLOO_ONLY.fullmatch(line):
        return 0
    m = _GLOO_RUN.search(line)
    if m is not None:
        cuts.append(m.start())
    m = _RECOVERABLE.search(line)
    if m is not None:  # from its log prefix ("W1201 22:17:12.5 file.cc:185] ")
        starts = [s.start() for s in _MAYBE_NOISE.finditer(line, 0, m.start() + 1)]
        cuts.append(starts[-1] if starts else m.start())
    return min(cuts) if cuts else None


_PIECE = re.compile(rb"([^\r\n]*)(\r\n|\r|\n|)")


class _TextSink:
    """Bytes written to a text stream that has no binary buffer (``io.StringIO``, as
    ``contextlib.redirect_stdout`` installs), decoded as UTF-8."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data: bytes) -> int:
        self.stream.write(data.decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self.stream.flush()


def binary_stream(stream) -> IO[bytes] | None:
    """Where to write bytes for the text stream ``stream`` (``sys.stdout``): its
    ``buffer``, or ``stream`` itself through a decoding adapter when it has none."""
    if stream is None:
        return None
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextSink(stream)


class Console:
    """The launcher's stdout and stderr, shared by every relay (thread-safe)."""

    def __init__(self, stdout: IO[bytes] | None, stderr: IO[bytes] | None):
        self.streams = {1: stdout, 2: stderr}
        self.lock = threading.Lock()
        self.owner: tuple[int, object] | None = None  # (fd, relay) with an open line
        self.fresh = False  # the owner's last piece ended with "\r"

    def emit(self, relay: object, fd: int, prefix: bytes, text: bytes, end: bytes) -> None:
        """Write one piece (``text`` then ``end``: "", "\\r", "\\n" or "\\r\\n")."""
        stream = self.streams.get(fd)
        if stream is None:
            return
        with self.lock:
            try:
                key = (fd, relay)
                if self.owner is not None and self.owner != key:
                    other = self.streams.get(self.owner[0])
                    if other is not None:
                        other.write(b"\n")
                        other.flush()
                    self.owner = None
                continuing = self.owner == key and not self.fresh
                head = prefix if not continuing and (text or end in (b"\n", b"\r\n")) else b""
                stream.write(head + text + end)
                stream.flush()
            except (OSError, ValueError):
                return
            if end == b"":
                if text or self.owner == key:
                    self.owner, self.fresh = key, False
            elif end == b"\r":
                self.owner, self.fresh = key, True
            else:
                self.owner, self.fresh = None, False


class Relay:
    """One child stream: to the console (prefixed, filtered), log files, a tail."""

    def __init__(self, prefix: bytes, console: Console | None, fd: int,
                 files: Sequence[IO[bytes]] = (), tail: deque | None = None,
                 verbose: bool = False):
        self.prefix, self.console, self.fd = prefix, console, fd
        self.files, self.tail, self.verbose = list(files), tail, verbose
        self.held = b""  # a partial line kept back (may be noise, or a lone "\r")
        self.line = b""  # the current line's text already forwarded (for tail and noise)
        # gloo messages begun whose "\n" has not come yet (see _GLOO_WORD): while there
        # are any, a line of nothing but their tokens is the rest of one
        self.gloo_open = 0

    def feed(self, data: bytes) -> None:
        """Forward ``data``; a last, unterminated piece is held (see :meth:`flush`)."""
        for f in self.files:
            f.write(data)
            f.flush()
        data = self.held + data
        self.held = b""
        pos = 0
        while pos < len(data):
            m = _PIECE.match(data, pos)
            text, end = m.group(1), m.group(2)
            pos = m.end()
            if pos == len(data) and end in (b"", b"\r"):
                self.held = text + end  # print() sends "\n" in a second write
                return
            self._piece(text, end)

    def pending(self) -> bool:
        """Is a held piece waiting that :meth:`flush` would forward?"""
        return bool(self.held) and not self._noise_candidate()

    def _noise_candidate(self) -> bool:
        """The held piece may hold the start of a routine message (at any position:
        C++ writes it into a line a progress bar left open): wait for the line's end."""
        if self.verbose or self.held.endswith(b"\r"):
            return False
        return (_MAYBE_NOISE.search(self.held) is not None
                or (self.gloo_open > 0 and _GLOO_ONLY.fullmatch(self.held) is not None))

    def flush(self) -> None:
        """No more data came for a moment: forward the held piece (a live bar update).

        A piece that may start a routine runtime message waits for its line's end.
        """
        if not self.pending():
            return
        held, self.held = self.held, b""
        if held.endswith(b"\r"):
            self._piece(held[:-1], b"\r")
        else:
            self._piece(held, b"")

    def _quiet(self, line: bytes, text: bytes) -> tuple[bytes, bytes] | None:
        """``(line, text)`` without a routine message (None: nothing left to show)."""
        cut = _noise_start(line, self.gloo_open > 0) if not self.verbose else None
        self.gloo_open = max(0, self.gloo_open + line.count(_GLOO_OPEN) - 1)
        if cut is None:
            return line, text
        forwarded = len(line) - len(text)  # already on the console
        line, text = line[:cut], text[:max(0, cut - forwarded)]
        return (line, text) if line.strip() else None

    def _piece(self, text: bytes, end: bytes) -> None:
        if end in (b"\n", b"\r\n"):
            line, self.line = self.line + text, b""
            kept = self._quiet(line, text)
            if kept is None:
                if self.console is not None and self.console.owner == (self.fd, self):
                    self.console.emit(self, self.fd, self.prefix, b"", end)
                return
            line, text = kept
            if self.tail is not None:
                self.tail.append(line + b"\n")
        elif end == b"\r":
            self.line = b""  # a redraw (progress bar): only the last state matters
        else:
            self.line += text
        if self.console is not None:
            self.console.emit(self, self.fd, self.prefix, text, end)

    def close(self) -> None:
        """The child closed the stream: finish a partial last line."""
        text, self.held = self.held.rstrip(b"\r"), b""
        if text or self.line:
            self._piece(text, b"\n")
        elif self.console is not None and self.console.owner == (self.fd, self):
            self.console.emit(self, self.fd, self.prefix, b"", b"\n")  # end a bar's line
        for f in self.files:
            f.close()


def _pump(pipe: IO[bytes], relay: Relay) -> None:
    fd = pipe.fileno()
    try:
        while True:
            if relay.pending():
                ready, _, _ = select.select([fd], [], [], _SETTLE_S)
                if not ready:
                    relay.flush()
                    continue
            data = os.read(fd, 65536)
            if not data:
                break
            relay.feed(data)
    except (OSError, ValueError):
        pass
    finally:
        try:
            relay.close()
        except (OSError, ValueError):
            pass
        pipe.close()


def start_relay(pipe: IO[bytes], relay: Relay) -> threading.Thread:
    """A daemon thread that relays ``pipe`` until the child closes it."""
    t = threading.Thread(target=_pump, args=(pipe, relay), daemon=True,
                         name=f"jdist-relay{relay.prefix.decode(errors='replace').strip()}")
    t.start()
    return t

"""A sans-IO STOMP frame codec: bytes in, ``Frame`` objects out, and back.

How it works: ``receive_data`` appends to one ``bytearray``. ``next_event`` first drops
the EOLs that separate frames (heart-beats, and the optional EOLs after a NUL), then looks
for the blank line that ends the headers with ``bytes.find``, line by line, resuming where
the previous attempt stopped: a frame costs time linear in its own size whether it is fed
one byte at a time or arrives with thousands of others. With a ``content-length`` the
body is that many octets and must be followed by a NUL; without one the body runs to the
first NUL. Consumed bytes are
deleted from the front of the buffer, which ``bytearray`` does without copying the rest.

Header values (and keys, leniently: stomp.py escapes values only) are unescaped per the
negotiated version: none in 1.0, ``\\n \\c \\\\`` in 1.1, plus ``\\r`` in 1.2; never in
CONNECT, STOMP and CONNECTED frames. An undefined escape in a value is fatal, as the spec
says. A trailing CR is dropped from every frame line (1.2 allows CRLF; earlier clients on
some platforms send it too). Every error is a ``StompProtocolError`` subclass.
"""

from __future__ import annotations

from typing import Final

from protocols._limits import parse_decimal
from protocols.stomp.errors import FrameTooLarge, InvalidFrame, StompProtocolError
from protocols.stomp.frames import UNESCAPED_COMMANDS, Frame, Version

DEFAULT_MAX_FRAME_SIZE: Final = 5 * 1024 * 1024 + 64 * 1024
DEFAULT_MAX_HEADERS: Final = 128

_UNESCAPE_11: Final = {"n": "\n", "c": ":", "\\": "\\"}
_UNESCAPE_12: Final = {**_UNESCAPE_11, "r": "\r"}
_ESCAPE_11: Final = str.maketrans({"\\": "\\\\", "\n": "\\n", ":": "\\c"})
_ESCAPE_12: Final = str.maketrans({"\\": "\\\\", "\n": "\\n", ":": "\\c", "\r": "\\r"})
# 1.0 and CONNECT/CONNECTED cannot carry these characters at all; the server's own
# values (error texts) are flattened rather than producing a broken frame.
_FLATTEN: Final = str.maketrans({"\n": " ", "\r": " "})


def _unescape(text: str, table: dict[str, str], *, strict: bool) -> str:
    if "\\" not in text:
        return text
    out: list[str] = []
    start = 0
    while (slash := text.find("\\", start)) >= 0:
        out.append(text[start:slash])
        replacement = table.get(text[slash + 1 : slash + 2])
        if replacement is None:
            if strict:
                raise InvalidFrame(f"undefined escape sequence in header value {text!r}")
            out.append("\\")
            start = slash + 1
        else:
            out.append(replacement)
            start = slash + 2
    out.append(text[start:])
    return "".join(out)


class Codec:
    """Decode client frames and encode server frames for one connection.

    ``version`` selects the header escaping; the connection sets it once CONNECTED is
    negotiated. ``next_event()`` returns a ``Frame``, or None when more bytes are needed,
    or raises a ``StompProtocolError`` (after which the codec must not be used again).
    """

    def __init__(
        self,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_headers: int = DEFAULT_MAX_HEADERS,
        version: Version = Version.V1_0,
    ) -> None:
        self.max_frame_size = max_frame_size
        self.max_headers = max_headers
        self.version = version
        self._buf = bytearray()
        self._scan = 0  # where the search for the end of the headers resumes
        self._head: tuple[str, tuple[tuple[str, str], ...], int, int | None] | None = None
        self._nul_scan = 0  # where the search for the body's NUL resumes

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as frames."""
        return len(self._buf)

    def receive_data(self, data: bytes) -> None:
        self._buf += data

    def next_event(self) -> Frame | None:
        if self._head is None and not (self._skip_eols() and self._read_head()):
            return None
        assert self._head is not None
        command, headers, body_start, length = self._head
        buf = self._buf
        if length is not None:
            end = body_start + length
            if len(buf) <= end:
                return None
            if buf[end] != 0:
                raise InvalidFrame(f"{command} frame: no NUL after content-length octets")
        else:
            end = buf.find(b"\x00", self._nul_scan)
            if end < 0 and len(buf) <= self.max_frame_size:
                self._nul_scan = len(buf)
                return None
            if end < 0 or end + 1 > self.max_frame_size:
                raise FrameTooLarge(f"frame larger than {self.max_frame_size} bytes")
        body = bytes(buf[body_start:end])
        del buf[: end + 1]
        self._head = None
        self._scan = 0
        return Frame(command, headers, body)

    def _skip_eols(self) -> bool:
        """Drop heart-beat EOLs; True when a frame's first byte is buffered."""
        buf = self._buf
        skip = 0
        size = len(buf)
        while skip < size:
            byte = buf[skip]
            if byte == 0x0A:
                skip += 1
            elif byte == 0x0D:
                if skip + 1 == size:
                    break
                if buf[skip + 1] != 0x0A:
                    raise InvalidFrame("CR not followed by LF between frames")
                skip += 2
            else:
                break
        if skip:
            del buf[:skip]
        return skip < len(buf) and buf[0] != 0x0D

    def _read_head(self) -> bool:
        """Find and parse the command and headers; False when more bytes are needed."""
        buf = self._buf
        size = len(buf)
        pos = self._scan
        # Line by line: each find is short, so the cost is linear in the frame, however
        # many frames follow it in the buffer.
        while True:
            lf = buf.find(b"\n", pos)
            if lf < 0 or lf + 1 == size or (lf + 2 == size and buf[lf + 1] == 0x0D):
                if buf.find(b"\x00", self._scan) >= 0:
                    raise InvalidFrame("NUL before the end of the headers")
                if size > self.max_frame_size:
                    raise FrameTooLarge(f"frame headers larger than {self.max_frame_size} bytes")
                self._scan = size if lf < 0 else lf
                return False
            after = buf[lf + 1]
            if after == 0x0A:
                head_end, body_start = lf, lf + 2
                break
            if after == 0x0D and buf[lf + 2] == 0x0A:
                head_end, body_start = lf, lf + 3
                break
            pos = lf + 1
        if buf.find(b"\x00", 0, head_end) >= 0:
            raise InvalidFrame("NUL before the end of the headers")
        if head_end > self.max_frame_size:
            raise FrameTooLarge(f"frame headers larger than {self.max_frame_size} bytes")
        command, headers, raw_length = self._parse_head(bytes(buf[:head_end]))
        length = (
            None if raw_length is None else self._content_length(command, raw_length, body_start)
        )
        self._head = (command, headers, body_start, length)
        self._nul_scan = body_start
        return True

    def _parse_head(self, head: bytes) -> tuple[str, tuple[tuple[str, str], ...], str | None]:
        """Command, headers, and the first content-length header's raw value."""
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidFrame("frame headers are not valid UTF-8") from e
        lines = text.split("\n")
        if "\r" in text:
            lines = [line.removesuffix("\r") for line in lines]
        if len(lines) - 1 > self.max_headers:
            raise FrameTooLarge(f"more than {self.max_headers} headers")
        command = lines[0]
        if not (command.isascii() and command.isalpha() and command.isupper()):
            raise InvalidFrame(f"invalid command {command[:40]!r}")
        table: dict[str, str] | None = None
        if command not in UNESCAPED_COMMANDS:
            if self.version is Version.V1_2:
                table = _UNESCAPE_12
            elif self.version is Version.V1_1:
                table = _UNESCAPE_11
        headers: list[tuple[str, str]] = []
        length: str | None = None
        for line in lines[1:]:
            key, colon, value = line.partition(":")
            if not (colon and key):
                raise InvalidFrame(f"{command} frame: malformed header line {line[:80]!r}")
            if table is not None and "\\" in line:
                key = _unescape(key, table, strict=False)
                value = _unescape(value, table, strict=True)
            if key == "content-length" and length is None:
                length = value
            headers.append((key, value))
        return command, tuple(headers), length

    def _content_length(self, command: str, raw: str, body_start: int) -> int:
        length = parse_decimal(raw)
        if length is None:
            raise InvalidFrame(f"{command} frame: invalid content-length {raw[:40]!r}")
        if body_start + length + 1 > self.max_frame_size:
            raise FrameTooLarge(
                f"{command} frame of {length} body bytes is over the limit of "
                f"{self.max_frame_size} bytes"
            )
        return length

    def send(self, frame: Frame) -> bytes:
        """Encode one frame, escaping its headers as the version and command require."""
        if self.version is Version.V1_0 or frame.command in UNESCAPED_COMMANDS:
            table = _FLATTEN
        elif self.version is Version.V1_1:
            table = _ESCAPE_11
        else:
            table = _ESCAPE_12
        lines = [frame.command]
        lines.extend(
            f"{key.translate(table)}:{value.translate(table)}" for key, value in frame.headers
        )
        lines.append("\n")
        return "\n".join(lines).encode("utf-8") + frame.body + b"\x00"


__all__ = ["DEFAULT_MAX_FRAME_SIZE", "DEFAULT_MAX_HEADERS", "Codec", "StompProtocolError"]

"""gcp-storage-emulator, serving each request on its own thread and answering ``Expect: 100-continue``.

The emulator's HTTP server handles one request at a time; Google's C++ client (pyarrow's GCS filesystem,
which Ray's model loader uses) downloads several files at once and keeps a large download's stream open
while it asks for the next file, which a one-at-a-time server never answers. The same client sends each
chunk of a resumable upload with ``Expect: 100-continue`` and, as curl does, waits a second for the
interim answer before it sends the body anyway; the emulator speaks HTTP/1.0 and never gives one, so a
260 MB model took 36 s to upload (34 chunks of 8 MiB, a second each). Same arguments as the emulator's own
command line.
"""

import sys
from http import server

server.HTTPServer = server.ThreadingHTTPServer  # the emulator looks the class up on this module at start

from gcp_storage_emulator.server import RequestHandler  # noqa: E402

_parse_request = RequestHandler.parse_request


def _parse_request_and_continue(self: server.BaseHTTPRequestHandler) -> bool:
    # BaseHTTPRequestHandler answers the expectation only when it speaks HTTP/1.1 itself.
    ok = _parse_request(self)
    expects = (self.headers.get("Expect", "") if ok else "").lower() == "100-continue"
    if expects and self.request_version >= "HTTP/1.1" and self.protocol_version < "HTTP/1.1":
        self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.wfile.flush()
    return ok


RequestHandler.parse_request = _parse_request_and_continue  # type: ignore[method-assign]

from gcp_storage_emulator.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

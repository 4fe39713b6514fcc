"""gcp-storage-emulator, serving each request on its own thread.

The emulator's HTTP server handles one request at a time; Google's C++ client (pyarrow's GCS filesystem,
which Ray's model loader uses) downloads several files at once and keeps a large download's stream open
while it asks for the next file, which a one-at-a-time server never answers. Same arguments as the
emulator's own command line.
"""

import sys
from http import server

server.HTTPServer = server.ThreadingHTTPServer  # the emulator looks the class up on this module at start

from gcp_storage_emulator.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""Stand-ins for inference servers that misbehave (tests only), on 127.0.0.1:PORT.

python tests/stub_server.py garbage PORT
    a broken server: HTTP 200 with non-JSON to every request.
python tests/stub_server.py stubborn PORT PIDFILE
    a valid model list, but it ignores SIGTERM, and so does a worker process it starts first (its pid
    goes to PIDFILE): only a SIGKILL of the whole process group stops them.
"""

import json
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Garbage(BaseHTTPRequestHandler):
    body, content_type = b"<html>it works!</html>", "text/html"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_POST = do_GET

    def log_message(self, format, *args):
        pass


class Models(Garbage):
    body, content_type = json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode(), "application/json"


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the worker
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(sys.argv[3], "w") as f:
            f.write(str(worker.pid))
    HTTPServer(("127.0.0.1", port), Models if mode == "stubborn" else Garbage).serve_forever()

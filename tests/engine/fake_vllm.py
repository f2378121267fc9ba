"""A stand-in for vLLM's OpenAI server where only its port and served names matter (the port
race tests): binds `--port` as vLLM does (exits 1 if it is taken) and lists every
`--served-model-name` on /v1/models."""

from __future__ import annotations

import argparse
import http.server
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", nargs="+", default=["policy"])
    args, _ = parser.parse_known_args()
    names = args.served_model_name

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"data": [{"id": name} for name in names]} if self.path == "/v1/models" else {})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    try:
        server = http.server.HTTPServer((args.host, args.port), Handler)
    except OSError as exc:
        print(f"ERROR: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        return 1
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A cloud metadata service for tests: the reclaim-notice endpoints of AWS (IMDSv2), GCP and Azure,
as their documentation describes them, including what each answers to a request that lacks its
required header. Run inside a sandbox instance's network namespace on 169.254.169.254:80, it is
what the guard on that instance sees on a real spot VM.

    python metadata_server.py --provider aws|gcp|azure|silent --control FILE --log FILE [--bind A --port P]

--control: a JSON file the test writes to raise a notice: {"deadline": EPOCH} (absent or empty: no
notice); {"rebalance": EPOCH}: AWS's rebalance recommendation, noticeTime EPOCH. Each provider
shows a notice in its own format: AWS `spot/instance-action` {"action": "terminate", "time": ISO},
GCP `instance/preempted` TRUE, Azure a Scheduled Event "Preempt" with
NotBefore. --log: one JSON line per request (method, path, the headers that matter, status).
`silent`: accepts connections and never answers (a metadata address that hangs).

- AWS: PUT /latest/api/token needs X-aws-ec2-metadata-token-ttl-seconds (1..21600), else 400;
  every GET needs a token it issued in X-aws-ec2-metadata-token, else 401 (IMDSv2 required).
  instance-action and the rebalance recommendation are 404 until there is a notice.
- GCP: every request needs Metadata-Flavor: Google, else 403; answers carry Metadata-Flavor: Google.
- Azure: /metadata/scheduledevents needs Metadata: true (else 400) and api-version (else 400).
"""

from __future__ import annotations

import argparse
import email.utils
import json
import secrets
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

TOKEN_TTL = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN = "X-aws-ec2-metadata-token"


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the address's name up (getfqdn), which hangs where no DNS answers
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


def make_handler(provider: str, control: Path, log: Path) -> type[BaseHTTPRequestHandler]:
    tokens: set[str] = set()
    lock = threading.Lock()

    def controlled(key: str) -> float | None:
        try:
            data = json.loads(control.read_text() or "null")
        except (OSError, ValueError):
            return None
        return float(data[key]) if isinstance(data, dict) and key in data else None

    def deadline() -> float | None:
        return controlled("deadline")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def reply(self, status: int, body: bytes | str, kind: str = "text/plain", headers: dict | None = None) -> None:
            # logged before the answer leaves: a request the answer causes (the GET after a token's
            # PUT, in another thread) must come after it in the log
            seen = {k: self.headers.get(k) for k in (TOKEN_TTL, TOKEN, "Metadata-Flavor", "Metadata")
                    if self.headers.get(k) is not None}
            if TOKEN in seen:
                seen[TOKEN] = "known" if seen[TOKEN] in tokens else "unknown"
            with lock, log.open("a") as f:
                f.write(json.dumps({"method": self.command, "path": self.path, "headers": seen, "status": status})
                        + "\n")
            data = body.encode() if isinstance(body, str) else body
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def handle_one_request(self) -> None:
            if provider == "silent":
                time.sleep(3600)        # accepted, never answered
                return
            super().handle_one_request()

        def do_PUT(self) -> None:
            if provider != "aws" or urlsplit(self.path).path != "/latest/api/token":
                return self.not_here()
            ttl = self.headers.get(TOKEN_TTL, "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self.reply(400, "")
            token = secrets.token_urlsafe(32)
            with lock:
                tokens.add(token)
            self.reply(200, token, headers={TOKEN_TTL: ttl})

        def do_GET(self) -> None:
            {"aws": self.aws, "gcp": self.gcp, "azure": self.azure}[provider]()

        def not_here(self) -> None:
            if provider == "gcp":
                self.reply(403 if self.headers.get("Metadata-Flavor") != "Google" else 404, "")
            else:
                self.reply(404, "")

        def aws(self) -> None:
            if self.headers.get(TOKEN) not in tokens:
                return self.reply(401, "")
            path, when = urlsplit(self.path).path, deadline()
            if path == "/latest/meta-data/spot/instance-action" and when is not None:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
                return self.reply(200, json.dumps({"action": "terminate", "time": stamp}), "application/json")
            advised = controlled("rebalance")
            if path == "/latest/meta-data/events/recommendations/rebalance" and advised is not None:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(advised))
                return self.reply(200, json.dumps({"noticeTime": stamp}), "application/json")
            self.reply(404, "")

        def gcp(self) -> None:
            if self.headers.get("Metadata-Flavor") != "Google":
                return self.reply(403, "Missing required header: Metadata-Flavor: Google\n")
            if urlsplit(self.path).path != "/computeMetadata/v1/instance/preempted":
                return self.reply(404, "", headers={"Metadata-Flavor": "Google"})
            self.reply(200, "TRUE" if deadline() is not None else "FALSE", headers={"Metadata-Flavor": "Google"})

        def azure(self) -> None:
            parts = urlsplit(self.path)
            if parts.path != "/metadata/scheduledevents":
                return self.reply(404, "")
            if self.headers.get("Metadata") != "true":
                return self.reply(400, json.dumps({"error": "Bad request. Required metadata header not specified"}),
                                  "application/json")
            if not parse_qs(parts.query).get("api-version"):
                return self.reply(400, json.dumps({"error": "Bad request. api-version was not specified"}),
                                  "application/json")
            when = deadline()
            events = [] if when is None else [{
                "EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt",
                "ResourceType": "VirtualMachine", "Resources": ["relaunch-test-vm"], "EventStatus": "Scheduled",
                "NotBefore": email.utils.formatdate(when, usegmt=True), "Description": "", "EventSource": "Platform",
                "DurationInSeconds": -1}]
            self.reply(200, json.dumps({"DocumentIncarnation": 1 if events else 0, "Events": events}),
                       "application/json")

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--provider", choices=["aws", "gcp", "azure", "silent"], required=True)
    parser.add_argument("--control", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--bind", default="169.254.169.254")
    parser.add_argument("--port", type=int, default=80)
    args = parser.parse_args()
    server = Server((args.bind, args.port), make_handler(args.provider, args.control, args.log))
    print(f"listening on {args.bind}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The reference reward server: any reward function (`package.module:function`) behind the `reward.http` protocol
(rlhf_ray/actors/http_reward.py), for tests, examples and as a template for a real one.

    python -m rlhf_ray.reward_server --function rlhf_ray.data.demo_sort:score --port 8000
    # then, in the PPO config:  reward: {http: {url: "http://127.0.0.1:8000/score"}}

It listens on 127.0.0.1 unless told otherwise; one thread per request. The function gets the dataset columns it
names (all of them with **kwargs), as in process. Reached from other machines, it should require a token and speak
https:

    REWARD_TOKEN=... python -m rlhf_ray.reward_server --function ... --host 0.0.0.0 --token-env REWARD_TOKEN \
        --tls-cert server.pem --tls-key server.key
    # the job: reward: {http: {url: "https://HOST:8000/score", token_env: REWARD_TOKEN, ca_file: ca.pem}}

A request without the token, or with another, is refused with HTTP 401 before the function sees it.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlhf_ray.functions import column_arguments, load_function


def make_server(function, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                tls: tuple[str, str] | None = None) -> ThreadingHTTPServer:
    """A server scoring POSTed batches with `function(prompts, answers, **columns)`; port 0 picks a free one
    (`server.server_address[1]`). Start it with `serve_forever()` (or `serve_in_thread`). `token`: requests must
    carry `Authorization: Bearer <token>`; `tls`: (certificate, key) PEM files, to serve https."""
    expected = f"Bearer {token}".encode() if token else None

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            if expected is not None and not hmac.compare_digest(
                    self.headers.get("Authorization", "").encode(), expected):
                self._reply(401, {"error": "a bearer token is required, and this one is not the server's"})
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                columns = request.get("columns", {})
                rows = [dict(zip(columns, values)) for values in zip(*columns.values())] if columns else []
                kwargs = column_arguments(function, rows)  # the columns the function takes, as in process
                scores = [float(s) for s in function(request["prompts"], request["answers"], **kwargs)]
                status, reply = 200, {"scores": scores}
            except Exception as exc:  # noqa: BLE001 - the caller gets the error, the server keeps serving
                status, reply = 500, {"error": f"{type(exc).__name__}: {exc}"}
            self._reply(status, reply)

        def _reply(self, status: int, reply: dict) -> None:
            body = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 - quiet: one line per batch is noise
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    server.scheme = "https" if tls else "http"
    return server


def serve_in_thread(server: ThreadingHTTPServer) -> str:
    """Serve in a daemon thread; returns the URL to put in `reward.http.url`."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return f"{getattr(server, 'scheme', 'http')}://{host}:{port}/score"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--function", required=True, help="package.module:function, as reward.function takes")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-env", help="require the bearer token held by this environment variable")
    parser.add_argument("--token-file", help="require the bearer token this file holds")
    parser.add_argument("--tls-cert", help="serve https with this certificate (PEM; with --tls-key)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    args = parser.parse_args(argv)
    token = (os.environ.get(args.token_env, "") if args.token_env else
             open(args.token_file, encoding="utf-8").read() if args.token_file else "").strip() or None
    if (args.token_env or args.token_file) and token is None:
        parser.error(f"the token ({args.token_env or args.token_file}) is empty")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    server = make_server(load_function(args.function), args.host, args.port, token, tls)
    print(f"scoring with {args.function} at {server.scheme}://{args.host}:{server.server_address[1]}/score"
          f"{' (token required)' if token else ''}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

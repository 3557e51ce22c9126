"""The reference reward server: any reward function (`package.module:function`) behind the `reward.http` protocol
(rlhf_ray/actors/http_reward.py), for tests, examples and as a template for a real one.

    python -m rlhf_ray.reward_server --function rlhf_ray.data.demo_sort:score --port 8000
    # then, in the PPO config:  reward: {http: {url: "http://127.0.0.1:8000/score"}}

It listens on 127.0.0.1 unless told otherwise; one thread per request. The function gets the dataset columns it
names (all of them with **kwargs), as in process.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlhf_ray.functions import column_arguments, load_function


def make_server(function, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A server scoring POSTed batches with `function(prompts, answers, **columns)`; port 0 picks a free one
    (`server.server_address[1]`). Start it with `serve_forever()` (or `serve_in_thread`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                columns = request.get("columns", {})
                rows = [dict(zip(columns, values)) for values in zip(*columns.values())] if columns else []
                kwargs = column_arguments(function, rows)  # the columns the function takes, as in process
                scores = [float(s) for s in function(request["prompts"], request["answers"], **kwargs)]
                status, reply = 200, {"scores": scores}
            except Exception as exc:  # noqa: BLE001 - the caller gets the error, the server keeps serving
                status, reply = 500, {"error": f"{type(exc).__name__}: {exc}"}
            body = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 - quiet: one line per batch is noise
            pass

    return ThreadingHTTPServer((host, port), Handler)


def serve_in_thread(server: ThreadingHTTPServer) -> str:
    """Serve in a daemon thread; returns the URL to put in `reward.http.url`."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return f"http://{host}:{port}/score"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--function", required=True, help="package.module:function, as reward.function takes")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = make_server(load_function(args.function), args.host, args.port)
    print(f"scoring with {args.function} at http://{args.host}:{server.server_address[1]}/score", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

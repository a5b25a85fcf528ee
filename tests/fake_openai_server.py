"""A stand-in for `vllm serve` in the tests: GET /health, GET /v1/models, POST /v1/completions (standard library).

    python tests/fake_openai_server.py --port P [--text T] [--model NAME] [--after N --then exit|hang]
                                       [--startup-delay S]

Every completion is `--text` with finish_reason "stop", n per prompt (prompts as token-id lists or strings).
`--after N --then exit` answers N completion requests and then exits the process at once (a server that
died mid-run); `--then hang` accepts later requests but never answers them (a server that stopped
answering). It prints one line per request to stdout (the run folder's server log in the tests).
"""
import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--text", default="\n\nSo the answer is \\boxed{0}.")
    parser.add_argument("--model", default="fake")
    parser.add_argument("--after", type=int, default=-1)
    parser.add_argument("--then", choices=("exit", "hang"), default="exit")
    parser.add_argument("--startup-delay", type=float, default=0.0)
    args = parser.parse_args()
    time.sleep(args.startup_delay)
    served = {"n": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):
            print(fmt % a, flush=True)

        def reply(self, body: dict, code: int = 200):
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            self.wfile.flush()

        def do_GET(self):
            if self.path == "/health":
                self.reply({})
            elif self.path == "/v1/models":
                self.reply({"data": [{"id": args.model, "max_model_len": 4096}]})
            else:
                self.reply({"error": "not found"}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                stop = 0 <= args.after <= served["n"]
                served["n"] += 1
            if stop and args.then == "hang":
                time.sleep(3600)
                return
            if stop:
                os._exit(0)
            prompts = body["prompt"] if isinstance(body["prompt"], list) and body["prompt"] and \
                isinstance(body["prompt"][0], (list, str)) else [body["prompt"]]
            n = int(body.get("n", 1))
            choices = [{"index": i, "text": args.text, "finish_reason": "stop"} for i in range(len(prompts) * n)]
            self.reply({"choices": choices})

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"fake server on port {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())

"""A stand-in for an SGLang HTTP server (NOT SGLang: sglang cannot be installed on this CPU test machine),
speaking the subset of SGLang's HTTP API the trainer uses, with SGLang 0.5.23's rules as measured against
the real server (issue 9):

  * `--api-key KEY`: every path but /health needs `Authorization: Bearer KEY`, else HTTP 401 (SGLang's
    add_api_key_middleware).
  * weight updates (`/update_weights_from_tensor`, `/update_weights_from_distributed`) outside a
    `/begin_weight_update` ... `/end_weight_update` session: HTTP 400.
  * `/init_weights_update_group` joins a real torch.distributed gloo group with the trainer (rank
    rank_offset + tp_rank, built like SGLang's init_custom_process_group) and
    `/update_weights_from_distributed` receives real broadcasts on it.
  * `/update_weights_from_tensor`: SGLang's MultiprocessingSerializer cannot run here; the tests replace
    it by a JSON encoding (see `fake_serializer` in the tests), which this server decodes.

Every request is appended to the JSON-lines file given by --log, so tests can check which endpoints were
called and in which order. `--mode`: ok | refuse_init | refuse_update | no_session_routes.

    python tests/sglang_standin.py --port P --log FILE [--api-key KEY] [--mode ok] [--dp-size 1]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--log", required=True)
ap.add_argument("--api-key", default=None)
ap.add_argument("--mode", default="ok")
ap.add_argument("--dp-size", type=int, default=1)
ap.add_argument("--echo-worker", action="store_true", help="a child process prints the key, as SGLang's workers may")
args, _unknown = ap.parse_known_args()

STATE = {"session": False, "group": None, "weights": {}, "lock": threading.Lock()}


def record(entry: dict) -> None:
    with STATE["lock"], open(args.log, "a") as f:
        f.write(json.dumps(entry) + "\n")


def gen(ids, sp):
    toks, t = [], ids[-1]
    for _ in range(sp["max_new_tokens"]):
        t = (t * 7 + 3) % 50
        toks.append(t)
        if t in sp["stop_token_ids"]:
            return toks, "stop"
    return toks, "length"


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        if args.api_key is None or self.path.startswith("/health"):
            return True
        return self.headers.get("Authorization") == "Bearer " + args.api_key

    def do_GET(self):
        auth = self._authorized()
        record({"path": self.path, "method": "GET", "authorized": auth})
        if not auth:
            return self._send(401, {"error": "Unauthorized"})
        if self.path == "/health":
            return self._send(200, {})
        if self.path == "/get_server_info":
            return self._send(200, {"tp_size": 1, "pp_size": 1, "dp_size": args.dp_size, "version": "stand-in"})
        if self.path == "/_weights":
            return self._send(200, STATE["weights"])
        self._send(404, {"error": "no route " + self.path})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        auth = self._authorized()
        record({"path": self.path, "method": "POST", "authorized": auth,
                "names": req.get("names") if isinstance(req, dict) else None})
        if not auth:
            return self._send(401, {"error": "Unauthorized"})
        p = self.path
        if p == "/generate":
            res = []
            for ids, sp in zip(req["input_ids"], req["sampling_params"]):
                toks, reason = gen(ids, sp)
                res.append({"output_ids": toks, "meta_info": {"finish_reason": {"type": reason},
                                                              "output_token_logprobs": [[-0.01 * t, t, None] for t in toks]}})
            return self._send(200, res)
        if p in ("/begin_weight_update", "/end_weight_update"):
            if args.mode == "no_session_routes":
                return self._send(404, {"detail": "Not Found"})
            opening = p == "/begin_weight_update"
            if STATE["session"] == opening:
                return self._send(400, {"error": f"weight update session already {'open' if opening else 'closed'}"})
            STATE["session"] = opening
            return self._send(200, {"success": True, "message": ""})
        if p in ("/update_weights_from_tensor", "/update_weights_from_distributed") and \
                args.mode != "no_session_routes" and not STATE["session"]:
            return self._send(400, {"error": "no weight update session open: call /begin_weight_update first"})
        if p == "/update_weights_from_tensor":
            for blob in req["serialized_named_tensors"]:
                for name, values in json.loads(base64.b64decode(blob)).items():
                    STATE["weights"][name] = float(sum(values))
            return self._send(200, {"success": True, "message": ""})
        if p == "/init_weights_update_group":
            if args.mode == "refuse_init":
                return self._send(200, {"success": False, "message": "stand-in refuses to join the weight group"})
            import datetime

            from megatron_opd.rollout.sglang_engine import init_custom_process_group

            STATE["group"] = init_custom_process_group(
                backend=req["backend"], init_method=f"tcp://{req['master_address']}:{req['master_port']}",
                world_size=req["world_size"], rank=req["rank_offset"] + 0, group_name=req["group_name"],
                timeout=datetime.timedelta(seconds=60))
            return self._send(200, {"success": True, "message": "joined"})
        if p == "/update_weights_from_distributed":
            if args.mode == "refuse_update":
                return self._send(200, {"success": False, "message": "stand-in refuses the distributed update"})
            import torch
            import torch.distributed as dist

            for name, dtype, shape in zip(req["names"], req["dtypes"], req["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(t, src=0, group=STATE["group"])
                STATE["weights"][name] = float(t.double().sum())
            return self._send(200, {"success": True, "message": ""})
        if p in ("/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk"):
            return self._send(200, {"success": True, "message": ""})
        self._send(404, {"error": "no route " + p})


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
print(f"sglang stand-in on {args.host}:{args.port} mode={args.mode} key={'yes' if args.api_key else 'no'}", flush=True)
print(f"server_args=ServerArgs({', '.join(f'{k}={v!r}' for k, v in vars(args).items())})", flush=True)  # as SGLang logs
if args.echo_worker:
    import subprocess

    subprocess.run([sys.executable, "-c", "import os, sys; print('worker api_key=' + os.environ['K']); "
                    "print('to stderr: ' + os.environ['K'], file=sys.stderr)"],
                   env={**os.environ, "K": str(args.api_key)}, check=True)
ThreadingHTTPServer((args.host, args.port), H).serve_forever()

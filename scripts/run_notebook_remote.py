"""Runs a notebook's code cells on a Jupyter server (through the tunnel's URL) in a fresh
kernel, over the server's REST API and kernel websocket, and prints what each cell shows.

Usage: python scripts/run_notebook_remote.py URL NOTEBOOK [--kernel NAME]
The token is read from URL and sent in the Authorization header, never in a request line.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from urllib.parse import parse_qs, urlparse

import nbformat
import requests
import websocket


def message(msg_type: str, content: dict, session: str) -> dict:
    return {
        "header": {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": session,
                   "username": "demo", "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "content": content, "channel": "shell",
    }


def shown(msg: dict) -> str | None:
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        return content["text"].rstrip("\n")
    if kind in ("display_data", "execute_result"):
        return content["data"].get("text/plain", "").rstrip("\n")
    if kind == "error":
        return f"{content['ename']}: {content['evalue']}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("notebook")
    ap.add_argument("--kernel", default=None, help="kernelspec (default: the notebook's)")
    args = ap.parse_args()
    parsed = urlparse(args.url)
    token = parse_qs(parsed.query)["token"][0]
    base = f"{parsed.scheme}://{parsed.netloc}"
    auth = {"Authorization": f"token {token}"}
    nb = nbformat.read(args.notebook, as_version=4)
    kernel_name = args.kernel or nb.metadata["kernelspec"]["name"]

    kernel = requests.post(f"{base}/api/kernels", json={"name": kernel_name}, headers=auth, timeout=60)
    kernel.raise_for_status()
    kernel_id = kernel.json()["id"]
    ws_url = f"ws://{parsed.netloc}/api/kernels/{kernel_id}/channels"
    ws = websocket.create_connection(ws_url, header=[f"Authorization: token {token}"], timeout=120)
    session = uuid.uuid4().hex
    failed = False
    try:
        for cell in (c for c in nb.cells if c.cell_type == "code"):
            request = message("execute_request", {"code": cell.source, "silent": False,
                                                  "store_history": True, "user_expressions": {},
                                                  "allow_stdin": False, "stop_on_error": True},
                              session)
            ws.send(json.dumps(request))
            count, outputs, idle, replied = None, [], False, False
            while not (idle and replied):
                msg = json.loads(ws.recv())
                if msg.get("parent_header", {}).get("msg_id") != request["header"]["msg_id"]:
                    continue
                if msg["msg_type"] == "execute_reply":
                    replied, count = True, msg["content"].get("execution_count")
                    failed |= msg["content"]["status"] != "ok"
                elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
                elif msg["msg_type"] == "update_display_data":
                    continue
                elif (text := shown(msg)) is not None:
                    outputs.append(text)
            print(f"\nIn [{count}]: " + cell.source.replace("\n", "\n        "))
            for text in outputs:
                print("   " + text.replace("\n", "\n   "))
    finally:
        ws.close()
        requests.delete(f"{base}/api/kernels/{kernel_id}", headers=auth, timeout=30)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The reader's own path: JupyterLab started the way ``make lab`` starts it, a notebook run in a kernel
that server started, cell by cell, as a reader pressing "Run All" would.

nbval (the rest of ``make test``) runs each notebook in a kernel of its own; this test goes through the
server a reader talks to: its REST API lists the notebooks, starts a kernel, and the cells are executed over
the kernel's websocket. The server is headless, on a free port, with a token, and is stopped at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = "00_overview.ipynb"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict | None = None):
    req = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
def lab_server():
    port, token = _free_port(), secrets.token_hex(16)
    jupyter = pathlib.Path(sys.executable).parent / "jupyter"
    # the same command line as `make lab`, plus a fixed port and token so the test can talk to it
    cmd = [
        str(jupyter),
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        "--notebook-dir=notebooks",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        "--ServerApp.port_retries=0",
    ]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    env = dict(os.environ) | {"DSV4REF_DEVICE": "cpu", "JUPYTER_RUNTIME_DIR": str(ROOT / "build" / "jupyter-runtime")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                _get(f"{base}/api/status?token={token}")
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("jupyter lab exited: " + proc.stderr.read().decode()[-2000:]) from None
                time.sleep(0.5)
        else:
            raise RuntimeError("jupyter lab did not answer within 60 s")
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _run_cells(ws_url: str, cells: list[str]) -> list[dict]:
    """Execute each cell over the kernel's websocket; return the execute_reply contents and any errors."""
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(ws_url)
    session = uuid.uuid4().hex
    results = []
    for code in cells:
        msg_id = uuid.uuid4().hex
        ws.write_message(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "msg_type": "execute_request",
                        "session": session,
                        "username": "reader",
                        "version": "5.3",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "channel": "shell",
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": True,
                        "user_expressions": {},
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                }
            )
        )
        errors, reply = [], None
        while reply is None:
            raw = await asyncio.wait_for(ws.read_message(), timeout=300)
            assert raw is not None, "the kernel's websocket closed"
            m = json.loads(raw)
            if m.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "error":
                errors.append(m["content"]["ename"] + ": " + m["content"]["evalue"])
            elif m["msg_type"] == "execute_reply":
                reply = m["content"]
        results.append({"status": reply["status"], "errors": errors})
        if reply["status"] != "ok":
            break
    ws.close()
    return results


def test_reader_runs_a_notebook_through_jupyterlab(lab_server):
    base, token = lab_server
    listing = _get(f"{base}/api/contents?token={token}")
    names = sorted(c["name"] for c in listing["content"] if c["type"] == "notebook")
    assert names == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))

    nb = _get(f"{base}/api/contents/{NOTEBOOK}?token={token}")["content"]
    cells = [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in nb["cells"] if c["cell_type"] == "code"
    ]
    kernel = _post(f"{base}/api/kernels?token={token}", {"name": nb["metadata"]["kernelspec"]["name"]})
    ws_url = base.replace("http", "ws") + f"/api/kernels/{kernel['id']}/channels?token={token}"
    try:
        results = asyncio.run(_run_cells(ws_url, cells))
    finally:
        req = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()
    assert len(results) == len(cells), f"stopped at cell {len(results)}: {results[-1]}"
    assert all(r["status"] == "ok" and not r["errors"] for r in results), results

"""JupyterLab on 127.0.0.1 (random port + token) serving a temporary copy of notebooks/, and
Debian's chromium driven by Playwright. The server is started with its PID recorded and stopped
by that PID (and only its own leftover children) in ``finally``."""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from probekit.notebook.run import kernel_env, write_kernelspec

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode} before serving {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(url)


def lab_settings(directory: Path) -> None:
    """No news/update toasts; render every cell (no virtual scrolling) so locators see them."""
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for rel, content in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_text(json.dumps(content))


def stop_by_pid(proc) -> None:
    kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                          text=True).stdout.split()
    proc.send_signal(signal.SIGTERM)          # jupyter_server shuts its kernels down on SIGTERM
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in kids:                          # only the server's own children, by PID
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def artifacts():
    """``test-artifacts/``: screenshots and logs of the browser tests."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def lab():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make chromium` installs Debian's chromium")
    ARTIFACTS.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="probekit-lab-"))
    root = tmp / "notebooks"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    write_kernelspec(tmp / "jupyter", pythonpath=str(ROOT))     # shadows the python3 kernel
    lab_settings(tmp / "settings")
    env = kernel_env()
    env.update(JUPYTER_PATH=str(tmp / "jupyter"), JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), IPYTHONDIR=str(tmp / "ipython"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), PYTHONPATH=str(ROOT))
    port, token = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
           "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    log = open(ARTIFACTS / "jupyterlab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    (ARTIFACTS / "jupyterlab.pid").write_text(str(proc.pid))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/api/status?token={token}", proc)
        yield {"base": base, "token": token, "root": root}
    finally:
        stop_by_pid(proc)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def page(lab):
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="chromium-profile-")    # fresh --user-data-dir
    console = []
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROME_ARGS,
            viewport={"width": 1400, "height": 1100})
        try:
            pg = ctx.pages[0] if ctx.pages else ctx.new_page()
            pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            yield pg
        finally:
            (ARTIFACTS / "browser_console.log").write_text("\n".join(console))
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)

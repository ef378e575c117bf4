"""The wheel is complete: built from the sources, installed (not editable) into a fresh venv, its
dashboard serves the page, script and style it ships."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "roles" / "observe" / "dashboard_static"

# Run inside the fresh venv: serve the dashboard of the installed package, fetch what a browser does.
_FETCH = r"""
import asyncio, json, sys, urllib.request
from rolectl import roles
from rolectl.roles.observe.dashboard import start_dashboard

async def main():
    handle = await start_dashboard(job=sys.argv[1], nats_url=sys.argv[2], monitor_url=None)
    loop = asyncio.get_running_loop()
    def get(path):
        with urllib.request.urlopen(handle.url.rstrip("/") + path, timeout=120) as resp:
            return resp.status, resp.read().decode()
    try:
        pages = {path: await loop.run_in_executor(None, get, path)
                 for path in ("/", "/static/app.js", "/static/style.css")}
    finally:
        await handle.aclose()
    print(json.dumps({"roles": roles.__file__, "pages": pages}))

asyncio.run(main())
"""


def _build_wheel(tmp_path: Path) -> Path:
    # Build from a clean copy: setuptools reuses build/ in the source tree, whose leftovers from an
    # earlier build could hide a file the package data no longer lists.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", "build", "*.egg-info", "runs", ".git", "__pycache__", ".pytest_cache", ".hypothesis",
        "node_modules", "device_carry", ".gl"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(src)], check=True, timeout=600)
    wheels = list(dist.glob("rolectl-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _fresh_venv(tmp_path: Path) -> Path:
    """A venv whose own site-packages holds only what we install; the test venv's dependencies are
    reachable through a .pth file (nothing is downloaded), its editable rolectl is not (a .pth
    file's paths are added, the .pth files inside them are not run)."""
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "test-venv-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def test_wheel_installs_only_the_rolectl_namespace(tmp_path):
    # `bus` and `roles` are other distributions' names: installing rolectl must not shadow them
    with zipfile.ZipFile(_build_wheel(tmp_path)) as wheel:
        top = {name.split("/")[0] for name in wheel.namelist()}
        packages = {name.rpartition("/")[0].replace("/", ".") for name in wheel.namelist()
                    if name.endswith("/__init__.py")}
    assert {t for t in top if not t.endswith(".dist-info")} == {"rolectl"}
    # every package folder of the source tree is in the wheel (the build lists them by hand)
    expected = {"rolectl"} | {"rolectl." + ".".join(p.parent.relative_to(ROOT).parts)
                              for layer in ("sync_protocol", "bus", "roles")
                              for p in (ROOT / layer).rglob("__init__.py")}
    assert packages == expected


def test_installed_wheel_serves_the_dashboard(tmp_path, nats_url, job_name):
    wheel = _build_wheel(tmp_path)
    python = _fresh_venv(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                    str(wheel)], check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(python), "-c", _FETCH, job_name, nats_url], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["roles"].startswith(str(tmp_path / "fresh")), f"imported the sources, not the wheel: {result}"
    pages = result["pages"]
    assert pages["/"] == [200, (STATIC / "index.html").read_text()]
    assert pages["/static/app.js"] == [200, (STATIC / "app.js").read_text()]
    assert pages["/static/style.css"] == [200, (STATIC / "style.css").read_text()]

#!/usr/bin/env python3
"""Builds the project's Dockerfile with buildah on a minimal Debian base and a CPU torch, runs the image
as its non-root user, and checks it serves: CI's image test (tests/deploy/test_image_build.py runs this).

Steps (each timed, the times printed as one JSON line at the end):
  1. tools: apt-get installs buildah and mmdebstrap when missing (root only).
  2. base: mmdebstrap makes a minbase rootfs (python3, python3-venv, ca-certificates) of the host's Debian
     suite; `buildah from scratch` + add + commit imports it as a local base image. This stands in for
     the CUDA PyTorch base that real builds use (the Dockerfile's default BASE_IMAGE).
  3. build: `buildah bud --isolation chroot --storage-driver vfs --build-arg BASE_IMAGE=<base>
     --build-arg TORCH_SPEC=torch==2.13.0` (the CPU pin lives here only; the Dockerfile's default installs
     no torch of its own). The host's wheel dir and CA bundle are bind-mounted for the RUN steps only.
  4. inspect: the image's user is the numeric non-root UID:GID, its entrypoint `graphcache serve`, its
     size at most --max-size-mb (MAX_IMAGE_MB, documented in docs/DEPLOY.md).
  5. run: `buildah run` of the image's entrypoint as the image's user (chroot isolation shares the
     host's network, so the port is reachable on 127.0.0.1); checks the server process's uid, waits for
     /ready, sends one /v1/completions and checks the answer, runs the image's HEALTHCHECK command and
     the chart's hub-download import in the container, then SIGTERM and a clean exit.
Everything lives in a private storage root under a scratch dir that is removed at the end: nothing is
cached between runs (CI starts clean anyway).

Usage (root, Debian): python3 scripts/build_image.py [--work DIR] [--keep] [--max-size-mb N]
Exit status 0 = every check passed; 2 = cannot run here (not root, no apt), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "localhost/graphcache:ci"
BASE = "localhost/graphcache-ci-base:latest"
# The torch that CPU builds pin (the CPU wheel on this machine's index); real builds pass none.
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
# Bound on the CPU image (Debian minbase ~225 MB + CPU torch + deps); docs/DEPLOY.md gives the breakdown.
MAX_IMAGE_MB = int(os.environ.get("MAX_IMAGE_MB", "1536"))
EXPECTED_USER = "10001:10001"
EXPECTED_ENTRYPOINT = ["graphcache", "serve"]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CANNOT_RUN = 2


class CannotRun(Exception):
    """This machine cannot build images (not root, no apt): exit 2, which the test reports as a skip."""


def log(msg: str) -> None:
    print(f"[build_image {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[str], *, timeout: float = 1800, capture: bool = False, **kw) -> str:
    """Runs cmd, failing loudly with its output; returns stdout when capture."""
    log("$ " + " ".join(cmd))
    proc = subprocess.run(
        cmd, text=True, timeout=timeout, stdout=subprocess.PIPE if capture else None, stderr=None, **kw
    )
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}")
    return proc.stdout if capture else ""


class Buildah:
    """buildah with a private storage root (vfs: no overlay or fuse needed) under the scratch dir."""

    def __init__(self, work: Path):
        self.flags = [
            "--root",
            str(work / "storage"),
            "--runroot",
            str(work / "runroot"),
            "--storage-driver",
            "vfs",
        ]

    def cmd(self, *args: str) -> list[str]:
        return ["buildah", *self.flags, *args]

    def __call__(self, *args: str, capture: bool = False, timeout: float = 1800) -> str:
        return sh(self.cmd(*args), capture=capture, timeout=timeout)


# --------------------------------------------------------------------------- steps


def ensure_tools() -> None:
    missing = [t for t in ("buildah", "mmdebstrap") if shutil.which(t) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise CannotRun(
            f"{', '.join(missing)} missing and not root: run as root, or apt-get install {' '.join(missing)}"
        )
    if shutil.which("apt-get") is None:
        raise CannotRun(f"{', '.join(missing)} missing and no apt-get (needs a Debian/Ubuntu host)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sh(["apt-get", "update", "-qq"], env=env)
    # uidmap/slirp4netns/fuse-overlayfs (Recommends) are for rootless and overlay use: not needed here.
    sh(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


def host_suite() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME=") and line.split("=", 1)[1].strip('"'):
            return line.split("=", 1)[1].strip('"')
    return "bookworm"


def make_base(b: Buildah, work: Path, suite: str) -> None:
    rootfs = work / "rootfs.tar"
    # minbase: apt, dpkg, passwd (groupadd/useradd) and coreutils; the rest is what the Dockerfile's RUN uses.
    sh(
        [
            "mmdebstrap",
            "--quiet",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            suite,
            str(rootfs),
        ]
    )
    ctr = b("from", "scratch", capture=True).strip()
    b("add", ctr, str(rootfs), "/")
    # A rootfs tar carries no image config; the Dockerfile's ENV PATH=...:$PATH needs a PATH to extend.
    b("config", "--env", f"PATH={DEFAULT_PATH}", "--cmd", '["/bin/bash"]', ctr)
    b("commit", "--rm", "--quiet", ctr, BASE)
    rootfs.unlink()


def build(b: Buildah) -> None:
    # docker format: OCI image configs have no HEALTHCHECK, and buildah would drop the Dockerfile's.
    args = [
        "bud",
        "--isolation",
        "chroot",
        "--layers=false",
        "--format",
        "docker",
        "--file",
        str(ROOT / "Dockerfile"),
        "--tag",
        IMAGE,
        "--build-arg",
        f"BASE_IMAGE={BASE}",
        "--build-arg",
        f"TORCH_SPEC={TORCH_SPEC}",
    ]
    # The host's pip setup, for RUN steps only: its wheel dir (the local CPU torch) and its CA bundle
    # (a network that re-signs TLS needs the host's CA, which Debian's ca-certificates lacks).
    for wheels in filter(None, os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()):
        if Path(wheels).is_dir():
            args += ["--volume", f"{wheels}:{wheels}:ro", "--build-arg", f"PIP_FIND_LINKS={wheels}"]
            break
    bundle = "/etc/ssl/certs/ca-certificates.crt"
    if Path(bundle).is_file():
        args += ["--volume", f"{bundle}:{bundle}:ro", "--build-arg", f"PIP_CERT={bundle}"]
    b(*args, str(ROOT))


def image_info(b: Buildah) -> dict:
    """buildah inspect's JSON (this buildah's --format has no `json` function, so the whole document)."""
    return json.loads(b("inspect", "--type", "image", IMAGE, capture=True))


def inspect(b: Buildah) -> dict:
    info = image_info(b)
    config = info["OCIv1"]["config"]
    # Uncompressed layer tars as stored: what the image takes on a node's disk once pulled.
    size_mb = sum(layer["size"] for layer in json.loads(info["Manifest"])["layers"]) / 2**20
    healthcheck = (info.get("Docker", {}).get("config", {}).get("Healthcheck") or {}).get("Test")
    facts = {
        "user": config.get("User"),
        "entrypoint": config.get("Entrypoint"),
        "size_mb": round(size_mb),
        "healthcheck": healthcheck,
    }
    log(f"image: {facts}")
    problems = []
    if facts["user"] != EXPECTED_USER:
        problems.append(f"user {facts['user']!r}, expected {EXPECTED_USER!r} (the chart's runAsUser)")
    if facts["entrypoint"] != EXPECTED_ENTRYPOINT:
        problems.append(f"entrypoint {facts['entrypoint']!r}, expected {EXPECTED_ENTRYPOINT!r}")
    if not healthcheck or healthcheck[0] != "CMD":
        problems.append(f"no HEALTHCHECK in the image config ({healthcheck!r}); it needs --format docker")
    if size_mb > MAX_IMAGE_MB:
        problems.append(f"image is {size_mb:.0f} MiB, over the {MAX_IMAGE_MB} MiB bound (docs/DEPLOY.md)")
    if problems:
        raise SystemExit("image checks failed: " + "; ".join(problems))
    return facts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}


def session_processes(session: int) -> list[tuple[int, int, str]]:
    """(pid, uid, command line) of the processes in our buildah run's session (setsid made it): buildah,
    its chroot helper (root) and the container's own processes."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) != session:  # stat field 6: session id
                continue
            uid = next(
                int(x.split()[1])
                for x in (stat.parent / "status").read_text().splitlines()
                if x.startswith("Uid:")
            )
            cmdline = (
                (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            )
            out.append((int(stat.parent.name), uid, cmdline))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return out


def server_processes(session: int, entrypoint: list[str]) -> list[tuple[int, int, str]]:
    """The container's processes running the entrypoint (buildah's own processes excluded)."""
    return [p for p in session_processes(session) if "buildah" not in p[2] and " ".join(entrypoint) in p[2]]


def run_and_check(b: Buildah, work: Path, ready_timeout: float) -> dict:
    ctr = b("from", "--quiet", IMAGE, capture=True).strip()
    port = free_port()
    config = image_info(b)
    entrypoint = config["OCIv1"]["config"]["Entrypoint"]
    healthcheck = config["Docker"]["config"]["Healthcheck"]["Test"][1:]  # after "CMD"
    env = {
        "GRAPHCACHE_HOST": "127.0.0.1",
        "GRAPHCACHE_PORT": str(port),
        "GRAPHCACHE_DEVICE": "cpu",
        "GRAPHCACHE_MAX_NUM_SEQS": "8",
        "GRAPHCACHE_MAX_CAPTURE_SIZE": "8",
    }
    # No --user: buildah run uses the image's USER, which is what this checks.
    cmd = b.cmd(
        "run", "--isolation", "chroot", *[f"--env={k}={v}" for k, v in env.items()], ctr, "--", *entrypoint
    )
    server_log = work / "server.log"
    log("$ " + " ".join(cmd) + f"  (background, log {server_log})")
    with server_log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    result: dict = {"port": port}
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise SystemExit(
                    f"the container exited ({proc.returncode}) before /ready:\n"
                    + server_log.read_text()[-4000:]
                )
            if time.monotonic() - t0 > ready_timeout:
                raise SystemExit(
                    f"/ready not 200 after {ready_timeout:.0f} s:\n" + server_log.read_text()[-4000:]
                )
            try:
                status, ready = http("GET", base + "/ready", timeout=5)
                if status == 200:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        log(f"/ready after {result['ready_s']} s: {ready}")

        log(f"processes of the run: {session_processes(proc.pid)}")
        servers = server_processes(proc.pid, entrypoint)
        uids = {uid for _, uid, _ in servers}
        if not servers or uids != {int(EXPECTED_USER.split(":")[0])}:
            raise SystemExit(
                f"the server runs as uid(s) {sorted(uids)}, expected only {EXPECTED_USER}: {servers}"
            )
        result["server_uid"] = uids.pop()

        status, body = http(
            "POST",
            base + "/v1/completions",
            timeout=120,
            body={
                "model": ready["model"],
                "prompt": "The image test says",
                "max_tokens": 5,
                "temperature": 0,
            },
        )
        choice = (body.get("choices") or [{}])[0]
        log(f"/v1/completions -> {status}: {body}")
        if not (
            status == 200
            and body.get("object") == "text_completion"
            and isinstance(choice.get("text"), str)
            and body.get("usage", {}).get("completion_tokens", 0) >= 1
            and choice.get("finish_reason") in ("length", "stop")
        ):
            raise SystemExit(f"bad completion answer ({status}): {body}")
        result["completion_tokens"] = body["usage"]["completion_tokens"]

        # The image's own HEALTHCHECK command, run in the container beside the server (same network).
        hc = subprocess.run(
            b.cmd("run", "--isolation", "chroot", f"--env=GRAPHCACHE_PORT={port}", ctr, "--", *healthcheck),
            capture_output=True,
            text=True,
            timeout=120,
        )
        log(f"HEALTHCHECK command -> exit {hc.returncode}")
        if hc.returncode != 0:
            raise SystemExit(
                f"the image's HEALTHCHECK failed against a healthy server: {hc.stdout}{hc.stderr}"
            )

        # The chart's model.source=hub init container runs helm/graphcache/files/hub_download.py in this
        # image: huggingface_hub (a dependency of tokenizers) must be importable there.
        hub = subprocess.run(
            b.cmd(
                "run",
                "--isolation",
                "chroot",
                ctr,
                "--",
                "python",
                "-c",
                "from huggingface_hub import snapshot_download",
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if hub.returncode != 0:
            raise SystemExit(
                "huggingface_hub.snapshot_download is not importable in the image (the chart's hub "
                f"download needs it): {hub.stderr[-2000:]}"
            )

        # SIGTERM to the server (not buildah): the drain path a kubelet's stop takes; it must exit 0.
        for pid, _, _ in servers:
            os.kill(pid, signal.SIGTERM)
        rc = proc.wait(timeout=90)
        log(f"container exited {rc} after SIGTERM")
        if rc != 0:
            raise SystemExit(f"the container exited {rc} on SIGTERM:\n" + server_log.read_text()[-4000:])
        return result
    finally:
        if proc.poll() is None:  # only on failure: our own session, by its id; TERM lets buildah clean up
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        subprocess.run(b.cmd("rm", ctr), capture_output=True, timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, help="scratch dir (default: a new temp dir, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir (storage, logs) at the end")
    ap.add_argument("--suite", default=None, help="Debian suite for the base (default: the host's)")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument(
        "--run-only",
        action="store_true",
        help="debugging: skip tools/base/build and check the image already in --work's storage",
    )
    args = ap.parse_args()

    times: dict[str, float] = {}
    t_all = time.monotonic()
    work = args.work or Path(
        tempfile.mkdtemp(prefix="graphcache-image-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    )
    work.mkdir(parents=True, exist_ok=True)
    # buildah's own temp dirs (per run, per build) go under the scratch dir too, so nothing outlives it.
    (work / "tmp").mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(work / "tmp")
    try:
        if os.geteuid() != 0:
            raise CannotRun("needs root (buildah with chroot isolation and mmdebstrap build as root here)")
        b = Buildah(work)
        if not args.run_only:
            t = time.monotonic()
            ensure_tools()
            times["tools_s"] = time.monotonic() - t
            t = time.monotonic()
            make_base(b, work, args.suite or host_suite())
            times["base_s"] = time.monotonic() - t
            t = time.monotonic()
            build(b)
            times["build_s"] = time.monotonic() - t
        facts = inspect(b)
        t = time.monotonic()
        facts.update(run_and_check(b, work, args.ready_timeout))
        times["run_s"] = time.monotonic() - t
    except CannotRun as e:
        print(f"build_image: cannot run here: {e}", file=sys.stderr)
        return CANNOT_RUN
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    times["total_s"] = time.monotonic() - t_all
    print(
        "BUILD_IMAGE_RESULT " + json.dumps({**facts, **{k: round(v, 1) for k, v in times.items()}}),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

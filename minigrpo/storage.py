"""The run directory's storage: every read and write of RUN (a folder or an fsspec URL) goes through here, whole
objects only (README, "The run directory"). Any failure of the store is an OSError naming the object."""
import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import threading
from concurrent.futures import ThreadPoolExecutor

import fsspec
from fsspec.implementations.local import LocalFileSystem


class Storage:
    def __init__(self, url: str):
        try:
            self.fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
        except ImportError as e:  # s3fs or gcsfs not installed
            raise SystemExit(f"--run_dir {url} needs: pip install -r requirements-storage.txt ({e})") from e
        self.local, self.s3 = isinstance(self.fs, LocalFileSystem), "s3" in self.fs.protocol
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        self.poll_s, self.mutex, self.depth = 0.02 if self.local else 0.2, threading.RLock(), 0  # a bucket bills requests

    def url(self, key: str = "") -> str:
        path = f"{self.root}/{key}".rstrip("/")
        return path if self.local else self.fs.unstrip_protocol(path)

    @contextlib.contextmanager
    def _naming(self, what: str, key: str):  # any failure: an OSError naming the object (FileNotFoundError stays, unless writing)
        try:
            yield
        except Exception as e:  # noqa: BLE001 - whatever the backend raises
            kind = type(e) if isinstance(e, FileExistsError) or isinstance(e, FileNotFoundError) and what != "write" else OSError
            raise kind(getattr(e, "errno", None), f"cannot {what} {self.url(key)}: {type(e).__name__}: {e}") from e

    def put(self, key: str, data: bytes | str, create: bool = False):  # never seen half; create: if absent, else FileExistsError
        self.put_many({key: data}, create)

    def put_many(self, objects: "dict[str, bytes | str]", create: bool = False):  # concurrently on a bucket, unless create
        objects = {k: d.encode(errors="surrogateescape") if isinstance(d, str) else d for k, d in objects.items()}
        if not self.local:
            with self._naming("write", next(iter(objects), "")):
                if create:  # If-None-Match on S3, elsewhere a look first (a hard link on a local disk, below)
                    return [self.fs.pipe_file(f"{self.root}/{k}", data, mode="create") for k, data in objects.items()]
                return self.fs.pipe({f"{self.root}/{k}": v for k, v in objects.items()})
        for key, data in objects.items():
            tmp = os.path.join(os.path.dirname(f"{self.root}/{key}"), f".{os.urandom(6).hex()}.tmp")
            with self._naming("write", key):
                os.makedirs(os.path.dirname(tmp), exist_ok=True)  # a short tmp name: the key's may be as long as a name can be
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    (os.link if create else os.replace)(tmp, f"{self.root}/{key}")
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(tmp)

    def get(self, key: str) -> bytes:  # a whole object; FileNotFoundError if absent, ValueError if locally not a regular file
        path = f"{self.root}/{key}"
        with self._naming("read", key):
            if not self.local:  # s3fs asks for the size (a HEAD) before a GET, unless told to read in one request
                return self.fs.cat_file(path, **{"max_concurrency": 1} if self.s3 else {})
            if stat.S_ISREG(os.lstat(path).st_mode):  # a hostile entry can neither hang a reader nor lead it outside the run
                with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
                    return f.read()
        raise ValueError(f"{path} is not a regular file (a directory, symlink, FIFO or device); refusing to read it")

    def get_many(self, keys: "list[str]") -> list:  # concurrent get()s (a round trip each on a bucket): bytes or exception
        with ThreadPoolExecutor(16) as pool:  # exception() waits for its read
            return [read.exception() or read.result() for read in [pool.submit(self.get, key) for key in keys]]

    def versioned(self, key: str, read=True) -> tuple[bytes | None, str | None]:  # token: S3's ETag, else the bytes' sha256
        with contextlib.suppress(FileNotFoundError):
            with self._naming("read", key):  # the ETag first (read=False: alone, a HEAD); newer bytes only fail a swap
                etag = self.fs.info(f"{self.root}/{key}")["ETag"] if self.s3 else None
            return (None if etag and not read else (data := self.get(key))), etag or hashlib.sha256(data).hexdigest()
        return None, None

    def swap(self, key: str, data: bytes | str, token: str | None) -> str:
        """Replace an object if still version `token` (None: absent); returns the new token, else FileExistsError."""
        data = data.encode() if isinstance(data, str) else data
        if self.s3:  # If-Match, or If-None-Match for an absent one; a local disk looks and writes under the run's lock
            with self._naming("write", key):
                try:
                    return self.fs.pipe_file(f"{self.root}/{key}", data, **{"IfMatch": token} if token else {"mode": "create"})["ETag"]
                except OSError as e:  # a stale If-Match is a 412 (errno EINVAL), a vanished object a 404
                    if isinstance(e, FileExistsError) or token and isinstance(e, FileNotFoundError) or "pre-condition" in str(e):
                        raise FileExistsError(f"{self.url(key)} was replaced by another writer") from e
                    raise
        with self.locked():
            if self.versioned(key)[1] != token:
                raise FileExistsError(f"{self.url(key)} was replaced by another writer")
            self.put(key, data)
        return hashlib.sha256(data).hexdigest()

    @contextlib.contextmanager
    def locked(self):  # the run's lock (flock on RUN/.lock), re-entrant, on a local disk or NFS; a no-op on a bucket
        with self.mutex, contextlib.ExitStack() as held:
            if self.local and self.depth == 0:  # the outermost holder locks the file; closing it releases the lock
                os.makedirs(self.root, exist_ok=True)
                fcntl.flock(held.enter_context(open(f"{self.root}/.lock", "a")), fcntl.LOCK_EX)
            self.depth += 1
            held.callback(setattr, self, "depth", self.depth - 1)  # on the way out, however it goes
            yield

    def exists(self, key: str) -> bool:
        with self._naming("look up", key):
            return self.fs.exists(f"{self.root}/{key}")

    def list(self, prefix: str) -> list[str]:
        """Sorted names directly under a prefix (local temp files left out; a bucket's listing may lag a put)."""
        path = f"{self.root}/{prefix}".rstrip("/")
        with self._naming("list", prefix):
            try:  # a local listing through os is ten times cheaper than through fsspec
                entries = os.listdir(path) if self.local else self.fs.ls(path, detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
        return sorted(n for n in (e.rstrip("/").rsplit("/", 1)[-1] for e in entries) if not (self.local and n.startswith(".")))

    def delete(self, key: "str | list[str]", recursive: bool = False):  # or, recursive, all under a prefix; gone is fine
        keys = [key] if isinstance(key, str) else key
        for batch in [[k] for k in keys] if self.local else [keys] if keys else []:
            with self._naming("delete", batch[0]), contextlib.suppress(FileNotFoundError):
                if not self.local:
                    self.fs.rm([f"{self.root}/{k}" for k in batch], recursive=recursive)
                else:  # on a local disk a directory goes whole, recursive or not; a link goes, not its target (lstat)
                    (shutil.rmtree if stat.S_ISDIR(os.lstat(path := f"{self.root}/{batch[0]}").st_mode) else os.remove)(path)


def read_bytes(path: str) -> bytes:  # one whole file from a local path or URL a user points at (an adapter), links followed
    fs, path = fsspec.core.url_to_fs(path)
    return fs.cat_file(path, **{"max_concurrency": 1} if "s3" in fs.protocol else {})  # one GET, as in get()

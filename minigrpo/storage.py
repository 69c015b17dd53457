"""The run directory's storage: every read and write of RUN (a folder or an fsspec URL) goes through this module,
whole objects only (README, "The run directory"). On a local disk put() writes a hidden temp file, fsyncs it and
os.replace()s it, and get() reads only regular files, so a hostile entry in the run directory can neither hang a
reader nor point it outside the run. Any failure of the store is an OSError naming the object.
"""
import contextlib
import glob
import os
import stat
import time
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem


class Storage:
    def __init__(self, url: str):
        try:
            self.fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
        except ImportError as e:  # s3fs or gcsfs not installed
            raise SystemExit(f"--run_dir {url} needs: pip install -r requirements-storage.txt ({e})") from e
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        self.poll_s = 0.02 if self.local else 0.2  # how often to look again while waiting: listings cost a request

    def url(self, key: str = "") -> str:
        path = f"{self.root}/{key}".rstrip("/")
        return path if self.local else self.fs.unstrip_protocol(path)

    @contextlib.contextmanager
    def _naming(self, what: str, key: str):
        """Any failure becomes one OSError naming the object (FileNotFoundError stays one, except on a write)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - whatever the backend raises
            kind = FileNotFoundError if isinstance(e, FileNotFoundError) and what != "write" else OSError
            raise kind(getattr(e, "errno", None), f"cannot {what} {self.url(key)}: {type(e).__name__}: {e}") from e

    def put(self, key: str, data: bytes | str):
        """Write one whole object; readers see the old one or the new one, never half."""
        self.put_many({key: data})

    def put_many(self, objects: "dict[str, bytes | str]"):
        """put() of several objects, concurrently on a bucket."""
        objects = {key: data.encode() if isinstance(data, str) else data for key, data in objects.items()}
        if not self.local:
            with self._naming("write", next(iter(objects), "")):
                return self.fs.pipe({f"{self.root}/{k}": v for k, v in objects.items()})
        for key, data in objects.items():
            folder, name = os.path.split(f"{self.root}/{key}")
            tmp = f"{folder}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
            with self._naming("write", key):
                os.makedirs(folder, exist_ok=True)
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, f"{folder}/{name}")
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)

    def get(self, key: str) -> bytes:
        """Read one whole object: FileNotFoundError if absent, ValueError for a local symlink, FIFO or device."""
        path = f"{self.root}/{key}"
        with self._naming("read", key):
            if not self.local:
                return self.fs.cat_file(path)
            if stat.S_ISREG(os.lstat(path).st_mode):
                with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
                    return f.read()
        raise ValueError(f"{path} is not a regular file (a symlink, FIFO or device); refusing to read it")

    def get_many(self, keys: "list[str]") -> list:
        """get() of several objects, concurrently on a bucket: each entry is the bytes or get()'s exception."""
        if self.local or len(keys) < 2:
            out = []
            for key in keys:
                try:
                    out.append(self.get(key))
                except (OSError, ValueError) as e:
                    out.append(e)
            return out
        paths = [f"{self.root}/{k}" for k in keys]
        with self._naming("read", keys[0]):
            found = self.fs.cat(paths, on_error="return")
        return [found.get(p, FileNotFoundError(p)) for p in paths]

    def exists(self, key: str) -> bool:
        with self._naming("look up", key):
            return self.fs.exists(f"{self.root}/{key}")

    def list(self, prefix: str) -> list[str]:
        """Sorted names directly under a prefix (a bucket's listing may lag a put; local temp files left out)."""
        path = f"{self.root}/{prefix}".rstrip("/")
        with self._naming("list", prefix):
            try:  # a local listing through os is ten times cheaper than through fsspec
                entries = os.listdir(path) if self.local else self.fs.ls(path, detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
        names = (e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return sorted(n for n in names if not (self.local and n.startswith(".")))

    def delete(self, key: "str | list[str]", recursive: bool = False):
        """Delete an object, a list of them, or with recursive everything under a prefix; what is gone is fine."""
        keys = [key] if isinstance(key, str) else key
        # one bulk request on a bucket; on a local disk one by one, since rm stops at the first missing file
        batches = [[k] for k in keys] if self.local else [keys] if keys else []
        for batch in batches:
            with self._naming("delete", batch[0]), contextlib.suppress(FileNotFoundError):
                self.fs.rm([f"{self.root}/{k}" for k in batch], recursive=recursive)

    def sweep_temps(self, prefix: str, max_age_s: float = 300.0):
        """Local disks only: remove temp files older than max_age_s that a killed writer left behind."""
        for path in (glob.glob(f"{glob.escape(self.root)}/{prefix}/.*.tmp") if self.local else []):
            with contextlib.suppress(FileNotFoundError):  # another process got there first
                if time.time() - os.lstat(path).st_mtime > max_age_s:
                    os.remove(path)


def read_bytes(path: str) -> bytes:
    """One whole file from a local path or URL that a user points at (an adapter), links followed."""
    with fsspec.open(path, "rb") as f:
        return f.read()

"""The run directory's storage: every read and write of RUN goes through this module.

RUN is a local path or an fsspec URL, with the backend's own way of finding credentials and endpoints:

    runs/demo, /mnt/nfs/run1        a folder (nothing to install)
    s3://bucket/prefix              S3 or any S3 server (pip install -r requirements-storage.txt; the usual AWS
                                    variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...)
    gs://bucket/prefix              Google Cloud Storage (gcsfs)
    hf://buckets/OWNER/NAME/prefix  a Hugging Face storage bucket (huggingface_hub; HF_TOKEN)
    memory://name                   in-process, for tests

Object stores have no rename, no append and no atomic directory, and their FUSE mounts fake them badly, so the
protocol on top needs only what every store does atomically: put a whole object, get a whole object, list a
prefix, delete. A reader sees an object whole or not at all: an object-store PUT is atomic, and on a local disk
put() writes a hidden temp file, fsyncs it and os.replace()s it. A listing may lag a put; nothing relies on it
being fresh. On a local disk get() reads only regular files (no symlinks, FIFOs or devices), so a hostile entry
in the run directory can neither hang a reader nor point it outside the run.

Any failure of the store itself (disk full, permission denied, a bucket's 403 or 5xx after the backend's
retries) is an OSError whose message names the object; the scripts turn it into one line and exit code 1.
"""
import contextlib
import os
import shutil
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
            raise SystemExit(f"--run_dir {url} needs an optional package: pip install -r requirements-storage.txt "
                             f"({e})") from e
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        self.poll_s = 0.02 if self.local else 0.2  # how often to look again while waiting: listings cost a request

    def url(self, key: str = "") -> str:
        """The full address of an object or prefix, as a local path or a URL (what a server or a log needs)."""
        path = f"{self.root}/{key}".rstrip("/")
        return path if self.local else self.fs.unstrip_protocol(path)

    def _fail(self, what: str, key: str, e: Exception):
        """Re-raise as one OSError naming the object (FileNotFoundError stays one, except on a write)."""
        kind = FileNotFoundError if isinstance(e, FileNotFoundError) and what != "write" else OSError
        raise kind(getattr(e, "errno", None), f"cannot {what} {self.url(key)}: {type(e).__name__}: {e}") from e

    def put(self, key: str, data: bytes | str):
        """Write one whole object; readers see the old one or the new one, never half."""
        data = data.encode() if isinstance(data, str) else data
        path = f"{self.root}/{key}"
        try:
            if not self.local:
                return self.fs.pipe_file(path, data)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        except Exception as e:  # noqa: BLE001 - every backend error becomes one OSError naming the object
            self._fail("write", key, e)

    def put_many(self, objects: "dict[str, bytes]"):
        """put() of several objects, concurrently on a bucket."""
        if self.local or len(objects) < 2:
            for key, data in objects.items():
                self.put(key, data)
            return
        try:
            self.fs.pipe({f"{self.root}/{k}": v for k, v in objects.items()})
        except Exception as e:  # noqa: BLE001
            self._fail("write", next(iter(objects)), e)

    def get(self, key: str) -> bytes:
        """Read one whole object. FileNotFoundError if absent; ValueError for a local entry that is not a
        regular file (a symlink, FIFO or device: never followed, never opened for reading)."""
        path = f"{self.root}/{key}"
        try:
            if not self.local:
                return self.fs.cat_file(path)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise ValueError(f"{path} is not a regular file (a symlink, FIFO or device); refusing to read it")
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                return f.read()
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001
            self._fail("read", key, e)

    def get_many(self, keys: "list[str]") -> list:
        """get() of several objects, concurrently on a bucket (one round trip's latency, not one per object).
        Each entry is the bytes or the exception get() would have raised."""
        if self.local or len(keys) < 2:
            out = []
            for key in keys:
                try:
                    out.append(self.get(key))
                except (OSError, ValueError) as e:
                    out.append(e)
            return out
        paths = [f"{self.root}/{k}" for k in keys]
        try:
            found = self.fs.cat(paths, on_error="return")
        except Exception as e:  # noqa: BLE001
            self._fail("read", keys[0], e)
        return [found.get(p, FileNotFoundError(p)) for p in paths]

    def exists(self, key: str) -> bool:
        try:
            return os.path.exists(f"{self.root}/{key}") if self.local else self.fs.exists(f"{self.root}/{key}")
        except Exception as e:  # noqa: BLE001
            self._fail("look up", key, e)

    def list(self, prefix: str) -> list[str]:
        """Sorted names directly under a prefix (objects and sub-prefixes; local temp files left out)."""
        try:  # a local listing through os is ten times cheaper than through fsspec
            path = f"{self.root}/{prefix}".rstrip("/")
            entries = os.listdir(path) if self.local else self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as e:  # noqa: BLE001
            self._fail("list", prefix, e)
        names = (e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return sorted(n for n in names if not (self.local and n.startswith(".")))

    def delete(self, key: "str | list[str]", recursive: bool = False):
        """Delete an object, a list of them (one bulk request on a bucket), or with recursive everything under
        a prefix. Deleting what is gone is not an error."""
        keys = [key] if isinstance(key, str) else key
        try:
            if self.local:  # one by one: a missing file must not stop the rest
                for path in (f"{self.root}/{k}" for k in keys):
                    with contextlib.suppress(FileNotFoundError):
                        shutil.rmtree(path) if recursive and os.path.isdir(path) else os.remove(path)
            elif keys:
                self.fs.rm([f"{self.root}/{k}" for k in keys], recursive=recursive)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            self._fail("delete", keys[0], e)

    def sweep_temps(self, prefix: str, max_age_s: float = 300.0):
        """Local disks only: remove temp files older than max_age_s that a killed writer left behind."""
        folder = f"{self.root}/{prefix}"
        if not self.local or not os.path.isdir(folder):
            return
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            try:
                if name.startswith(".") and name.endswith(".tmp") and time.time() - os.lstat(path).st_mtime > max_age_s:
                    os.remove(path)
            except FileNotFoundError:  # another process got there first
                pass


def read_bytes(path: str) -> bytes:
    """One whole file from a local path or URL that a user points at (an adapter), links followed."""
    with fsspec.open(path, "rb") as f:
        return f.read()
